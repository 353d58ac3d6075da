"""A shard's end of a turn and its replies: a request's reply waits (``_answer``) until ``commit`` has served the
waiters of queues that got messages and written the turn's records; and what a write that fails does: the turn's
pushes and leases undone (``roll_back``) and their requests refused ``journal_unavailable`` at once, the rest kept,
their replies waiting for the write, tried again every second.

A mixin of ``workers.workqueues.shard.Shard``: the turn's commit is that one object's, over its state
(``Shard.__init__``); kept in a room of its own so that the shard's room holds the state and the entry point.
"""

from __future__ import annotations

import collections
import logging
import time

from shardbroker.router import guard
from shardbroker.workers.workqueues.messages import D_RECEIPT, pushed_seqs
from shardbroker.workers.workqueues.model import Queue
from shardbroker.workers.workqueues.receipts import record_text
from shardbroker.workers.workqueues.shard_receive import Waiter
from shardbroker.workers.workqueues.shard_requests import Reply

log = logging.getLogger("broker.queues")

JOURNAL_UNAVAILABLE = "journal_unavailable"   # the error of a push or receive undone by a failed journal write
_RETRY_WRITE_S = 1.0        # a failed journal write is tried again this often while changes wait for it
_LOG_EVERY_S = 10.0         # while the journal cannot be written, one log line per this many seconds
_UNAVAILABLE = {"ok": False, "error": JOURNAL_UNAVAILABLE, "retry": True}


class Committing:
    """``Shard``'s commit and replies (its state is the Shard's)."""

    def _answer(self, reply: Reply, result: dict) -> None:
        self._replies.append((reply, result))
        if not self._committing:
            self._schedule_flush()

    def commit(self) -> None:
        """End of the turn: serve the waiters of queues that got messages, journal what changed, then let the
        replies go (they leave in the same flush)."""
        if self._wake:
            self._committing = True
            try:
                now = time.monotonic_ns()
                while self._wake:
                    _, q = self._wake.popitem()
                    self._serve(q, now)
            finally:
                self._committing = False
        journal = self.journal
        try:
            if journal.dirty:
                try:
                    journal.commit()
                except OSError as exc:
                    if not journal.dirty:   # written, then its fsync failed: the hub's to report (and retry)
                        raise
                    self._write_failed(exc)
                    return
                if self._failing_since:
                    self._written_again()
        finally:
            if self._served:
                self._served.clear()
        if self._replies:
            replies, self._replies = self._replies, []
            for reply, result in replies:
                guard.call("a work-queue reply", reply, result)   # one failing must not drop the others

    # -- a journal that cannot be written -------------------------------------------------------------------
    def _write_failed(self, exc: OSError) -> None:
        """The turn's write failed (the journal cut the file back and kept the records).  Its pushes and leases are
        undone and their requests refused now; the rest stays buffered, its replies waiting for the write."""
        journal = self.journal
        records = journal.failed
        refused: set[int] = set()
        undone = kept = 0
        before = self.journal_refused
        if records is not None:
            ids, receipts, keep = roll_back(self.queues, records)
            journal.take_back(keep)
            undone, kept = len(records) - len(keep), len(keep)
            if ids or receipts:
                refused = self._refuse(ids, receipts)
        self._failed_writes += 1
        now = time.monotonic()
        if not self._failing_since or now - self._failed_logged >= _LOG_EVERY_S:
            log.error("work-queue journal: %s; %d request(s) refused with %s (%d change(s) undone), %d change(s) "
                      "kept in memory whose replies wait for the write%s", exc.strerror or exc,
                      self.journal_refused - before, JOURNAL_UNAVAILABLE, undone, kept,
                      " (retrying every second)" if journal.dirty else "")
            self._failed_logged = now
        if not self._failing_since:
            self._failing_since = now
        replies, self._replies = self._replies, []
        if journal.dirty:   # changes are kept: only the refusals leave now
            self._replies = [r for r in replies if id(r[1]) not in refused]
            replies = [r for r in replies if id(r[1]) in refused]
        for reply, result in replies:
            guard.call("a work-queue reply", reply, result)
        if journal.dirty or any(q.visible for name in self.waiters if (q := self.queues.get(name)) is not None):
            if self._retry is None:
                self._retry = self.loop.call_later(_RETRY_WRITE_S, self._retry_write)

    def _retry_write(self) -> None:
        self._retry = None
        self._wake_waiters()
        self._schedule_flush()

    def _wake_waiters(self) -> None:
        """Waiters put back by an undone write, on queues with visible messages: served at the next commit."""
        for name in self.waiters:
            q = self.queues.get(name)
            if q is not None and q.visible:
                self._wake[name] = q

    def _written_again(self) -> None:
        log.warning("work-queue journal: written again after %.1f s (%d failed write(s), %d request(s) refused "
                    "meanwhile)", time.monotonic() - self._failing_since, self._failed_writes, self.journal_refused)
        self._failing_since = 0.0
        self._failed_writes = 0
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._wake_waiters()
        if self._wake:
            self._schedule_flush()

    def _refuse(self, ids: set[str], receipts: set[str]) -> set[int]:
        """The replies of the turn that speak of undone pushes or leases become ``journal_unavailable`` (counted in
        ``journal_refused``); a long poll served with undone leases waits again instead, where it was.  -> ``id()``
        of the replies that leave now."""
        served = {id(result): (name, w) for name, w, result in self._served}
        refused: set[int] = set()
        back: list[tuple[str, Waiter]] = []
        replies = self._replies
        for k, (reply, result) in enumerate(replies):
            if result.get("ok") is not True:
                continue
            group = result.get("results")
            if group is not None:   # single pushes sent together: each of the undone ones is refused
                answers = [_UNAVAILABLE if r.get("id") in ids else r for r in group]
                undone = sum(r is _UNAVAILABLE for r in answers)
                if undone:
                    self.journal_refused += undone
                    refusal = {"ok": True, "results": answers}
                    refused.add(id(refusal))
                    replies[k] = (reply, refusal)
                continue
            msg_id = result.get("id")
            many = result.get("ids")
            messages = result.get("messages")
            if (type(msg_id) is str and msg_id in ids) or (type(many) is list and not ids.isdisjoint(many)) or \
                    (messages and messages[0][D_RECEIPT] in receipts):   # a receive's leases: undone together
                waiter = served.get(id(result)) if messages else None
                if waiter is not None:
                    replies[k] = None   # type: ignore[call-overload]
                    if waiter[1].holder in self._holders:   # its connection is still there
                        back.append(waiter)
                    continue
                refusal = dict(_UNAVAILABLE)
                refused.add(id(refusal))
                self.journal_refused += 1
                replies[k] = (reply, refusal)
        if back:
            self._replies = [r for r in replies if r is not None]
            for name, w in reversed(back):   # at the head of the line, in the order they had
                w.done = False
                self._waiting[w.holder] = self._waiting.get(w.holder, 0) + 1
                self.waiters.setdefault(name, collections.deque()).appendleft(w)
                self._wait_until(w.deadline, self.queues[name])
        return refused


def roll_back(queues: dict[str, Queue], records: list[tuple[str, tuple]]) -> tuple[set, set, list]:
    """Undo the pushes (a client's: not a dead letter's, not a redrive's) and leases among a failed write's
    ``records``, newest first.  A queue where a later record of the turn depends on one of them (a lease
    acked, extended, requeued or dead-lettered in the same turn, a purge, a take) keeps them all: rare, and
    always right.  -> (ids of the messages un-pushed, receipts of the leases undone, the records kept)."""
    undo: dict[str, list[int]] = {}      # queue -> indexes of its records to undo
    seqs: dict[str, set] = {}            # queue -> the messages they pushed or leased
    leased: dict[str, set] = {}          # queue -> the receipts of their leases
    keep_all: set[str] = set()
    for i, (name, rec) in enumerate(records):
        if not name:
            continue
        kind = rec[0]
        if kind == "pushes" or kind == "pushcol":
            undo.setdefault(name, []).append(i)
            seqs.setdefault(name, set()).update(pushed_seqs(rec))
        elif kind == "push" and not rec[8] and not rec[9] and not rec[11]:   # no deliveries, reason, redrive
            undo.setdefault(name, []).append(i)
            seqs.setdefault(name, set()).add(rec[1])
        elif kind == "leases":
            undo.setdefault(name, []).append(i)
            seqs.setdefault(name, set()).update(rec[1])
            leased.setdefault(name, set()).update(record_text(r) for r in rec[2])
        elif name in undo and name not in keep_all:
            mine, theirs = leased.get(name, ()), seqs[name]
            if kind == "purge" or kind == "take" and not theirs.isdisjoint(rec[1]) or \
                    kind == "dead" and rec[1] in theirs or \
                    kind in ("requeue", "deadline", "ack") and record_text(rec[1]) in mine or \
                    kind == "acks" and any(r in mine for r in rec[1]):
                keep_all.add(name)
    ids: set[str] = set()
    receipts: set[str] = set()
    dropped: set[int] = set()
    for name, indexes in undo.items():
        if name in keep_all:
            continue
        q = queues[name]
        pushed: set[int] = set()   # leased in the turn they were pushed in: back to no heap at all
        for i in indexes:
            rec = records[i][1]
            if rec[0] != "leases":
                pushed.update(pushed_seqs(rec))
        off_heap: set[int] = set()
        for i in reversed(indexes):
            rec = records[i][1]
            if rec[0] == "leases":
                q.undo_leases(rec[1], rec[2], pushed)
                receipts.update(record_text(r) for r in rec[2])
                off_heap.update(seq for seq in rec[1] if seq in pushed)
            else:
                ids.update(q.undo_push(rec, off_heap))
            dropped.add(i)
    keep = [item for i, item in enumerate(records) if i not in dropped] if dropped else records
    return ids, receipts, keep
