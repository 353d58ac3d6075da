"""What a work queue keeps in memory is bounded by what is live, or by a fixed count: never by the message rate
times a timeout (docs/reliability.md, Soak).  Counted on the structures themselves, not by RSS."""

from __future__ import annotations

import asyncio
import gc

import pytest

from shardbroker.workers.message import KIND_JSON
from shardbroker.workers.workqueues import history, model, queue_leases, shard_timer
from shardbroker.workers.workqueues.journal import Journal
from shardbroker.workers.workqueues.messages import D_RECEIPT, MS
from shardbroker.workers.workqueues.model import Queue
from shardbroker.workers.workqueues.rules import Settings
from shardbroker.workers.workqueues.shard import Shard


def _queue(settings: Settings = Settings()) -> Queue:  # noqa: B008 (a frozen dataclass)
    return Queue("jobs", settings, lambda when, q: None, lambda name, record: None)


def test_acked_leases_leave_the_deadline_heap():
    """Leases acked long before their deadline (12 h here) used to stay in the deadlines' heap until it: 80 B a
    message, without end at a steady rate.  Now the heap follows the leases held."""
    q = _queue()
    now = 1_000 * MS
    held = []
    for i in range(30_000):
        q.push(0, b"x", 4, now, now, 0)
        (d,) = q.lease(now, 1, 12 * 3600 * 1000, None)
        if i % 100 == 0:
            held.append(d[D_RECEIPT])      # a few stay leased
        else:
            assert q.ack_many([d[D_RECEIPT]], now) == [{"ok": True}]
    assert q.in_flight == len(held) == 300
    limit = 2 * q.in_flight + queue_leases.DEADLINES_SLACK + 1
    assert q._deadline_refs <= limit and len(q._deadlines) <= limit
    assert len(q._deadlines) < 3_000     # 30,000 before: one per lease granted
    assert q._deadline_refs == sum(len(r) for _, r in q._deadlines)
    # what is left still expires on time: every held lease, once, at its deadline
    q.expire(now + 12 * 3600 * 1000 * MS)
    assert q.in_flight == 0 and q.visible == 300 and q.expired == 300 and not q._deadlines and q._deadline_refs == 0


def test_extended_leases_keep_one_live_entry():
    q = _queue()
    now = 1_000 * MS
    q.push(0, b"x", 4, now, now, 0)
    (d,) = q.lease(now, 1, 60_000, None)
    for i in range(5_000):
        q.extend(d[D_RECEIPT], now + i * MS, 60_000)
    assert len(q._deadlines) <= 2 * 1 + queue_leases.DEADLINES_SLACK + 1 and len(q._deadlines) < 2_000
    deadline = q.leases[d[D_RECEIPT]][2]
    q.expire(deadline - 1)
    assert q.in_flight == 1
    q.expire(deadline)
    assert q.in_flight == 0 and q.expired == 1


def test_the_history_of_receipts_and_tokens_is_bounded_by_count():
    q = _queue()
    q._acks, q.tokens = history.History(limit=500), history.History(limit=300)
    now = 1_000 * MS
    receipts = []
    for i in range(2_000):
        q.push(0, b"x", 4, now, now, 0, token=(1, 1, i))
        (d,) = q.lease(now, 1, 30_000, None)
        q.ack_many([d[D_RECEIPT]], now)
        receipts.append(d[D_RECEIPT])
    assert 250 <= len(q._acks) <= 500 and 150 <= len(q.tokens) <= 300
    assert q.ack_many([receipts[-1]], now)[0].get("already_acked") is True   # the newest are remembered
    assert (1, 1, 1999) in q.tokens and (1, 1, 0) not in q.tokens


def test_the_history_forgets_by_time_and_keeps_each_entry_its_time():
    t = [0.0]
    h = history.History(limit=1_000_000, seconds=300, clock=lambda: t[0])
    for i in range(10_000):           # 10 a second for 1,000 s
        t[0] = i / 10
        h[i] = i
        assert len(h) <= 2 * 300 * 10 + 1          # about twice the window's worth, whatever the run time
        # everything of the last 300 s is still there
        assert h.get(max(0, i - 2999)) == max(0, i - 2999) and (i - 2999 < 0 or h[i - 2999] == i - 2999)
    assert 0 not in h and h.get(0, "gone") == "gone" and h.pop(9_999) == 9_999 and 9_999 not in h
    older = next(iter(h._old))          # set again from the older generation: the newest value is what it holds,
    n = len(h)                          # the stale one stays until its generation goes
    h[older] = "again"
    assert h[older] == "again" and len(h) == n + 1
    assert h.pop(older) == "again" and older not in h and len(h) == n - 1


def test_a_workers_histories_together_keep_a_budget_dropping_the_oldest_generations_first():
    """Each history is bounded by its own count, but a worker's many queues only by their rate times the
    window: ``trim`` drops the oldest generations among them, whichever history holds them, until they hold the
    budget or less; the newest entries stay, and histories within it are left alone."""
    t = [0.0]
    hs = [history.History(limit=1_000_000, seconds=300, clock=lambda: t[0]) for _ in range(5)]
    for step in range(700):                 # 10 seconds apart, a batch of 10 in each history, time 0 to 6,990 s
        t[0] = step * 10.0
        for i, h in enumerate(hs):
            h.add([(i, step, k) for k in range(10)], step)
    held = sum(map(len, hs))
    assert 1_500 <= held <= 3_000            # each: one to two windows' worth, 30 to 60 steps of 10 entries
    assert history.trim(hs, held) == 0       # within the budget: nothing dropped
    dropped = history.trim(hs, 1_000)
    assert 1_000 - 300 < held - dropped <= 1_000   # at most a generation (30 steps of 10) below the budget
    kept = {(i, step) for i, h in enumerate(hs) for step in range(700) if (i, step, 0) in h}
    assert all((i, 699) in kept for i in range(5))                     # the newest of each stay
    gone = {(i, step) for i in range(5) for step in range(700)} - kept
    # oldest first across the histories: what went is no newer than the oldest generation that stayed
    assert max(step for _, step in gone) < min(step for _, step in kept) + 30
    assert len({i for i, _ in gone}) > 1                               # from more than one queue's history
    t[0] += 1.0
    hs[0][("set", 1)] = "after"                  # a dropped newer generation starts again
    assert hs[0][("set", 1)] == "after"


def test_the_newest_value_shadows_the_older_generations():
    h = history.History(limit=100)
    for i in range(40):
        h[i] = i
    h.add(list(range(30, 70)), "batch")          # 40 more would not fit in half the limit: a new generation
    assert len(h) == 80 and h[35] == "batch" and h[10] == 10   # the newest value shadows the older generation's
    h[36] = "again"
    assert h[36] == "again" and h.get(37) == "batch" and 36 in h
    h.add(list(range(100, 150)), "later")        # and again: the first generation is forgotten
    assert 10 not in h and h[35] == "batch" and h[36] == "again" and len(h) == 90
    assert h.pop(36) == "again" and 36 not in h   # gone from both generations


def test_the_history_keeps_added_batches_as_entries_in_their_order():
    h = history.History(limit=100)
    h[1] = "set"
    h.add([1, 2, 3], "acked")                # newer than what was set: it wins
    h.add((3, 4), "again")
    assert len(h) == 6 and h[1] == "acked" and h[3] == "again" and h.get(4) == "again" and 5 not in h
    h.add([10, 11], "acked")
    h[10] = "set later"                      # setting settles what was added before it
    assert h[10] == "set later" and h[11] == "acked"
    h.add(list(range(20, 60)), "old")        # 48 entries and 40 more do not fit in half the limit: a new generation
    h.add(list(range(50, 90)), "new")
    assert h[55] == "new" and h._old_batches   # found in the newer: the older's batches are left as they are
    assert h[45] == "old" and h[10] == "set later"
    h.add(list(range(100, 150)), "newest")   # and again: the batches of the oldest generation are forgotten
    assert 45 not in h and 10 not in h and h[85] == "new" and h.get(149) == "newest"
    assert h.pop(85) == "new" and 85 not in h
    h.add("aabbcc", "packed", 2)             # keys of two characters each, joined: three entries (a new generation)
    h.add(["bb"], "listed")
    assert len(h) == 54 and h["aa"] == "packed" and h["bb"] == "listed" and h.get("cc") == "packed"
    assert "ab" not in h and "a" not in h
    h.add([7], "x")
    h.clear()
    assert len(h) == 0 and 7 not in h and 149 not in h


def test_a_batch_of_acks_with_a_repeat_in_it_answers_it_already_acked():
    q = _queue()
    now = 1_000 * MS
    for _ in range(3):
        q.push(0, b"x", 4, now, now, 0)
    receipts = [d[D_RECEIPT] for d in q.lease(now, 3, 30_000, None)]
    results = q.ack_many([receipts[0], receipts[1], receipts[0], receipts[2], receipts[1]], now)
    assert [r.get("already_acked", False) for r in results] == [False, False, True, False, True]
    assert q.acked == 3 and q.duplicate_acks == 2
    assert all(q.ack_many([r], now)[0].get("already_acked") for r in receipts)


def test_a_lease_lost_to_its_deadline_leaves_the_acks_history_as_it_was_kept():
    """The acks' batches become dict entries only when a repeated or unknown receipt looks for them: an expiry,
    which sets a fate of its own, does not make them (that would turn the acks' saved work into pauses)."""
    q = _queue()
    now = 1_000 * MS
    for _ in range(3):
        q.push(0, b"x", 4, now, now, 0)
    acked = [d[D_RECEIPT] for d in q.lease(now, 2, 30_000, None)]
    q.ack_many(acked, now)
    (lost,) = [d[D_RECEIPT] for d in q.lease(now, 1, 1_000, None)]
    q.expire(now + 1_000 * MS)
    assert q._acks._new_batches == [("".join(acked), True, 22)]   # as the ack kept them: joined
    assert q.ack_many([lost], now + 1_000 * MS)[0]["error"] == "lease_lost"
    assert q._acks._new_batches                      # a lost lease is answered without looking at the acks
    assert q.ack_many([acked[0]], now + 1_000 * MS)[0].get("already_acked") is True


@pytest.mark.skipif(model.core.IMPLEMENTATION != "compiled", reason="the compiled loops are not built")
def test_a_growing_queue_stays_out_of_the_collectors_passes():
    """A million queued messages cost a full collector pass 20-70 ms when their store or the FIFO of the visible
    ones was a container it walks: the store is kept untracked (every way of pushing puts untracked tuples in it;
    one tracked tuple would make the collector track the whole dict again) and the FIFO holds runs, not numbers."""
    q = _queue()
    now = 1_000 * MS
    for _ in range(1000):
        q.push(KIND_JSON, b"1", 4, now, 5, 0)
    q.push_data(KIND_JSON, [b"2"] * 500, 4, 0, now, 5)
    q.push_many([(KIND_JSON, b"3", 4, 0)] * 500, now, 5)
    q.push(KIND_JSON, b"4", 4, now, 5, 0, token=("c", 1))           # through apply
    q.push_many([(KIND_JSON, b"5", 4, 1000)] * 3, now, 5)            # delayed
    q.apply(("pushes", None, [tuple([q.next_seq, "x" * 16, KIND_JSON, b"6", 4, 5, "", "", 0])], None))   # replay
    assert len(q.messages) == 2005 and q.visible == 2002
    assert not gc.is_tracked(q.messages)
    assert list(q._ready.fifo[4]) == [range(1, 2002), range(2005, 2006)]   # the delayed ones: a gap
    assert [m[3] for m in (q.messages[s] for s in q._ready.pop_many(2002))][-3:] == [b"3", b"4", b"6"]


def test_served_long_polls_leave_the_due_heap():
    """A long poll served at once left its deadline (up to 5 minutes away) in the shard's heap of due times:
    one entry per poll, at the poll rate times wait_ms.  Now the heap follows the polls waiting."""
    async def body():
        s = Shard(0, Settings(), Journal(None), lambda: None, 256)
        box: list = []
        for _ in range(20_000):
            s.handle("recv", {"queue": "jobs", "max": 1, "wait_ms": 300_000}, (0, 1), box.append)
            s.handle("push", {"queue": "jobs", "data": b"x"}, (0, 2), box.append)
            s.commit()
            (receipt,) = s.queues["jobs"].leases
            s.handle("ack", {"queue": "jobs", "receipt": receipt}, (0, 1), box.append)
            s.commit()
        waiting = [s.handle("recv", {"queue": "jobs", "max": 1, "wait_ms": 300_000}, (0, 3), box.append)
                   for _ in range(10)]
        assert len(waiting) == 10 and len(s.waiters["jobs"]) == 10
        assert len(s._due) <= 2 * s._due_live + shard_timer._DUE_SLACK + 1
        assert len(s._due) < 20_000 // 2
        # the waiting polls still end at their deadlines
        for _ in range(3):
            s._compact_due()
        deadlines = {w.deadline for w in s.waiters["jobs"]}
        assert deadlines <= {when for when, name in s._due if name == "jobs"}
    asyncio.run(body())


def test_an_idle_queue_with_dedup_ids_is_forgotten_once_the_window_has_passed(monkeypatch):
    """Its dedup ids go with it, so a queue is kept while they are within queues.dedup_window, and no longer: an
    idle queue's ids never age out by themselves (a history rotates on writes), and it would keep its place under
    max_queues_per_worker for ever."""
    clock = [1000.0]
    monkeypatch.setattr(shard_timer.time, "monotonic", lambda: clock[0])

    async def body():
        s = Shard(0, Settings(dedup_window_s=3600.0), Journal(None), lambda: None, 256, {}, max_queues=10,
                  forget_idle_s=600.0)
        box: list = []
        s.handle("push", {"queue": "d", "data": b"x", "dedup_id": "once"}, (0, 1), box.append)
        s.handle("recv", {"queue": "d", "max": 1}, (0, 1), box.append)
        s.commit()
        s.handle("ack", {"queue": "d", "receipt": box[-1]["messages"][0][D_RECEIPT]}, (0, 1), box.append)
        s.commit()
        for minutes in (0, 10, 20, 50):        # idle from the first sweep on; within the hour: kept
            clock[0] = 1000.0 + minutes * 60
            s._forget_idle()
            assert "d" in s.queues, minutes
        clock[0] = 1000.0 + 61 * 60            # an hour idle: its ids have aged out with it
        s._forget_idle()
        assert "d" not in s.queues
    asyncio.run(body())


def test_a_shard_forgets_a_queue_only_after_a_whole_sweep_without_anything_done_to_it():
    """Queues named by clients would otherwise stay for ever (~4.5 KB each, empty).  A sweep forgets the empty,
    unwaited, unconfigured queues that the sweep before found so and that did nothing since; a queue used in
    between (a push and its ack leave it empty again), one with a waiter, and a configured one are kept."""
    async def body():
        s = Shard(0, Settings(), Journal(None), lambda: None, 256, {"kept": Settings()}, max_queues=10)
        box: list = []

        def cycle(name: str) -> None:   # a push, its receive and its ack: empty again, but used
            s.handle("push", {"queue": name, "data": b"x"}, (0, 1), box.append)
            s.handle("recv", {"queue": name, "max": 1}, (0, 1), box.append)
            s.commit()
            s.handle("ack", {"queue": name, "receipt": box[-1]["messages"][0][D_RECEIPT]}, (0, 1), box.append)
            s.commit()
        s.queue("kept")
        for name in ("busy", "idle", "full"):
            cycle(name)
        s.handle("push", {"queue": "full", "data": b"x"}, (0, 1), box.append)
        s.handle("recv", {"queue": "waited", "max": 1, "wait_ms": 300_000}, (0, 2), box.append)
        s._forget_idle()                                  # found idle: busy, idle (not yet forgotten)
        assert set(s.queues) == {"kept", "busy", "idle", "full", "waited"}
        cycle("busy")
        s._forget_idle()                                  # idle did nothing since: forgotten; busy did
        assert set(s.queues) == {"kept", "busy", "full", "waited"}
        s._forget_idle()
        assert set(s.queues) == {"kept", "full", "waited"}
        cycle("idle")                                     # a name forgotten is free: made anew
        assert s.queues["idle"].pushed == 1 and s.queues["idle"].acked == 1
    asyncio.run(body())


def test_a_shards_tick_keeps_its_queues_histories_within_the_budget(monkeypatch):
    monkeypatch.setattr(shard_timer, "HISTORY_BUDGET", 500)

    async def body():
        s = Shard(0, Settings(), Journal(None), lambda: None, 256)
        box: list = []
        for i in range(2_000):   # pushes from another worker (with tokens), each received and acked
            name = f"q{i % 20}"
            s.handle("push", {"queue": name, "data": b"x", "token": [1, 7, i]}, (1, 7), box.append)
            s.handle("recv", {"queue": name, "max": 1}, (0, 1), box.append)
            s.commit()
            s.handle("ack", {"queue": name, "receipt": box[-1]["messages"][0][D_RECEIPT]}, (0, 1), box.append)
            s.commit()

        def held() -> int:
            return sum(len(h) for q in s.queues.values() for h in (q._recent, q._acks, q.tokens))
        assert held() == 4_000           # a token and an acked receipt each, far within each queue's own bound
        s.tick()
        assert 0 < held() <= 500
        last = s.queues["q19"]
        assert last.tokens.get((1, 7, 1999)) is not None   # the newest stay
    asyncio.run(body())
