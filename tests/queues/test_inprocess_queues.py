"""Baseline of the work-queue protocols, in process (tests/support/inprocess.py), on a worker whose queue service is
built
as ``workers.process`` builds it (``workqueues.start``, journal in the test's directory): qlite's handshake and
requests byte for byte, NDJSON's ``qpush``/``qrecv``/``qack``, NATS' ``$Q.`` subjects, and the queue permissions."""

import re
import struct

import bcrypt

from shardbroker.workers.protocols.nats.session import NatsSession
from shardbroker.workers.protocols.ndjson.session import NdjsonSession
from shardbroker.workers.protocols.qlite import codec
from shardbroker.workers.protocols.qlite.session import QliteSession

from support.inprocess import Broker, run, turns

SECRETS = {"pub": "pub secret!", "sub": "sub secret!", "pub2": "pub2 secret!"}
QLITE = {"qlite": {"enabled": True, "queue": "jobs"},
         "security": {"iterations": 1000,
                      "users": [{"username": name, "qlite_secret": secret} for name, secret in SECRETS.items()]}}
NOT_CORRELATED = codec.fail(codec.NOT_CORRELATED)


def u32(n):
    return struct.pack("<I", n)


async def frame(c):
    """The next qlite frame's payload."""
    (n,) = struct.unpack("<I", await c.read(4))
    return await c.read(n)


async def call(c, fn, data=b""):
    c.send(codec.request(fn, data))
    return await frame(c)


async def login(broker, user, role, secret=None, cost=4):
    c = broker.connect(QliteSession)
    greeting = await frame(c)
    assert len(greeting) == 26 and greeting[:10] == b"greetings;" and b"\0" not in greeting[10:]
    challenge = greeting[10:]
    hashed = bcrypt.hashpw(codec.bcrypt_input((secret or SECRETS[user]).encode(), challenge), bcrypt.gensalt(cost))
    c.send(codec.auth_frame(role, user.encode(), hashed))
    return c


def test_qlite_handshake_push_hide_delete(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, QLITE, queues=True) as b:
            p = await login(b, "pub", codec.PUBLISHER)
            await p.expect(b"\x05\x00\x00\x00PASS;")
            # pipelined: answered in order, each PUSH with the count of visible messages after it
            p.send(codec.request("PUSH", b"job-1") + codec.request("push", b"job-2") + codec.request("LEN"))
            await p.expect(codec.ok(u32(1)) + codec.ok(u32(2)) + codec.ok(u32(2)))
            assert await call(p, "HIDE", u32(30)) == b"FAIL;" + codec.PUBLISHER_HIDE.encode()
            assert await call(p, "STAT") == b"FAIL;" + codec.PUBLISHER_STAT.encode()
            assert await call(p, "PUSH") == b"FAIL;" + codec.EMPTY_PUSH.encode()
            s = await login(b, "sub", codec.SUBSCRIBER)
            await s.expect(codec.ok())
            got = await call(s, "HIDE", u32(30))
            assert got[:5] == b"PASS;" and got[21:] == b";job-1"
            receipt = got[5:21]
            assert await call(s, "LEN") == b"PASS;" + u32(1)
            stat = await call(s, "STAT")
            assert stat[:5] == b"PASS;" and len(stat) == 5 + 24
            assert {**codec.parse_stat(stat[5:]), "oldest_age_ms": 0} == {
                "visible": 1, "in_flight": 1, "delayed": 0, "dlq": 0, "oldest_age_ms": 0}
            assert await call(s, "DEL", receipt) == b"PASS;" + receipt
            s.send(codec.request("DEL", receipt))
            await s.expect(NOT_CORRELATED)                        # a second DEL fails, as in the original
            assert await call(s, "DEL", b"short") == b"FAIL;invalid UUID (got 5 bytes)"
            assert await call(s, "PUSH", b"x") == b"FAIL;" + codec.SUBSCRIBER_PUSH.encode()
            assert await call(s, "NOPE") == b"FAIL;" + codec.unknown_function(b"NOPE").encode()
            s.send(codec.frame(b"LEN"))
            assert await frame(s) == b"FAIL;" + codec.NO_SEMICOLON.encode()
            assert await call(s, "HIDE", u32(31)) == b"FAIL;" + codec.HIDDEN_TOO_LONG.encode()   # max_hidden 30
            got = await call(s, "HIDE", u32(5))
            assert got[21:] == b";job-2"
            assert await call(s, "HIDE", u32(5)) == b"FAIL;" + codec.QUEUE_EMPTY.encode()
            assert not p.closed and not s.closed

    run(scenario)


def test_qlite_login_refusals(tmp_path):
    async def scenario():
        doc = {**QLITE, "qlite": {**QLITE["qlite"], "max_publishers": 1}}
        async with await Broker.start(tmp_path, doc, queues=True) as b:
            wrong = await login(b, "sub", codec.SUBSCRIBER, secret="not it")
            await wrong.expect(codec.fail(codec.AUTH_INVALID))
            assert wrong.closed
            unknown = await login(b, "nobody", codec.SUBSCRIBER, secret="x")   # the same answer, names hidden
            await unknown.expect(codec.fail(codec.AUTH_INVALID))
            costly = b.connect(QliteSession)
            challenge = (await frame(costly))[10:]
            hashed = bcrypt.hashpw(SECRETS["sub"].encode() + challenge, bcrypt.gensalt(4))
            costly.send(codec.auth_frame(codec.SUBSCRIBER, b"sub", hashed[:4] + b"13" + hashed[6:]))
            await costly.expect(codec.fail(codec.AUTH_INVALID))              # cost 13: refused unchecked
            garbled = b.connect(QliteSession)
            await frame(garbled)
            garbled.send(codec.frame(b"\x00no-semicolon"))
            await garbled.expect(codec.fail(codec.AUTH_FORMAT))
            first = await login(b, "pub", codec.PUBLISHER)
            await first.expect(codec.ok())
            second = await login(b, "pub2", codec.PUBLISHER)
            await second.expect(codec.fail(codec.role_full(codec.PUBLISHER)))
            assert second.closed and not first.closed

    run(scenario)


def test_ndjson_qpush_qrecv_qack(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, queues=True) as b:
            c = b.connect(NdjsonSession)
            c.send(b'{"op":"qpush","queue":"jobs","data":{"n":1}}\n'
                   b'{"op":"qpush","queue":"jobs","data":"two","priority":9,"id":"a"}\n'
                   b'{"op":"qrecv","queue":"jobs","max":5,"visibility_ms":60000}\n')
            first, second, recv = await c.json(3)
            assert set(first) == {"ok", "id"} and first["ok"] is True and re.fullmatch(r"[\w-]{16}", first["id"])
            assert second["ok"] is True and second["id"] == "a" and re.fullmatch(r"[\w-]{16}", second["msg_id"])
            assert recv["ok"] is True
            # higher priority first; each with its own receipt
            assert [(m["id"], m["data"], m["priority"], m["deliveries"]) for m in recv["messages"]] == [
                (second["msg_id"], "two", 9, 1), (first["id"], {"n": 1}, 4, 1)]
            receipts = [m["receipt"] for m in recv["messages"]]
            assert all(re.fullmatch(r"[\w-]{22}", r) for r in receipts)
            c.send_json({"op": "qack", "queue": "jobs", "receipt": receipts[0]},
                        {"op": "qack", "queue": "jobs", "receipt": receipts[0]},
                        {"op": "qrecv", "queue": "jobs"}, {"op": "qpush", "queue": "a.*", "data": 1},
                        {"op": "qrecv", "queue": "jobs", "visibility": 1}, {"op": "qstat", "queue": "jobs", "id": 3})
            ack, again, empty, bad_queue, bad_field, stat = await c.json(6)
            assert (ack, again, empty, bad_queue) == ({"ok": True}, {"ok": True, "already_acked": True},
                                                      {"ok": True, "messages": []},
                                                      {"ok": False, "error": "invalid_queue"})
            assert bad_field == {"ok": False, "error": "unknown_field", "field": "visibility",
                                 "did_you_mean": "visibility_ms"}
            assert stat["id"] == 3 and {k: stat["stat"][k] for k in ("visible", "in_flight", "pushed", "acked",
                                                                     "duplicate_acks", "owner")} == {
                "visible": 0, "in_flight": 1, "pushed": 2, "acked": 1, "duplicate_acks": 1, "owner": 0}

    run(scenario)


def test_one_queue_for_qlite_ndjson_and_nats(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, QLITE, queues=True) as b:
            nd = b.connect(NdjsonSession)
            nd.send_json({"op": "qpush", "queue": "jobs", "data": "from ndjson"})
            assert (await nd.json())[0]["ok"] is True
            na = b.connect(NatsSession)
            na.send(b'CONNECT {"verbose":false}\r\nSUB _INBOX.1 1\r\nPUB $Q.PUSH.jobs _INBOX.1 9\r\nfrom nats\r\n')
            reply = (await na.lines(3))[1:]   # INFO, then the reply on the inbox
            assert reply[0] == b"MSG _INBOX.1 1 35\r\n" and re.fullmatch(rb'\{"ok":true,"id":"[\w-]{16}"\}\r\n',
                                                                         reply[1])
            s = await login(b, "sub", codec.SUBSCRIBER)
            await s.expect(codec.ok())
            assert (await call(s, "HIDE", u32(10)))[21:] == b";from ndjson"   # a JSON string, as its bytes
            p = await login(b, "pub", codec.PUBLISHER)
            await p.expect(codec.ok())
            assert await call(p, "PUSH", b"\xffraw") == b"PASS;" + u32(2)
            na.send(b"PUB $Q.RECV.jobs _INBOX.1 0\r\n\r\n")
            head, body = await na.lines(2)
            assert re.fullmatch(rb"MSG _INBOX\.1 1 \$Q\.ACK\.jobs\.[\w-]{22} 9\r\n", head) and body == b"from nats\r\n"
            nd.send_json({"op": "qrecv", "queue": "jobs"})
            (got,) = (await nd.json())[0]["messages"]
            assert (got["data"], got["encoding"]) == ("/3Jhdw==", "base64")   # qlite's bytes, not UTF-8

    run(scenario)


def test_queue_requests_need_the_queues_permissions(tmp_path):
    async def scenario():
        doc = {"security": {"enabled": True, "iterations": 1000,
                            "admin_user": {"username": "root", "password": "root-pw", "permissions": ["admin"]},
                            "users": [{"username": "maker", "password": "pw", "permissions": ["publish:jobs"]}]}}
        async with await Broker.start(tmp_path, doc, queues=True) as b:
            c = b.connect(NdjsonSession)
            c.send_json({"op": "qpush", "queue": "jobs", "data": 1},
                        {"op": "auth", "user": "maker", "pass": "pw"}, {"op": "qpush", "queue": "jobs", "data": 1},
                        {"op": "qpush", "queue": "other", "data": 1}, {"op": "qrecv", "queue": "jobs"},
                        {"op": "qpurge", "queue": "jobs"})
            replies = await c.json(6)
            assert replies[0] == {"ok": False, "error": "auth_required"} and replies[1] == {"ok": True}
            assert replies[2]["ok"] is True
            assert replies[3:] == [{"ok": False, "error": "permission_denied"}] * 3
            await turns()
            assert not c.closed

    run(scenario)
