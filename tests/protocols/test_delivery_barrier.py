"""A reply to a ping means delivered: after a publisher's PONG (NATS) or ``ping`` reply (NDJSON), every message it
published before the ping has been handed to its subscribers' connections, on every worker.

The reproduction from the issue: a subscriber on one worker, a publisher on the other.  The publisher sends a burst
and a PING in one write; once its PONG arrives, the subscriber unsubscribes.  Every message must reach the
subscriber before its own PONG: the unsubscribe came after the publisher was told the messages were delivered.
"""

import asyncio
import json
import os
import signal
import time
import zlib

import nats

from support.harness import Raw

RUNS = 300
BURST = 600


def _on_other_workers(broker, a: Raw, b: Raw) -> bool:
    ports = {c["port"]: c["worker"] for c in broker.http("/connz?limit=1000")[1]["connections"]}
    wa, wb = ports[a.sock.getsockname()[1]], ports[b.sock.getsockname()[1]]
    return wa != wb


def _nats_pair(broker) -> tuple[Raw, Raw]:
    """A subscriber and a publisher connection, on different workers."""
    port = broker.ports["nats"]
    s = Raw(port)
    s.line()  # INFO
    s.send(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
    assert s.line() == b"PONG\r\n"
    for _ in range(16):
        p = Raw(port)
        p.line()
        p.send(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        assert p.line() == b"PONG\r\n"
        if _on_other_workers(broker, s, p):
            return s, p
        p.close()
    raise AssertionError("could not place the two connections on different workers")


def _count_until_pong(conn: Raw) -> int:
    """The messages before the next PONG.  The server's PINGs are answered: its first comes 2 s after CONNECT,
    whatever a test has got to by then (further on the slower the machine)."""
    msgs = 0
    while True:
        line = conn.line()
        if line == b"PONG\r\n":
            return msgs
        if line.startswith(b"MSG "):
            conn.line()  # the payload
            msgs += 1
        elif line == b"PING\r\n":
            conn.send(b"PONG\r\n")
        else:
            raise AssertionError(f"unexpected {line!r}")


def _nothing_within(conn: Raw, wait: float) -> bool:
    """True if nothing but the server's own PINGs (answered) arrives within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = conn.line(timeout=left)
        except TimeoutError:
            return not conn.buf   # not even part of a line
        if line != b"PING\r\n":
            return False
        conn.send(b"PONG\r\n")
    return True


def test_nats_pong_means_cross_worker_messages_are_delivered(broker):
    s, p = _nats_pair(broker)
    burst = b"PUB barrier.x 1\r\nx\r\n" * BURST + b"PING\r\n"
    short = []
    for run in range(RUNS):
        s.send(b"SUB barrier.x 1\r\nPING\r\n")
        assert _count_until_pong(s) == 0, "messages of an earlier run arrived late"
        p.send(burst)
        assert _count_until_pong(p) == 0
        s.send(b"UNSUB 1\r\nPING\r\n")
        got = _count_until_pong(s)
        if got != BURST:
            short.append((run, got))
    assert not short, f"runs that lost messages (run, received of {BURST}): {short[:10]} ({len(short)} in all)"
    assert _nothing_within(s, 0.3), "messages arrived after the unsubscribe"
    s.close()
    p.close()


def test_ndjson_ping_reply_means_cross_worker_messages_are_delivered(broker):
    port = broker.port
    s = Raw(port)
    for _ in range(16):
        p = Raw(port)
        p.request({"op": "ping"})
        if _on_other_workers(broker, s, p):
            break
        p.close()
    else:
        raise AssertionError("could not place the two connections on different workers")
    burst = b"".join(json.dumps({"op": "pub", "topic": "barrier.n", "data": i}).encode() + b"\n"
                     for i in range(BURST)) + b'{"op":"ping","id":"done"}\n'
    short = []
    for run in range(RUNS // 3):
        assert s.request({"op": "sub", "topic": "barrier.n"})["ok"]
        p.send(burst)
        while p.json().get("id") != "done":  # the pubs' oks, then the ping's reply
            pass
        s.send(b'{"op":"unsub","topic":"barrier.n","id":"u"}\n')
        got = 0
        while True:
            obj = s.json()
            if obj.get("id") == "u":
                break
            if obj.get("topic") == "barrier.n":
                got += 1
        if got != BURST:
            short.append((run, got))
    assert not short, f"runs that lost messages (run, received of {BURST}): {short[:10]} ({len(short)} in all)"
    s.close()
    p.close()


def test_drain_of_a_responder_answers_requests_in_flight(start_broker):
    """nats-py's drain(): UNSUBs right after a flush.  Requests a requester published (and flushed) before the
    responder drains must all be answered."""
    broker = start_broker(workers=2)
    url = f"nats://127.0.0.1:{broker.ports['nats']}"

    async def run():
        lost = 0
        for _ in range(20):
            responder = await nats.connect(url, allow_reconnect=False)
            requester = await nats.connect(url, allow_reconnect=False)
            answered = 0

            async def handle(msg):
                await msg.respond(b"ok")

            await responder.subscribe("svc.echo", cb=handle)
            await asyncio.sleep(0)
            await responder.flush()
            inbox = requester.new_inbox()
            replies = await requester.subscribe(inbox)
            await asyncio.sleep(0)
            await requester.flush()
            for i in range(200):
                await requester.publish("svc.echo", b"%d" % i, reply=inbox)
            await requester.flush()     # the requests are with the responder's connection now
            await responder.drain()     # UNSUB, flush, answer what it holds, close
            while answered < 200:   # a reply missing for a second is lost (the rest come within milliseconds)
                try:
                    await replies.next_msg(timeout=1)
                    answered += 1
                except nats.errors.TimeoutError:
                    break
            lost += 200 - answered
            await requester.close()
        assert lost == 0, f"{lost} requests went unanswered after a flush and a drain"

    asyncio.run(run())


def test_nats_ping_before_sub_in_one_write_answers_once_the_sub_is_in_force(broker):
    """nats-py's subscribe() then flush() writes PING ahead of the SUB.  nats-server answers after processing the
    whole read, so the PONG still means the subscription is in force: a publish from another worker reaches it."""
    s, p = _nats_pair(broker)
    missed = []
    for run in range(100):
        subject = b"late.%d" % run
        s.send(b"PING\r\nSUB " + subject + b" 1\r\n")
        assert _count_until_pong(s) == 0
        p.send(b"PUB " + subject + b" 1\r\nx\r\nPING\r\n")
        assert _count_until_pong(p) == 0
        s.send(b"UNSUB 1\r\nPING\r\n")
        if _count_until_pong(s) != 1:
            missed.append(run)
    assert not missed, f"runs whose publish missed the subscription: {missed[:10]} ({len(missed)} in all)"
    s.close()
    p.close()



def test_nats_pong_waits_for_queue_members_two_hops_away(start_broker):
    """Publisher on worker a, the subject's owner (which picks queue members) on worker b, the only member on
    worker c: the PONG waits until c has the messages, not only b."""
    broker = start_broker(workers=3)
    port = broker.ports["nats"]
    by_worker: dict[int, Raw] = {}
    extra = []
    while len(by_worker) < 3:
        c = Raw(port)
        c.line()
        c.send(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        assert c.line() == b"PONG\r\n"
        rows = {r["port"]: r["worker"] for r in broker.http("/connz")[1]["connections"]}
        w = rows[c.sock.getsockname()[1]]
        if w in by_worker:
            extra.append(c)
        else:
            by_worker[w] = c
        assert len(extra) < 32
    # a subject owned by neither the publisher's worker (0) nor the member's (2)
    subject = next(s for s in (f"hop.{i}" for i in range(1000)) if zlib.crc32(s.encode()) % 3 == 1)
    pub, member = by_worker[0], by_worker[2]
    member.send(b"SUB %s workers 1\r\nPING\r\n" % subject.encode())
    assert _count_until_pong(member) == 0
    member_worker_pid = next(w["pid"] for w in broker.varz()["workers"] if w["worker"] == 2)
    # Frozen, the member's worker cannot take the owner's forwards: the PONG must wait for it.
    os.kill(member_worker_pid, signal.SIGSTOP)
    try:
        pub.send(b"PUB %s 1\r\nx\r\n" % subject.encode() * 200 + b"PING\r\n")
        assert _nothing_within(pub, 0.5), "PONG while the queue member's worker had not received the messages"
    finally:
        os.kill(member_worker_pid, signal.SIGCONT)
    assert _count_until_pong(pub) == 0
    member.send(b"PING\r\n")
    assert _count_until_pong(member) == 200
    for c in list(by_worker.values()) + extra:
        c.close()
