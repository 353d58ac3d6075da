"""Users, passwords, permissions and the admin protocol, cluster-wide, against the real broker."""

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
from test_cluster import close_spread, spread

from shardbroker.cli.client import AsyncClient, BrokerError
from shardbroker.cluster.config import passwords

from support.harness import REPO, Raw


def secure_config(**security) -> dict:
    """Jolt's secure example (bound to loopback), cheap hashing unless a test says otherwise."""
    base = {
        "enabled": True,
        "iterations": 1000,
        "failures_per_address": 1000,
        "admin_user": {"username": "admin", "password": "strong-admin-password", "permissions": ["admin"]},
        "users": [
            {"username": "publisher1", "password": "secret1", "permissions": ["publish:chat.room1"]},
            {"username": "subscriber1", "password": "secret2", "permissions": ["subscribe:chat.room1"]},
            {"username": "chatuser", "password": "secret3", "permissions": ["publish:chat.*", "subscribe:chat.*"]},
        ],
    }
    base.update(security)
    return {"network": {"bind": "127.0.0.1", "port": 8080}, "security": base}


@pytest.fixture
def secure(start_broker):
    return start_broker(workers=2, config=secure_config())


def auth(conn: Raw, user: str, password: str) -> dict:
    return conn.request({"op": "auth", "user": user, "pass": password})


ADMIN = ("admin", "strong-admin-password")


def test_readme_secure_transcript_verbatim(secure):
    with Raw(secure.port) as sub, Raw(secure.port) as pub:
        sub.send(b'{"op":"auth","user":"chatuser","pass":"secret3"}\n')
        assert sub.line() == b'{"ok":true}\n'
        sub.send(b'{"op":"sub","topic":"chat.room1"}\n')
        assert sub.line() == b'{"ok":true}\n'
        pub.send(b'{"op":"auth","user":"chatuser","pass":"secret3"}\n')
        assert pub.line() == b'{"ok":true}\n'
        pub.send(b'{"op":"pub","topic":"chat.room1","data":"hello secure world"}\n')
        assert pub.line() == b'{"ok":true}\n'
        assert sub.line() == b'{"topic":"chat.room1","data":"hello secure world"}\n'


def test_error_reasons_before_and_during_authentication(secure):
    with Raw(secure.port) as c:
        assert c.request({"op": "ping"}) == {"ok": True}
        for req in ({"op": "sub", "topic": "chat.room1"}, {"op": "unsub", "topic": "chat.room1"},
                    {"op": "pub", "topic": "chat.room1", "data": 1}, {"op": "info"},
                    {"op": "admin.list_users"}):
            assert c.request(req) == {"ok": False, "error": "auth_required"}, req
        for req in ({"op": "auth"}, {"op": "auth", "user": "chatuser"}, {"op": "auth", "pass": "secret3"},
                    {"op": "auth", "user": "chatuser", "pass": ""}, {"op": "auth", "user": 5, "pass": "x"}):
            assert c.request(req) == {"ok": False, "error": "missing_credentials"}, req
        assert auth(c, "chatuser", "wrong") == {"ok": False, "error": "auth_failed"}
        assert auth(c, "nobody", "secret3") == {"ok": False, "error": "auth_failed"}
        assert c.request({"op": "pub", "topic": "chat.room1", "data": 1}) == {"ok": False, "error": "auth_required"}
        assert auth(c, "chatuser", "secret3") == {"ok": True}
        assert c.request({"op": "pub", "topic": "other", "data": 1}) == {"ok": False, "error": "permission_denied"}
        assert c.request({"op": "sub", "topic": "other"}) == {"ok": False, "error": "permission_denied"}
        assert c.request({"op": "admin.list_users"}) == {"ok": False, "error": "permission_denied"}
        assert c.request({"op": "unknown"}) == {"ok": False, "error": "unknown_op"}


def test_pipelined_requests_after_auth_see_its_result(secure):
    with Raw(secure.port) as c:
        c.send(b'{"op":"auth","user":"chatuser","pass":"secret3","id":1}\n{"op":"sub","topic":"chat.a","id":2}\n'
               b'{"op":"auth","user":"chatuser","pass":"bad","id":3}\n{"op":"pub","topic":"chat.a","data":1,"id":4}\n')
        replies = [c.json() for _ in range(5)]
        assert [r.get("id") for r in replies if "ok" in r] == [1, 2, 3, 4]
        assert {"ok": False, "error": "auth_failed", "id": 3} in replies
        assert {"ok": True, "id": 4} in replies  # a failed re-auth keeps the identity it had


PERMISSION_MATRIX = [
    # user, op, topic, allowed
    ("chatuser", "pub", "chat", True), ("chatuser", "pub", "chat.room1", True),
    ("chatuser", "pub", "chat.room1.x", True), ("chatuser", "pub", "chatty", False),
    ("chatuser", "pub", "other.chat", False),
    ("chatuser", "sub", "chat", True), ("chatuser", "sub", "chat.x", True), ("chatuser", "sub", "chatty", False),
    ("chatuser", "sub", "chat.>", True), ("chatuser", "sub", "chat.*", True), ("chatuser", "sub", "chat.*.x", True),
    ("chatuser", "sub", "*.room1", False), ("chatuser", "sub", ">", False), ("chatuser", "sub", "*", False),
    ("chatuser", "sub", "chatty.>", False),
    ("publisher1", "pub", "chat.room1", True), ("publisher1", "pub", "chat.room2", False),
    ("publisher1", "pub", "chat", False), ("publisher1", "pub", "chat.room1.x", False),
    ("publisher1", "sub", "chat.room1", False),
    ("subscriber1", "sub", "chat.room1", True), ("subscriber1", "sub", "chat.*", False),
    ("subscriber1", "sub", "chat.room1.>", False), ("subscriber1", "pub", "chat.room1", False),
    ("admin", "pub", "anything.at.all", True), ("admin", "sub", ">", True),
    ("below", "pub", "news.a", True), ("below", "pub", "news", False), ("below", "sub", "news.>", True),
    ("below", "sub", "news", False), ("all", "pub", "x.y.z", True), ("all", "sub", ">", True),
    ("all", "sub", "*.room1", True),
]


def test_permission_matrix(start_broker):
    config = secure_config()
    config["security"]["users"] += [
        {"username": "below", "password": "b", "permissions": ["publish:news.>", "subscribe:news.>"]},
        {"username": "all", "password": "a", "permissions": ["publish:*", "subscribe:*"]},
    ]
    b = start_broker(workers=1, config=config)
    secrets = {"chatuser": "secret3", "publisher1": "secret1", "subscriber1": "secret2", "admin": ADMIN[1],
               "below": "b", "all": "a"}
    conns = {}
    try:
        for name, password in secrets.items():
            conns[name] = Raw(b.port)
            assert auth(conns[name], name, password) == {"ok": True}
        for name, op, topic, allowed in PERMISSION_MATRIX:
            req = {"op": op, "topic": topic}
            if op == "pub":
                req["data"] = 1
            reply = conns[name].request(req)
            expected = {"ok": True} if allowed else {"ok": False, "error": "permission_denied"}
            assert reply == expected, (name, op, topic)
            if op == "sub" and allowed:
                conns[name].request({"op": "unsub", "topic": topic})
    finally:
        for c in conns.values():
            c.close()


def test_delivery_needs_subscribe_permission_at_delivery_time_across_workers(start_broker):
    b = start_broker(workers=3, config=secure_config())

    async def run():
        clients = await spread(b.port, 3, 1, *ADMIN)
        admin = clients[0][0]
        await admin.request("admin.create_user", user="reader", permissions=["subscribe:news.*"], **{"pass": "r"})
        reader = clients[1][0]
        await reader.auth("reader", "r")  # a re-auth: now "reader" on worker 1
        await reader.sub("news.>")
        writer = clients[2][0]
        await writer.pub("news.a", 1)
        assert (await reader.next_message(timeout=5)).data == 1
        # Narrow the permission while subscribed: deliveries outside it stop at once, the rest continue.
        await admin.request("admin.set_permissions", user="reader", permissions=["subscribe:news.sports.*"])
        await writer.pub("news.a", 2)
        await writer.pub("news.sports.x", 3)
        assert (await reader.next_message(timeout=5)).data == 3
        await admin.request("admin.set_permissions", user="reader", permissions=[])
        await writer.pub("news.sports.x", 4)
        await admin.request("admin.set_permissions", user="reader", permissions=["subscribe:news.*"])
        await writer.pub("news.a", 5)
        assert (await reader.next_message(timeout=5)).data == 5
        with pytest.raises(TimeoutError):
            await reader.next_message(timeout=0.3)
        await close_spread(clients)

    asyncio.run(run())


def test_admin_changes_are_in_force_on_every_worker_before_ok(start_broker):
    b = start_broker(workers=4, config=secure_config())

    async def run():
        clients = await spread(b.port, 4, 1, *ADMIN)
        admin = clients[0][0]
        sessions = [clients[w][0] for w in (1, 2, 3)]
        for round_ in range(5):
            name = f"user{round_}"
            await admin.request("admin.create_user", user=name, permissions=["publish:x"], **{"pass": "pw1"})
            for s in sessions:  # no pause: the new user exists on every worker already
                await s.auth(name, "pw1")
            await admin.request("admin.set_password", user=name, **{"pass": "pw2"})
            for _ in range(4):  # fresh connections land on every worker in turn
                probe = await AsyncClient.connect("127.0.0.1", b.port)
                with pytest.raises(BrokerError, match="auth_failed"):
                    await probe.auth(name, "pw1")
                await probe.auth(name, "pw2")
                await probe.close()
            for s in sessions:  # changing a password does not close sessions opened with the old one
                await s.pub("x", round_)
        listing = (await admin.request("admin.list_users"))["users"]
        assert {"user": "user3", "permissions": ["publish:x"]} in listing
        assert all(set(entry) == {"user", "permissions"} for entry in listing), "hashes must never be listed"
        for c in [admin, *sessions]:
            await c.close()

    asyncio.run(run())


def test_admin_ok_waits_for_a_worker_that_is_slow_to_apply_the_change(start_broker):
    b = start_broker(workers=2, config=secure_config())

    async def run():
        clients = await spread(b.port, 2, 1, *ADMIN)
        admin, other = clients[0][0], clients[1][0]
        slow_pid = (await other.info())["pid"]
        os.kill(slow_pid, signal.SIGSTOP)
        try:
            create = asyncio.ensure_future(admin.request(
                "admin.create_user", user="late", permissions=["publish:x"], **{"pass": "pw"}))
            await asyncio.sleep(0.5)
            assert not create.done(), "ok was sent before every worker had the change"
        finally:
            os.kill(slow_pid, signal.SIGCONT)
        await create
        await other.auth("late", "pw")
        await admin.close()
        await other.close()

    asyncio.run(run())


def test_deleting_a_user_closes_its_sessions_on_every_worker(start_broker):
    b = start_broker(workers=2, config=secure_config())
    with Raw(b.port) as admin:
        auth(admin, *ADMIN)
        admin.request({"op": "admin.create_user", "user": "temp", "pass": "t", "permissions": ["subscribe:t.*"]})
        sessions = [Raw(b.port) for _ in range(4)]
        try:
            assert {s.request({"op": "info"})["error"] for s in sessions} == {"auth_required"}
            workers = set()
            for s in sessions:
                auth(s, "temp", "t")
                workers.add(s.request({"op": "info"})["info"]["worker"])
            assert workers == {0, 1}
            other = Raw(b.port)
            auth(other, "chatuser", "secret3")
            assert admin.request({"op": "admin.delete_user", "user": "temp"}) == {"ok": True}
            for s in sessions:
                assert s.json() == {"ok": False, "error": "user_deleted"}
                assert s.closed()
            assert other.request({"op": "ping"}) == {"ok": True}
            with Raw(b.port) as again:
                assert auth(again, "temp", "t") == {"ok": False, "error": "auth_failed"}
        finally:
            for s in sessions:
                s.close()


def test_admin_protocol_errors(secure):
    with Raw(secure.port) as a:
        auth(a, *ADMIN)
        cases = [
            ({"op": "admin.create_user", "user": "chatuser", "pass": "x"}, "user_exists"),
            ({"op": "admin.create_user", "pass": "x"}, "missing_user"),
            ({"op": "admin.create_user", "user": "new"}, "missing_password"),
            ({"op": "admin.create_user", "user": "has space", "pass": "x"}, "invalid_user"),
            ({"op": "admin.create_user", "user": "n", "pass": "x", "permissions": ["fly:x"]}, "invalid_permission"),
            ({"op": "admin.create_user", "user": "n", "pass": "x", "permissions": "admin"}, "invalid_permission"),
            ({"op": "admin.create_user", "user": "n", "pass": "x", "permissions": ["publish:a.*.b"]},
             "invalid_permission"),
            ({"op": "admin.delete_user", "user": "ghost"}, "unknown_user"),
            ({"op": "admin.set_password", "user": "ghost", "pass": "x"}, "unknown_user"),
            ({"op": "admin.set_permissions", "user": "ghost", "permissions": []}, "unknown_user"),
            ({"op": "admin.delete_user", "user": "admin"}, "protected_user"),
            ({"op": "admin.set_permissions", "user": "admin", "permissions": ["publish:*"]}, "protected_user"),
            ({"op": "admin.nope"}, "unknown_op"),
        ]
        for req, reason in cases:
            assert a.request(req) == {"ok": False, "error": reason}, req
        assert a.request({"op": "admin.create_user", "user": "n", "pass": "x", "id": 9}) == {"ok": True, "id": 9}


def test_admin_ops_without_security(broker):
    with Raw(broker.port) as c:
        assert c.request({"op": "admin.list_users"}) == {"ok": False, "error": "security_disabled"}


def test_reauth_switches_identity_and_drops_subscriptions_it_may_not_hold(secure):
    with Raw(secure.port) as c, Raw(secure.port) as p:
        auth(c, "chatuser", "secret3")
        c.request({"op": "sub", "topic": "chat.room1"})
        c.request({"op": "sub", "topic": "chat.other"})
        assert auth(c, "subscriber1", "secret2") == {"ok": True}
        info = c.request({"op": "info"})["info"]
        assert info["user"] == "subscriber1" and info["subscriptions"] == ["chat.room1"]
        auth(p, "chatuser", "secret3")
        p.request({"op": "pub", "topic": "chat.other", "data": "no"})
        p.request({"op": "pub", "topic": "chat.room1", "data": "yes"})
        assert c.json() == {"topic": "chat.room1", "data": "yes"}
        assert c.request({"op": "pub", "topic": "chat.room1", "data": 1}) == {"ok": False,
                                                                              "error": "permission_denied"}


def test_failed_attempts_close_the_connection(secure):
    with Raw(secure.port) as c:
        for _ in range(4):
            assert auth(c, "chatuser", "nope") == {"ok": False, "error": "auth_failed"}
        assert c.request({"op": "ping"}) == {"ok": True}
        assert auth(c, "chatuser", "nope") == {"ok": False, "error": "auth_failed"}
        assert c.closed()


def test_failures_are_rate_limited_per_address_across_workers(start_broker):
    b = start_broker(workers=2, config=secure_config(failures_per_address=6, block_duration=60))
    conns = [Raw(b.port) for _ in range(3)]  # spread over both workers
    try:
        for i in range(6):
            assert auth(conns[i % 3], "chatuser", "nope")["error"] == "auth_failed"
        b.wait_log(r"127\.0\.0\.1: 6 failed authentications")
        for _ in range(3):
            with Raw(b.port) as c:  # even the right password, on either worker
                assert auth(c, "chatuser", "secret3") == {"ok": False, "error": "rate_limited"}
    finally:
        for c in conns:
            c.close()


def test_unauthenticated_connections_time_out(start_broker):
    b = start_broker(workers=1, config=secure_config(auth_timeout=0.5))
    with Raw(b.port) as idle, Raw(b.port) as ok:
        assert auth(ok, "chatuser", "secret3") == {"ok": True}
        assert idle.request({"op": "ping"}) == {"ok": True}  # activity is not authentication
        assert idle.json(timeout=5) == {"ok": False, "error": "auth_timeout"}
        assert idle.closed()
        time.sleep(0.6)
        assert ok.request({"op": "ping"}) == {"ok": True}


@pytest.mark.exclusive   # compares the time of logins
def test_unknown_user_and_wrong_password_take_the_same_time(start_broker):
    b = start_broker(workers=1, config=secure_config(iterations=200_000))
    timings = {"unknown": [], "wrong": []}
    for i in range(12):
        for kind, user in (("unknown", f"ghost{i}"), ("wrong", "chatuser")):
            with Raw(b.port) as c:
                started = time.perf_counter()
                assert auth(c, user, "not-the-password") == {"ok": False, "error": "auth_failed"}
                timings[kind].append(time.perf_counter() - started)
    unknown, wrong = statistics.median(timings["unknown"]), statistics.median(timings["wrong"])
    assert 0.5 < unknown / wrong < 2.0, timings
    assert min(timings["unknown"]) > 0.01, "an unknown user must cost a real hash"


@pytest.mark.exclusive   # seconds of CPU in 50 logins that must end before auth_timeout
def test_deliveries_keep_flowing_while_fifty_clients_authenticate(start_broker):
    # One worker; 600,000 iterations: the 50 checks take seconds of CPU, none of it on the event loop.
    b = start_broker(workers=1, config=secure_config(iterations=600_000))
    n = 2000

    async def run():
        sub = await AsyncClient.connect("127.0.0.1", b.port, user="chatuser", password="secret3")
        pub = await AsyncClient.connect("127.0.0.1", b.port, user="chatuser", password="secret3")
        await sub.sub("chat.flow")
        storm = [await AsyncClient.connect("127.0.0.1", b.port) for _ in range(50)]
        auths = [asyncio.ensure_future(c.auth("chatuser", "secret3")) for c in storm]
        await asyncio.sleep(0.05)
        for i in range(n):
            await pub.pub("chat.flow", i, wait=False)
            if i % 100 == 99:
                await pub.ping()
        got = [(await sub.next_message(timeout=30)).data for _ in range(n)]
        pending = sum(not a.done() for a in auths)
        await asyncio.gather(*auths)
        assert got == list(range(n))
        assert pending > 0, "every auth finished before the deliveries: they were held up"
        for c in [sub, pub, *storm]:
            await c.close()

    asyncio.run(run())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_password_checks_run_below_the_event_loops_priority(start_broker):
    b = start_broker(workers=1, config=secure_config())
    with Raw(b.port) as c:
        assert auth(c, "chatuser", "secret3") == {"ok": True}
    (pid,) = b.worker_pids()

    def nice(tid: str) -> int:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19, counted after "(comm)"

    loop = nice(str(pid))
    assert loop == os.getpriority(os.PRIO_PROCESS, 0), "the event loop's thread keeps the broker's priority"
    others = [nice(t) for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)]
    assert min(19, loop + 10) in others, f"no hashing thread 10 below the loop's priority: {others}"


def test_password_hash_in_config_and_plaintext_warning(tmp_path, start_broker):
    config = secure_config()
    config["security"]["users"].append({"username": "hashed", "password_hash": passwords.hash_password("h4sh", 1000),
                                        "permissions": ["publish:x"]})
    b = start_broker(workers=1, config=config)
    with Raw(b.port) as c:
        assert auth(c, "hashed", "h4sh") == {"ok": True}
    # The harness writes the config with the default umask (0644): plaintext passwords readable by others.
    assert "holds plaintext passwords and is readable by others" in b.log()
    assert "chmod 600" in b.log()


def test_configured_passwords_work_as_soon_as_the_broker_is_ready(start_broker):
    """Plaintext passwords of the configuration are hashed while the workers start, no longer before them: the
    ready line must still come only once every worker can check them.  At the real iteration count (hashing one
    takes ~0.2 s) and with enough users that hashing them all takes longer than the workers take to boot:
    logins on both workers and both protocols, sent right after the ready line."""
    config = secure_config(iterations=600_000)
    config["security"]["users"] += [{"username": f"filler{i}", "password": f"pw{i}", "permissions": []}
                                    for i in range(10)]
    b = start_broker(workers=2, config=config)
    ndjson = [Raw(b.port) for _ in range(2)]
    nats = [Raw(b.ports["nats"]) for _ in range(2)]
    try:
        for c in ndjson:
            c.send(b'{"op":"auth","user":"chatuser","pass":"secret3"}\n')
        for c in nats:
            assert c.line().startswith(b"INFO ")
            c.send(b'CONNECT {"verbose":false,"user":"publisher1","pass":"secret1"}\r\nPING\r\n')
        for c in ndjson:
            assert c.json(timeout=30) == {"ok": True}
        for c in nats:
            assert c.line(timeout=30) == b"PONG\r\n"
        assert {c.request({"op": "info"})["info"]["worker"] for c in ndjson} == {0, 1}
        assert auth(ndjson[0], "admin", "strong-admin-password") == {"ok": True}
        assert ndjson[0].request({"op": "admin.list_users"})["ok"] is True
    finally:
        for c in ndjson + nats:
            c.close()


def test_sighup_rereads_users(tmp_path, start_broker):
    b = start_broker(workers=2, config=secure_config())
    path = next(tmp_path.glob("config-*.json"))
    os.chmod(path, 0o600)
    with Raw(b.port) as old:
        auth(old, "subscriber1", "secret2")
        config = json.loads(path.read_text())
        config["security"]["users"] = [u for u in config["security"]["users"] if u["username"] != "subscriber1"]
        config["security"]["users"].append({"username": "fresh", "password": "f", "permissions": ["publish:f"]})
        path.write_text(json.dumps(config))
        mark = len(b.log())
        os.kill(b.proc.pid, signal.SIGHUP)
        b.wait_log(r"user\(s\) reloaded", after=mark)
        assert old.json() == {"ok": False, "error": "user_deleted"}
        with Raw(b.port) as c:
            assert auth(c, "fresh", "f") == {"ok": True}


def run_cli(*args, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=60, env={**os.environ, **(env or {})})


def test_brokerctl_hash_password_reads_stdin_not_argv():
    res = run_cli("hash-password", "--iterations", "1000", stdin="s3cret\n")
    assert res.returncode == 0, res.stderr
    assert passwords.verify(res.stdout.strip(), "s3cret")
    assert res.stdout.startswith("$pbkdf2-sha256$i=1000$")


def test_brokerctl_user_commands(secure):
    env = {"BROKER_ADMIN_USER": "admin", "BROKER_ADMIN_PASSWORD": ADMIN[1]}
    port = str(secure.port)
    ok = lambda res: res.returncode == 0 or pytest.fail(res.stderr)  # noqa: E731
    ok(run_cli("user", "-p", port, "add", "carol", "subscribe:c.*", stdin="pw-c\n", env=env))
    ok(run_cli("user", "-p", port, "grant", "carol", "publish:c.x", env=env))
    listing = run_cli("user", "-p", port, "list", env=env)
    assert "carol\tpublish:c.x subscribe:c.*" in listing.stdout
    with Raw(secure.port) as c:
        assert auth(c, "carol", "pw-c") == {"ok": True}
        assert c.request({"op": "pub", "topic": "c.x", "data": 1}) == {"ok": True}
    ok(run_cli("user", "-p", port, "revoke", "carol", "publish:c.x", env=env))
    ok(run_cli("user", "-p", port, "passwd", "carol", stdin="pw-c2\n", env=env))
    with Raw(secure.port) as c:
        assert auth(c, "carol", "pw-c2") == {"ok": True}
        assert c.request({"op": "pub", "topic": "c.x", "data": 1})["error"] == "permission_denied"
    ok(run_cli("user", "-p", port, "delete", "carol", env=env))
    bad = run_cli("user", "-p", port, "delete", "carol", env=env)
    assert bad.returncode == 1 and "unknown_user" in bad.stderr
    denied = run_cli("user", "-p", port, "list", env={**env, "BROKER_ADMIN_PASSWORD": "wrong"})
    assert denied.returncode == 1 and "auth_failed" in denied.stderr


# -- security.no_auth_user (nats-server's): a client without credentials acts as that user ---------------------

GUEST = {"username": "guest", "password": "guest-pw", "permissions": ["publish:public.>", "subscribe:public.>"]}


def guest_config(**security) -> dict:
    config = secure_config(no_auth_user="guest", **security)
    config["security"]["users"].append(dict(GUEST))
    return config


def nats_raw(broker, connect: bytes | None):
    from test_nats import NatsRaw  # here, not at the top: test_nats imports this module

    return NatsRaw(broker, connect=connect)


def test_no_auth_user_nats_connect_without_credentials(start_broker):
    b = start_broker(workers=2, config=guest_config())
    with nats_raw(b, b'CONNECT {"verbose":false}\r\n') as c, nats_raw(b, b"CONNECT {}\r\n") as v:
        assert c.info["auth_required"] is True  # as nats-server: credentials are still asked for
        assert v.line() == b"+OK\r\n"
        c.send(b"SUB public.> 1\r\nSUB chat.room1 2\r\nPING\r\n")
        expected = b"-ERR 'Permissions Violation for Subscription to \"chat.room1\"'\r\nPONG\r\n"
        assert c.read_exactly(expected) == expected
        c.send(b"PUB public.a 2\r\nhi\r\nPUB chat.room1 1\r\nx\r\nPING\r\n")
        expected = (b"MSG public.a 1 2\r\nhi\r\n"
                    b"-ERR 'Permissions Violation for Publish to \"chat.room1\"'\r\nPONG\r\n")
        assert c.read_exactly(expected) == expected
        v.send(b"PUB public.b 1\r\nv\r\n")  # from the other connection (maybe the other worker)
        assert v.line() == b"+OK\r\n"
        assert c.read_exactly(b"MSG public.b 1 1\r\nv\r\n") == b"MSG public.b 1 1\r\nv\r\n"
    # Credentials that are given are checked: a wrong one is refused, never the no_auth_user.
    for bad in (b'{"user":"chatuser","pass":"nope"}', b'{"user":"guest","pass":"nope"}', b'{"user":"chatuser"}',
                b'{"pass":"guest-pw"}', b'{"auth_token":"nope"}'):
        with nats_raw(b, b'CONNECT ' + bad + b'\r\nPING\r\n') as c:
            assert c.line() == b"-ERR 'Authorization Violation'\r\n", bad
            assert c.closed()
    # Right credentials are another user's, not the guest's.
    with nats_raw(b, b'CONNECT {"verbose":false,"user":"publisher1","pass":"secret1"}\r\n'
                     b'PUB public.a 1\r\nx\r\nPUB chat.room1 1\r\ny\r\nPING\r\n') as c:
        expected = b"-ERR 'Permissions Violation for Publish to \"public.a\"'\r\nPONG\r\n"
        assert c.read_exactly(expected) == expected


def test_no_auth_user_ndjson_session_starts_as_that_user(start_broker):
    b = start_broker(workers=2, config=guest_config(auth_timeout=0.5))
    with Raw(b.port) as c, Raw(b.port) as other:
        assert c.request({"op": "info"})["info"]["user"] == "guest"
        assert c.request({"op": "sub", "topic": "public.>"}) == {"ok": True}
        assert c.request({"op": "sub", "topic": "chat.room1"}) == {"ok": False, "error": "permission_denied"}
        assert c.request({"op": "pub", "topic": "chat.room1", "data": 1}) == {"ok": False,
                                                                              "error": "permission_denied"}
        assert other.request({"op": "pub", "topic": "public.x", "data": "hi"}) == {"ok": True}
        assert c.json() == {"topic": "public.x", "data": "hi"}
        time.sleep(0.8)  # past auth_timeout: the guest is not an unauthenticated connection
        c.send(b'{"op":"pub","topic":"public.y","data":2}\n')
        assert sorted([c.line(), c.line()]) == [b'{"ok":true}\n', b'{"topic":"public.y","data":2}\n']
        # A failed auth keeps the guest identity; a successful one switches (and drops what it may not hold).
        assert auth(c, "chatuser", "wrong") == {"ok": False, "error": "auth_failed"}
        c.send(b'{"op":"pub","topic":"public.z","data":3}\n')
        assert sorted([c.line(), c.line()]) == [b'{"ok":true}\n', b'{"topic":"public.z","data":3}\n']
        assert auth(c, "chatuser", "secret3") == {"ok": True}
        info = c.request({"op": "info"})["info"]
        assert info["user"] == "chatuser" and info["subscriptions"] == []
        assert c.request({"op": "pub", "topic": "chat.room1", "data": 1}) == {"ok": True}
        assert c.request({"op": "pub", "topic": "public.a", "data": 1}) == {"ok": False, "error": "permission_denied"}


def test_no_auth_user_deleted_at_run_time_refuses_clients_without_credentials(start_broker):
    b = start_broker(workers=2, config=guest_config())
    with Raw(b.port) as admin:
        assert auth(admin, *ADMIN) == {"ok": True}
        guests = [Raw(b.port) for _ in range(2)]  # both workers
        natsguest = nats_raw(b, b'CONNECT {"verbose":false}\r\nPING\r\n')
        try:
            assert {g.request({"op": "info"})["info"]["worker"] for g in guests} == {0, 1}
            assert natsguest.line() == b"PONG\r\n"
            assert admin.request({"op": "admin.delete_user", "user": "guest"}) == {"ok": True}
            for g in guests:  # as for any deleted user
                assert g.json() == {"ok": False, "error": "user_deleted"}
                assert g.closed()
            assert natsguest.line() == b"-ERR 'Authorization Violation'\r\n" and natsguest.closed()
            for _ in range(2):  # no guest any more: clients without credentials must authenticate again
                with Raw(b.port) as c:
                    assert c.request({"op": "pub", "topic": "public.a", "data": 1}) == {"ok": False,
                                                                                        "error": "auth_required"}
                with nats_raw(b, b"CONNECT {}\r\n") as c:
                    assert c.line() == b"-ERR 'Authorization Violation'\r\n" and c.closed()
            # The name is looked up when a client connects: a new user of that name is the guest from now on.
            assert admin.request({"op": "admin.create_user", "user": "guest", "pass": "p2",
                                  "permissions": ["publish:lobby"]}) == {"ok": True}
            for _ in range(2):
                with Raw(b.port) as c:
                    assert c.request({"op": "pub", "topic": "lobby", "data": 1}) == {"ok": True}
                    assert c.request({"op": "pub", "topic": "public.a", "data": 1})["error"] == "permission_denied"
        finally:
            natsguest.close()
            for g in guests:
                g.close()


def test_no_auth_user_must_name_a_configured_user(tmp_path):
    config = secure_config(no_auth_user="ghost")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "start", "--workers", "2", "--config", str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "security.no_auth_user: 'ghost' is not a configured user" in lines[0]


def test_no_auth_user_with_nats_py_without_credentials(start_broker):
    import nats
    from nats.errors import Error as NatsError

    b = start_broker(workers=2, config=guest_config())
    url = f"nats://127.0.0.1:{b.ports['nats']}"

    async def run():
        errors = []

        async def on_error(exc):
            errors.append(str(exc))

        sub = await nats.connect(url, allow_reconnect=False, error_cb=on_error)
        pub = await nats.connect(url, allow_reconnect=False, error_cb=on_error)
        s = await sub.subscribe("public.>")
        await asyncio.sleep(0)
        await sub.flush()
        await pub.publish("public.news", b"hello")
        await pub.publish("chat.room1", b"not allowed")
        await pub.flush()
        msg = await s.next_msg(timeout=5)
        assert (msg.subject, msg.data) == ("public.news", b"hello")
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert any("permissions violation for publish" in e.lower() for e in errors), errors
        await sub.close()
        await pub.close()
        # nats-py with a wrong password is refused, not let in as the guest.
        with pytest.raises(NatsError, match="Authorization Violation"):
            await nats.connect(f"nats://guest:nope@127.0.0.1:{b.ports['nats']}", allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=5, error_cb=on_error)

    asyncio.run(run())
