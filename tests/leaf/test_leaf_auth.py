"""How the broker logs in to its hub as a leaf node (workers/protocols/leaf/credentials.py), against real
nats-servers: user/password, token, nkey, a .creds file (an operator set up here, with JWTs signed by nkeys), TLS with
a test CA; and what a wrong one looks like (the broker's log names the URL and the reason, it keeps redialling with a
growing delay, and serves its own clients meanwhile).

nats-server's leafnode ``authorization {}`` takes ``user``/``password``, one ``nkey``, or ``users`` (user, password,
account: no nkeys, no permissions, no token); without it a leaf logs in as a client does (the top-level
``authorization {}``: tokens, users with permissions, or JWTs in operator mode).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import time

import nkeys
import pytest
from leafprobes import (
    RECONNECT,
    assert_no_crash,
    broker_leafz,
    connect,
    connects,
    leaf_config,
    nats_url,
    redials,
    remote,
    serves_local_clients,
    until_received,
)

from support.certs import CertificateAuthority

pytestmark = pytest.mark.timeout(60)


def new_key(prefix: int) -> nkeys.KeyPair:
    """A fresh nkey pair of a role (``nkeys.PREFIX_BYTE_USER``, ...): nkeys has no generator, so a seed is encoded."""
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def write_seed(path, key: nkeys.KeyPair) -> str:
    """An nkey file as ``nk -gen user`` writes it: the seed on a line."""
    path.write_text(key.seed.decode() + "\n")
    path.chmod(0o600)
    return str(path)


def traffic_flows(hub, broker, hub_opts: dict | None = None) -> None:
    """A hub client's message reaches a broker client, and back."""
    async def run():
        bn = await connect(nats_url(broker))
        hn = await connect(hub.url, **(hub_opts or {}))
        down = await bn.subscribe("down.x")
        up = await hn.subscribe("up.x")
        await bn.flush()
        await hn.flush()
        assert (await until_received(hn, "down.x", down, b"to-broker")).data == b"to-broker"
        assert (await until_received(bn, "up.x", up, b"to-hub")).data == b"to-hub"
        await bn.close()
        await hn.close()

    asyncio.run(run())


def wait_failures(broker, url: str, n: int, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    found: list = []
    while time.monotonic() < deadline:
        found = redials(broker, url)
        if len(found) >= n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{len(found)} failed attempts, not {n}:\n{broker.log()}")


# -- user and password ----------------------------------------------------------------------------------------------

USERPASS = {"authorization": {"user": "leafy", "password": "s3cret pw"}}


def test_user_and_password(nats_servers, start_broker):
    hub = nats_servers("hub", leaf_opts=USERPASS)
    broker = start_broker(workers=2, config=leaf_config(remote(hub, user="leafy", password="s3cret pw")))
    leafs = hub.wait_leafs(2)
    assert {leaf["name"] for leaf in leafs} == {"sb-w0", "sb-w1"}
    traffic_flows(hub, broker)
    assert not redials(broker)
    assert "s3cret" not in broker.log()
    assert_no_crash(broker)


def test_a_bad_password_is_logged_and_retried_with_backoff(nats_servers, start_broker):
    hub = nats_servers("hub", leaf_opts=USERPASS)
    broker = start_broker(workers=1, config=leaf_config(remote(hub, user="leafy", password="wrong pw")))
    fails = wait_failures(broker, hub.leaf_url, 4)
    for m in fails:
        assert m["name"] == "sb-w0" and m["level"] == "WARNING"
        assert m["what"] == "the hub said -ERR 'Authorization Violation'", m[0]
    # each failure in a row doubles the delay (reconnect 0.2 s, plus up to 0.2 s at random; logged to 0.1 s)
    delays = [float(m["delay"]) for m in fails]
    for k, delay in enumerate(delays[:4]):
        low = RECONNECT * 2 ** k
        assert low - 0.05 <= delay <= low + RECONNECT + 0.05, delays
    assert delays[3] > delays[0] * 3, delays
    # the hub saw each try
    assert hub.log().count("authentication error") >= 4, hub.log()[-3000:]
    assert "wrong pw" not in broker.log()

    serves_local_clients(broker, b"fine")   # meanwhile
    wait_failures(broker, hub.leaf_url, 5)   # still trying
    assert not connects(broker) and not hub.leafz()["leafs"]
    leafz = broker_leafz(broker)
    if leafz is not None:   # the broker's own view, where it has one
        (link,) = leafz
        assert link["state"] != "connected" and link["failures"] >= 5, link
        assert "Authorization Violation" in link["last_error"], link
    assert_no_crash(broker)


# -- token ----------------------------------------------------------------------------------------------------------

def test_token(nats_servers, start_broker):
    hub = nats_servers("hub", extra='authorization { token: "t0k3n" }')
    broker = start_broker(workers=1, config=leaf_config(remote(hub, token="t0k3n")))
    assert [leaf["name"] for leaf in hub.wait_leafs(1)] == ["sb-w0"]
    traffic_flows(hub, broker, {"token": "t0k3n"})
    assert not redials(broker) and "t0k3n" not in broker.log()
    assert_no_crash(broker)


def test_a_wrong_token_is_refused(nats_servers, start_broker):
    hub = nats_servers("hub", extra='authorization { token: "t0k3n" }')
    broker = start_broker(workers=1, config=leaf_config(remote(hub, token="nope")))
    fails = wait_failures(broker, hub.leaf_url, 2)
    assert all(m["what"] == "the hub said -ERR 'Authorization Violation'" for m in fails), [m[0] for m in fails]
    assert not hub.leafz()["leafs"]


# -- nkey -----------------------------------------------------------------------------------------------------------

def test_nkey(nats_servers, start_broker, tmp_path):
    user = new_key(nkeys.PREFIX_BYTE_USER)
    hub = nats_servers("hub", leaf_opts={"authorization": {"nkey": user.public_key.decode()}})
    seed = write_seed(tmp_path / "leaf.nk", user)
    broker = start_broker(workers=2, config=leaf_config(remote(hub, nkey_file=seed)))
    assert {leaf["name"] for leaf in hub.wait_leafs(2)} == {"sb-w0", "sb-w1"}
    traffic_flows(hub, broker)
    assert not redials(broker) and user.seed.decode() not in broker.log()
    assert_no_crash(broker)


def test_another_nkey_is_refused(nats_servers, start_broker, tmp_path):
    allowed, other = new_key(nkeys.PREFIX_BYTE_USER), new_key(nkeys.PREFIX_BYTE_USER)
    hub = nats_servers("hub", leaf_opts={"authorization": {"nkey": allowed.public_key.decode()}})
    seed = write_seed(tmp_path / "other.nk", other)
    broker = start_broker(workers=1, config=leaf_config(remote(hub, nkey_file=seed)))
    fails = wait_failures(broker, hub.leaf_url, 2)
    assert all(m["what"] == "the hub said -ERR 'Authorization Violation'" for m in fails), [m[0] for m in fails]
    assert not hub.leafz()["leafs"]


# -- a .creds file, in operator mode --------------------------------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(issuer: nkeys.KeyPair, subject: nkeys.KeyPair, name: str, claims: dict) -> str:
    """A NATS JWT (v2) as nsc makes one: ed25519-nkey, signed by ``issuer``."""
    body = {"iat": int(time.time()) - 10, "iss": issuer.public_key.decode(), "name": name,
            "sub": subject.public_key.decode(), "nats": {**claims, "version": 2}}
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()).decode()
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()) + "." + _b64(json.dumps(body).encode())
    return head + "." + _b64(issuer.sign(head.encode()))


class Operator:
    """An operator and one account it signs (resolved from memory): the hub's config text, and users' .creds."""

    def __init__(self) -> None:
        self.key = new_key(nkeys.PREFIX_BYTE_OPERATOR)
        self.account = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
        self.jwt = jwt(self.key, self.key, "test-operator", {"type": "operator"})
        limits = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                  "conn": -1, "leaf": -1}
        self.account_jwt = jwt(self.key, self.account, "A", {"type": "account", "limits": limits})

    def config(self) -> str:
        return (f'operator: "{self.jwt}"\nresolver: MEMORY\n'
                f'resolver_preload: {{ {self.account.public_key.decode()}: "{self.account_jwt}" }}\n')

    def creds(self, path, signer: nkeys.KeyPair | None = None) -> str:
        user = new_key(nkeys.PREFIX_BYTE_USER)
        user_jwt = jwt(signer or self.account, user, "leaf-user",
                       {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                        "************************* IMPORTANT *************************\n"
                        "NKEY Seed printed below can be used to sign and prove identity.\n\n"
                        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n")
        path.chmod(0o600)
        return str(path)


def test_creds_file(nats_servers, start_broker, tmp_path):
    op = Operator()
    hub = nats_servers("hub", extra=op.config())
    creds = op.creds(tmp_path / "leaf.creds")
    broker = start_broker(workers=2, config=leaf_config(remote(hub, credentials=creds)))
    leafs = hub.wait_leafs(2)
    assert {leaf["name"] for leaf in leafs} == {"sb-w0", "sb-w1"}
    assert {leaf["account"] for leaf in leafs} == {op.account.public_key.decode()}   # bound by the JWT
    traffic_flows(hub, broker, {"user_credentials": op.creds(tmp_path / "client.creds")})
    assert not redials(broker)
    assert_no_crash(broker)


def test_creds_of_an_unknown_account_are_refused(nats_servers, start_broker, tmp_path):
    op = Operator()
    hub = nats_servers("hub", extra=op.config())
    creds = op.creds(tmp_path / "stranger.creds", signer=new_key(nkeys.PREFIX_BYTE_ACCOUNT))
    broker = start_broker(workers=1, config=leaf_config(remote(hub, credentials=creds)))
    fails = wait_failures(broker, hub.leaf_url, 2)
    assert all(m["what"] == "the hub said -ERR 'Authorization Violation'" for m in fails), [m[0] for m in fails]
    assert not hub.leafz()["leafs"]


# -- TLS ------------------------------------------------------------------------------------------------------------

def tls_hub(nats_servers, tmp_path, ca: CertificateAuthority):
    cert, key = ca.issue("localhost").write(tmp_path, "hub")
    return nats_servers("hub", leaf_opts={"tls": {"cert_file": cert, "key_file": key, "timeout": 2}})


def test_tls_with_a_test_ca(nats_servers, start_broker, tmp_path):
    ca = CertificateAuthority("leaf test CA")
    hub = tls_hub(nats_servers, tmp_path, ca)
    broker = start_broker(workers=2, config=leaf_config(remote(hub, tls={"ca": ca.write(tmp_path)})))
    assert {leaf["name"] for leaf in hub.wait_leafs(2)} == {"sb-w0", "sb-w1"}
    traffic_flows(hub, broker)
    assert not redials(broker)
    assert "TLS handshake error" not in hub.log()
    assert_no_crash(broker)


def test_tls_with_the_wrong_ca_says_why(nats_servers, start_broker, tmp_path):
    hub = tls_hub(nats_servers, tmp_path, CertificateAuthority("the hub's CA"))
    other = CertificateAuthority("another CA").write(tmp_path, "other-ca")
    broker = start_broker(workers=1, config=leaf_config(remote(hub, tls={"ca": other})))
    fails = wait_failures(broker, hub.leaf_url, 2)
    for m in fails:
        assert "certificate verify failed" in m["what"], m[0]
    assert not hub.leafz()["leafs"]
    assert_no_crash(broker)


def test_no_tls_where_the_hub_requires_it_says_why(nats_servers, start_broker, tmp_path):
    """The hub insists (its INFO says tls_required) and the remote has no ``tls``: the system's CAs are tried, and
    do not know the test CA."""
    hub = tls_hub(nats_servers, tmp_path, CertificateAuthority("the hub's CA"))
    broker = start_broker(workers=1, config=leaf_config(remote(hub)))
    fails = wait_failures(broker, hub.leaf_url, 2)
    for m in fails:
        assert "certificate verify failed" in m["what"], m[0]
    assert not hub.leafz()["leafs"]
