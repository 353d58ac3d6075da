"""Receives named by an attempt id (docs/queues.md#attempts): the same id gets the same deliveries back while their
leases live, from any connection and any worker; an ack or an extend names the group; and the dedup window is the
configuration's (``queues.dedup_window``)."""

from __future__ import annotations

import time

from support.harness import Raw


def _push(c: Raw, n: int, queue: str = "jobs") -> list[str]:
    return [c.request({"op": "qpush", "queue": queue, "data": i})["id"] for i in range(n)]


def test_the_same_attempt_gets_the_same_deliveries_from_another_connection(broker):
    a, b = Raw(broker.port), Raw(broker.port)
    _push(a, 5)
    first = a.request({"op": "qrecv", "queue": "jobs", "max": 3, "attempt": "etl/0/0/0", "visibility_ms": 30000})
    again = b.request({"op": "qrecv", "queue": "jobs", "max": 3, "attempt": "etl/0/0/0", "visibility_ms": 30000})
    assert len(first["messages"]) == 3 and "replayed" not in first
    assert again["replayed"] is True and again["messages"] == first["messages"]   # ids, receipts, deliveries
    other = b.request({"op": "qrecv", "queue": "jobs", "max": 3, "attempt": "etl/0/1/0"})
    assert {m["id"] for m in other["messages"]}.isdisjoint({m["id"] for m in first["messages"]})
    assert len(other["messages"]) == 2

    done = a.request({"op": "qack", "queue": "jobs", "attempts": ["etl/0/0/0", "etl/0/1/0", "etl/0/2/0"]})
    assert done == {"ok": True, "acked": 5, "lost": 0, "unknown": ["etl/0/2/0"]}
    assert a.request({"op": "qstat", "queue": "jobs"})["stat"]["in_flight"] == 0
    # acked: a commit sent again finds nothing, and the id receives anew (nothing is left to receive)
    assert a.request({"op": "qack", "queue": "jobs", "attempts": ["etl/0/0/0"]})["unknown"] == ["etl/0/0/0"]
    assert a.request({"op": "qrecv", "queue": "jobs", "attempt": "etl/0/0/0"})["messages"] == []


def test_an_attempt_whose_leases_expired_receives_anew_and_nothing_is_lost(broker):
    c = Raw(broker.port)
    _push(c, 2)
    first = c.request({"op": "qrecv", "queue": "jobs", "max": 2, "attempt": "x", "visibility_ms": 100})
    time.sleep(0.4)
    again = c.request({"op": "qrecv", "queue": "jobs", "max": 2, "attempt": "x", "visibility_ms": 30000})
    assert "replayed" not in again
    assert {m["id"] for m in again["messages"]} == {m["id"] for m in first["messages"]}
    assert all(m["deliveries"] == 2 for m in again["messages"])
    assert {m["receipt"] for m in again["messages"]}.isdisjoint({m["receipt"] for m in first["messages"]})


def test_a_group_extend_keeps_every_lease(broker):
    c = Raw(broker.port)
    _push(c, 3)
    got = c.request({"op": "qrecv", "queue": "jobs", "max": 3, "attempt": "slow", "visibility_ms": 500})
    ext = c.request({"op": "qextend", "queue": "jobs", "attempts": ["slow", "nope"], "visibility_ms": 30000})
    assert ext == {"ok": True, "extended": 3, "lost": 0, "unknown": ["nope"]}
    time.sleep(0.8)   # past the first visibility: still leased, and the attempt still replays
    assert c.request({"op": "qstat", "queue": "jobs"})["stat"]["in_flight"] == 3
    again = c.request({"op": "qrecv", "queue": "jobs", "max": 3, "attempt": "slow"})
    assert again["replayed"] is True and again["messages"] == got["messages"]


def test_a_long_poll_with_an_attempt_remembers_what_it_was_served(broker):
    a, b = Raw(broker.port), Raw(broker.port)
    a.send(b'{"op":"qrecv","queue":"later","max":2,"wait_ms":5000,"attempt":"w1","id":1}\n')
    assert a.nothing(0.2)
    assert b.request({"op": "qpush", "queue": "later", "messages": [{"data": 1}, {"data": 2}]})["ok"]
    served = a.json()
    assert len(served["messages"]) == 2
    again = b.request({"op": "qrecv", "queue": "later", "max": 2, "attempt": "w1"})
    assert again["replayed"] is True and again["messages"] == served["messages"]


def test_bad_attempts_are_clear_errors(broker):
    c = Raw(broker.port)
    _push(c, 1)
    assert c.request({"op": "qrecv", "queue": "jobs", "attempt": ""}) == \
        {"ok": False, "error": "invalid_attempt", "min": 1, "max": 256}
    assert c.request({"op": "qrecv", "queue": "jobs", "attempt": 7})["error"] == "invalid_attempt"
    assert c.request({"op": "qack", "queue": "jobs", "attempts": "a"}) == \
        {"ok": False, "error": "invalid_attempts", "max": 1000}
    assert c.request({"op": "qack", "queue": "jobs", "attempts": []})["error"] == "invalid_attempts"
    assert c.request({"op": "qextend", "queue": "jobs", "attempts": ["x" * 300]})["error"] == "invalid_attempt"
    assert c.request({"op": "qack", "queue": "nothing.here", "attempts": ["a"]}) == \
        {"ok": True, "acked": 0, "lost": 0, "unknown": ["a"]}
    assert c.request({"op": "qrecv", "queue": "jobs", "atempt": "a"})["error"] == "unknown_field"


def test_the_dedup_window_is_the_configurations(start_broker):
    short = start_broker(workers=1, config={"queues": {"dedup_window": 1}})
    c = Raw(short.port)
    first = c.request({"op": "qpush", "queue": "jobs", "data": 1, "dedup_id": "d"})
    assert c.request({"op": "qpush", "queue": "jobs", "data": 1, "dedup_id": "d"})["duplicate"] is True
    for other in ("e", "f"):   # remembered at least the window: forgotten with the generation after the next
        time.sleep(1.1)
        assert "duplicate" not in c.request({"op": "qpush", "queue": "jobs", "data": 1, "dedup_id": other})
    later = c.request({"op": "qpush", "queue": "jobs", "data": 1, "dedup_id": "d"})
    assert later["ok"] and "duplicate" not in later and later["id"] != first["id"]


def test_an_attempt_whose_leases_were_extended_one_by_one_outlives_its_first_deadline():
    """In process: deliveries are (id, receipt, ...) and leases (seq, granted, deadline, ...), as messages.py has
    them."""
    from shardbroker.workers.workqueues.attempts import Attempts

    groups = Attempts()
    deliveries = [("id1", "r1"), ("id2", "r2")]
    groups.record("a", deliveries, deadline=100)
    groups.sweep(150, {"r1": (1, 0, 140, 0, None), "r2": (2, 0, 500, 0, None)})   # r2 extended by its receipt
    assert groups.replay("a", {"r2": (2, 0, 500, 0, None)}, 200) == [("id2", "r2")]
    groups.sweep(600, {"r2": (2, 0, 500, 0, None)})
    assert len(groups) == 0
