"""TLS on every listener (docs/security.md#tls): a real broker, real clients (nats-py, our client library,
brokerctl, ``openssl s_client``), certificates made here (tests/support/certs.py)."""

import asyncio
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import nats
import pytest

from shardbroker.cli.client import AsyncClient, BlockingClient, tls_context
from shardbroker.cluster.config import certnames

from support.certs import CertificateAuthority, name
from support.harness import REPO, Raw

ADMIN = {"username": "admin", "password": "admin-pw", "permissions": ["admin"]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the broker's certificate (localhost, 127.0.0.1), client certificates, and their files."""
    d = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority()
    other = CertificateAuthority("another CA")
    files = {"ca": ca.write(d), "other_ca": other.write(d, "other-ca")}
    files["cert"], files["key"] = ca.issue().write(d, "server")
    files["cert2"], files["key2"] = ca.issue().write(d, "server2")        # the renewed certificate
    files["expired_cert"], files["expired_key"] = ca.issue(expired=True).write(d, "server-expired")
    subject = name(("O", "Acme"), ("OU", "eng"), ("CN", "alice"))
    files["alice"] = ca.issue(subject=subject, dns=(), ips=(), client=True).write(d, "alice")
    files["carol"] = ca.issue("carol", emails=["carol@example.com"], dns=(), ips=(), client=True).write(d, "carol")
    files["nobody"] = ca.issue("nobody", dns=(), ips=(), client=True).write(d, "nobody")
    files["alice_expired"] = ca.issue(subject=subject, dns=(), ips=(), client=True, expired=True).write(d, "alice-x")
    files["stranger"] = other.issue("alice", subject=subject, dns=(), ips=(), client=True).write(d, "stranger")
    files["dir"] = d
    return files


def client_ctx(pki, who: str | None = None, ca: str = "ca") -> ssl.SSLContext:
    cert, key = pki[who] if who else (None, None)
    return tls_context(pki[ca], cert, key)


def tls_raw(port: int, ctx: ssl.SSLContext) -> Raw:
    raw = Raw(port)
    raw.sock = ctx.wrap_socket(raw.sock, server_hostname="127.0.0.1")
    return raw


def secured(pki, **sections) -> dict:
    """Security on, alice (by certificate only) and bob (by password), TLS on the given listeners."""
    users = [{"username": "alice", "cert_names": ["CN=alice,OU=eng,O=Acme"],
              "permissions": ["publish:alice.>", "subscribe:alice.>"]},
             {"username": "carol", "cert_names": ["carol@example.com"], "password": "carol-pw",
              "permissions": ["publish:>", "subscribe:>"]},
             {"username": "bob", "password": "bob-pw", "permissions": ["publish:>", "subscribe:>"]}]
    return {"security": {"enabled": True, "iterations": 1000, "admin_user": ADMIN, "users": users},
            "tls": {"cert": pki["cert"], "key": pki["key"], "ca": pki["ca"]}, **sections}


def varz(b, pki) -> dict:
    """/varz, over HTTPS when monitoring has TLS."""
    try:
        return b.varz()
    except (urllib.error.URLError, ConnectionError):
        return https(b, pki, "/varz")[1]


def counted(b, key: str, n: int, pki=None) -> dict:
    """/varz once ``key`` has reached ``n`` (the broker counts a failed handshake when it sees the failure, which
    may be after the client gave up), or after 5 s."""
    deadline = time.monotonic() + 5
    while True:
        v = varz(b, pki)
        if v[key] >= n or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def https(b, pki, path: str, ctx: ssl.SSLContext | None = None):
    url = f"https://127.0.0.1:{b.ports['monitoring']}{path}"
    with urllib.request.urlopen(url, timeout=10, context=ctx or client_ctx(pki)) as resp:
        body = resp.read()
        return resp.status, json.loads(body) if path != "/metrics" else body.decode()


def brokerctl(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60, env={**base, **(env or {})})


# -- NATS ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [False, True, "auto"])
def test_nats_py_over_tls_info_first_and_handshake_first(start_broker, pki, mode):
    """nats-server's three ways: INFO then the handshake (tls=), the handshake first (tls_handshake_first), and
    "auto", which serves both on one port."""
    cfg = {"tls": {"cert": pki["cert"], "key": pki["key"]}, "nats": {"tls": {"handshake_first": mode}}}
    b = start_broker(workers=2, config=cfg)
    firsts = {False: [False], True: [True], "auto": [False, True]}[mode]

    async def run():
        ctx = client_ctx(pki)
        conns = [await nats.connect(f"tls://127.0.0.1:{b.ports['nats']}", tls=ctx, tls_handshake_first=first,
                                    allow_reconnect=False, connect_timeout=5) for first in firsts * 2]
        try:
            assert all(nc._server_info.get("tls_required") for nc in conns)
            subs = [await nc.subscribe("tls.nats") for nc in conns]
            for nc in conns:
                await asyncio.sleep(0)
                await nc.flush()
            await conns[0].publish("tls.nats", b"over TLS")
            await conns[0].flush()
            for sub in subs:   # every subscriber, on both workers
                assert (await sub.next_msg(timeout=5)).data == b"over TLS"
        finally:
            for nc in conns:
                await nc.close()

    asyncio.run(run())
    v = b.varz()
    assert v["tls_required"] is True and v["tls_handshakes"] >= len(firsts) * 2
    assert v["tls_listeners"]["nats"]["handshake_first"] == mode


def test_nats_plaintext_to_a_tls_port_gets_info_then_is_refused(start_broker, pki):
    """As nats-server: INFO (saying tls_required) in plaintext, and a client that answers in plaintext gets
    -ERR 'Secure Connection - TLS Required' and is closed; nats-py without TLS fails to connect."""
    b = start_broker(workers=1, config={"tls": {"cert": pki["cert"], "key": pki["key"]}, "nats": {"tls": True}})
    with Raw(b.ports["nats"]) as c:
        info = json.loads(c.line()[5:])
        assert info["tls_required"] is True and "tls_verify" not in info
        c.send(b"CONNECT {}\r\nPING\r\n")
        assert c.line() == b"-ERR 'Secure Connection - TLS Required'\r\n"
        assert c.closed()

    async def plain():
        with pytest.raises(Exception):  # noqa: B017 (nats-py raises its own or ssl's errors, by version)
            # no tls=: nats-py tries the system's CAs, which did not sign this certificate
            await nats.connect(f"nats://127.0.0.1:{b.ports['nats']}", allow_reconnect=False, connect_timeout=3)
    asyncio.run(plain())
    v = counted(b, "tls_handshake_failures", 2)
    assert v["tls_plaintext_refused"] == 1 and v["tls_handshake_failures"] == 2


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_stalled_handshake_is_closed_after_the_timeout_and_counted(start_broker, pki, event_loop):
    cfg = {"tls": {"cert": pki["cert"], "key": pki["key"], "handshake_timeout": 0.5},
           "nats": {"tls": {"handshake_first": True}}, "network": {"tls": True},
           "workers": {"event_loop": event_loop}}
    b = start_broker(workers=1, config=cfg)
    for port in (b.port, b.ports["nats"]):
        with Raw(port) as c:
            c.send(b"\x16\x03\x01")      # the start of a ClientHello, and then nothing
            started = time.monotonic()
            assert c.closed(timeout=5)
            assert 0.3 < time.monotonic() - started < 3
    with Raw(b.ports["nats"]) as c:       # handshake first: a client that waits for INFO waits in vain
        started = time.monotonic()
        assert c.line() == b"-ERR 'Secure Connection - TLS Required'\r\n"
        assert 0.3 < time.monotonic() - started < 3 and c.closed()
    # the worker's loop went on meanwhile: a good client is served at once
    with tls_raw(b.port, client_ctx(pki)) as c:
        assert c.request({"op": "ping"}) == {"ok": True}
    v = counted(b, "tls_handshake_timeouts", 3)
    assert v["tls_handshake_timeouts"] == 3 and v["tls_handshake_failures"] == 3
    text = urllib.request.urlopen(f"http://127.0.0.1:{b.ports['monitoring']}/metrics").read().decode()
    assert 'shardbroker_tls_handshakes_total{outcome="timeout",worker="0"} 3.0' in text
    assert "shardbroker_tls_certificate_not_after_seconds{listener=\"nats\"}" in text


# -- NDJSON, our client, brokerctl, openssl --------------------------------------------------------------------------

def test_our_clients_and_brokerctl_over_tls(start_broker, pki):
    b = start_broker(workers=2, config={"tls": {"cert": pki["cert"], "key": pki["key"]}, "network": {"tls": True}})
    ctx = client_ctx(pki)

    async def run():
        async with await AsyncClient.connect("127.0.0.1", b.port, tls=ctx) as sub:
            await sub.sub("tls.ndjson")
            with BlockingClient.connect("127.0.0.1", b.port, tls=ctx) as pub:
                pub.pub("tls.ndjson", {"n": 1})
                assert pub.info()["workers"] == 2
            assert (await sub.next_message(timeout=5)).data == {"n": 1}
            res = brokerctl("pub", "--ca", pki["ca"], "-p", str(b.port), "tls.ndjson", "from brokerctl")
            assert res.returncode == 0, res.stderr
            assert (await sub.next_message(timeout=5)).data == "from brokerctl"
            env = {"BROKER_URL": f"tls://127.0.0.1:{b.port}", "BROKER_CA": pki["ca"]}
            res = brokerctl("pub", "tls.ndjson", "from BROKER_URL", env=env)
            assert res.returncode == 0, res.stderr
            assert (await sub.next_message(timeout=5)).data == "from BROKER_URL"
    asyncio.run(run())
    # without the CA the broker's certificate is not trusted: a clear error, exit 1
    res = brokerctl("pub", "--tls", "-p", str(b.port), "tls.ndjson", "x")
    assert res.returncode == 1 and "TLS: CERTIFICATE_VERIFY_FAILED" in res.stderr, res.stderr


def test_openssl_s_client(start_broker, pki):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    b = start_broker(workers=1, config={"tls": {"cert": pki["cert"], "key": pki["key"], "min_version": "1.3"},
                                        "network": {"tls": True}})
    proc = subprocess.Popen(["openssl", "s_client", "-connect", f"127.0.0.1:{b.port}", "-CAfile", pki["ca"],
                             "-verify_return_error", "-quiet"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        proc.stdin.write(b'{"op":"ping"}\n')
        proc.stdin.flush()
        assert proc.stdout.readline() == b'{"ok":true}\n'   # s_client -quiet starts reading only once verified
    finally:
        proc.kill()
        proc.communicate()
    res = subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{b.port}", "-CAfile", pki["ca"],
                          "-brief"], input=b"", capture_output=True, timeout=30)
    assert "Verification: OK" in res.stderr.decode() and "TLSv1.3" in res.stderr.decode(), res.stderr
    # min_version 1.3: a client that offers 1.2 at most is refused
    res = subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{b.port}", "-CAfile", pki["ca"],
                          "-tls1_2", "-brief"], input=b"", capture_output=True, timeout=30)
    assert res.returncode != 0 and b'{"ok"' not in res.stdout


def test_ndjson_plaintext_to_a_tls_port_is_told_and_closed(start_broker, pki):
    b = start_broker(workers=1, config={"tls": {"cert": pki["cert"], "key": pki["key"]}, "network": {"tls": True}})
    with Raw(b.port) as c:
        c.send(b'{"op":"ping"}\n')
        assert c.json() == {"ok": False, "error": "tls_required"}
        assert c.closed()
    assert counted(b, "tls_plaintext_refused", 1)["tls_plaintext_refused"] == 1


def test_an_expired_server_certificate_is_refused_by_clients(start_broker, pki):
    cfg = {"tls": {"cert": pki["expired_cert"], "key": pki["expired_key"]}, "network": {"tls": True},
           "nats": {"tls": True}}
    b = start_broker(workers=1, config=cfg)
    assert "expired on" in b.log()   # the broker says so when it starts
    with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
        BlockingClient.connect("127.0.0.1", b.port, tls=client_ctx(pki))

    async def run():
        with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
            await nats.connect(f"tls://127.0.0.1:{b.ports['nats']}", tls=client_ctx(pki), allow_reconnect=False,
                               connect_timeout=5)
    asyncio.run(run())


# -- mutual TLS ------------------------------------------------------------------------------------------------------

def test_mutual_tls_accepts_verified_certificates_and_maps_them_to_users(start_broker, pki):
    cfg = secured(pki, network={"tls": {"verify_and_map": True}}, nats={"tls": {"verify_and_map": True}})
    b = start_broker(workers=2, config=cfg)
    # NDJSON: the certificate is the login, the user's permissions apply
    with tls_raw(b.port, client_ctx(pki, "alice")) as c:
        assert c.request({"op": "info"})["info"]["user"] == "alice"
        assert c.request({"op": "sub", "topic": "alice.x"}) == {"ok": True}
        assert c.request({"op": "pub", "topic": "other", "data": 1}) == {"ok": False, "error": "permission_denied"}
        # a password still switches identity
        assert c.request({"op": "auth", "user": "bob", "pass": "bob-pw"}) == {"ok": True}
        assert c.request({"op": "info"})["info"]["user"] == "bob"
    with tls_raw(b.port, client_ctx(pki, "carol")) as c:   # by the email address of its SAN
        assert c.request({"op": "info"})["info"]["user"] == "carol"
    # a verified certificate that names nobody: no identity; the client logs in with a password, or not at all
    with tls_raw(b.port, client_ctx(pki, "nobody")) as c:
        assert c.request({"op": "info"}) == {"ok": False, "error": "auth_required"}
        assert c.request({"op": "auth", "user": "bob", "pass": "bob-pw"}) == {"ok": True}
    # brokerctl: the certificate is the login, no -u
    res = brokerctl("pub", "--ca", pki["ca"], "--cert", pki["alice"][0], "--key", pki["alice"][1], "-p", str(b.port),
                    "alice.cli", "by certificate")
    assert res.returncode == 0, res.stderr
    res = brokerctl("pub", "--ca", pki["ca"], "--cert", pki["nobody"][0], "--key", pki["nobody"][1], "-p",
                    str(b.port), "alice.cli", "x")
    assert res.returncode == 1 and "auth_required" in res.stderr, res.stderr
    # alice has no password: no password logs her in
    with tls_raw(b.port, client_ctx(pki, "nobody")) as c:
        assert c.request({"op": "auth", "user": "alice", "pass": ""}) == {"ok": False, "error": "missing_credentials"}
        assert c.request({"op": "auth", "user": "alice", "pass": "x"}) == {"ok": False, "error": "auth_failed"}

    async def run():
        url = f"tls://127.0.0.1:{b.ports['nats']}"
        nc = await nats.connect(url, tls=client_ctx(pki, "alice"), allow_reconnect=False, connect_timeout=5)
        assert nc._server_info["tls_verify"] is True
        errors = []

        async def on_error(e):
            errors.append(str(e))
        nc2 = await nats.connect(url, tls=client_ctx(pki, "alice"), allow_reconnect=False, error_cb=on_error)
        sub = await nc.subscribe("alice.in")
        await asyncio.sleep(0)
        await nc.flush()
        await nc2.publish("alice.in", b"mapped")
        await nc2.publish("elsewhere", b"denied")
        await nc2.flush()
        assert (await sub.next_msg(timeout=5)).data == b"mapped"
        await asyncio.sleep(0.2)
        assert any("permissions violation for publish" in e.lower() for e in errors), errors
        await nc.close()
        await nc2.close()
        # without the mapping, nats-py must bring credentials
        with pytest.raises(Exception):  # noqa: B017 (as above)
            await nats.connect(url, tls=client_ctx(pki, "nobody"), allow_reconnect=False, connect_timeout=5,
                               max_reconnect_attempts=0)
        nc3 = await nats.connect(url, tls=client_ctx(pki, "nobody"), user="bob", password="bob-pw",
                                 allow_reconnect=False)
        await nc3.close()
    asyncio.run(run())
    conns = varz(b, pki)
    assert conns["tls_verify"] is True


def test_a_certificate_login_counts_towards_max_connections_per_user(start_broker, pki):
    cfg = secured(pki, network={"tls": {"verify_and_map": True}}, limits={"max_connections_per_user": 1})
    b = start_broker(workers=2, config=cfg)
    with tls_raw(b.port, client_ctx(pki, "alice")) as first:
        assert first.request({"op": "info"})["info"]["user"] == "alice"
        with tls_raw(b.port, client_ctx(pki, "alice")) as second:
            assert second.json() == {"ok": False, "error": "max_connections_per_user"}
            assert second.closed()


def test_mutual_tls_refuses_missing_foreign_and_expired_client_certificates(start_broker, pki):
    b = start_broker(workers=1, config=secured(pki, network={"tls": {"verify": True}}))
    for who in (None, "stranger", "alice_expired"):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            # TLS 1.3: the client's handshake ends before the server has checked its certificate, so the refusal
            # arrives with the first read
            c = tls_raw(b.port, client_ctx(pki, who))
            c.request({"op": "ping"})
    with tls_raw(b.port, client_ctx(pki, "alice")) as c:   # verify without map: a password is still needed
        assert c.request({"op": "info"}) == {"ok": False, "error": "auth_required"}
    assert counted(b, "tls_handshake_failures", 3)["tls_handshake_failures"] == 3
    log = b.log()   # why, in the log
    assert "peer did not return a certificate" in log and "certificate has expired" in log
    assert "unable to get local issuer certificate" in log


# -- Bridge and qlite: the handshake comes first, the protocol runs inside it --------------------------------------

def _read_exactly(c: Raw, n: int) -> bytes:
    while len(c.buf) < n:
        data = c.sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed; have {c.buf!r}")
        c.buf += data
    out, c.buf = c.buf[:n], c.buf[n:]
    return out


def test_bridge_and_qlite_over_tls(start_broker, pki):
    from shardbroker.workers.protocols.bridge import codec as bridge_codec
    from shardbroker.workers.protocols.qlite import codec as qlite_codec

    cfg = secured(pki, bridge={"enabled": True, "port": 0, "user": "bob", "tls": {"verify_and_map": True}},
                  qlite={"enabled": True, "port": 0, "tls": True})
    b = start_broker(workers=1, config=cfg)
    # Bridge clients act as bridge.user, or as the user their certificate names: alice may not read bridge.*
    with tls_raw(b.ports["bridge"], client_ctx(pki, "nobody")) as c:
        c.send(b"Schat   ")
        assert _read_exactly(c, 1) == bridge_codec.OK
        with tls_raw(b.ports["bridge"], client_ctx(pki, "alice")) as refused:
            refused.send(b"Schat   ")
            assert _read_exactly(refused, 1) == bridge_codec.FAIL
        with Raw(b.port) as pub:
            assert pub.request({"op": "auth", "user": "bob", "pass": "bob-pw"}) == {"ok": True}
            assert pub.request({"op": "pub", "topic": "bridge.chat", "data": "hi"}) == {"ok": True}
        assert _read_exactly(c, 4 + len(bridge_codec.END)) == b"\x02\x00hi" + bridge_codec.END
    # qlite: after the handshake the server greets with its challenge, inside TLS
    with tls_raw(b.ports["qlite"], client_ctx(pki)) as c:
        payload = _read_exactly(c, int.from_bytes(_read_exactly(c, 4), "little"))
        assert len(qlite_codec.parse_greeting(payload)) == qlite_codec.CHALLENGE_SIZE
    with Raw(b.ports["qlite"]) as c:   # a plaintext client waits for the greeting, which never comes in plaintext
        assert c.nothing(0.5)


# -- monitoring --------------------------------------------------------------------------------------------------

def test_monitoring_serves_https(start_broker, pki):
    b = start_broker(workers=1, config={"tls": {"cert": pki["cert"], "key": pki["key"]}, "monitoring": {"tls": True}})
    status, body = https(b, pki, "/varz")
    assert status == 200 and body["tls_listeners"]["monitoring"]["cert_not_after"]
    assert body["tls_required"] is False   # nats-server's field: the NATS port's
    with pytest.raises(urllib.error.HTTPError) as err:   # plain HTTP to the HTTPS port: a 400 saying so
        urllib.request.urlopen(f"http://127.0.0.1:{b.ports['monitoring']}/varz", timeout=5)
    assert err.value.code == 400 and b"HTTPS" in err.value.read()
    assert https(b, pki, "/varz")[1]["tls_plaintext_refused"] == 1


# -- reload ------------------------------------------------------------------------------------------------------

def _reload(b) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", "reload", "--pid", str(b.proc.pid)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def _serial(port: int, pki) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with client_ctx(pki).wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return s.getpeercert()["serialNumber"]


def test_certificates_reload_without_dropping_connections(start_broker, pki, tmp_path):
    live_cert, live_key = tmp_path / "live.pem", tmp_path / "live.key"
    shutil.copy(pki["cert"], live_cert)
    shutil.copy(pki["key"], live_key)
    cfg = {"tls": {"cert": str(live_cert), "key": str(live_key)}, "network": {"tls": True}, "nats": {"tls": True},
           "monitoring": {"tls": True}}
    b = start_broker(workers=2, config=cfg)
    first = _serial(b.port, pki)
    kept = [tls_raw(b.port, client_ctx(pki)) for _ in range(2)]   # one on each worker
    for c in kept:
        assert c.request({"op": "sub", "topic": "reload.kept"}) == {"ok": True}

    async def nats_client():
        return await nats.connect(f"tls://127.0.0.1:{b.ports['nats']}", tls=client_ctx(pki), allow_reconnect=False)
    loop = asyncio.new_event_loop()
    nc = loop.run_until_complete(nats_client())
    # renewed certificate and key, under the same names: a reload takes them
    shutil.copy(pki["cert2"], live_cert)
    shutil.copy(pki["key2"], live_key)
    res = _reload(b)
    assert res.returncode == 0, res.stderr
    assert "TLS files re-read" in res.stdout and "live.pem" in res.stdout
    renewed = _serial(b.port, pki)
    assert renewed != first
    assert https(b, pki, "/healthz")[0] == 200
    # the connections made before are still there, and still work
    with tls_raw(b.port, client_ctx(pki)) as pub:
        assert pub.request({"op": "pub", "topic": "reload.kept", "data": "after"}) == {"ok": True}
    for c in kept:
        assert c.json() == {"topic": "reload.kept", "data": "after"}
    loop.run_until_complete(nc.flush(timeout=5))
    assert nc.is_connected
    # a bad file: the reload is refused, says why, and the running certificate stays
    live_key.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    res = _reload(b)
    assert res.returncode == 1 and "configuration not reloaded" in res.stderr and "tls.cert, tls.key" in res.stderr
    assert _serial(b.port, pki) == renewed
    live_key.unlink()
    res = _reload(b)
    assert res.returncode == 1 and "tls.key" in res.stderr and "cannot read" in res.stderr
    assert _serial(b.port, pki) == renewed
    for c in kept:
        assert c.request({"op": "ping"}) == {"ok": True}
        c.close()
    loop.run_until_complete(nc.close())
    loop.close()


# -- configuration -----------------------------------------------------------------------------------------------

def test_a_bad_tls_file_stops_the_start_naming_the_key(tmp_path, pki):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"tls": {"cert": pki["cert"], "key": str(tmp_path / "missing.key")},
                                "nats": {"tls": True}}))
    res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "start", "--config", str(path), "--port", "0",
                          "--nats-port", "0", "--monitor-port", "0", "--workers", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "tls.key" in res.stderr and "missing.key" in res.stderr and "cannot read" in res.stderr


def test_certificate_names_are_matched_as_nats_server_does():
    cert = {"subject": ((("organizationName", "Acme, Inc"),), (("organizationalUnitName", "eng"),),
                        (("commonName", "alice"),)),
            "subjectAltName": (("DNS", "alice.example.com"), ("email", "alice@example.com"),
                               ("URI", "spiffe://acme/alice"), ("IP Address", "10.0.0.1"))}
    kinds = certnames.identities(cert)
    assert kinds[:3] == [("email", "alice@example.com"), ("dns", "alice.example.com"),
                         ("uri", "spiffe://acme/alice")]
    dn = certnames.canonical_dn
    assert kinds[3] == ("dn", dn("CN=alice,OU=eng,O=Acme\\, Inc"))
    # spelling does not matter: case of the types, long names, spaces after separators, either order
    assert dn("cn=alice, ou=eng, o=Acme\\, Inc") == dn("commonName=alice,OU=eng,O=Acme\\2C Inc") == kinds[3][1]
    assert kinds[4] == ("dn", dn("O=Acme\\, Inc,OU=eng,CN=alice"))
    assert dn("alice@example.com") is None and dn("spiffe://acme/alice?x=1") is None
    with pytest.raises(certnames.DnError):
        dn("CN=alice,bogus")
