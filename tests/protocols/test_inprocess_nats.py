"""Baseline of the NATS session, in process (tests/support/inprocess.py): the exact bytes of INFO and of a client's
transcript (CONNECT, PING/PONG, SUB with and without queue group, PUB with and without reply, HPUB/HMSG, UNSUB),
request/reply, no responders, echo, UNSUB limits, nats-server's -ERR texts and when they close, keepalive, the
permission checks of security on, and a PONG that waits for a subscription to be in force on the other worker."""

import orjson

from shardbroker.workers.protocols.nats.session import NatsSession
from shardbroker.workers.protocols.ndjson.session import NdjsonSession

from support.inprocess import SERVER_INFO, Broker, run, turns, until

HDR = b"NATS/1.0\r\nA: b\r\n\r\n"   # 18 bytes


async def nats(broker, connect=b'{"verbose":false}', worker=0):
    c = broker.connect(NatsSession, worker)
    c.send(b"CONNECT " + connect + b"\r\n")
    await until(lambda: c.transport.data.endswith(b"\r\n"))
    c.take()
    return c


async def pong(c):
    c.send(b"PING\r\n")
    await until(lambda: c.transport.data.endswith(b"PONG\r\n"), what="PONG")
    return c.take()[:-6]


def test_info_is_the_first_thing_a_client_reads(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            c = b.connect(NatsSession)
            await turns()
            line = c.take()
            assert line.startswith(b"INFO ") and line.endswith(b" \r\n")
            assert orjson.loads(line[5:-3]) == {**SERVER_INFO, "client_id": c.session.cid, "client_ip": "127.0.0.1"}
            assert line[5:-3] == orjson.dumps({**SERVER_INFO, "client_id": c.session.cid, "client_ip": "127.0.0.1"})

    run(scenario)


def test_verbose_transcript(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            w = b.connect(NatsSession)
            w.send(b"CONNECT {}\r\nSUB foo.> 9\r\n")   # verbose and pedantic are nats-server's defaults
            await until(lambda: w.transport.data.endswith(b"+OK\r\n+OK\r\n"))
            w.take()
            c = b.connect(NatsSession)
            await turns()
            c.take()
            c.send(b'CONNECT {"verbose":true,"pedantic":true,"headers":true,"name":"t","lang":"python",'
                   b'"version":"1"}\r\nPING\r\nSUB foo.* 1\r\nSUB foo.bar q 2\r\n'
                   b"PUB foo.bar 5\r\nhello\r\nPUB foo.bar reply.to 2\r\nhi\r\n"
                   b"HPUB foo.bar 18 23\r\n" + HDR + b"hello\r\n"
                   b"UNSUB 1\r\nPUB foo.bar 1\r\nx\r\n"
                   b"PUB foo.* 1\r\ny\r\nPUB foo..x 1\r\nz\r\nSUB a..b 3\r\nSUB foo.bar 2\r\nPING\r\n")
            await c.expect(
                b"+OK\r\nPONG\r\n+OK\r\n+OK\r\n"
                b"+OK\r\nMSG foo.bar 1 5\r\nhello\r\nMSG foo.bar 2 5\r\nhello\r\n"
                b"+OK\r\nMSG foo.bar 1 reply.to 2\r\nhi\r\nMSG foo.bar 2 reply.to 2\r\nhi\r\n"
                b"+OK\r\nHMSG foo.bar 1 18 23\r\n" + HDR + b"hello\r\nHMSG foo.bar 2 18 23\r\n" + HDR + b"hello\r\n"
                b"+OK\r\n"                                       # UNSUB
                b"+OK\r\nMSG foo.bar 2 1\r\nx\r\n"
                b"-ERR 'Invalid Publish Subject'\r\n+OK\r\n"     # a wildcard subject: delivered all the same
                b"-ERR 'Invalid Publish Subject'\r\n"            # an invalid one: dropped
                b"-ERR 'Invalid Subject'\r\n"
                b"+OK\r\n"                                       # a duplicate sid is ignored
                b"PONG\r\n")
            await c.silent()
            # the other connection never negotiated headers: MSG with the payload alone
            await w.expect(b"MSG foo.bar 9 5\r\nhello\r\nMSG foo.bar 9 reply.to 2\r\nhi\r\nMSG foo.bar 9 5\r\nhello\r\n"
                           b"MSG foo.bar 9 1\r\nx\r\nMSG foo.* 9 1\r\ny\r\n")
            info = c.session.info()
            assert (info["name"], info["lang"], info["version"], info["subscriptions"]) == ("t", "python", "1", 1)
            assert (info["in_msgs"], info["out_msgs"]) == (5, 7)
            assert not c.closed

    run(scenario)


def test_quiet_transcript_and_an_ndjson_subscriber(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            nd = b.connect(NdjsonSession)
            nd.send_json({"op": "sub", "topic": "q.*"})
            await nd.expect(b'{"ok":true}\n')
            c = await nats(b, b'{"verbose":false,"pedantic":false,"headers":true}')
            c.send(b"SUB q.* 1\r\nPUB q.a 2\r\nhi\r\nPUB q.a r.1 0\r\n\r\nHPUB q.b 18 21\r\n" + HDR + b"hey\r\n")
            assert await pong(c) == (b"MSG q.a 1 2\r\nhi\r\nMSG q.a 1 r.1 0\r\n\r\n"
                                     b"HMSG q.b 1 18 21\r\n" + HDR + b"hey\r\n")
            assert await nd.json(3) == [{"topic": "q.a", "data": "hi"}, {"topic": "q.a", "data": "", "reply": "r.1"},
                                        {"topic": "q.b", "data": "hey", "headers": HDR.decode()}]

    run(scenario)


def test_request_reply_and_no_responders(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            svc = await nats(b)
            svc.send(b"SUB svc.echo grp 1\r\n")
            req = await nats(b, b'{"verbose":false,"headers":true,"no_responders":true}')
            req.send(b"SUB _INBOX.abc.* 7\r\nPUB svc.echo _INBOX.abc.1 4\r\nping\r\n")
            await svc.expect(b"MSG svc.echo 1 _INBOX.abc.1 4\r\nping\r\n")
            svc.send(b"PUB _INBOX.abc.1 4\r\npong\r\n")
            await req.expect(b"MSG _INBOX.abc.1 7 4\r\npong\r\n")
            req.send(b"PUB svc.none _INBOX.abc.2 1\r\nx\r\n")   # nobody listens: a 503 on the inbox at once
            await req.expect(b"HMSG _INBOX.abc.2 7 16 16\r\nNATS/1.0 503\r\n\r\n\r\n")
            old = await nats(b)                                 # without no_responders: silence
            old.send(b"SUB _INBOX.x 1\r\nPUB svc.none _INBOX.x 1\r\nx\r\n")
            assert await pong(old) == b""

    run(scenario)


def test_echo_false_and_unsub_limits(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            quiet = await nats(b, b'{"verbose":false,"echo":false}')
            other = await nats(b)
            other.send(b"SUB e 1\r\nUNSUB 1 2\r\n")          # two messages, then gone
            assert await pong(other) == b""
            quiet.send(b"SUB e 1\r\nPUB e 4\r\nmine\r\n")
            assert await pong(quiet) == b""                    # its own message is not echoed
            other.send(b"PUB e 6\r\ntheirs\r\n" + b"PUB e 1\r\n3\r\nPUB e 1\r\n4\r\n")
            assert await pong(other) == b"MSG e 1 4\r\nmine\r\nMSG e 1 6\r\ntheirs\r\n"
            assert await pong(quiet) == b"MSG e 1 6\r\ntheirs\r\nMSG e 1 1\r\n3\r\nMSG e 1 1\r\n4\r\n"
            assert other.session.info()["subscriptions"] == 0

    run(scenario)


def test_protocol_errors_and_which_close(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, {"nats": {"max_payload": 64, "max_control_line": 256}}) as b:
            cases = [
                (b'CONNECT {"verbose":false}\r\nFOO\r\nPING\r\n', b"-ERR 'Unknown Protocol Operation'\r\n"),
                (b'CONNECT {"verbose":false}\r\nPUB x 65\r\n', b"-ERR 'Maximum Payload Violation'\r\n"),
                (b"SUB " + b"x" * 300, b"-ERR 'maximum control line exceeded'\r\n"),
                (b'CONNECT {"protocol":2}\r\n', b"-ERR 'invalid client protocol'\r\n"),
                (b'CONNECT {"no_responders":true}\r\n', b"-ERR 'no responders requires headers support'\r\n"),
                (b'CONNECT {"jwt":"x"}\r\n', b"-ERR 'Authorization Violation'\r\n"),
                (b"CONNECT nope\r\n", b""),                         # closed without a word, as nats-server
                (b'CONNECT {"verbose":"yes"}\r\n', b""),
                (b"SUB x\r\n", b""),
                (b'CONNECT {"verbose":false}\r\nHPUB x 18 19\r\n' + HDR + b"1\r\n", b""),   # headers not negotiated
            ]
            for sent, answer in cases:
                c = b.connect(NatsSession)
                await turns()
                c.take()
                c.send(sent)
                await turns()
                assert (c.take(), c.closed) == (answer, True), sent
            breaches = b.hubs[0].stats()["breaches"]
            assert (breaches["max_payload"], breaches["max_control_line"]) == (1, 1)

    run(scenario)


def test_server_pings_and_a_stale_client_is_closed(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, {"nats": {"ping_interval": 0.05, "ping_max": 1}}) as b:
            live = await nats(b)
            stale = await nats(b)
            pongs = []

            def answer_pings():   # the live client answers every PING; the stale one none
                while live.transport.data.startswith(b"PING\r\n"):
                    del live.transport.data[:6]
                    live.send(b"PONG\r\n")
                    pongs.append(1)
                return stale.closed

            await until(answer_pings, what="the stale client to be closed")
            await stale.expect(b"PING\r\n-ERR 'Stale Connection'\r\n")
            assert pongs and not live.closed and not live.transport.data
            assert live.session.info()["rtt"] > 0

    run(scenario)


USERS = {"security": {"enabled": True, "iterations": 1000,
                      "admin_user": {"username": "root", "password": "root-pw", "permissions": ["admin"]},
                      "users": [{"username": "alice", "password": "pw-a",
                                 "permissions": ["publish:chat.>", "subscribe:chat.>"]},
                                {"username": "tok", "password": "the-token", "token": True,
                                 "permissions": ["subscribe:chat.>"]}]}}


def test_security_login_and_permission_violations(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, USERS) as b:
            anon = b.connect(NatsSession)
            await turns()
            assert orjson.loads(anon.take()[5:-3])["auth_required"] is True
            anon.send(b'CONNECT {"verbose":false}\r\nPING\r\n')
            await anon.expect(b"-ERR 'Authorization Violation'\r\n")
            assert anon.closed
            bad = b.connect(NatsSession)
            bad.send(b'CONNECT {"user":"alice","pass":"nope"}\r\nPING\r\n')
            await until(lambda: bad.closed)
            assert bad.take().endswith(b"\r\n-ERR 'Authorization Violation'\r\n")
            a = b.connect(NatsSession)
            await turns()
            a.take()
            a.send(b'CONNECT {"verbose":true,"user":"alice","pass":"pw-a"}\r\nPUB secret.x 1\r\nx\r\n'
                   b"SUB secret.> 1\r\nSUB > 2\r\nSUB chat.* q 3\r\nPUB chat.a 2\r\nhi\r\nPING\r\n")
            await a.expect(b"+OK\r\n-ERR 'Permissions Violation for Publish to \"secret.x\"'\r\n"
                           b"-ERR 'Permissions Violation for Subscription to \"secret.>\"'\r\n"
                           b"-ERR 'Permissions Violation for Subscription to \">\"'\r\n"
                           b"+OK\r\n+OK\r\nMSG chat.a 3 2\r\nhi\r\nPONG\r\n")
            assert not a.closed and a.session.info()["authorized_user"] == "alice"
            t = await nats(b, b'{"verbose":false,"auth_token":"the-token"}')
            t.send(b"PUB chat.a 1\r\nx\r\n")                   # tok may not publish
            await t.expect(b"-ERR 'Permissions Violation for Publish to \"chat.a\"'\r\n")
            assert [m["user"] for m in b.asked if m["k"] == "claim"] == ["alice", "tok"]
            b.refuse_claims = True     # limits.max_connections_per_user, counted by the supervisor
            over = b.connect(NatsSession)
            over.send(b'CONNECT {"user":"alice","pass":"pw-a"}\r\nPING\r\n')
            await until(lambda: over.closed)
            assert over.take().endswith(b" \r\n-ERR 'maximum account active connections exceeded'\r\n")

    run(scenario)


def test_a_pong_waits_for_a_subscription_to_be_in_force_on_the_other_worker(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, workers=2) as b:
            s = await nats(b, b'{"verbose":true}', worker=1)
            s.send(b"SUB far 1\r\nPING\r\n")
            assert s.take() == b"" and b.hubs[0].stats()["remote_patterns"] == 0
            await s.expect(b"+OK\r\nPONG\r\n")
            assert b.hubs[0].stats()["remote_patterns"] == 1
            p = await nats(b, worker=0)
            p.send(b"PUB far 3\r\nabc\r\n")
            await s.expect(b"MSG far 1 3\r\nabc\r\n")
            s.send(b"UNSUB 1\r\nPING\r\n")
            await s.expect(b"+OK\r\nPONG\r\n")
            await until(lambda: b.hubs[0].stats()["remote_patterns"] == 0)
            assert await pong(p) == b""

    run(scenario)
