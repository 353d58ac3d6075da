"""A shard's time: its one timer for all its queues (``loop.call_at`` at the earliest due time of any of them, a
heap of due times with stale entries skipped) for lease expiries, delayed messages and long-poll deadlines; and its
once-a-second ``tick``: the journal's fsync policy, idle queues forgotten, the queues' histories held to a budget,
and a compaction when it pays.

A mixin of ``workers.workqueues.shard.Shard``: the timer is that one object's, over its state (``Shard.__init__``);
kept in a room of its own so that the shard's room holds the state and the entry point.
"""

from __future__ import annotations

import heapq
import logging
import time

from shardbroker.workers.workqueues import history
from shardbroker.workers.workqueues.model import Queue

log = logging.getLogger("broker.queues")

# The shard's heap of due times keeps a long poll's deadline until it comes, even when the poll was served at once
# (the usual case).  Once it holds more than twice what is live after its last rebuild plus this, it is rebuilt
# with what is live (each queue's next due time, each waiting poll's deadline): its size follows the polls waiting,
# not the poll rate times wait_ms (up to 5 minutes).
_DUE_SLACK = 4096
FORGET_IDLE_S = 600.0       # a queue empty and untouched this long (two sweeps apart) is forgotten (_forget_idle)
# Entries all of a worker's queues' histories (acked receipts, other ends of leases, push tokens) may hold together:
# 70-130 B each (190-280 for a push's dedup_id), so ~70-130 MB; past it the oldest go first (history.trim), whichever
# queue they are in.
HISTORY_BUDGET = 1_000_000
_TRIM_EVERY_S = 10.0        # how often they are counted (~1.4 ms a 1,000 queues): the budget passed for 10 s at most


class Timing:
    """``Shard``'s timer and tick (its state is the Shard's)."""

    def _at(self, when: int, q: Queue) -> None:
        heapq.heappush(self._due, (when, q.name))
        if len(self._due) > 2 * self._due_live + _DUE_SLACK:
            self._compact_due()
        if not self._timer_at or when < self._timer_at:
            self._arm(when)

    def _wait_until(self, when: int, q: Queue) -> None:
        """A long poll's deadline: look at the queue then (its own due times are the queue's to ask for)."""
        self._at(when, q)

    def _compact_due(self) -> None:
        """Rebuild the due times' heap (in place: ``_on_timer`` may hold it) with what is live: each queue's own
        next due time (``due_at``: the later entries of a queue are redundant, its timer asks again) and the
        deadline of each poll still waiting."""
        live = {(q.due_at, name) for name, q in self.queues.items() if q.due_at}
        for name, queued in self.waiters.items():
            live.update((w.deadline, name) for w in queued if not w.done)
        due = self._due
        due[:] = live
        heapq.heapify(due)
        self._due_live = len(due)

    def _arm(self, when: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        # loop.time() is time.monotonic(); the ns deadline is never early once rounded up to the loop's clock
        self._timer = self.loop.call_at(when / 1e9 + 0.0005, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = 0
        now = time.monotonic_ns()
        due = self._due
        touched: set[str] = set()
        while due and due[0][0] <= now:
            touched.add(heapq.heappop(due)[1])
        for name in touched:
            q = self.queues.get(name)
            if q is not None:
                q.due_at = 0       # its entry fired: what is left to come is what expire says
                nxt = q.expire(now)
                if nxt:
                    q._at(nxt)
                self._settle(q, now)
            self._expire_waiters(name, now)
        if due:
            self._arm(due[0][0])
        self._schedule_flush()

    def tick(self) -> None:
        """About once a second: fsync per policy, forget idle queues, and compact when it pays."""
        try:
            self.journal.tick()
        except OSError as exc:
            log.error("work-queue journal: fsync failed: %s", exc.strerror or exc)
        now = time.monotonic()
        if now >= self._forget_at:
            self._forget_idle()
        if now >= self._trim_at:
            self._trim_at = now + _TRIM_EVERY_S
            history.trim([h for q in self.queues.values() for h in (q._recent, q._acks, q.tokens)], HISTORY_BUDGET)
            now_ns = time.monotonic_ns()
            for q in self.queues.values():
                if len(q.attempts):
                    q.attempts.sweep(now_ns, q.leases)
        if now < self._compact_after:
            return
        try:
            self.compact()
        except OSError as exc:   # the old journal is kept as it was (Journal.rewrite)
            self._compaction_failed(exc)

    def _forget_idle(self) -> None:
        """Forget each queue that was empty, with nobody waiting, at the last sweep (``forget_idle_s`` ago) and
        has done nothing since: a client may name any number of queues, and an empty one still costs ~4.5 KB.  Its
        name is free again (a push makes it anew).  A configured queue is kept.  Nothing is journaled: replaying
        the queue's records rebuilds it empty, and the replacement's own sweeps forget it again.  What it
        remembered goes with it (receipts acked, push tokens): one holding push tokens waits until it has been idle
        for its dedup window too (queues.dedup_window), as its tokens must last that long."""
        now = time.monotonic()
        self._forget_at = now + self.forget_idle_s
        idle, self._idle = self._idle, {}
        forgotten = 0
        for name, q in list(self.queues.items()):
            if q.messages or q.dead or name in self.waiters or name in self.configured:
                continue
            activity = q.activity()
            seen = idle.get(name)
            if seen is None or seen[0] != activity:
                self._idle[name] = (activity, now)
                continue
            # idle since seen[1]; its dedup ids (queues.dedup_window) must have aged out too
            if len(q.tokens) and now - seen[1] < q.settings.dedup_window_s:
                self._idle[name] = seen
                continue
            del self.queues[name]
            self._gone(name)
            forgotten += 1
        if forgotten:
            self.queues_forgotten += forgotten
            log.debug("worker %d: forgot %d idle queue(s)", self.index, forgotten)
