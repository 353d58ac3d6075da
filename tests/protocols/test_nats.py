"""NATS wire compatibility: the real nats-py client, and raw sockets for the byte-level facts."""

import asyncio
import json
import os
import signal
import time

import nats
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from test_security import ADMIN, secure_config

from shardbroker.cli.client import AsyncClient

from support.harness import Raw


@pytest.fixture
def nb(start_broker):
    return start_broker(workers=3)


def url(broker) -> str:
    return f"nats://127.0.0.1:{broker.ports['nats']}"


async def connect(broker, **kwargs):
    kwargs.setdefault("allow_reconnect", False)
    return await nats.connect(url(broker), **kwargs)


async def synced(*clients) -> None:
    """Subscriptions made so far are in force everywhere.  nats-py (2.16) writes flush()'s PING at once but a
    SUB through its flusher task, so a PING can overtake a SUB: let the flusher run first, then flush."""
    await asyncio.sleep(0)
    for c in clients:
        await c.flush()


# -- nats-py ---------------------------------------------------------------------------------------------------

def test_nats_py_pub_sub_wildcards_and_flush(nb):
    async def run():
        pub, sub = await connect(nb), await connect(nb)
        s1 = await sub.subscribe("demo.*")
        s2 = await sub.subscribe("demo.>")
        await synced(sub)
        for subject in ("demo.a", "demo.b.c", "other"):
            await pub.publish(subject, subject.encode())
        await pub.flush()
        got1 = [(await s1.next_msg(timeout=5)).subject]
        got2 = [(await s2.next_msg(timeout=5)).subject for _ in range(2)]
        with pytest.raises(NatsTimeout):
            await s1.next_msg(timeout=0.3)
        assert got1 == ["demo.a"] and got2 == ["demo.a", "demo.b.c"]
        await pub.close()
        await sub.close()

    asyncio.run(run())


def test_nats_py_request_reply_and_no_responders(nb):
    async def run():
        svc, client = await connect(nb), await connect(nb)

        async def echo(msg):
            await msg.respond(b"pong:" + msg.data)

        await svc.subscribe("svc.echo", cb=echo)
        await synced(svc)
        for i in range(20):
            reply = await client.request("svc.echo", b"ping%d" % i, timeout=5)
            assert reply.data == b"pong:ping%d" % i
        with pytest.raises(NoRespondersError):
            await client.request("svc.nobody", b"x", timeout=5)
        await svc.close()
        await client.close()

    asyncio.run(run())


def test_request_inboxes_used_once_are_not_cached(nb):
    # A route is cached from a subject's second use: a stream of requests leaves one cached route per subject
    # used again (the service's), not one per inbox (which the garbage collector would walk until dropped).
    async def run():
        svc, client = await connect(nb), await connect(nb)

        async def echo(msg):
            await msg.respond(msg.data)

        await svc.subscribe("svc.cached", cb=echo)
        await synced(svc)
        for i in range(300):
            assert (await client.request("svc.cached", b"%d" % i, timeout=5)).data == b"%d" % i
        cached = nb.http("/subsz")[1]["num_cache"]
        assert cached <= 3   # svc.cached, on the workers it was published on or forwarded to
        for _ in range(3):
            await client.publish("hot.subject", b"x")
        await client.flush()
        assert nb.http("/subsz")[1]["num_cache"] == cached + 1
        await svc.close()
        await client.close()

    asyncio.run(run())


def test_nats_py_queue_groups_across_workers_exactly_once_and_fair(nb):
    async def run():
        members = [await connect(nb) for _ in range(6)]      # spread over the 3 workers
        counts = [0] * len(members)
        seen: list[bytes] = []

        def counter(i):
            async def cb(msg):
                counts[i] += 1
                seen.append(msg.data)
            return cb

        for i, m in enumerate(members):
            await m.subscribe("jobs.*", queue="workers", cb=counter(i))
        plain = await connect(nb)
        plain_sub = await plain.subscribe("jobs.*")
        await synced(*members, plain)
        pub = await connect(nb)
        n = 600
        for i in range(n):
            await pub.publish(f"jobs.{i % 7}", b"%d" % i)
        await pub.flush()
        deadline = time.monotonic() + 15
        while len(seen) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert sorted(seen) == sorted(b"%d" % i for i in range(n)), "each message exactly once in the group"
        assert min(counts) >= n / len(members) * 0.5, counts  # fair: round-robin per subject at the owner
        assert [int((await plain_sub.next_msg(timeout=5)).data) for _ in range(n)] == list(range(n))
        for c in members + [plain, pub]:
            await c.close()

    asyncio.run(run())


def test_nats_py_headers(nb):
    async def run():
        a, b = await connect(nb), await connect(nb)
        sub = await b.subscribe("hdr.t")
        await synced(b)
        await a.publish("hdr.t", b"with-hdr", headers={"X-Test": "1", "Foo": "bar"})
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"with-hdr" and msg.headers == {"X-Test": "1", "Foo": "bar"}
        await a.close()
        await b.close()

    asyncio.run(run())


def test_nats_py_unsubscribe_limit_and_drain(nb):
    async def run():
        a, b = await connect(nb), await connect(nb)
        got = []

        async def cb(msg):
            got.append(msg.data)

        sub = await b.subscribe("lim", cb=cb)
        await sub.unsubscribe(limit=2)
        await synced(b)
        for i in range(5):
            await a.publish("lim", b"%d" % i)
        await a.flush()
        await asyncio.sleep(0.3)
        assert got == [b"0", b"1"]
        drained = []

        async def slow(msg):
            await asyncio.sleep(0.001)
            drained.append(msg.data)

        await b.subscribe("drain.t", cb=slow)
        await synced(b)
        for i in range(50):
            await a.publish("drain.t", b"%d" % i)
        await a.flush()
        await b.drain()
        assert len(drained) == 50
        await a.close()

    asyncio.run(run())


def test_nats_py_echo_false(nb):
    async def run():
        quiet = await connect(nb, no_echo=True)
        other = await connect(nb)
        mine = await quiet.subscribe("echo.t")
        theirs = await other.subscribe("echo.t")
        await synced(quiet, other)
        await quiet.publish("echo.t", b"me")
        await quiet.flush()
        assert (await theirs.next_msg(timeout=5)).data == b"me"
        with pytest.raises(NatsTimeout):
            await mine.next_msg(timeout=0.3)
        await quiet.close()
        await other.close()

    asyncio.run(run())


def test_nats_py_reconnects_after_its_worker_is_killed(nb):
    async def run():
        reconnected = asyncio.Event()

        async def on_reconnect():
            reconnected.set()

        client = await nats.connect(url(nb), reconnected_cb=on_reconnect, max_reconnect_attempts=20,
                                    reconnect_time_wait=0.2)
        sub = await client.subscribe("after.kill")
        await synced(client)
        cid = client._client_id
        connz = nb.http("/connz")[1]
        worker = next(c["worker"] for c in connz["connections"] if c["cid"] == cid)
        os.kill(nb.pids[worker], signal.SIGKILL)
        await asyncio.wait_for(reconnected.wait(), 15)
        await synced(client)  # the client re-sends its SUBs after reconnecting
        other = await connect(nb)
        await other.publish("after.kill", b"again")
        await other.flush()
        assert (await sub.next_msg(timeout=5)).data == b"again"
        await client.close()
        await other.close()

    asyncio.run(run())


def test_nats_py_user_password_token_and_permission_errors(start_broker):
    config = secure_config()
    config["security"]["users"] += [
        {"username": "svc", "password": "tok-9f8e7d6c5b4a", "token": True,
         "permissions": ["publish:svc.>", "subscribe:svc.>", "subscribe:_INBOX.>"]},
    ]
    b = start_broker(workers=2, config=config)

    async def run():
        errors = []

        async def on_error(e):
            errors.append(str(e))

        chat = await connect(b, user="chatuser", password="secret3", error_cb=on_error)
        tok = await connect(b, token="tok-9f8e7d6c5b4a")
        sub = await tok.subscribe("svc.x")
        await synced(tok)
        await tok.publish("svc.x", b"hi")
        assert (await sub.next_msg(timeout=5)).data == b"hi"
        await chat.publish("forbidden", b"x")
        await chat.subscribe("forbidden.too")
        await synced(chat)
        await asyncio.sleep(0.2)
        assert any("permissions violation for publish to \"forbidden\"" in e.lower() for e in errors), errors
        assert any("permissions violation for subscription to \"forbidden.too\"" in e.lower() for e in errors)
        assert not chat.is_closed  # permission errors keep the connection open
        for kwargs in ({"user": "chatuser", "password": "nope"}, {"token": "bad-token"}, {}):
            with pytest.raises(Exception) as err:
                await connect(b, max_reconnect_attempts=0, **kwargs)
            assert "authorization violation" in str(err.value).lower()
        await chat.close()
        await tok.close()

    asyncio.run(run())


# -- raw sockets -----------------------------------------------------------------------------------------------

class NatsRaw(Raw):
    """A raw NATS connection: reads INFO first."""

    def __init__(self, broker, connect: bytes | None = b'CONNECT {"verbose":false}\r\n') -> None:
        super().__init__(broker.ports["nats"])
        line = self.line()
        assert line.startswith(b"INFO {") and line.endswith(b"} \r\n"), line
        self.info = json.loads(line[5:-3])
        if connect is not None:
            self.send(connect)

    def read_exactly(self, expected: bytes, timeout: float = 5.0) -> bytes:
        deadline = time.monotonic() + timeout
        while len(self.buf) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                break
            self.buf += data
        got, self.buf = self.buf[:len(expected)], self.buf[len(expected):]
        return got


def test_info_fields(nb):
    with NatsRaw(nb, connect=None) as c:
        info = c.info
        for key in ("server_id", "server_name", "version", "host", "port", "max_payload", "client_id",
                    "client_ip"):
            assert key in info, key
        assert info["proto"] == 1 and info["headers"] is True and info["port"] == nb.ports["nats"]
        assert info["client_ip"] == "127.0.0.1" and info["client_id"] > 0 and "auth_required" not in info


def test_rtmb_readme_session_in_real_nats_form(nb):
    with NatsRaw(nb, connect=b"CONNECT {}\r\n") as sub, NatsRaw(nb, connect=b"CONNECT {}\r\n") as pub:
        assert sub.line() == b"+OK\r\n"
        sub.send(b"SUB foo.bar sid1\r\nPING\r\n")
        assert sub.read_exactly(b"+OK\r\nPONG\r\n") == b"+OK\r\nPONG\r\n"
        assert pub.line() == b"+OK\r\n"
        pub.send(b"PUB foo.bar 12\r\nHello World!\r\n")
        assert pub.line() == b"+OK\r\n"
        expected = b"MSG foo.bar sid1 12\r\nHello World!\r\n"
        assert sub.read_exactly(expected) == expected
        sub.send(b"UNSUB sid1\r\nPING\r\n")
        assert sub.read_exactly(b"+OK\r\nPONG\r\n") == b"+OK\r\nPONG\r\n"


BASIC_SESSION = (
    b'CONNECT {"verbose":false,"pedantic":false,"protocol":1,"headers":true,"no_responders":true}\r\n'
    b"PING\r\nSUB a.* 1\r\nsub a.> 2\r\nSUB\tlf   3\nPING\r\n"
    b"PUB a.b 1\r\nX\r\nHPUB a.x reply.1 22 33\r\nNATS/1.0\r\nBar: Baz\r\n\r\nHello NATS!\r\n"
    b"pub  lf \t 3\nabc\r\nSUB _INBOX.abc.* 50\r\nPUB nobody.here _INBOX.abc.1 2\r\nhi\r\n"
    b"SUB lim 9\r\nUNSUB 9 2\r\nPUB lim 1\r\n1\r\nPUB lim 1\r\n2\r\nPUB lim 1\r\n3\r\nPING xyz\r\n"
)
BASIC_REPLY = (
    b"PONG\r\nPONG\r\n"
    b"MSG a.b 2 1\r\nX\r\nMSG a.b 1 1\r\nX\r\n"
    b"HMSG a.x 2 reply.1 22 33\r\nNATS/1.0\r\nBar: Baz\r\n\r\nHello NATS!\r\n"
    b"HMSG a.x 1 reply.1 22 33\r\nNATS/1.0\r\nBar: Baz\r\n\r\nHello NATS!\r\n"
    b"MSG lf 3 3\r\nabc\r\n"
    b"HMSG _INBOX.abc.1 50 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
    b"MSG lim 9 1\r\n1\r\nMSG lim 9 1\r\n2\r\nPONG\r\n"
)


def test_transcript_pipelined_in_one_packet(nb):
    with NatsRaw(nb, connect=None) as c:
        c.send(BASIC_SESSION)
        assert c.read_exactly(BASIC_REPLY) == BASIC_REPLY
        assert c.nothing()


def test_transcript_split_at_every_byte_boundary(start_broker):
    b = start_broker(workers=1)
    for cut in range(1, len(BASIC_SESSION)):
        with NatsRaw(b, connect=None) as c:
            c.send(BASIC_SESSION[:cut])
            time.sleep(0.001)
            c.send(BASIC_SESSION[cut:])
            assert c.read_exactly(BASIC_REPLY) == BASIC_REPLY, cut


def test_transcript_one_byte_at_a_time(nb):
    with NatsRaw(nb, connect=None) as c:
        for i in range(len(BASIC_SESSION)):
            c.send(BASIC_SESSION[i:i + 1])
        assert c.read_exactly(BASIC_REPLY) == BASIC_REPLY


def test_headers_are_stripped_for_clients_without_headers(nb):
    with NatsRaw(nb, connect=b'CONNECT {"verbose":false}\r\nSUB hx 1\r\nPING\r\n') as plain, \
            NatsRaw(nb, connect=b'CONNECT {"verbose":false,"headers":true}\r\n') as pub:
        assert plain.line() == b"PONG\r\n"
        pub.send(b"HPUB hx 22 33\r\nNATS/1.0\r\nBar: Baz\r\n\r\nHello NATS!\r\n")
        assert plain.read_exactly(b"MSG hx 1 11\r\nHello NATS!\r\n") == b"MSG hx 1 11\r\nHello NATS!\r\n"


ERRORS_THAT_CLOSE = [
    (b"FOO bar\r\n", b"-ERR 'Unknown Protocol Operation'\r\n"),
    (b"PUB foo 2\r\nabc\r\n", b"-ERR 'Unknown Protocol Operation'\r\n"),
    (b"PUB lf 3\nabc\nPING\r\n", b"-ERR 'Unknown Protocol Operation'\r\n"),
    (b"PUB big 1048577\r\n", b"-ERR 'Maximum Payload Violation'\r\n"),
    (b"HPUB big 10 1048577\r\n", b"-ERR 'Maximum Payload Violation'\r\n"),
    (b"SUB " + b"a" * 5000 + b" 1\r\n", b"-ERR 'maximum control line exceeded'\r\n"),
    (b"SUB " + b"a" * 5000, b"-ERR 'maximum control line exceeded'\r\n"),   # no newline yet: caught early
    (b'CONNECT {"protocol":2}\r\n', b"-ERR 'invalid client protocol'\r\n"),
    (b'CONNECT {"no_responders":true}\r\n', b"-ERR 'no responders requires headers support'\r\n"),
    (b'CONNECT {"account":"foo"}\r\n', b"-ERR 'Authorization Violation'\r\n"),
    # argument errors: closed without a word
    (b"PUB foo\r\n", b""),
    (b"SUB a b c d\r\n", b""),
    (b"CONNECT {bad json\r\n", b""),
    (b'CONNECT {"verbose":"yes"}\r\n', b""),
    (b"HPUB x 12 12\r\nNATS/1.0\r\n\r\n\r\n", b""),    # headers not negotiated
    (b"HPUB x 13 12\r\n", b""),
    (b"PUB foo -1\r\n", b""),
    (b"UNSUB 1 x\r\n", b""),
]


@pytest.mark.parametrize("data,reply", ERRORS_THAT_CLOSE, ids=[e[0][:24].decode() for e in ERRORS_THAT_CLOSE])
def test_errors_that_close(nb, data, reply):
    with NatsRaw(nb, connect=b"CONNECT {\"verbose\":false}\r\n" if not data.startswith(b"CONNECT") else None) as c:
        c.send(data)
        if reply:
            assert c.line() == reply
        assert c.closed()
        assert c.buf == b""


ERRORS_THAT_KEEP = [
    (b"SUB foo. 1\r\n", b"-ERR 'Invalid Subject'\r\n"),
    (b"SUB foo..bar 2\r\n", b"-ERR 'Invalid Subject'\r\n"),
    (b"SUB foo.>.bar 3\r\n", b"-ERR 'Invalid Subject'\r\n"),
]


@pytest.mark.parametrize("data,reply", ERRORS_THAT_KEEP, ids=[e[0][:24].decode() for e in ERRORS_THAT_KEEP])
def test_errors_that_keep_the_connection(nb, data, reply):
    with NatsRaw(nb) as c:
        c.send(data + b"PING\r\n")
        assert c.read_exactly(reply + b"PONG\r\n") == reply + b"PONG\r\n"


def test_literal_token_with_star_is_valid_and_duplicate_sid_is_ignored(nb):
    with NatsRaw(nb, connect=b'CONNECT {"verbose":true}\r\n') as c:
        c.send(b"UNSUB 99\r\nSUB a.b* 4\r\nSUB d 1\r\nSUB e 1\r\nPUB e 1\r\nx\r\nPUB d 1\r\ny\r\nPING\r\n")
        expected = b"+OK\r\n" * 7 + b"MSG d 1 1\r\ny\r\nPONG\r\n"
        assert c.read_exactly(expected) == expected


def test_pedantic_and_plain_publish_to_wildcards(nb):
    with NatsRaw(nb, connect=b'CONNECT {"verbose":false,"pedantic":true}\r\n') as p:
        p.send(b"SUB foo.* 1\r\nPUB foo.* 1\r\nx\r\nPING\r\n")
        expected = b"-ERR 'Invalid Publish Subject'\r\nMSG foo.* 1 1\r\nx\r\nPONG\r\n"
        assert p.read_exactly(expected) == expected
    with NatsRaw(nb, connect=b'CONNECT {"verbose":false,"pedantic":false}\r\n') as p:
        p.send(b"SUB foo.* 1\r\nPUB foo.* 1\r\nx\r\nPUB foo. 1\r\ny\r\nPING\r\n")
        expected = b"MSG foo.* 1 1\r\nx\r\nPONG\r\n"
        assert p.read_exactly(expected) == expected


def test_maximum_subscriptions_keeps_the_connection(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_subscriptions": 2}})
    with NatsRaw(b) as c:
        c.send(b"SUB a 1\r\nSUB b 2\r\nSUB c 3\r\nPING\r\n")
        expected = b"-ERR 'maximum subscriptions exceeded'\r\nPONG\r\n"
        assert c.read_exactly(expected) == expected


def test_maximum_connections_exceeded(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_connections": 2}})
    with NatsRaw(b), NatsRaw(b):
        time.sleep(0.2)
        with Raw(b.ports["nats"]) as third:
            assert third.line() == b"-ERR 'maximum connections exceeded'\r\n"
            assert third.closed()


def test_ops_before_connect_work_without_auth(nb):
    with NatsRaw(nb, connect=None) as c:
        c.send(b"PING\r\nSUB x 1\r\nPUB x 1\r\na\r\n")
        expected = b"PONG\r\n+OK\r\n+OK\r\nMSG x 1 1\r\na\r\n"
        assert c.read_exactly(expected) == expected


def test_server_pings_idle_clients_and_closes_stale_ones(start_broker):
    b = start_broker(workers=1, config={"nats": {"ping_interval": 0.2, "ping_max": 2}})
    with NatsRaw(b) as silent, NatsRaw(b) as alive:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                line = alive.line(timeout=0.1)
            except TimeoutError:
                continue
            assert line == b"PING\r\n"
            alive.send(b"PONG\r\n")
        expected = b"PING\r\nPING\r\n-ERR 'Stale Connection'\r\n"
        assert silent.read_exactly(expected) == expected
        assert silent.closed()
        alive.send(b"PING\r\n")
        while (line := alive.line()) == b"PING\r\n":
            pass
        assert line == b"PONG\r\n"


def test_auth_errors_and_timeout(start_broker):
    b = start_broker(workers=1, config=secure_config(auth_timeout=0.5))
    with NatsRaw(b, connect=None) as c:
        assert c.info["auth_required"] is True
        c.send(b"PING\r\n")
        assert c.line() == b"-ERR 'Authorization Violation'\r\n" and c.closed()
    with NatsRaw(b, connect=b'CONNECT {"verbose":false}\r\n') as c:
        assert c.line() == b"-ERR 'Authorization Violation'\r\n" and c.closed()
    with NatsRaw(b, connect=b'CONNECT {"verbose":false,"user":"chatuser","pass":"nope"}\r\n') as c:
        assert c.line() == b"-ERR 'Authorization Violation'\r\n" and c.closed()
    with NatsRaw(b, connect=None) as c:
        assert c.line(timeout=5) == b"-ERR 'Authentication Timeout'\r\n" and c.closed()
    with NatsRaw(b, connect=b'CONNECT {"verbose":false,"user":"chatuser","pass":"secret3"}\r\nPING\r\n') as c:
        assert c.line() == b"PONG\r\n"
        c.send(b"SUB private.x 1\r\nSUB private.x q 2\r\nPUB secret.x 1\r\nx\r\nSUB chat.ok 3\r\n"
               b"PUB chat.ok 1\r\ny\r\nPING\r\n")
        expected = (b"-ERR 'Permissions Violation for Subscription to \"private.x\"'\r\n"
                    b"-ERR 'Permissions Violation for Subscription to \"private.x\" using queue \"q\"'\r\n"
                    b"-ERR 'Permissions Violation for Publish to \"secret.x\"'\r\n"
                    b"MSG chat.ok 3 1\r\ny\r\nPONG\r\n")
        assert c.read_exactly(expected) == expected
        time.sleep(0.6)  # past the auth timeout: an authenticated connection stays
        c.send(b"PING\r\n")
        assert c.line() == b"PONG\r\n"


def test_slow_nats_consumer_is_closed_without_err(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_pending_bytes": 65536}})
    with NatsRaw(b, connect=b'CONNECT {"verbose":false}\r\nSUB big 1\r\nPING\r\n') as slow, NatsRaw(b) as pub:
        import socket
        slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        assert slow.line() == b"PONG\r\n"
        chunk = b"PUB big 1000\r\n" + b"x" * 1000 + b"\r\n"
        for _ in range(20):
            pub.send(chunk * 500)
        pub.send(b"PING\r\n")
        assert pub.line(timeout=20) == b"PONG\r\n"
        assert slow.closed(timeout=10)
        assert b"-ERR" not in slow.buf
    assert b.varz()["slow_consumers"] == 1


# -- one subject space -----------------------------------------------------------------------------------------

def test_cross_protocol_delivery_both_ways(nb):
    async def run():
        nc = await connect(nb)
        nsub = await nc.subscribe("x.>")
        await synced(nc)
        nd = await AsyncClient.connect("127.0.0.1", nb.port)
        await nd.sub("x.>")
        # NDJSON -> NATS: a string as its UTF-8 bytes, other values as their JSON encoding.
        await nd.pub("x.s", "h\u00e9llo")
        await nd.pub("x.j", {"a": [1, 2]})
        assert (await nsub.next_msg(timeout=5)).data == "h\u00e9llo".encode()
        assert json.loads((await nsub.next_msg(timeout=5)).data) == {"a": [1, 2]}
        assert (await nd.next_message(timeout=5)).data == "h\u00e9llo"
        assert (await nd.next_message(timeout=5)).data == {"a": [1, 2]}
        # NATS -> NDJSON: UTF-8 as a string, other bytes as base64 with a marker; reply and headers as fields.
        await nc.publish("x.u", "caf\u00e9".encode())
        await nc.publish("x.b", b"\xff\x00\xfe", reply="inbox.9", headers={"K": "v"})
        await nc.flush()
        m1, m2 = await nd.next_message(timeout=5), await nd.next_message(timeout=5)
        assert (m1.topic, m1.data, m1.extra) == ("x.u", "caf\u00e9", {})
        assert (m2.topic, m2.data) == ("x.b", "/wD+")
        assert m2.extra == {"encoding": "base64", "reply": "inbox.9", "headers": "NATS/1.0\r\nK: v\r\n\r\n"}
        await nc.close()
        await nd.close()

    asyncio.run(run())


def test_nats_users_are_the_same_registry_as_ndjson(start_broker):
    b = start_broker(workers=2, config=secure_config())

    async def run():
        admin = await AsyncClient.connect("127.0.0.1", b.port, user=ADMIN[0], password=ADMIN[1])
        await admin.request("admin.create_user", user="natsy", permissions=["publish:n.*", "subscribe:n.*"],
                            **{"pass": "pw"})
        nc = await connect(b, user="natsy", password="pw")
        sub = await nc.subscribe("n.x")
        await synced(nc)
        await admin.pub("n.x", "from ndjson")
        assert (await sub.next_msg(timeout=5)).data == b"from ndjson"
        await admin.request("admin.delete_user", user="natsy")
        await asyncio.sleep(0.3)
        assert nc.is_closed or nc.last_error is not None
        await nc.close()
        await admin.close()

    asyncio.run(run())


def test_monitoring_after_known_nats_traffic(nb):
    async def run():
        nc = await connect(nb, name="monitored")
        await nc.subscribe("m.*")
        await nc.subscribe("m.x", queue="g")
        await synced(nc)
        for _ in range(3):
            await nc.publish("m.x", b"12345")
        await nc.flush()
        await asyncio.sleep(0.2)
        connz = nb.http("/connz?subs=1")[1]
        entry = next(c for c in connz["connections"] if c["cid"] == nc._client_id)
        assert entry["name"] == "monitored" and entry["lang"] == "python3" and entry["version"]
        assert entry["subscriptions"] == 2 and entry["subscriptions_list"] == ["m.*", "m.x"]
        assert entry["in_msgs"] == 3 and entry["in_bytes"] == 15 and entry["out_msgs"] == 6
        assert entry["out_bytes"] == 30  # payload bytes, as nats-server counts them, not "MSG m.x 1 5\r\n..."
        assert entry["out_wire_bytes"] >= 6 * len(b"MSG m.x 1 5\r\n12345\r\n")
        varz = nb.varz()
        assert varz["in_msgs"] == 3 and varz["out_msgs"] == 6 and varz["in_bytes"] == 15
        assert varz["out_bytes"] == 30
        assert varz["subscriptions"] == 2
        await nc.close()

    asyncio.run(run())


def test_byte_counters_count_payloads_as_nats_server(start_broker):
    """in_bytes/out_bytes count payload bytes (the header block too for HPUB/HMSG), on every delivery path:
    batched, per message, across workers, with headers stripped for a client that did not negotiate them."""
    b = start_broker(workers=2)
    port = b.ports["nats"]
    conns = []
    for headers in ("true", "true", "false"):
        c = Raw(port)
        c.line()
        c.send(b'CONNECT {"verbose":false,"headers":%s}\r\nPING\r\n' % headers.encode())
        assert c.line() == b"PONG\r\n"
        conns.append(c)
    pub, sub_h, sub_plain = conns
    for s in (sub_h, sub_plain):
        s.send(b"SUB c.x 1\r\nPING\r\n")
        assert s.line() == b"PONG\r\n"
    hdr = b"NATS/1.0\r\nA: b\r\n\r\n"
    pub.send(b"PUB c.x 1\r\nA\r\n" + b"HPUB c.x %d %d\r\n" % (len(hdr), len(hdr) + 2) + hdr + b"BC\r\nPING\r\n")
    assert pub.line() == b"PONG\r\n"
    for s in (sub_h, sub_plain):
        s.send(b"PING\r\n")
        while s.line() != b"PONG\r\n":
            pass
    rows = {c["port"]: c for c in b.http("/connz")[1]["connections"]}
    entry = lambda raw: rows[raw.sock.getsockname()[1]]  # noqa: E731
    assert entry(pub)["in_bytes"] == 1 + len(hdr) + 2
    assert entry(sub_h)["out_bytes"] == 1 + len(hdr) + 2       # MSG, then HMSG with its header block
    assert entry(sub_plain)["out_bytes"] == 1 + 2              # MSG twice: the headers were not sent
    varz = b.varz()
    assert varz["in_bytes"] == 1 + len(hdr) + 2 and varz["out_bytes"] == 2 * (1 + 2) + len(hdr)
    for c in conns:
        c.close()
