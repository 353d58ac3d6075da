"""Baseline of the NDJSON and Bridge sessions, in process (tests/support/inprocess.py): transcripts of what a client
sends
and the exact bytes it gets back, through ``connection_made``/``data_received``/``eof_received`` only, and the
permission checks of security on.  NATS: test_inprocess_nats.py; qlite and work queues: test_inprocess_queues.py."""

import orjson

from shardbroker.workers.protocols.bridge.session import BridgeSession
from shardbroker.workers.protocols.nats.session import NatsSession
from shardbroker.workers.protocols.ndjson.session import NdjsonSession

from support.inprocess import Broker, run, turns, until

OK = b'{"ok":true}\n'
USERS = {"security": {"enabled": True, "iterations": 1000,
                      "admin_user": {"username": "root", "password": "root-pw", "permissions": ["admin"]},
                      "users": [{"username": "alice", "password": "pw-a",
                                 "permissions": ["publish:chat.>", "subscribe:chat.>"]},
                                {"username": "bob", "password": "pw-b",
                                 "permissions": ["subscribe:chat.>", "subscribe:bridge.>"]}]},
         "bridge": {"enabled": True, "user": "bob"}}


# -- NDJSON ------------------------------------------------------------------------------------------------------

def test_ndjson_sub_pub_unsub_transcript(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            s = b.connect(NdjsonSession)
            p = b.connect(NdjsonSession)
            s.send(b'{"op":"sub","topic":"room.*","id":1}\n{"op":"sub","topic":"room.*","id":2}\n')
            await s.expect(b'{"ok":true,"id":1}\n{"ok":true,"id":2}\n')   # a repeated sub is ok, and one sub
            p.send(b'{"op":"pub","topic":"room.a","data":"hello world"}\n'
                   b'{"op":"pub","topic":"room.b","data":{"n":1},"id":"x"}\n'
                   b'{"op":"pub","topic":"room.a.deep","data":0}\n{"op":"pub","topic":"room.c"}\n')
            await p.expect(OK + b'{"ok":true,"id":"x"}\n' + OK + OK)
            await s.expect(b'{"topic":"room.a","data":"hello world"}\n{"topic":"room.b","data":{"n":1}}\n'
                           b'{"topic":"room.c","data":null}\n')
            s.send(b'{"op":"unsub","topic":"room.*","id":3}\n{"op":"unsub","topic":"never","id":4}\n')
            await s.expect(b'{"ok":true,"id":3}\n{"ok":true,"id":4}\n')
            p.send(b'{"op":"pub","topic":"room.a","data":"after"}\n{"op":"ping"}\n')
            await p.expect(OK + OK)
            await s.silent()

    run(scenario)


def test_ndjson_a_subscriber_publishing_to_its_own_topic_gets_the_delivery_before_the_ok(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            c = b.connect(NdjsonSession)
            c.send(b'{"op":"sub","topic":"self"}\n{"op":"pub","topic":"self","data":1}\n'
                   b'{"op":"pub","topic":"self","data":2}\n')
            await c.expect(OK + b'{"topic":"self","data":1}\n' + OK + b'{"topic":"self","data":2}\n' + OK)

    run(scenario)


def test_ndjson_refusals_in_its_own_words(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            c = b.connect(NdjsonSession)
            c.send(b'not json\n[1]\n\n   \n{"op":"nope","id":5}\n{"op":"pub","data":1}\n'
                   b'{"op":"pub","topic":"a.*","data":1}\n{"op":"sub","topic":"a..b"}\n{"op":"sub","topic":7}\n'
                   b'{"op":"admin.list_users"}\n{"cmd":"ping","id":6}\n')
            expected = [{"ok": False, "error": "invalid_json"}, {"ok": False, "error": "invalid_json"},
                        {"ok": False, "error": "unknown_op", "id": 5}, {"ok": False, "error": "missing_topic"},
                        {"ok": False, "error": "invalid_topic"}, {"ok": False, "error": "invalid_topic"},
                        {"ok": False, "error": "invalid_topic"}, {"ok": False, "error": "security_disabled"},
                        {"ok": True, "id": 6}]
            assert await c.json(len(expected)) == expected   # blank lines are ignored
            c.send_json({"op": "info", "id": "i"})
            (info,) = await c.json()
            assert info["ok"] is True and info["id"] == "i"
            assert {k: v for k, v in info["info"].items() if k != "pid"} == {
                "server": "shardbroker", "worker": 0, "workers": 1, "cid": c.session.cid, "subscriptions": []}
            assert not c.closed

    run(scenario)


def test_ndjson_a_line_too_long_is_answered_and_closes(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, {"limits": {"max_line_bytes": 100}}) as b:
            c = b.connect(NdjsonSession)
            c.send(b'{"op":"ping"}\n{"op":"pub","topic":"t","data":"' + b"x" * 200 + b'"}\n{"op":"ping"}\n')
            await c.expect(OK + b'{"ok":false,"error":"line_too_long"}\n')
            assert c.closed and c.transport.eof_written      # half-closed after the reply, lingering
            await c.silent()
            assert b.hubs[0].stats()["breaches"]["max_payload"] == 1

    run(scenario)


def test_ndjson_a_half_closed_client_gets_its_replies_then_the_close(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            c = b.connect(NdjsonSession)
            c.send(b'{"op":"sub","topic":"t"}\n{"op":"ping"}\n{"op":"pub","topic":"t","data":1}')   # no newline
            assert c.half_close() is True     # keep the transport: replies must still go out
            await c.expect(OK + OK)           # the unterminated line is dropped
            await until(lambda: c.transport.lost)
            assert not c.transport.aborted

    run(scenario)


def test_ndjson_handshake_timeout(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, {"limits": {"handshake_timeout": 0.1}}) as b:
            c = b.connect(NdjsonSession)
            c.send(b'{"op":"pi')                  # half a line is no frame
            await c.expect(b'{"ok":false,"error":"handshake_timeout"}\n')
            assert c.closed and b.hubs[0].stats()["breaches"]["handshake_timeout"] == 1
            d = b.connect(NdjsonSession)
            d.send(b'{"op":"ping"}\n')
            await d.expect(OK)
            await turns()
            assert not d.closed

    run(scenario)


# -- Bridge ------------------------------------------------------------------------------------------------------

def test_bridge_subscribe_receive_unsubscribe(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            s = b.connect(BridgeSession)
            s.send(b"Sc-h.a_t")    # normalised: the topic "chat", subject bridge.chat
            await s.expect(b"O")
            s.send(b"Sa b    Sch")  # a command split across reads
            await s.expect(b"O")
            s.send(b"at   ")       # already subscribed: O again
            await s.expect(b"O")
            p = b.connect(NdjsonSession)
            body = "z" * 300
            p.send_json({"op": "pub", "topic": "bridge.chat", "data": body},
                        {"op": "pub", "topic": "bridge.a_b", "data": {"k": 1}})
            await p.expect(OK + OK)
            # 128-byte chunks after their 2-byte little-endian length, then the end marker
            await s.expect(b"\x80\x00" + b"z" * 128 + b"\x80\x00" + b"z" * 128 + b"\x2c\x00" + b"z" * 44
                           + b"\x04\x00\r\n\r\n" + b'\x07\x00{"k":1}\x04\x00\r\n\r\n')
            s.send(b"Uchat   Unever  ")
            await s.expect(b"OO")
            p.send_json({"op": "pub", "topic": "bridge.chat", "data": "gone"}, {"op": "ping"})
            await p.expect(OK + OK)
            await s.silent()
            assert s.half_close() is True and not s.closed   # a subscriber that half-closes stays
            p.send_json({"op": "pub", "topic": "bridge.a_b", "data": "still"})
            await s.expect(b"\x05\x00still\x04\x00\r\n\r\n")

    run(scenario)


def test_bridge_publish_streams_until_the_half_close(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            nd = b.connect(NdjsonSession)
            nd.send_json({"op": "sub", "topic": "bridge.news"})
            await nd.expect(OK)
            na = b.connect(NatsSession)
            na.send(b'CONNECT {"verbose":false}\r\nSUB bridge.news 1\r\nPING\r\n')
            await until(lambda: na.transport.data.endswith(b"PONG\r\n"))
            na.take()
            p = b.connect(BridgeSession)
            p.send(b"Pnews   " + b"a" * 100)
            await p.silent()                       # under one chunk: no O yet
            p.send(b"b" * 100)
            await p.expect(b"O")                   # 128 bytes in
            p.send(b"\xff" * 60)
            await p.expect(b"O")                   # 256
            await nd.silent()                      # nothing is published before the half-close
            assert p.half_close() is True
            await p.expect(b"O")                   # the last, partial chunk
            assert p.closed
            payload = b"a" * 100 + b"b" * 100 + b"\xff" * 60
            await na.expect(b"MSG bridge.news 1 260\r\n" + payload + b"\r\n")
            (line,) = await nd.json()
            assert line["topic"] == "bridge.news" and line["encoding"] == "base64"

    run(scenario)


def test_bridge_refusals_are_one_f_and_a_close(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, {"bridge": {"enabled": True, "max_publish_bytes": 200}}) as b:
            x = b.connect(BridgeSession)
            x.send(b"Sok     Xbad    Sok2    ")
            await x.expect(b"OF")
            assert x.closed
            big = b.connect(BridgeSession)
            big.send(b"Pbig    " + b"q" * 300)
            await big.expect(b"OF")     # the chunk within the limit, then the refusal
            assert big.closed and b.hubs[0].stats()["breaches"]["max_payload"] == 1

    run(scenario)


# -- security: permissions per operation -------------------------------------------------------------------------

def test_ndjson_auth_and_permissions(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, USERS) as b:
            c = b.connect(NdjsonSession)
            c.send_json({"op": "sub", "topic": "chat.a"}, {"op": "ping"},
                        {"op": "auth", "user": "bob", "pass": "wrong"}, {"op": "auth", "user": "nobody", "pass": "x"},
                        {"op": "auth", "user": "bob", "pass": "pw-b", "id": 1},
                        {"op": "pub", "topic": "chat.a", "data": 1}, {"op": "sub", "topic": "secret.x"},
                        {"op": "sub", "topic": ">"}, {"op": "sub", "topic": "chat.a", "id": 2},
                        {"op": "admin.list_users"})
            assert await c.json(10) == [
                {"ok": False, "error": "auth_required"}, {"ok": True}, {"ok": False, "error": "auth_failed"},
                {"ok": False, "error": "auth_failed"}, {"ok": True, "id": 1},
                {"ok": False, "error": "permission_denied"}, {"ok": False, "error": "permission_denied"},
                {"ok": False, "error": "permission_denied"}, {"ok": True, "id": 2},
                {"ok": False, "error": "permission_denied"}]
            assert [m["user"] for m in b.asked if m["k"] == "claim"] == ["bob"]   # the login was claimed
            a = b.connect(NdjsonSession)
            a.send_json({"op": "auth", "user": "alice", "pass": "pw-a"}, {"op": "pub", "topic": "chat.a", "data": 2},
                        {"op": "pub", "topic": "news", "data": 3})
            assert await a.json(3) == [{"ok": True}, {"ok": True}, {"ok": False, "error": "permission_denied"}]
            await c.expect(b'{"topic":"chat.a","data":2}\n')

    run(scenario)


def test_ndjson_too_many_failed_logins_close_the_connection(tmp_path):
    async def scenario():
        doc = {**USERS, "security": {**USERS["security"], "max_auth_failures": 2}}
        async with await Broker.start(tmp_path, doc) as b:
            c = b.connect(NdjsonSession)
            c.send_json({"op": "auth", "user": "bob", "pass": "x"}, {"op": "auth", "user": "bob", "pass": "y"},
                        {"op": "ping"})
            await c.expect(b'{"ok":false,"error":"auth_failed"}\n' * 2)
            await c.silent()
            assert c.closed

    run(scenario)


def test_ndjson_a_login_the_supervisor_refuses_is_answered_and_closed(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, USERS) as b:
            b.refuse_claims = True     # limits.max_connections_per_user, counted by the supervisor
            c = b.connect(NdjsonSession)
            c.send_json({"op": "auth", "user": "alice", "pass": "pw-a"}, {"op": "ping"})
            await c.expect(b'{"ok":false,"error":"max_connections_per_user"}\n')
            await c.silent()
            assert c.closed and b.asked == [{"k": "claim", "cid": c.session.cid, "user": "alice"}]

    run(scenario)


def test_bridge_acts_with_the_configured_users_permissions(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, USERS) as b:
            s = b.connect(BridgeSession)
            s.send(b"Sroom   ")           # bob may subscribe to bridge.>
            await s.expect(b"O")
            p = b.connect(BridgeSession)
            p.send(b"Proom   data")        # ... but not publish
            await p.expect(b"F")
            assert p.closed
            a = b.connect(NdjsonSession)
            a.send_json({"op": "auth", "user": "root", "pass": "root-pw"},
                        {"op": "pub", "topic": "bridge.room", "data": "hi"})
            assert await a.json(2) == [{"ok": True}, {"ok": True}]
            await s.expect(b"\x02\x00hi\x04\x00\r\n\r\n")

    run(scenario)


def test_ndjson_payload_values_pass_through_unchanged(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            s = b.connect(NdjsonSession)
            s.send_json({"op": "sub", "topic": "v"})
            await s.expect(OK)
            values = [0, -1.5, True, None, "", "\u00e9\u4e2d", [1, [2, {}]], {"a": {"b": []}}, 18446744073709551616]
            p = b.connect(NdjsonSession)
            p.send(b"".join(b'{"op":"pub","topic":"v","data":%s}\n' % orjson.dumps(v) if i < 8 else
                            b'{"op":"pub","topic":"v","data":18446744073709551616}\n' for i, v in enumerate(values)))
            await p.expect(OK * len(values))
            lines = await s.lines(len(values))
            assert lines[-1] == b'{"topic":"v","data":18446744073709551616}\n'   # beyond 64 bits: exact
            assert [orjson.loads(line)["data"] for line in lines[:-1]] == values[:-1]

    run(scenario)
