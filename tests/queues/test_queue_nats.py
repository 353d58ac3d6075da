"""Work queues from a real NATS client (nats-py): request/reply on ``$Q.<OP>.<queue>``, and the JetStream-style
``Msg`` methods (ack, nak, in_progress, term) on the messages a receive delivers."""

import asyncio
import base64
import json
import re
import socket

import nats
import pytest
from test_security import secure_config

from support.harness import NatsFrames, nats_ready, on_worker


def url(broker) -> str:
    return f"nats://127.0.0.1:{broker.ports['nats']}"


async def push(nc, queue: str, data: bytes, **headers) -> dict:
    return json.loads((await nc.request(f"$Q.PUSH.{queue}", data, headers=headers or None)).data)


async def recv(nc, queue: str, **body):
    return await nc.request(f"$Q.RECV.{queue}", json.dumps(body).encode(), timeout=5)


async def stat(nc, queue: str) -> dict:
    return json.loads((await nc.request(f"$Q.STAT.{queue}", b"")).data)["stat"]


def test_push_receive_ack_with_msg_methods(start_broker):
    broker = start_broker(workers=2, config={"queues": {"max_deliveries": 2}})

    async def run():
        nc = await nats.connect(url(broker), allow_reconnect=False)
        for i, priority in enumerate((0, 9, 4)):
            assert (await push(nc, "nq.jobs", b"job%d" % i, **{"Q-Priority": str(priority)}))["ok"]
        first = await recv(nc, "nq.jobs")
        assert first.data == b"job1" and first.headers["Q-Deliveries"] == "1"  # priority 9 first
        assert first.reply == f"$Q.ACK.nq.jobs.{first.headers['Q-Receipt']}"
        await first.ack()
        second = await recv(nc, "nq.jobs", visibility_ms=300)
        assert second.data == b"job2"
        await second.in_progress()          # +WPI: the same 300 ms again
        await asyncio.sleep(0.2)
        await second.in_progress()
        await asyncio.sleep(0.2)            # 400 ms since the receive: alive only through the heartbeats
        ack = json.loads((await nc.request(second.reply, b"+ACK")).data)
        assert ack == {"ok": True}
        third = await recv(nc, "nq.jobs")
        assert third.data == b"job0"
        await third.nak()                    # back, and delivered again with deliveries 2
        again = await recv(nc, "nq.jobs")
        assert again.data == b"job0" and again.headers["Q-Deliveries"] == "2"
        stale = json.loads((await nc.request(third.reply, b"+ACK")).data)
        assert stale == {"ok": False, "error": "lease_lost", "deliveries": 2}
        await again.nak()                    # the second (last) delivery: to the DLQ
        await nc.flush()
        s = await stat(nc, "nq.jobs")
        assert s["messages"] == 0 and s["acked"] == 2 and s["dead_lettered"] == 1
        dead = await recv(nc, "nq.jobs.dlq")
        assert dead.data == b"job0" and dead.headers["Q-Deliveries"] == "3"
        await dead.term()
        await nc.close()

    asyncio.run(run())


def test_batches_statuses_and_errors(start_broker):
    broker = start_broker(workers=2)

    async def run():
        nc = await nats.connect(url(broker), allow_reconnect=False)
        empty = await recv(nc, "nq.none")
        assert empty.headers["Status"] == "404" and empty.data == b""
        t0 = asyncio.get_running_loop().time()
        timeout = await recv(nc, "nq.none", expires=200_000_000)
        assert timeout.headers["Status"] == "408"
        assert asyncio.get_running_loop().time() - t0 >= 0.19
        for i in range(5):
            await push(nc, "nq.batch", b"%d" % i)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await asyncio.sleep(0)
        await nc.flush()
        await nc.publish("$Q.RECV.nq.batch", b'{"batch": 3}', reply=inbox)
        got = [await sub.next_msg(timeout=5) for _ in range(3)]
        assert [m.data for m in got] == [b"0", b"1", b"2"]
        assert len({m.headers["Q-Receipt"] for m in got}) == 3
        # a waiting receive gets a message pushed after it, from another connection
        other = await nats.connect(url(broker), allow_reconnect=False)
        waiting = asyncio.ensure_future(recv(nc, "nq.later", expires=5_000_000_000))
        await asyncio.sleep(0.1)
        await push(other, "nq.later", b"late")
        assert (await waiting).data == b"late"
        bad = json.loads((await nc.request("$Q.RECV.nq.batch", b"{not json")).data)
        assert bad == {"ok": False, "error": "invalid_json"}
        bad = json.loads((await nc.request("$Q.FROB.nq.batch", b"")).data)
        assert bad["error"] == "unknown_op"
        bad = json.loads((await nc.request("$Q.PUSH.nq.batch", b"x", headers={"Q-Priority": "high"})).data)
        assert bad["error"] == "invalid_priority"
        bad = json.loads((await nc.request("$Q.ACK.nq.batch.notareceipt", b"")).data)
        assert bad["error"] == "invalid_receipt"
        bad = json.loads((await nc.request("$Q.RECV.nq.batch", b'{"batch": 5000}')).data)
        assert bad["error"] == "invalid_max"
        await other.close()
        await nc.close()

    asyncio.run(run())


def test_queue_permissions_on_nats(start_broker):
    # replies come to the requester's inbox: it must be allowed to subscribe to it, as with nats-server
    users = [{"username": "producer", "password": "pw-producer", "permissions": ["publish:orders.>",
                                                                                 "subscribe:_INBOX.>"]},
             {"username": "worker", "password": "pw-worker", "permissions": ["subscribe:orders.>",
                                                                             "subscribe:_INBOX.>"]}]
    broker = start_broker(workers=2, config=secure_config(users=users))

    async def run():
        producer = await nats.connect(url(broker), user="producer", password="pw-producer", allow_reconnect=False)
        worker = await nats.connect(url(broker), user="worker", password="pw-worker", allow_reconnect=False)
        assert (await push(producer, "orders.new", b"o1"))["ok"]
        denied = await push(worker, "orders.new", b"o2")
        assert denied == {"ok": False, "error": "permission_denied"}
        denied = json.loads((await producer.request("$Q.RECV.orders.new", b"")).data)
        assert denied == {"ok": False, "error": "permission_denied"}
        msg = await recv(worker, "orders.new")
        assert msg.data == b"o1"
        await msg.ack()
        denied = json.loads((await worker.request("$Q.PURGE.orders.new", b"")).data)
        assert denied["error"] == "permission_denied"
        await producer.close()
        await worker.close()

    asyncio.run(run())


def test_answers_go_to_the_requesting_connection_alone(start_broker):
    """An answer is the broker's message to the requester, not a publish: a client without echo gets its answers,
    and nobody else subscribed to the reply subject, on any worker or in a queue group, sees one (findings A3, A4:
    a sniffer of `_INBOX.>` read other users' queues, and a reply subject was a way to publish where the requester
    may not).  Answers are not cached as routes either (each request's inbox is new)."""
    broker = start_broker(workers=2)
    watchers = [on_worker(broker.ports["ndjson"], w) for w in (0, 1)]
    for watcher in watchers:
        assert watcher.request({"op": "sub", "topic": "answers.>"}) == {"ok": True}
        assert watcher.request({"op": "sub", "topic": "_INBOX.>"}) == {"ok": True}

    async def run():
        nc = await nats.connect(url(broker), no_echo=True, allow_reconnect=False)
        members = [await nats.connect(url(broker), allow_reconnect=False) for _ in range(2)]
        got: list[bytes] = []

        async def member(msg):
            got.append(msg.data)

        for m in members:
            await m.subscribe("answers.>", queue="g", cb=member)
            await m.subscribe("_INBOX.>", cb=member)
            await m.flush()
        for i in range(200):   # each with an inbox of its own
            assert (await push(nc, "nq.answers", b"m%d" % i))["ok"]
        msg = await recv(nc, "nq.answers")
        assert msg.data == b"m0"
        assert json.loads((await nc.request(msg.reply, b"+ACK")).data) == {"ok": True}
        assert broker.http("/subsz")[1]["num_cache"] < 10   # while the subscriptions stand (a change clears it)
        own = await nc.subscribe("answers.1")
        await nc.publish("$Q.PUSH.nq.answers", b"seen", reply="answers.1")
        await nc.publish("$Q.RECV.nq.answers", b'{"batch":2}', reply="answers.1")
        answer = await own.next_msg(timeout=5)
        assert json.loads(answer.data)["ok"] is True
        assert (await own.next_msg(timeout=5)).data == b"m1"
        await asyncio.sleep(0.3)
        assert got == []
        for c in (nc, *members):
            await c.close()

    asyncio.run(run())
    for watcher in watchers:
        assert watcher.nothing(0.2), watcher.buf
    assert broker.http("/varz")[1]["in_msgs"] == 0   # requests to $Q are not publishes, nor are their answers
    for watcher in watchers:
        watcher.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_pipelined_pushes_are_each_answered_on_their_own_subject(start_broker, workers):
    # One read of pushes goes to the owner as one request (each push stored or refused on its own): every push
    # is answered on its own reply subject, in whatever mix, and what follows them in the read sees them done.
    broker = start_broker(workers=workers)

    def hpub(subject: str, reply: str, headers: dict, data: bytes) -> bytes:
        block = ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
        head = f"HPUB {subject} {reply} {len(block)} {len(block) + len(data)}\r\n".encode()
        return head + block + data + b"\r\n"

    with nats_ready(broker.ports["nats"], b"SUB _INBOX.t.* 1\r\n", timeout=10) as s:
        q = "$Q.PUSH.nq.gather"
        s.sendall(b"".join([
            b"PUB %s _INBOX.t.0 2\r\nm0\r\n" % q.encode(),
            hpub(q, "_INBOX.t.1", {"Q-Priority": "9"}, b"m1"),
            hpub(q, "_INBOX.t.2", {"Q-Priority": "high"}, b"m2"),
            hpub(q, "_INBOX.t.3", {"Nats-Msg-Id": "a"}, b"m3"),
            hpub(q, "_INBOX.t.4", {"Nats-Msg-Id": "a"}, b"m3 again"),
            b"PUB %s 2\r\nm5\r\n" % q.encode(),                       # no reply subject: stored, unanswered
            b"PUB $Q.PUSH.nq.other _INBOX.t.6 2\r\nm6\r\n",
            b"PUB %s _INBOX.t.7 2\r\nm7\r\n" % q.encode(),
            b"PUB $Q.STAT.nq.gather _INBOX.t.8 0\r\n\r\n",
            *[b"PUB $Q.PUSH.nq.plain _INBOX.t.%d 1\r\nx\r\n" % i for i in range(9, 29)],   # stored together
        ]))
        got = {k: json.loads(v[1]) for k, v in NatsFrames(s).by_token(28).items()}
    assert set(got) == {"0", "1", "2", "3", "4", "6", "7", "8", *map(str, range(9, 29))}
    assert len({got[str(i)]["id"] for i in range(9, 29)}) == 20
    assert all(got[k]["ok"] for k in ("0", "1", "3", "6", "7"))
    assert got["2"]["ok"] is False and got["2"]["error"] == "invalid_priority"
    assert got["4"] == dict(got["3"], duplicate=True)
    assert len({got[k]["id"] for k in ("0", "1", "3", "6", "7")}) == 5
    assert got["8"]["stat"]["visible"] == 5   # m0, m1, m3, m5, m7

    async def drain():
        nc = await nats.connect(url(broker), allow_reconnect=False)
        order = [(await recv(nc, "nq.gather")).data for _ in range(5)]
        await nc.close()
        return order

    assert asyncio.run(drain()) == [b"m1", b"m0", b"m3", b"m5", b"m7"]


@pytest.mark.parametrize("workers", [1, 2])
def test_pipelined_pushes_without_headers_keep_their_data_raw(start_broker, workers):
    """Pushes with nothing but their data travel to the owner together as the data's bytes, with their kind once
    (nats_ops._pushes): a NATS payload is raw bytes, never taken for JSON, whoever receives it."""
    broker = start_broker(workers=workers)
    payloads = [b"42", b"plain text", b"\xff\x00bytes", b'{"a":1}']
    with nats_ready(broker.ports["nats"], b"SUB _INBOX.k.* 1\r\n", timeout=10) as s:
        s.sendall(b"".join(b"PUB $Q.PUSH.nq.kinds _INBOX.k.%d %d\r\n%s\r\n" % (i, len(p), p)
                           for i, p in enumerate(payloads)))
        assert all(json.loads(v[1])["ok"] for v in NatsFrames(s).by_token(len(payloads)).values())
    conn = on_worker(broker.ports["ndjson"], 0)
    got = conn.request({"op": "qrecv", "queue": "nq.kinds", "max": 10})["messages"]
    conn.close()
    assert [m["data"] for m in got] == ["42", "plain text", base64.b64encode(b"\xff\x00bytes").decode(), '{"a":1}']
    assert [m.get("encoding") for m in got] == [None, None, "base64", None]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_read_of_pushes_longer_than_a_turn_is_answered_whole_and_seen_by_what_follows(start_broker, workers):
    """Pushes count against the turn's budget over NATS as over NDJSON (``PUSHES_PER_TURN``): a read of more goes
    on over several turns.  Every push is answered, without waiting for the long poll that ends the read, and a
    STAT between them sees them all."""
    from shardbroker.workers.workqueues.service import PUSHES_PER_TURN

    broker = start_broker(workers=workers)
    n = 3 * PUSHES_PER_TURN
    with nats_ready(broker.ports["nats"], b"SUB _INBOX.t.* 1\r\n", timeout=5) as s:
        s.sendall(b"".join(b"PUB $Q.PUSH.nq.turns _INBOX.t.%d 1\r\nx\r\n" % i for i in range(n))
                  + b"PUB $Q.STAT.nq.turns _INBOX.t.stat 0\r\n\r\n"
                  + b'PUB $Q.RECV.nq.turns-empty _INBOX.t.poll 23\r\n{"expires":20000000000}\r\n')
        got = {k: json.loads(v[1]) for k, v in NatsFrames(s).by_token(n + 1).items()}   # 5 s each, at most
        assert all(got[str(i)]["ok"] for i in range(n)) and len({got[str(i)]["id"] for i in range(n)}) == n
        assert got["stat"]["stat"]["visible"] == n
        with nats_ready(broker.ports["nats"], b"PUB $Q.PUSH.nq.turns-empty 4\r\nlate\r\n", timeout=5):
            pass
        [(token, _, payload)] = NatsFrames(s).take(1)
    assert (token, payload) == ("poll", b"late")


@pytest.mark.parametrize("workers", [1, 2])
def test_pipelined_acks_are_each_done_and_answered(start_broker, workers):
    # One read of acks goes to the owner as one request: each ack done or refused on its own, those with a reply
    # subject answered on it, and a request of another kind after them (a nak, a stat) sees them done.
    broker = start_broker(workers=workers)
    with socket.create_connection(("127.0.0.1", broker.ports["nats"]), timeout=10) as s:
        s.sendall(b'CONNECT {"verbose":false,"headers":true}\r\nSUB _INBOX.t.* 1\r\n'
                  + b"".join(b"PUB $Q.PUSH.nq.acks 2\r\nm%d\r\n" % i for i in range(10))
                  + b'PUB $Q.RECV.nq.acks _INBOX.t.recv 12\r\n{"batch":10}\r\n')
        frames = NatsFrames(s)
        r = [re.search(rb"Q-Receipt: (\S+)", headers).group(1).decode() for _, headers, _ in frames.take(10)]
        block = b"NATS/1.0\r\nQ-Receipt: %s\r\n\r\n" % r[6].encode()
        s.sendall(b"".join([
            *[b"PUB $Q.ACK.nq.acks.%s 0\r\n\r\n" % x.encode() for x in r[:6]],      # no reply: not answered
            b"PUB $Q.ACK.nq.acks.%s _INBOX.t.again 4\r\n+ACK\r\n" % r[0].encode(),
            b"PUB $Q.ACK.nq.acks.bogus _INBOX.t.bogus 0\r\n\r\n",
            b"HPUB $Q.ACK.nq.acks _INBOX.t.header %d %d\r\n%s\r\n" % (len(block), len(block), block),
            b"PUB $Q.ACK.nq.acks.%s _INBOX.t.nak 4\r\n-NAK\r\n" % r[7].encode(),
            b"PUB $Q.STAT.nq.acks _INBOX.t.stat 0\r\n\r\n",
        ]))
        got = {k: json.loads(v[1]) for k, v in frames.by_token(5).items()}
    assert got["again"] == {"ok": True, "already_acked": True}
    assert got["bogus"] == {"ok": False, "error": "invalid_receipt"}
    assert got["header"] == {"ok": True}
    assert got["nak"]["ok"] is True
    stat = got["stat"]["stat"]
    assert (stat["acked"], stat["in_flight"], stat["visible"]) == (7, 2, 1)


@pytest.mark.parametrize("headers", [None, {"Q-Delay": "300"}])
def test_push_delay_header(start_broker, headers):
    broker = start_broker(workers=1)

    async def run():
        nc = await nats.connect(url(broker), allow_reconnect=False)
        await push(nc, "nq.delay", b"d", **(headers or {}))
        first = await recv(nc, "nq.delay")
        if headers:
            assert first.headers["Status"] == "404"
            await asyncio.sleep(0.35)
            first = await recv(nc, "nq.delay")
        assert first.data == b"d"
        await nc.close()

    asyncio.run(run())


def test_thousands_of_waiting_receives_cost_little_and_are_served_in_order(start_broker):
    broker = start_broker(workers=2)
    waiting = 1000

    async def run():
        consumers = [await nats.connect(url(broker), allow_reconnect=False) for _ in range(2)]
        inboxes = []
        for c in consumers:
            inbox = c.new_inbox()
            inboxes.append((inbox, await c.subscribe(inbox)))
            await asyncio.sleep(0)
            await c.flush()
        body = json.dumps({"batch": 1, "expires": 30_000_000_000}).encode()
        order = []
        for i in range(waiting):                      # alternating between the two connections (two workers)
            c = i % 2
            await consumers[c].publish("$Q.RECV.nq.many", body, reply=inboxes[c][0])
            order.append(c)
            if i % 100 == 99:
                await consumers[c].flush()
        for c in consumers:
            await c.flush()
        producer = await nats.connect(url(broker), allow_reconnect=False)
        for _ in range(20):
            s = await stat(producer, "nq.many")
            if s["waiters"] == waiting:
                break
            await asyncio.sleep(0.1)
        assert s["waiters"] == waiting
        for i in range(waiting):
            await producer.publish("$Q.PUSH.nq.many", b"%d" % i)
        await producer.flush()
        got = [[], []]
        for c in (0, 1):
            for _ in range(waiting // 2):
                got[c].append(int((await inboxes[c][1].next_msg(timeout=10)).data))
        # each waiter got one message; arrival order across both connections is the order of the pushes
        merged = sorted(got[0] + got[1])
        assert merged == list(range(waiting))
        assert got[0] == sorted(got[0]) and got[1] == sorted(got[1])
        s = await stat(producer, "nq.many")
        assert s["waiters"] == 0 and s["in_flight"] == waiting
        for c in consumers + [producer]:
            await c.close()

    asyncio.run(run())


def test_waiters_per_connection_are_bounded(start_broker):
    broker = start_broker(workers=1)

    async def run():
        nc = await nats.connect(url(broker), allow_reconnect=False)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await asyncio.sleep(0)
        await nc.flush()
        body = json.dumps({"batch": 1, "expires": 30_000_000_000}).encode()
        for _ in range(1001):
            await nc.publish("$Q.RECV.nq.bounded", body, reply=inbox)
        await nc.flush()
        refused = json.loads((await sub.next_msg(timeout=5)).data)
        assert refused == {"ok": False, "error": "too_many_waiters", "retry": True}
        assert (await stat(nc, "nq.bounded"))["waiters"] == 1000
        await nc.close()
        nc2 = await nats.connect(url(broker), allow_reconnect=False)
        for _ in range(20):  # the closed connection's waiters are dropped
            if (await stat(nc2, "nq.bounded"))["waiters"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (await stat(nc2, "nq.bounded"))["waiters"] == 0
        await nc2.close()

    asyncio.run(run())


def test_a_receives_frames_are_the_same_whoever_else_listens(start_broker):
    """A receive's messages to an inbox that only one subscription listens on are made into frames at once
    (nats_ops._deliveries); with another subscription on it they go one by one through the hub.  The bytes are
    the same either way, for each kind of data (a JSON string, other JSON, raw bytes), counted alike, and a
    subscription's delivery limit (UNSUB <sid> <max>) still holds."""
    broker = start_broker(workers=1)
    queues = ("nq.alone", "nq.shared", "nq.limited")
    pusher = on_worker(broker.ports["ndjson"], 0)
    for queue in queues:
        for data in ("héllo", {"a": [1, 2]}, "x" * 70_000, 42):   # the large one ends a chunk (nats_ops._CHUNK)
            assert pusher.request({"op": "qpush", "queue": queue, "data": data})["ok"]
    pusher.close()
    with nats_ready(broker.ports["nats"],
                    b"".join(b"PUB $Q.PUSH.%s 4\r\n\x00raw\r\n" % q.encode() for q in queues)
                    + b"SUB _INBOX.a.* 1\r\nSUB _INBOX.s.* 2\r\nSUB _INBOX.s.x 3\r\nSUB _INBOX.l.* 4\r\nUNSUB 4 2\r\n",
                    timeout=10) as s:
        frames = NatsFrames(s)

        def receive(queue: str, inbox: bytes, count: int) -> list[bytes]:
            s.sendall(b'PUB $Q.RECV.%s %s.x 11\r\n{"batch":9}\r\n' % (queue.encode(), inbox))
            frames.take(count)
            return frames.raw[-count:]

        alone = receive("nq.alone", b"_INBOX.a", 5)
        shared = receive("nq.shared", b"_INBOX.s", 10)
        limited = receive("nq.limited", b"_INBOX.l", 2)
        s.sendall(b"PUB $Q.STAT.nq.limited _INBOX.a.stat 0\r\n\r\n")
        (token, _, stat), = frames.take(1)   # the answer after them: the limit held back the other two
        port = s.getsockname()[1]
        conn = next(c for c in broker.http("/connz?limit=1000")[1]["connections"] if c["port"] == port)

    def same(frame: bytes) -> bytes:   # what does not depend on the queue, the inbox or the lease
        rest = frame.split(b" ", 3)[3]
        rest = re.sub(rb"^\$Q\.ACK\.nq\.\w+\.(\S+)", b"ACK", rest)
        return re.sub(rb"(Q-Receipt|Q-Msg-Id): \S+", rb"\1: x", rest)

    payloads = ["héllo".encode(), b'{"a":[1,2]}', b"x" * 70_000, b"42", b"\x00raw"]
    assert [f.split(b"\r\n\r\n", 1)[1][:-2] for f in alone] == payloads
    assert all(f.startswith(b"HMSG _INBOX.a.x 1 $Q.ACK.nq.alone.") for f in alone)
    for f in alone:   # the receipt in the reply subject is the one in the headers
        assert re.search(rb"Q-Receipt: (\S+)", f).group(1) == f.split(b" ")[3].rsplit(b".", 1)[1]
    for sid in (b"2", b"3"):
        copies = [f for f in shared if f.split(b" ")[2] == sid]
        assert [same(f) for f in copies] == [same(f) for f in alone]
    assert [same(f) for f in limited] == [same(f) for f in alone[:2]]
    assert token == "stat" and json.loads(stat)["stat"]["in_flight"] == 5
    assert conn["out_msgs"] == 5 + 10 + 2 + 1
    assert conn["out_bytes"] == sum(len(f.split(b"\r\n", 1)[1]) - 2 for f in alone + shared + limited) + len(stat)
