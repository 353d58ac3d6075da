"""Batch pushes (``qpush`` with ``messages``, docs/queues.md) against the real broker, and what batching changed
underneath: waiters served with everything a turn made visible, receipts drawn in batches, and the journal's
batch records (``pushes``, ``leases``, ``acks``) replayed exactly, next to the records of older journals."""

import asyncio
import json
import os
import signal

from test_queues import cross, owned_by, push, recv, req, stat

from shardbroker.cli.client import AsyncClient, BrokerError, QueueMessageSpec

from support.harness import on_worker
from support.waiting import wait_for


def pushm(conn, queue, messages, **fields) -> dict:
    return req(conn, "qpush", queue=queue, messages=messages, **fields)


def test_batch_push_ids_in_order_and_fields(start_broker):
    b = start_broker(workers=2)
    for client_worker in (0, 1):            # across workers, then on the owner
        conn, q = cross(b, f"bp{client_worker}", client_worker)
        values = [{"a": [1, {"b": None}]}, "wörld", 42, 3.5, True, None, 12345678901234567890123, [1, "x"]]
        reply = pushm(conn, q, [{"data": v} for v in values], id="b1")
        assert reply["ok"] is True and reply["id"] == "b1" and set(reply) == {"ok", "ids", "id"}, reply
        ids = reply["ids"]
        assert len(ids) == len(values) == len(set(ids))
        got = recv(conn, q, max=100)
        assert [m["id"] for m in got] == ids                          # stored in order, served in order
        assert [m["data"] for m in got] == values                     # exact, big integers included
        assert all(m["priority"] == 4 and m["deliveries"] == 1 for m in got)
        assert req(conn, "qack", queue=q, receipts=[m["receipt"] for m in got])["ok"]
        s = stat(conn, q)
        assert (s["pushed"], s["acked"], s["messages"]) == (len(values), len(values), 0)
        conn.close()


def test_batch_push_priorities_and_delays(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "bpd")
    reply = pushm(conn, q, [{"data": "low"}, {"data": "high", "priority": 9}, {"data": "later", "delay_ms": 300},
                            {"data": "mid"}], priority=2)
    assert reply["ok"], reply
    s = stat(conn, q)
    assert (s["visible"], s["delayed"]) == (3, 1)
    assert [m["data"] for m in recv(conn, q, max=10)] == ["high", "low", "mid"]
    later = recv(conn, q, max=10, wait_ms=3000)
    assert [(m["data"], m["priority"]) for m in later] == [("later", 2)]
    # a request-level delay applies to every item without its own
    reply = pushm(conn, q, [{"data": 1}, {"data": 2, "delay_ms": 0}], delay_ms=60_000)
    s = stat(conn, q)
    assert (s["visible"], s["delayed"]) == (1, 1)
    assert [m["data"] for m in recv(conn, q, max=10)] == [2]
    # the request's own fields after items of nothing but data (the canonical form, taken as written): the same
    assert pushm(conn, q, [{"data": "p7"}, {"data": [7]}], priority=7)["ok"]
    assert pushm(conn, q, [{"data": "d"}], delay_ms=60_000, dedup_id="bd-1")["ok"]
    assert pushm(conn, q, [{"data": "x"}], priority=10) == {"ok": False, "error": "invalid_priority", "min": 0,
                                                          "max": 9}
    assert pushm(conn, q, [{"data": "x"}], delay_ms=-1)["error"] == "invalid_delay"
    assert pushm(conn, q, [{"data": "x"}], data=1)["error"] == "invalid_messages"   # data next to messages
    conn.send(b'{"op":"qpush","queue":"%s","messages":[{"data":"first"}],"messages":[{"data":"second"}]}\n'
              % q.encode())   # the batch a JSON parser keeps is the second
    assert json.loads(conn.line())["ok"]
    s = stat(conn, q)
    assert (s["visible"], s["delayed"]) == (3, 2)
    assert [(m["data"], m["priority"]) for m in recv(conn, q, max=10)] == [("p7", 7), ([7], 7), ("second", 4)]


def test_batch_push_errors_store_nothing_and_the_connection_goes_on(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_message_bytes": 100}})
    conn, q = cross(b, "bpe")
    bad = [
        ([], {"ok": False, "error": "invalid_messages", "min": 1, "max": 1000}),
        ([{"data": 1}] * 1001, {"ok": False, "error": "invalid_messages", "min": 1, "max": 1000}),
        ("nope", {"ok": False, "error": "invalid_messages", "min": 1, "max": 1000}),
        ([{"data": 1}, 2], {"ok": False, "error": "invalid_message", "index": 1}),
        ([{"data": 1}, {"data": 2, "priority": 10}],
         {"ok": False, "error": "invalid_priority", "min": 0, "max": 9, "index": 1}),
        ([{"data": 1}, {"data": 2, "priority": "9"}],
         {"ok": False, "error": "invalid_priority", "min": 0, "max": 9, "index": 1}),
        ([{"data": 1}, {"data": 2}, {"data": 3, "delay_ms": -1}],
         {"ok": False, "error": "invalid_delay", "min": 0, "max": 43_200_000, "index": 2}),
        ([{"data": "x" * 98}, {"data": "x" * 99}], {"ok": False, "error": "message_too_large", "max": 100, "index": 1}),
    ]
    for messages, error in bad:
        assert pushm(conn, q, messages) == error, messages
    assert pushm(conn, q, [{"data": 1}], priority=11) == {"ok": False, "error": "invalid_priority", "min": 0,
                                                           "max": 9}
    assert req(conn, "qpush", queue=q, data=1, messages=[{"data": 2}])["error"] == "invalid_messages"
    assert pushm(conn, q, [{"data": 1}], id=5)["id"] == 5
    assert pushm(conn, q, [], id=6) == {"ok": False, "error": "invalid_messages", "min": 1, "max": 1000, "id": 6}
    s = stat(conn, q)
    assert (s["pushed"], s["messages"], s["rejected"]) == (1, 1, 0)        # only the good batch
    push(conn, q, "after")                                                  # the connection goes on
    assert [m["data"] for m in recv(conn, q, max=10)] == [1, "after"]


def test_batch_push_to_a_full_queue_stores_nothing_and_says_what_fits(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_messages": 5, "max_bytes": 1024}})
    conn, q = cross(b, "bpf")
    assert pushm(conn, q, [{"data": i} for i in range(3)])["ok"]
    full = pushm(conn, q, [{"data": i} for i in range(3, 6)])
    assert full == {"ok": False, "error": "queue_full", "retry": True, "room": 2}
    s = stat(conn, q)
    assert (s["messages"], s["pushed"], s["rejected"]) == (3, 3, 3)          # nothing of it stored
    assert len(pushm(conn, q, [{"data": 3}, {"data": 4}])["ids"]) == 2      # what fits does
    # bytes: 1024 at most; 5 messages are there, so first make room
    for m in recv(conn, q, max=5):
        assert req(conn, "qack", queue=q, receipt=m["receipt"]) == {"ok": True}
    big = "x" * 408                                                         # 410 bytes each
    full = pushm(conn, q, [{"data": big}] * 3)
    assert full["error"] == "queue_full" and full["room"] == 2
    assert stat(conn, q)["messages"] == 0
    assert len(pushm(conn, q, [{"data": big}] * 2)["ids"]) == 2


def test_a_batch_wakes_the_first_waiter_with_all_of_it(start_broker):
    """Waiters are served at the end of the turn with everything visible then: a batch (or a burst of pushes)
    goes to the first waiter as one reply, up to its max, and the next waiter gets the rest."""
    b = start_broker(workers=2)
    q = owned_by(1, "bpw")
    first, second = on_worker(b.port, 0), on_worker(b.port, 1)
    pusher = on_worker(b.port, 0)
    for i, w in enumerate((first, second)):
        w.send(b'{"op":"qrecv","queue":"%s","max":30,"wait_ms":10000}\n' % q.encode())
        wait_for(lambda: stat(pusher, q)["waiters"] == i + 1, what=f"waiter {i}")
    ids = pushm(pusher, q, [{"data": i} for i in range(50)])["ids"]
    a = first.json(timeout=3)["messages"]
    c = second.json(timeout=3)["messages"]
    assert [m["id"] for m in a] == ids[:30] and [m["id"] for m in c] == ids[30:]
    # pipelined single pushes read in one turn go out together too
    first.send(b'{"op":"qrecv","queue":"%s","max":100,"wait_ms":10000}\n' % q.encode())
    wait_for(lambda: stat(pusher, q)["waiters"] == 1, what="the waiter")
    pusher.send(b"".join(b'{"op":"qpush","queue":"%s","data":%d}\n' % (q.encode(), i) for i in range(20)))
    pushed = [pusher.json(timeout=3)["id"] for _ in range(20)]
    got = first.json(timeout=3)["messages"]
    while len(got) < 20:            # the pushes may have arrived over more than one turn
        first.send(b'{"op":"qrecv","queue":"%s","max":100,"wait_ms":3000}\n' % q.encode())
        got += first.json(timeout=5)["messages"]
    assert [m["id"] for m in got] == pushed


def test_receipts_are_unique_well_formed_and_safe_for_qlite(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "rcpt")
    import base64
    seen = set()
    for _ in range(5):
        pushm(conn, q, [{"data": i} for i in range(1000)])
        got = recv(conn, q, max=1000)
        for m in got:
            raw = base64.urlsafe_b64decode(m["receipt"] + "==")
            assert len(m["receipt"]) == 22 and len(raw) == 16
            assert b";" not in raw and b"\0" not in raw
            assert base64.urlsafe_b64encode(raw).rstrip(b"=").decode() == m["receipt"]   # canonical
            seen.add(m["receipt"])
        results = req(conn, "qack", queue=q, receipts=[m["receipt"] for m in got])["results"]
        assert results == [{"ok": True}] * len(got)
    assert len(seen) == 5000


def test_ack_batch_with_repeats_and_a_non_canonical_spelling(start_broker):
    b = start_broker(workers=2)
    conn, q = cross(b, "rep")
    pushm(conn, q, [{"data": i} for i in range(3)])
    got = recv(conn, q, max=3)
    r = [m["receipt"] for m in got]
    # the last character of a receipt carries 4 unused bits: another spelling of the same 16 bytes
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    other = r[2][:21] + alphabet[alphabet.index(r[2][21]) + 1]
    results = req(conn, "qack", queue=q, receipts=[r[0], r[0], r[1], other, r[2]])["results"]
    assert results == [{"ok": True}, {"ok": True, "already_acked": True}, {"ok": True}, {"ok": True},
                       {"ok": True, "already_acked": True}]
    s = stat(conn, q)
    assert (s["acked"], s["duplicate_acks"], s["messages"]) == (3, 2, 0)


def test_client_qpush_many(start_broker):
    b = start_broker(workers=2)

    async def run():
        c = await AsyncClient.connect("127.0.0.1", b.port)
        try:
            q = owned_by(1, "cli.many")
            ids = await c.qpush_many(q, ["a", {"n": 1}, QueueMessageSpec("urgent", priority=9)], priority=1)
            assert len(ids) == 3
            got = await c.qrecv(q, max=10)
            assert [(m.data, m.extra["priority"]) for m in got] == [("urgent", 9), ("a", 1), ({"n": 1}, 1)]
            try:
                await c.qpush_many(q, [])
            except BrokerError as exc:
                assert "invalid_messages" in str(exc)
            else:
                raise AssertionError("an empty batch was accepted")
        finally:
            await c.close()

    asyncio.run(run())


def test_batch_push_survives_a_killed_owner(start_broker):
    """Batch pushes, leases and acks are journaled as batch records: a replaced owner has them all."""
    b = start_broker(workers=2, config={"queues": {"move_connections": False}})   # conn stays off the owner
    conn, q = cross(b, "bpk")
    ids = pushm(conn, q, [{"data": i} for i in range(100)])["ids"]
    got = recv(conn, q, max=40, visibility_ms=60_000)
    assert req(conn, "qack", queue=q, receipts=[m["receipt"] for m in got[:30]])["ok"]
    owner_pid = next(w["pid"] for w in b.varz()["workers"] if w["worker"] == 1)
    os.kill(owner_pid, signal.SIGKILL)
    s = wait_for(lambda: _stat_or_none(conn, q), timeout=15, what="the owner's replacement")
    assert (s["visible"], s["in_flight"], s["messages"]) == (60, 10, 70)
    # the leases resumed: their receipts still ack
    assert req(conn, "qack", queue=q, receipts=[m["receipt"] for m in got[30:]])["results"] == [{"ok": True}] * 10
    rest = recv(conn, q, max=100)
    assert [m["id"] for m in rest] == ids[40:]


def test_single_pushes_read_together_on_the_owner_are_stored_as_one_record_and_survive_its_kill_9(start_broker):
    """Plain single pushes to a queue of the worker they arrive on, read together, are stored together (one batch
    record: ``Shard._push_run``): each still gets its own reply and id, in order, and a replaced owner has them
    all, in that order, with those ids."""
    b = start_broker(workers=2, config={"queues": {"move_connections": False}})   # the reader stays off the owner
    q = owned_by(1, "run")
    producer = on_worker(b.port, 1)                        # on the owner: its pushes carry no token
    lines = [{"op": "qpush", "queue": q, "data": {"n": i}} for i in range(300)]
    producer.send(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    replies = [producer.json() for _ in lines]
    assert all(r["ok"] for r in replies) and len({r["id"] for r in replies}) == 300
    assert stat(producer, q)["pushed"] == 300
    owner_pid = next(w["pid"] for w in b.varz()["workers"] if w["worker"] == 1)
    producer.close()
    os.kill(owner_pid, signal.SIGKILL)
    conn = on_worker(b.port, 0)
    s = wait_for(lambda: _stat_or_none(conn, q), timeout=15, what="the owner's replacement")
    assert s["visible"] == 300, s
    got = recv(conn, q, max=1000) + recv(conn, q, max=1000)
    assert [m["id"] for m in got] == [r["id"] for r in replies]
    assert [m["data"] for m in got] == [{"n": i} for i in range(300)]


def _stat_or_none(conn, q):
    reply = req(conn, "qstat", queue=q)
    return reply["stat"] if reply.get("ok") else None


def test_tiny_bench_with_batch_producers(tmp_path):
    """The bench's batch-producer scenarios: every acknowledged message of every batch stored, or acked exactly
    once."""
    import json
    import subprocess
    import sys

    from shardbroker.cli.bench.servers import find_binary

    from support.harness import REPO

    peers = ["redis"] if find_binary("redis-server") else []
    res = subprocess.run(
        [sys.executable, "-m", "shardbroker.cli", "bench", "-s", "qpushb,qwork1b", "--rounds", "1", "--duration", "0.3",
         "--peers", ",".join(peers) or "none", "--workers", "2", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    targets = {"shardbroker/ndjson", "shardbroker/ndjson-nojournal"} | ({"redis", "redis-aof"} if peers else set())
    rows = {(row["scenario"], row["target"]): row for row in result["summary"]}
    assert set(rows) == {(s, t) for s in ("qpushb", "qwork1b") for t in targets}
    for row in rows.values():
        assert row["msgs_per_sec"] > 0 and row["expected"] >= 100 and row["loss"] == 0, row
        assert row["duplicates"] == 0 and row["refused"] == 0, row
    for run in result["runs"]:
        if run["target"].startswith("shardbroker"):
            assert run["expected"] % 100 == 0, run              # whole batches of 100
        if run["scenario"] == "qwork1b":
            assert run["left"]["pending"] == 0 and run["delivered"] == run["expected"], run


def test_single_pushes_read_together_are_each_stored_or_refused_on_their_own(start_broker):
    """Single ``qpush`` lines that arrive in one read go to the owner together (one request), but each is still its
    own push: one refused (full queue, bad priority) refuses only itself, every reply keeps its place, and what comes
    after them on the connection (a receive, another queue's push) sees them stored."""
    b = start_broker(workers=2, config={"queues": {"max_messages": 4}})
    for client_worker in (0, 1):            # across workers, then on the owner
        conn, q = cross(b, f"grp{client_worker}", client_worker)
        other = f"{q}.other"
        lines = [{"op": "qpush", "queue": q, "data": i, "id": i} for i in range(3)]
        lines.insert(1, {"op": "qpush", "queue": q, "data": "bad", "priority": 10, "id": "bad"})
        lines += [{"op": "qpush", "queue": q, "data": i, "id": i} for i in range(3, 6)]
        lines += [{"op": "qpush", "queue": other, "data": "o", "id": "o"},
                  {"op": "qrecv", "queue": q, "max": 10, "id": "r"}]
        conn.send(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        replies = [conn.json() for _ in lines]
        assert [r.get("id") for r in replies] == [line["id"] for line in lines]
        assert replies[1] == {"ok": False, "error": "invalid_priority", "min": 0, "max": 9, "id": "bad"}
        stored = [r for r in replies[:-2] if r["ok"]]
        assert len(stored) == 4 and [r["id"] for r in stored] == [0, 1, 2, 3]
        assert replies[-4:-2] == [{"ok": False, "error": "queue_full", "retry": True, "id": i} for i in (4, 5)]
        assert replies[-2]["ok"] is True
        assert [m["data"] for m in replies[-1]["messages"]] == [0, 1, 2, 3]
        assert stat(conn, q)["pushed"] == 4 and stat(conn, other)["pushed"] == 1
        conn.close()
