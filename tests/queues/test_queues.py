"""Work queues (docs/queues.md) over NDJSON, against the real broker: two workers, and queues placed on purpose on
the worker the client is not on (a queue's owner is crc32(name) % workers; ``<q>.dlq`` lives with ``<q>``)."""

import asyncio
import base64
import itertools
import json
import os
import time
import zlib

import pytest

from support.harness import Raw, on_worker
from support.waiting import wait_for

WORKERS = 2


def owned_by(worker: int, prefix: str) -> str:
    """A queue name whose owner is ``worker``."""
    for i in itertools.count():
        name = f"{prefix}.{i}"
        if zlib.crc32(name.encode()) % WORKERS == worker:
            return name
    raise AssertionError("unreachable")


def cross(broker, prefix: str, client_worker: int = 0) -> tuple[Raw, str]:
    """A connection on ``client_worker`` and a queue owned by the other worker."""
    return on_worker(broker.port, client_worker), owned_by(1 - client_worker, prefix)


def req(conn: Raw, op: str, **fields) -> dict:
    return conn.request({"op": op, **fields})


def push(conn: Raw, queue: str, data, **fields) -> str:
    reply = req(conn, "qpush", queue=queue, data=data, **fields)
    assert reply["ok"] is True, reply
    assert set(reply) == {"ok", "id"}, reply
    return reply["id"]


def recv(conn: Raw, queue: str, **fields) -> list[dict]:
    reply = req(conn, "qrecv", queue=queue, **fields)
    assert reply["ok"] is True, reply
    return reply["messages"]


def stat(conn: Raw, queue: str) -> dict:
    reply = req(conn, "qstat", queue=queue)
    assert reply["ok"] is True, reply
    return reply["stat"]


def fake_receipt() -> str:
    """A well-formed receipt no lease ever had."""
    return base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()


# -- basics ------------------------------------------------------------------------------------------------------

def test_push_recv_ack_round_trip_preserves_data(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "rt")
    values = [{"a": 1, "b": [1, 2, {"c": None}]}, "hello wörld", 42, 3.5, -7, [1, "x"], True, None,
              12345678901234567890]
    ids = [push(conn, q, v) for v in values]
    assert len(set(ids)) == len(ids)
    got = recv(conn, q, max=100)
    assert [m["data"] for m in got] == values
    assert [m["id"] for m in got] == ids
    now_ms = time.time() * 1000
    for m in got:
        assert set(m) == {"id", "receipt", "data", "deliveries", "priority", "enqueued_at"}, m
        assert m["deliveries"] == 1
        assert m["priority"] == 4
        assert abs(m["enqueued_at"] - now_ms) < 10_000
        assert len(m["receipt"]) == 22
    assert len({m["receipt"] for m in got}) == len(got)
    for m in got:
        assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True}
    assert recv(conn, q) == []
    s = stat(conn, q)
    assert (s["messages"], s["acked"], s["pushed"], s["owner"]) == (0, len(values), len(values), 1)


def test_request_id_is_echoed(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "echo")
    pushed = req(conn, "qpush", queue=q, data=1, id=7)
    assert pushed == {"ok": True, "id": 7, "msg_id": pushed["msg_id"]}   # the message's id is not lost
    r = req(conn, "qrecv", queue=q, id="r1")
    assert r["id"] == "r1" and [m["id"] for m in r["messages"]] == [pushed["msg_id"]]
    assert req(conn, "qack", queue=q, receipt=r["messages"][0]["receipt"], id=9) == {"ok": True, "id": 9}
    assert req(conn, "qrecv", queue="a.*", id=3) == {"ok": False, "error": "invalid_queue", "id": 3}
    assert req(conn, "qrecv", queue=q, wait_ms=50, id=4) == {"ok": True, "messages": [], "id": 4}


def test_priority_order_and_fifo_within_a_priority(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "prio")
    for data, prio in [("a0", 0), ("b4", None), ("c9", 9), ("d4", 4), ("e0", 0), ("f9", 9), ("g4", 4)]:
        if prio is None:
            push(conn, q, data)                  # default priority 4
        else:
            push(conn, q, data, priority=prio)
    got = recv(conn, q, max=10)
    assert [m["data"] for m in got] == ["c9", "f9", "b4", "d4", "g4", "a0", "e0"]
    assert [m["priority"] for m in got] == [9, 9, 4, 4, 4, 0, 0]
    # one at a time gives the same order
    for m in got:
        req(conn, "qnack", queue=q, receipt=m["receipt"])
    singles = [recv(conn, q)[0]["data"] for _ in range(7)]
    assert singles == ["c9", "f9", "b4", "d4", "g4", "a0", "e0"]


def test_delay_ms(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "delay")
    t0 = time.monotonic()
    push(conn, q, "later", delay_ms=300)
    push(conn, q, "now")
    assert [m["data"] for m in recv(conn, q, max=10)] == ["now"]
    assert recv(conn, q) == []
    s = stat(conn, q)
    assert (s["delayed"], s["visible"], s["in_flight"]) == (1, 0, 1)
    # a long poll is served when the delay is over, not before
    got = recv(conn, q, wait_ms=3000)
    elapsed = time.monotonic() - t0
    assert [m["data"] for m in got] == ["later"]
    assert 0.28 <= elapsed < 2.0, elapsed
    assert stat(conn, q)["delayed"] == 0


def test_visibility_expiry_redelivers_and_old_receipt_is_lost(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "vis")
    mid = push(conn, q, {"job": 1})
    t0 = time.monotonic()
    first = recv(conn, q, visibility_ms=200)[0]
    assert recv(conn, q) == []                          # leased: invisible
    again = recv(conn, q, wait_ms=3000, visibility_ms=5000)  # served when the lease expires
    elapsed = time.monotonic() - t0
    assert 0.18 <= elapsed < 2.0, elapsed
    assert len(again) == 1
    second = again[0]
    assert second["id"] == mid and second["data"] == {"job": 1}
    assert (first["deliveries"], second["deliveries"]) == (1, 2)
    assert second["receipt"] != first["receipt"]
    # lease_lost says how often the message has been delivered by now (the second lease included)
    assert req(conn, "qack", queue=q, receipt=first["receipt"]) == {"ok": False, "error": "lease_lost",
                                                                    "deliveries": 2}
    assert req(conn, "qextend", queue=q, receipt=first["receipt"], visibility_ms=100)["error"] == "lease_lost"
    assert req(conn, "qack", queue=q, receipt=second["receipt"]) == {"ok": True}
    s = stat(conn, q)
    assert (s["expired"], s["redelivered"], s["delivered"], s["stale_receipts"], s["acked"], s["messages"]) == \
        (1, 1, 2, 2, 1, 0)


def test_extend_keeps_lease_past_original_deadline(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "ext")
    push(conn, q, "x")
    t0 = time.monotonic()
    m = recv(conn, q, visibility_ms=250)[0]
    r = req(conn, "qextend", queue=q, receipt=m["receipt"], visibility_ms=800)
    assert r["ok"] is True and 700 <= r["deadline_in_ms"] <= 800, r
    other = on_worker(b.port, 1)
    assert recv(other, q, wait_ms=450) == []             # past the original 250 ms: still leased
    assert time.monotonic() - t0 >= 0.4
    assert stat(other, q)["in_flight"] == 1
    assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True}
    s = stat(conn, q)
    assert (s["extended"], s["expired"], s["acked"]) == (1, 0, 1)


def test_nack_back_to_visible_and_delayed(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "nack")
    push(conn, q, "m")
    m1 = recv(conn, q, visibility_ms=10_000)[0]
    assert req(conn, "qnack", queue=q, receipt=m1["receipt"]) == {"ok": True, "state": "visible"}
    m2 = recv(conn, q, visibility_ms=10_000)[0]
    assert (m2["deliveries"], m2["data"]) == (2, "m")
    t0 = time.monotonic()
    assert req(conn, "qnack", queue=q, receipt=m2["receipt"], delay_ms=300) == {"ok": True, "state": "delayed"}
    assert recv(conn, q) == []
    assert stat(conn, q)["delayed"] == 1
    m3 = recv(conn, q, wait_ms=3000)
    assert 0.28 <= time.monotonic() - t0 < 2.0
    assert m3[0]["deliveries"] == 3
    assert req(conn, "qnack", queue=q, receipt=m1["receipt"])["error"] == "lease_lost"
    assert stat(conn, q)["nacked"] == 2


def test_max_deliveries_dead_letters_and_redrive(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_deliveries": 2}})
    conn, q = cross(b, "md")
    dlq = q + ".dlq"
    mid = push(conn, q, {"n": 1}, priority=7)
    first = recv(conn, q, visibility_ms=10_000)[0]
    assert req(conn, "qnack", queue=q, receipt=first["receipt"]) == {"ok": True, "state": "visible"}
    second = recv(conn, q, visibility_ms=150)[0]
    assert second["deliveries"] == 2
    # the second lease lapses: that was the last delivery, so it goes to the DLQ (a long poll there gets it)
    dead = recv(conn, dlq, wait_ms=3000, visibility_ms=10_000)
    assert len(dead) == 1
    d = dead[0]
    assert (d["id"], d["data"], d["priority"], d["enqueued_at"]) == (mid, {"n": 1}, 7, first["enqueued_at"])
    assert (d["dead_reason"], d["source"]) == ("max_deliveries", q)
    assert recv(conn, q) == []
    s = stat(conn, q)
    assert (s["messages"], s["dead_lettered"], s["expired"], s["nacked"]) == (0, 1, 1, 1)
    ds = stat(conn, dlq)
    assert ds["owner"] == s["owner"] == 1                  # the DLQ lives with its queue
    assert (ds["in_flight"], ds["pushed"]) == (1, 1)
    assert req(conn, "qack", queue=dlq, receipt=d["receipt"]) == {"ok": True}
    # a fresh dead letter, then moved back
    push(conn, q, "again")
    for _ in range(2):
        m = recv(conn, q, visibility_ms=10_000)[0]
        state = req(conn, "qnack", queue=q, receipt=m["receipt"])["state"]
    assert state == "dead"
    assert stat(conn, dlq)["visible"] == 1
    assert req(conn, "qredrive", queue=dlq) == {"ok": True, "moved": 1}
    assert stat(conn, dlq)["messages"] == 0
    back = recv(conn, q)
    assert len(back) == 1
    assert back[0]["data"] == "again" and back[0]["deliveries"] == 1   # a fresh start
    assert "dead_reason" not in back[0]
    assert req(conn, "qredrive", queue=q) == {"ok": False, "error": "not_a_dlq"}


def test_redrive_with_max_and_to_on_same_owner(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_deliveries": 1}})
    conn, q = cross(b, "rd")
    dlq = q + ".dlq"
    for i in range(3):
        push(conn, q, i)
    for m in recv(conn, q, max=3):
        assert req(conn, "qnack", queue=q, receipt=m["receipt"])["state"] == "dead"
    assert stat(conn, dlq)["visible"] == 3
    assert req(conn, "qredrive", queue=dlq, max=2) == {"ok": True, "moved": 2}
    assert [m["data"] for m in recv(conn, q, max=10)] == [0, 1]
    target = owned_by(1, "rdto")      # same owner as q
    assert req(conn, "qredrive", queue=dlq, to=target) == {"ok": True, "moved": 1}
    assert [m["data"] for m in recv(conn, target, max=10)] == [2]


def test_redrive_to_queue_on_another_owner_is_refused_and_moves_nothing(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_deliveries": 1}})
    conn, q = cross(b, "rdx")
    dlq = q + ".dlq"
    push(conn, q, "lost?")
    m = recv(conn, q)[0]
    assert req(conn, "qnack", queue=q, receipt=m["receipt"])["state"] == "dead"
    target = owned_by(0, "rdxto")     # the other worker
    reply = req(conn, "qredrive", queue=dlq, to=target)
    assert reply == {"ok": False, "error": "target_elsewhere"}
    assert [x["data"] for x in recv(conn, dlq)] == ["lost?"]   # still in the DLQ, nothing stranded


def test_qdead_terminates_to_dlq(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "term")
    mid = push(conn, q, "poison")
    m = recv(conn, q, visibility_ms=10_000)[0]
    assert req(conn, "qdead", queue=q, receipt=m["receipt"]) == {"ok": True}
    assert req(conn, "qack", queue=q, receipt=m["receipt"])["error"] == "lease_lost"
    assert recv(conn, q) == []
    d = recv(conn, q + ".dlq")[0]
    assert (d["id"], d["data"], d["dead_reason"], d["source"]) == (mid, "poison", "terminated", q)
    assert stat(conn, q)["dead_lettered"] == 1


def test_duplicate_ack(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "dup")
    push(conn, q, 1)
    m = recv(conn, q)[0]
    assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True}
    assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True, "already_acked": True}
    assert req(conn, "qextend", queue=q, receipt=m["receipt"], visibility_ms=10) == {"ok": False,
                                                                                     "error": "already_acked"}
    s = stat(conn, q)
    assert (s["acked"], s["duplicate_acks"]) == (1, 1)


def test_batch_ack_mixed(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "batch")
    for i in range(3):
        push(conn, q, i)
    m = recv(conn, q, max=3, visibility_ms=10_000)
    r0, r1, r2 = (x["receipt"] for x in m)
    assert req(conn, "qack", queue=q, receipt=r2) == {"ok": True}
    reply = req(conn, "qack", queue=q, receipts=[r0, r0, "nope", fake_receipt(), r2, r1, 17])
    assert reply == {"ok": True, "results": [
        {"ok": True},
        {"ok": True, "already_acked": True},
        {"ok": False, "error": "invalid_receipt"},
        {"ok": False, "error": "unknown_receipt"},
        {"ok": True, "already_acked": True},
        {"ok": True},
        {"ok": False, "error": "invalid_receipt"},
    ]}
    s = stat(conn, q)
    assert (s["acked"], s["duplicate_acks"], s["messages"]) == (3, 2, 0)
    assert req(conn, "qack", queue=q, receipts=[])["error"] == "invalid_receipts"
    assert req(conn, "qack", queue=q, receipts=r0)["error"] == "invalid_receipts"
    assert req(conn, "qack", queue=q, receipts=[r0] * 1001)["error"] == "invalid_receipts"


# -- long polls --------------------------------------------------------------------------------------------------

@pytest.mark.exclusive   # a reply within 0.5 s of the push
def test_long_poll_returns_on_push_from_another_worker(start_broker):
    b = start_broker(workers=2)
    waiter = on_worker(b.port, 0)
    q = owned_by(1, "lp")
    for pusher_worker in (1, 0):       # the pusher on the owner, then on the waiter's worker (neither the owner)
        pusher = on_worker(b.port, pusher_worker)
        t0 = time.monotonic()
        waiter.send(b'{"op":"qrecv","queue":"%s","wait_ms":10000}\n' % q.encode())
        wait_for(lambda: stat(pusher, q)["waiters"] == 1, what="the waiter to register")
        assert waiter.nothing(0.1)
        mid = push(pusher, q, {"w": pusher_worker})
        t_push = time.monotonic()
        reply = waiter.json(timeout=3)
        assert time.monotonic() - t_push < 0.5
        assert time.monotonic() - t0 < 3
        assert [(m["id"], m["data"]) for m in reply["messages"]] == [(mid, {"w": pusher_worker})]
        assert req(waiter, "qack", queue=q, receipt=reply["messages"][0]["receipt"]) == {"ok": True}
        assert stat(pusher, q)["waiters"] == 0
        pusher.close()


def test_waiters_served_in_arrival_order_one_each(start_broker):
    b = start_broker(workers=2)
    q = owned_by(1, "fifo")
    waiters = [on_worker(b.port, w) for w in (0, 1, 0, 1)]
    pusher = on_worker(b.port, 0)
    for i, w in enumerate(waiters):
        w.send(b'{"op":"qrecv","queue":"%s","max":10,"wait_ms":10000}\n' % q.encode())
        wait_for(lambda: stat(pusher, q)["waiters"] == i + 1, what=f"waiter {i}")
    for i in range(4):
        push(pusher, q, f"m{i}")
        reply = waiters[i].json(timeout=3)
        assert [m["data"] for m in reply["messages"]] == [f"m{i}"], (i, reply)
        for later in waiters[i + 1:]:
            assert later.nothing(0.05)
        assert stat(pusher, q)["waiters"] == 3 - i
    # the queue is empty: every message went to exactly one waiter
    s = stat(pusher, q)
    assert (s["in_flight"], s["visible"], s["delivered"]) == (4, 0, 4)


def test_long_poll_times_out_empty_and_holds_later_requests(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "lpt")
    t0 = time.monotonic()
    conn.send(b'{"op":"qrecv","queue":"%s","wait_ms":300,"id":1}\n{"op":"qstat","queue":"%s","id":2}\n'
              % (q.encode(), q.encode()))
    first = conn.json(timeout=3)
    elapsed = time.monotonic() - t0
    second = conn.json(timeout=3)
    assert first == {"ok": True, "messages": [], "id": 1}
    assert 0.29 <= elapsed < 1.5, elapsed
    assert second["id"] == 2 and second["stat"]["waiters"] == 0


def test_closed_connection_waiter_does_not_take_messages(start_broker):
    b = start_broker(workers=2)
    q = owned_by(1, "gone")
    gone = on_worker(b.port, 0)
    other = on_worker(b.port, 1)
    gone.send(b'{"op":"qrecv","queue":"%s","wait_ms":10000}\n' % q.encode())
    wait_for(lambda: stat(other, q)["waiters"] == 1, what="the waiter")
    gone.close()
    time.sleep(0.3)
    push(other, q, "kept")
    got = recv(other, q, wait_ms=1000)
    assert [m["data"] for m in got] == ["kept"], stat(other, q)


def test_release_on_close(start_broker):
    b = start_broker(workers=2)
    for holder_worker in (0, 1):      # the holder away from the owner, then on it
        q = owned_by(1, f"roc{holder_worker}")
        other = on_worker(b.port, 1 - holder_worker)
        holder = on_worker(b.port, holder_worker)
        push(other, q, "r")
        m = recv(holder, q, visibility_ms=60_000, release_on_close=True)[0]
        assert recv(other, q) == []
        t0 = time.monotonic()
        holder.close()
        back = recv(other, q, wait_ms=3000)
        assert time.monotonic() - t0 < 1.0
        assert len(back) == 1 and back[0]["id"] == m["id"] and back[0]["deliveries"] == 2
        assert req(other, "qack", queue=q, receipt=m["receipt"])["error"] == "lease_lost"
        other.close()


def test_default_keeps_leases_after_close_until_expiry(start_broker):
    b = start_broker(workers=2)
    q = owned_by(1, "keep")
    other = on_worker(b.port, 1)
    holder = on_worker(b.port, 0)
    push(other, q, "k")
    t0 = time.monotonic()
    recv(holder, q, visibility_ms=500)
    holder.close()
    assert recv(other, q, wait_ms=150) == []
    assert stat(other, q)["in_flight"] == 1
    back = recv(other, q, wait_ms=3000)
    assert time.monotonic() - t0 >= 0.45
    assert len(back) == 1 and back[0]["deliveries"] == 2


# -- limits and bad input ----------------------------------------------------------------------------------------

def test_queue_full(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_messages": 3, "max_bytes": 1024}})
    conn, q = cross(b, "full")
    for i in range(3):
        push(conn, q, i)
    assert req(conn, "qpush", queue=q, data=3) == {"ok": False, "error": "queue_full", "retry": True}
    assert req(conn, "qpush", queue=q, data=3, id="x") == {"ok": False, "error": "queue_full", "retry": True,
                                                           "id": "x"}
    other = owned_by(0, "full.other")
    push(conn, other, "fine")                              # other queues keep working, as does the connection
    m = recv(conn, q)[0]
    assert m["data"] == 0
    assert req(conn, "qpush", queue=q, data=3) == {"ok": False, "error": "queue_full", "retry": True}  # leased counts
    assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True}
    push(conn, q, 3)
    s = stat(conn, q)
    assert (s["messages"], s["rejected"], s["pushed"]) == (3, 3, 4)
    assert [x["data"] for x in recv(conn, q, max=10)] == [1, 2, 3]
    # max_bytes: the JSON encoding of data is what counts
    qb = owned_by(1, "fullbytes")
    push(conn, qb, "x" * 998)                              # 1000 bytes
    assert req(conn, "qpush", queue=qb, data="y" * 30)["error"] == "queue_full"
    push(conn, qb, "y" * 22)                               # 24 bytes: 1024 exactly
    assert stat(conn, qb)["bytes"] == 1024


def test_a_full_dead_letter_queue_stops_pushes_to_its_queue(start_broker):
    """Dead letters are never dropped nor refused, so a DLQ at its bound (the queue's ``max_messages``) stops
    pushes to its queue instead: a consumer that ends every lease without an ack cannot grow the two without
    end.  What the queue held still goes to the DLQ, past its bound; room there lets pushes in again."""
    b = start_broker(workers=2, config={"queues": {"max_messages": 3, "max_deliveries": 1}})
    conn, q = cross(b, "dl")
    dlq = q + ".dlq"

    def nack_all(n: int) -> None:
        for m in recv(conn, q, max=n):
            assert req(conn, "qnack", queue=q, receipt=m["receipt"]) == {"ok": True, "state": "dead"}
    for name in "abc":
        push(conn, q, name)
    nack_all(2)
    push(conn, q, "d")
    push(conn, q, "e")                                       # the DLQ holds 2 of 3: pushes go on
    nack_all(3)
    assert stat(conn, dlq)["messages"] == 5                  # past its bound: nothing a queue held is dropped
    full = {"ok": False, "error": "queue_full", "retry": True, "dlq": dlq}
    assert req(conn, "qpush", queue=q, data="f") == full
    assert req(conn, "qpush", queue=q, messages=[{"data": "f"}, {"data": "g"}]) == full
    line = json.dumps({"op": "qpush", "queue": q, "data": "f"}).encode() + b"\n"
    conn.send(line * 2)                                      # pipelined single pushes, the fast path
    assert [conn.json(), conn.json()] == [full, full]
    assert stat(conn, q)["rejected"] == 5
    got = recv(conn, dlq, max=3)
    assert [m["data"] for m in got] == ["a", "b", "c"]
    assert req(conn, "qack", queue=dlq, receipts=[m["receipt"] for m in got])["ok"]
    push(conn, q, "f")                                       # room in the DLQ: pushes again
    assert [m["data"] for m in recv(conn, q)] == ["f"]


def test_a_worker_holds_a_bounded_number_of_queues_and_forgets_idle_ones(start_broker):
    """``max_queues_per_worker``: a push or a long poll that would make one queue too many is refused, and nothing
    else is (a receive that does not wait makes no queue); a queue empty, unwaited and untouched for
    ``forget_idle`` is forgotten, which makes room; a configured queue and a queue with a waiter are kept."""
    b = start_broker(workers=1, config={"queues": {"max_queues_per_worker": 5, "forget_idle": 1,
                                                   "queues": [{"name": "kept"}]}})
    conn, waiting = on_worker(b.port, 0), on_worker(b.port, 0)
    for name in ("a", "b", "c"):
        push(conn, name, name)
    waiting.send(b'{"op":"qrecv","queue":"w","wait_ms":30000}\n')   # kept, a, b, c, w: five
    wait_for(lambda: "w" in {row["queue"] for row in b.http("/queuez")[1]["queues"]}, what="w's waiter")
    full = {"ok": False, "error": "too_many_queues", "max": 5}
    assert req(conn, "qpush", queue="d", data=1) == full
    assert req(conn, "qrecv", queue="e", wait_ms=100) == full
    assert recv(conn, "e") == []                                         # no wait: nothing to make a queue for
    assert stat(conn, "e")["messages"] == 0
    assert req(conn, "qrecv", queue="e", max=0)["error"] == "invalid_max"    # the request is checked all the same
    push(conn, "a", "again")                                             # existing queues take pushes
    (m1, m2) = recv(conn, "a", max=2)
    assert req(conn, "qack", queue="a", receipts=[m1["receipt"], m2["receipt"]])["ok"]

    def names() -> set:
        return {row["queue"] for row in b.http("/queuez")[1]["queues"]}
    wait_for(lambda: "a" not in names(), timeout=8, what="the idle queue forgotten")
    assert names() == {"kept", "b", "c", "w"}
    assert stat(conn, "a") == {**stat(conn, "zz"), "queue": "a"}          # reads as a name never used
    push(conn, "d", "room")                                              # the room it left
    assert req(conn, "qpush", queue="f", data=1) == full
    push(conn, "w", "for the waiter")
    assert [m["data"] for m in waiting.json()["messages"]] == ["for the waiter"]

    async def over_nats():   # the same answer on every protocol
        import nats
        nc = await nats.connect(f"nats://127.0.0.1:{b.ports['nats']}")
        reply = json.loads((await nc.request("$Q.PUSH.f", b"1")).data)
        await nc.close()
        return reply
    assert asyncio.run(over_nats()) == full
    (worker,) = b.varz()["workers"]
    assert (worker["workqueues"], worker["queues_refused"], worker["queues_forgotten"]) == (5, 4, 1)


def test_message_too_large(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_message_bytes": 100}})
    conn, q = cross(b, "big")
    push(conn, q, "x" * 98)                                # "xxx...": 100 bytes
    assert req(conn, "qpush", queue=q, data="x" * 99) == {"ok": False, "error": "message_too_large", "max": 100}
    assert req(conn, "qpush", queue=q, data={"k": "v" * 200})["error"] == "message_too_large"
    assert [len(m["data"]) for m in recv(conn, q, max=10)] == [98]
    assert stat(conn, q)["pushed"] == 1


def test_invalid_queue_names(start_broker):
    b = start_broker(workers=2)
    conn = on_worker(b.port, 0)
    for queue in ("a.*", "a.>", "*", ">", "", 5, None, "a..b", ".a", "a.", ["x"], " a b", "x" * 4097):
        for op in ("qpush", "qrecv", "qack", "qextend", "qnack", "qdead", "qstat", "qpurge", "qredrive"):
            fields = {"op": op}   # and only the fields the op defines (another is unknown_field)
            if op == "qpush":
                fields["data"] = 1
            elif op in ("qack", "qextend", "qnack", "qdead"):
                fields["receipt"] = fake_receipt()
            if queue is not None:
                fields["queue"] = queue
            assert conn.request(fields) == {"ok": False, "error": "invalid_queue"}, (op, queue)
    assert req(conn, "qpush", queue="ok.name", data=1)["ok"] is True


def test_invalid_arguments(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "bad")
    for value in (0, 1001, -1, "5", 1.5, True):
        assert req(conn, "qrecv", queue=q, max=value)["error"] == "invalid_max", value
    for value in (-1, 300_001, "10", 0.5):
        assert req(conn, "qrecv", queue=q, wait_ms=value)["error"] == "invalid_wait", value
    for value in (-1, 12 * 3600 * 1000 + 1, "100"):
        assert req(conn, "qrecv", queue=q, visibility_ms=value)["error"] == "invalid_visibility", value
    for value in (-1, 10, "9", 4.0, False):
        assert req(conn, "qpush", queue=q, data=1, priority=value)["error"] == "invalid_priority", value
    for value in (-1, 12 * 3600 * 1000 + 1, "100", 1.5):
        assert req(conn, "qpush", queue=q, data=1, delay_ms=value)["error"] == "invalid_delay", value
    assert stat(conn, q)["pushed"] == 0                   # nothing was stored by the refused pushes
    push(conn, q, 1)
    m = recv(conn, q, visibility_ms=10_000)[0]
    for receipt in ("nope", "!" * 22, 123, None, "", m["receipt"] + "A"):
        for op in ("qack", "qextend", "qnack", "qdead"):
            assert req(conn, op, queue=q, receipt=receipt)["error"] == "invalid_receipt", (op, receipt)
    assert req(conn, "qextend", queue=q, receipt=m["receipt"], visibility_ms=-5)["error"] == "invalid_visibility"
    assert req(conn, "qnack", queue=q, receipt=m["receipt"], delay_ms=-5)["error"] == "invalid_delay"
    for op in ("qack", "qextend", "qnack", "qdead"):
        assert req(conn, op, queue=q, receipt=fake_receipt())["error"] == "unknown_receipt", op
        assert req(conn, op, queue=owned_by(0, "never.used"), receipt=fake_receipt())["error"] == \
            "unknown_receipt", op
    assert req(conn, "qfly", queue=q) == {"ok": False, "error": "unknown_op"}
    # the lease survived all of that
    assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True}


# -- stat, purge -------------------------------------------------------------------------------------------------

def test_qstat_exact_counts(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "stat")
    assert stat(conn, q) == {
        "queue": q, "visible": 0, "in_flight": 0, "delayed": 0, "messages": 0, "bytes": 0,
        "oldest_visible_age_ms": 0, "pushed": 0, "delivered": 0, "redelivered": 0, "acked": 0, "nacked": 0,
        "expired": 0, "extended": 0, "dead_lettered": 0, "stale_receipts": 0, "duplicate_acks": 0, "rejected": 0,
        "duplicate_pushes": 0, "waiters": 0, "owner": 1}
    for data in ("a", "b", "c", "d"):
        push(conn, q, data)
    push(conn, q, "e", delay_ms=60_000)
    a, bm, c = recv(conn, q, max=3, visibility_ms=10_000)
    assert req(conn, "qack", queue=q, receipt=a["receipt"]) == {"ok": True}
    assert req(conn, "qack", queue=q, receipt=a["receipt"])["already_acked"] is True
    assert req(conn, "qextend", queue=q, receipt=bm["receipt"], visibility_ms=20_000)["ok"] is True
    assert req(conn, "qnack", queue=q, receipt=c["receipt"])["state"] == "visible"
    c2 = recv(conn, q, visibility_ms=100)[0]
    assert c2["data"] == "c" and c2["deliveries"] == 2
    wait_for(lambda: stat(conn, q)["expired"] == 1, what="the lease to expire")
    assert req(conn, "qack", queue=q, receipt=c["receipt"])["error"] == "lease_lost"
    s = stat(conn, q)
    assert 0 <= s.pop("oldest_visible_age_ms") < 10_000
    assert s == {
        "queue": q, "visible": 2, "in_flight": 1, "delayed": 1, "messages": 4, "bytes": 12,
        "pushed": 5, "delivered": 4, "redelivered": 1, "acked": 1, "nacked": 1, "expired": 1, "extended": 1,
        "dead_lettered": 0, "stale_receipts": 1, "duplicate_acks": 1, "rejected": 0, "duplicate_pushes": 0,
        "waiters": 0, "owner": 1}
    assert [m["data"] for m in recv(conn, q, max=10)] == ["c", "d"]


def test_oldest_visible_age(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "age")
    push(conn, q, 1)
    time.sleep(0.25)
    age = stat(conn, q)["oldest_visible_age_ms"]
    assert 240 <= age < 5000, age


def test_qpurge(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "purge")
    for i in range(3):
        push(conn, q, i)
    push(conn, q, "d", delay_ms=60_000)
    m = recv(conn, q, visibility_ms=10_000)[0]
    assert req(conn, "qpurge", queue=q) == {"ok": True, "purged": 4}
    s = stat(conn, q)
    assert (s["messages"], s["visible"], s["in_flight"], s["delayed"], s["bytes"]) == (0, 0, 0, 0, 0)
    assert recv(conn, q) == []
    assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True, "purged": True}
    assert req(conn, "qpurge", queue=q) == {"ok": True, "purged": 0}
    push(conn, q, "after")
    assert [x["data"] for x in recv(conn, q)] == ["after"]


# -- permissions -------------------------------------------------------------------------------------------------

def secure_config() -> dict:
    return {"security": {
        "enabled": True, "iterations": 1000, "failures_per_address": 1000,
        "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]},
        "users": [
            {"username": "producer", "password": "p", "permissions": ["publish:jobs.*"]},
            {"username": "consumer", "password": "c", "permissions": ["subscribe:jobs.*"]},
            {"username": "both", "password": "b", "permissions": ["publish:jobs.>", "subscribe:jobs.>"]},
            {"username": "exact", "password": "e", "permissions": ["publish:work.one", "subscribe:work.one"]},
        ]}}


def login(port: int, worker: int, user: str, password: str) -> Raw:
    return on_worker(port, worker, user, password)


def test_permissions(start_broker):
    b = start_broker(workers=2, config=secure_config())
    q = owned_by(1, "jobs")                # jobs.N
    anon = Raw(b.port)
    assert req(anon, "qpush", queue=q, data=1) == {"ok": False, "error": "auth_required"}
    producer = login(b.port, 0, "producer", "p")
    consumer = login(b.port, 0, "consumer", "c")
    both = login(b.port, 0, "both", "b")
    admin = login(b.port, 0, "admin", "adminpw")
    denied = {"ok": False, "error": "permission_denied"}

    push(producer, q, "job")
    assert req(producer, "qpush", queue="other.x", data=1) == denied
    for op in ("qrecv", "qstat", "qack", "qextend", "qnack", "qdead"):
        assert req(producer, op, queue=q, receipt=fake_receipt()) == denied, op
    assert req(consumer, "qpush", queue=q, data=1) == denied
    m = recv(consumer, q, visibility_ms=10_000)[0]
    assert m["data"] == "job"
    assert stat(consumer, q)["in_flight"] == 1
    assert req(consumer, "qack", queue=q, receipt=m["receipt"]) == {"ok": True}
    assert recv(consumer, q + ".dlq") == []        # subscribe:jobs.* covers jobs.N.dlq (any depth, as Jolt's)
    exact = login(b.port, 0, "exact", "e")         # subscribe:work.one does not cover work.one.dlq
    push(exact, "work.one", 1)
    assert [m["data"] for m in recv(exact, "work.one")] == [1]
    assert req(exact, "qrecv", queue="work.one.dlq") == denied
    assert req(exact, "qpush", queue="work.two", data=1) == denied
    for user in (producer, consumer, both):
        assert req(user, "qpurge", queue=q) == denied
        assert req(user, "qredrive", queue=q + ".dlq") == denied
    push(both, q, "x")
    assert recv(both, q + ".dlq") == []
    assert req(admin, "qpurge", queue=q) == {"ok": True, "purged": 1}
    assert req(admin, "qredrive", queue=q + ".dlq") == {"ok": True, "moved": 0}
    assert stat(admin, q)["pushed"] == 2
    push(admin, q, "from admin")
