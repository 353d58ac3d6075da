"""The work queues one worker owns (``router.shardmap``: a queue's owner is its name's owner), behind one entry
point, ``handle(op, args, holder, reply)``, whichever protocol and worker the request came from.

- One timer for the whole shard (``loop.call_at`` at the earliest due time of any queue; a heap of due times with
  stale entries skipped): lease expiry, delayed messages and long-poll deadlines.  Never one task per message, and
  nothing runs while nothing is due.
- Every change is journaled (``journal``) and replies wait in ``_replies`` until ``commit`` (run at the start of
  the hub's end-of-turn flush) has written the turn's records: a producer is told ``ok`` only for what is stored.
- A write that fails (a full disk: ENOSPC, EFBIG; EIO) undoes the turn's pushes and leases, as if never made, and
  answers their requests ``journal_unavailable`` (``retry``) at once; a long poll served in that turn waits again.
  The turn's other changes (acks, extends, nacks, expiries, dead letters, purges, redrives) stay applied and
  buffered, and their replies wait for the write, tried again every second (``_write_failed``).
- Long polls wait in a FIFO per queue, wherever their clients are; a message wakes the first waiter, and only it.
  Waiters are served at the end of the turn (``commit``), with everything that became visible in it: a burst of
  pushes read in one turn goes to the first waiter as one batch, not one message to it and the rest to nobody.
- A holder is the connection a request came from, ``(worker, cid)``: leases taken with ``release_on_close`` and
  waiters are dropped when it closes (``drop_holder``) or its worker dies (``drop_worker``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import logging
import time
from typing import Callable, Iterator

from shardbroker.router import guard
from shardbroker.router.subjects import is_valid_literal
from shardbroker.workers.message import KIND_JSON
from shardbroker.workers.tally import Tally

from shardbroker.workers.workqueues import history
from shardbroker.workers.workqueues.journal import Journal
from shardbroker.workers.workqueues.operations import OPERATIONS
from shardbroker.workers.workqueues.model import (
    D_RECEIPT, DLQ_SUFFIX, ENQUEUED, ID, KIND, MAX_PRIORITY, MS, PRIORITY, REDRIVEN, SOURCE, DATA, Queue, QueueError,
    Settings, canonical_receipt, is_dlq, pushed_seqs, record_text,
)

log = logging.getLogger("broker.queues")

Reply = Callable[[dict], None]
MAX_BATCH = 1000            # messages a receive leases, receipts an ack takes, messages a push stores, at most
MAX_WAIT_MS = 300_000
MAX_DEDUP_ID = 128          # characters of a push's dedup_id (SQS's MessageDeduplicationId)
# A ``pushes`` request's options for those of its pushes that are data's bytes alone (kind: JSON unless it says)
_RUN_OPTIONS = ("priority", "delay_ms", "kind")
# Long polls waiting at once: a waiter costs a few hundred bytes, but a client must not be able to add them
# without end (a NATS connection can send any number of receives).
MAX_WAITERS_PER_CONNECTION = 1000
MAX_WAITERS_PER_QUEUE = 100_000
DEFAULT_PRIORITY = 4
# Rewrite the journal once it holds this much of what is gone, and more of that than of what is live: a rewrite
# costs the live bytes it writes and pays with the dead ones it drops, so its cost stays below what was appended
# (a queue drained from a backlog is not rewritten halfway, only once mostly gone), and the file stays below twice
# the live state plus this.
_COMPACT_DEAD = 64 << 20
# The shard's heap of due times keeps a long poll's deadline until it comes, even when the poll was served at once
# (the usual case).  Once it holds more than twice what is live after its last rebuild plus this, it is rebuilt
# with what is live (each queue's next due time, each waiting poll's deadline): its size follows the polls waiting,
# not the poll rate times wait_ms (up to 5 minutes).
_DUE_SLACK = 4096
JOURNAL_UNAVAILABLE = "journal_unavailable"   # the error of a push or receive undone by a failed journal write
_RETRY_WRITE_S = 1.0        # a failed journal write is tried again this often while changes wait for it
_COMPACT_BACKOFF_S = 60.0   # after a failed compaction (a full disk), none is tried for this long
FORGET_IDLE_S = 600.0       # a queue empty and untouched this long (two sweeps apart) is forgotten (_forget_idle)
# Entries all of a worker's queues' histories (acked receipts, other ends of leases, push tokens) may hold together:
# 70-130 B each (190-280 for a push's dedup_id), so ~70-130 MB; past it the oldest go first (history.trim), whichever
# queue they are in.
HISTORY_BUDGET = 1_000_000
_TRIM_EVERY_S = 10.0        # how often they are counted (~1.4 ms a 1,000 queues): the budget passed for 10 s at most
_LOG_EVERY_S = 10.0         # while the journal cannot be written, one log line per this many seconds
_UNAVAILABLE = {"ok": False, "error": JOURNAL_UNAVAILABLE, "retry": True}
DENIED = {"ok": False, "error": "permission_denied"}


def _boot_id() -> str:
    """This boot of the machine (Linux): monotonic deadlines from another boot mean nothing."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _clock() -> tuple:
    """The shard's journal record of the clocks its deadlines are taken on."""
    return ("clock", _boot_id(), time.monotonic_ns(), time.time_ns())


class Waiter:
    __slots__ = ("reply", "holder", "user", "max", "visibility", "release", "deadline", "done")

    def __init__(self, reply: Reply, holder: tuple, user: str | None, count: int, visibility: int, release: bool,
                 deadline: int) -> None:
        self.reply = reply
        self.holder = holder
        self.user = user   # who waits (security on), asked again whether it may receive when it is served
        self.max = count
        self.visibility = visibility
        self.release = release
        self.deadline = deadline
        self.done = False


def _is_dedup_id(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_DEDUP_ID


def _run_push(item: dict | bytes, options: dict) -> tuple | None:
    """One of a ``pushes`` request's pushes as (data, kind, priority, delay_ms, dedup_id), the data's bytes alone
    taking the request's ``options``; None: it has fields that a run of pushes stored together does not take."""
    if type(item) is bytes:
        return (item, options.get("kind", KIND_JSON), options.get("priority", DEFAULT_PRIORITY),
                options.get("delay_ms", 0), None)
    if len(item) > 2 + ("priority" in item) + ("delay_ms" in item) + ("dedup_id" in item):
        return None
    return (item.get("data"), item.get("kind"), item.get("priority", DEFAULT_PRIORITY), item.get("delay_ms", 0),
            item.get("dedup_id"))


def _int(args: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = args.get(key, default)
    if value is None:
        return default
    if type(value) is not int or not lo <= value <= hi:
        raise QueueError(f"invalid_{key.removesuffix('_ms')}", min=lo, max=hi)
    return value


class Shard:
    def __init__(self, index: int, settings: Settings, journal: Journal, schedule_flush: Callable[[], None],
                 max_name: int, configured: dict[str, Settings] | None = None, max_queues: int = 0,
                 forget_idle_s: float = FORGET_IDLE_S, max_queues_per_party: int = 0) -> None:
        self.index = index
        self.settings = settings
        self.configured = configured or {}   # configured queues' own settings
        self.max_queues = max_queues         # queues a client's push or wait may bring the shard to (0: no bound)
        # ... of which one party (a user; with security off, a client address) may have made this many, so that one
        # cannot take every place from the others (0: no bound)
        self.max_queues_per_party = max_queues_per_party
        self._made_by: dict[str, str] = {}   # queue -> the party whose push or wait made it (while it lives)
        self._made = Tally()                 # party -> queues it made that live
        self.forget_idle_s = forget_idle_s
        self._forget_at = time.monotonic() + forget_idle_s   # the next sweep for idle queues (_forget_idle)
        self._idle: dict[str, tuple] = {}    # queue -> its activity when the last sweep found it idle
        self._trim_at = 0.0                  # when the queues' histories are next held to HISTORY_BUDGET
        self.queues_refused = 0              # pushes and long polls refused too_many_queues, since the start
        self.queues_forgotten = 0            # idle queues forgotten, since the start
        self.journal = journal
        self._schedule_flush = schedule_flush
        self._max_name = max_name
        self.loop = asyncio.get_running_loop()
        self.queues: dict[str, Queue] = {}
        self.waiters: dict[str, collections.deque[Waiter]] = {}
        self._due: list[tuple[int, str]] = []      # (monotonic ns, queue): look at it then
        self._due_live = 0                         # entries of _due live at its last rebuild (_compact_due)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._replies: list[tuple[Reply, dict]] = []
        self._wake: dict[str, Queue] = {}        # queues with waiters and visible messages: serve them at commit
        self._committing = False
        self._holders: dict[tuple, set[str]] = {}  # holder -> queues where it waits or holds release-on-close leases
        self._waiting: dict[tuple, int] = {}       # holder -> its long polls waiting here
        self._served: list[tuple[str, Waiter, dict]] = []   # this turn's waiters served: (queue, waiter, result)
        self._retry: asyncio.TimerHandle | None = None     # the next try of a failed journal write
        self._failing_since = 0.0                 # monotonic s of the first failed write of this spell (0: none)
        self._failed_logged = 0.0
        self._failed_writes = 0
        self.journal_refused = 0                  # requests answered journal_unavailable, since the start
        self.compactions = 0                      # journal rewrites put in place, since the start
        self._compact_after = 0.0                 # monotonic s: no compaction before (one failed)
        self.owns: Callable[[str], bool] = lambda name: True   # whether a queue is placed here (set by the service)
        # whether a user may receive from a queue now (set by the service from the worker's users: every worker
        # has the change in force before an admin's change is acknowledged)
        self.may_receive: Callable[[str, str], bool] = lambda user, name: True

    # -- queues ---------------------------------------------------------------------------------------------
    def queue(self, name: str) -> Queue:
        """The queue ``name``, created if it does not exist (what stores or waits makes a queue exist)."""
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = self._new(name)
        return q

    def _look_up(self, name: object) -> Queue | None:
        """The queue ``name`` if it exists; None if it does not (nothing is created: requests that only read or
        settle leases must not grow the table); QueueError if ``name`` cannot be a queue's."""
        q = self.queues.get(name) if type(name) is str else None
        if q is None:
            self._valid(name)
        return q

    def _valid(self, name: object) -> str:
        if type(name) is not str or not is_valid_literal(name, self._max_name):
            raise QueueError("invalid_queue")
        return name

    def _new(self, name: object) -> Queue:
        name = self._valid(name)
        return Queue(name, self._settings_of(name), self._at, self.journal.append)

    def _settings_of(self, name: str) -> Settings:
        """The settings queue ``name`` has (or would have once created)."""
        settings = self.configured.get(name, self.settings)
        if is_dlq(name):  # a dead-letter queue never dead-letters: its messages used up their deliveries
            settings = dataclasses.replace(self.configured.get(name[:-len(DLQ_SUFFIX)], settings), max_deliveries=0)
        return settings

    def _opened(self, name: object, party: str | None = None) -> Queue:
        """The queue a client's push or long poll names, created if new while the shard holds fewer than
        ``max_queues``, and ``party`` (who asked) made fewer than ``max_queues_per_party`` of those it holds (a
        client may name any number of queues, and an empty one costs ~4.5 KB); what the broker creates itself (a
        dead-letter queue, a configured queue, a replay) is never refused."""
        q = self.queues.get(name) if type(name) is str else None
        if q is not None:
            return q
        if self.max_queues and len(self.queues) >= self.max_queues:
            self._valid(name)
            self.queues_refused += 1
            raise QueueError("too_many_queues", max=self.max_queues)
        per_party = self.max_queues_per_party
        if party is not None and per_party and self._made[party] >= per_party:
            self._valid(name)
            self.queues_refused += 1
            raise QueueError("too_many_queues", max=per_party, per="user")
        q = self.queue(name)
        if party is not None:
            self._made_by[q.name] = party
            self._made.add(party)
        return q

    def _gone(self, name: str) -> None:
        """Queue ``name`` was forgotten: its maker may make another."""
        party = self._made_by.pop(name, None)
        if party is not None:
            self._made.remove(party)

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

    # -- the entry point ------------------------------------------------------------------------------------
    def handle(self, op: str, args: dict, holder: tuple, reply: Reply) -> None:
        """Run one request; ``reply`` gets ``{"ok": True, ...}`` or ``{"ok": False, "error": ..., ...}`` once the
        records it made are journaled (a long poll: once it has messages or its wait is over)."""
        handler = _OPS.get(op)
        try:
            if handler is None:
                raise QueueError("unknown_op")
            result = handler(self, args, holder, reply)
        except QueueError as exc:
            result = exc.result()
        if result is not None:
            self._answer(reply, result)

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
            ids, receipts, keep = self._roll_back(records)
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

    def _roll_back(self, records: list[tuple[str, tuple]]) -> tuple[set, set, list]:
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
            q = self.queues[name]
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

    # -- operations -----------------------------------------------------------------------------------------
    def _pushed_to(self, args: dict) -> Queue:
        """The queue a push names, created if new (a name that cannot be a queue's raises in ``queue``)."""
        return self._opened(args.get("queue"), args.get("party"))

    @staticmethod
    def _token(args: dict) -> tuple | str | None:
        """A push request's token, which names it among resends: the client's ``dedup_id`` (a str), or the one its
        worker gave it to cross the fabric (a tuple; a list once it crossed)."""
        dedup = args.get("dedup_id")
        if dedup is not None:
            if not _is_dedup_id(dedup):
                raise QueueError("invalid_dedup_id", min=1, max=MAX_DEDUP_ID)
            return dedup
        token = args.get("token")
        return tuple(token) if token is not None else None

    def _repeat(self, q: Queue, stored: str | tuple, token: tuple | str, args: dict | None) -> dict:
        """The answer to a push (``args``; None: a batch) whose token names one already stored: ``stored``, its id
        (a batch's ids).  Only a client's ``dedup_id`` can name the other form of push, a conflict."""
        batch = args is None
        if (type(stored) is tuple) != batch:
            raise QueueError("dedup_id_conflict")
        result = {"ok": True, "ids": list(stored)} if batch else self._pushed(q, stored, args)
        if type(token) is str:   # a client's retry, which may want to know (a resend after a crash is not one)
            result["duplicate"] = True
            q.duplicate_pushes += len(stored) if batch else 1
        return result

    def _push(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q = self._pushed_to(args)
        if "messages" in args or "datas" in args:
            return self._push_many(q, args)
        return self._push_one(q, args, self._token(args))

    def _push_one(self, q: Queue, args: dict | bytes, token: tuple | str | None, clock: tuple[int, int] | None = None,
                  options: dict | None = None) -> dict:
        """One push; ``clock``: (monotonic, wall) ns, read once for the pushes that arrived together."""
        if type(args) is bytes:   # a push of data and ``options`` (``pushes``): JSON unless they say
            args = {"data": args, "kind": KIND_JSON, **(options or {})}
        if token is not None:
            stored = q.tokens.get(token)
            if stored is not None:  # sent again (a client's retry, a resend after a crash): one copy
                return self._repeat(q, stored, token, args)
        data, kind = args.get("data", b""), args.get("kind", 0)
        priority = args.get("priority", DEFAULT_PRIORITY)
        if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
            priority = _int(args, "priority", DEFAULT_PRIORITY, 0, MAX_PRIORITY)
        delay = _int(args, "delay_ms", 0, 0, q.settings.max_delay_ms) if "delay_ms" in args else 0
        self._check_dead_letters(q, 1)
        q.check_push(len(data))
        now, wall = clock or (time.monotonic_ns(), time.time_ns())
        msg_id = q.push(kind, data, priority, now, wall, delay, token=token)
        if not delay and q.name in self.waiters:
            self._wake[q.name] = q
        return self._pushed(q, msg_id, args)

    def _pushes(self, args: dict, holder: tuple, reply: Reply) -> dict:
        """Single pushes to one queue that arrived together (``pushes``: a list of push args without ``queue``, or
        the bytes of a push's data with the request's ``priority``, ``delay_ms`` and ``kind``, if any: JSON from
        ndjson_ops.push_run, raw from nats_ops), each stored or refused on its own, as if sent one by one (unlike
        a batch push's all or nothing); one call and, from another worker, one request instead of one each.
        -> ``{"ok": true, "results": [...]}``, or ``{"ok": true, "ids": [...]}`` when every one was stored."""
        q = self._pushed_to(args)
        token = self._token(args)
        clock = (time.monotonic_ns(), time.time_ns())
        options = {key: args[key] for key in _RUN_OPTIONS if key in args}
        if token is None:
            stored = self._push_run(q, args["pushes"], clock, options)
            if stored is not None:
                return stored
        results = []
        for i, item in enumerate(args["pushes"]):
            try:
                results.append(self._push_one(q, item, self._item_token(item, token, i), clock, options))
            except QueueError as exc:
                results.append(exc.result())
        return {"ok": True, "results": results}

    def _item_token(self, item: dict | bytes, token: tuple | None, i: int) -> tuple | str | None:
        """The token of the ``i``-th of single pushes that travelled together under ``token``: its own
        ``dedup_id``, or its place under the request's."""
        if type(item) is not bytes and "dedup_id" in item:
            return self._token(item)
        return token + (i,) if token is not None else None

    def _push_run(self, q: Queue, items: list[dict | bytes], clock: tuple[int, int], options: dict) -> dict | None:
        """Single pushes from this worker with one kind, priority and delay (args with data, kind and at most
        those and a ``dedup_id``; or data's bytes, with ``options``' kind, priority and delay) that all fit now:
        stored together, as one record (with each push's ``dedup_id``, if any), which is what pushing them one by
        one would have come to (each stored, in order), for less work per push.  None: not such a run (a push with
        other fields, pushes of different kinds, priorities or delays, one too large, a queue too full for all of
        them, a priority or delay out of range, a ``dedup_id`` invalid, known or named twice), for the one-by-one
        path to decide each on its own.  Pushes from another worker carry tokens, one per push under the
        request's: they go one by one."""
        s = q.settings
        datas, kind, tokens = items, options.get("kind", KIND_JSON), None
        priority, delay = options.get("priority", DEFAULT_PRIORITY), options.get("delay_ms", 0)
        sizes = [len(item) for item in items if type(item) is bytes]
        if len(sizes) != len(items):   # not all of them JSON data's bytes alone (the common case, checked at once)
            pushes = [_run_push(item, options) for item in items]
            if None in pushes:
                return None
            datas, kinds, priorities, delays, dedups = (list(column) for column in zip(*pushes))
            kind, priority, delay = kinds[0], priorities[0], delays[0]
            # one kind, priority and delay; ints alone (a True or a 1.0 equals a 1, and is refused on its own)
            if None in datas or type(kind) is not int or not all(type(v) is int for v in priorities + delays) \
                    or kinds.count(kind) + priorities.count(priority) + delays.count(delay) != 3 * len(pushes):
                return None
            named = [dedup for dedup in dedups if dedup is not None]
            if named:   # each dedup_id valid, new, and once: else each push is judged on its own
                if not all(_is_dedup_id(dedup) and q.tokens.get(dedup) is None for dedup in named) \
                        or len(set(named)) != len(named):
                    return None
                tokens = dedups
            sizes = [len(data) for data in datas]
        if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY or type(delay) is not int \
                or not 0 <= delay <= s.max_delay_ms:
            return None
        total = sum(sizes)
        if not sizes or max(sizes) > s.max_message_bytes or len(q.messages) + len(datas) > s.max_messages \
                or q.bytes + total > s.max_bytes or self._dead_letters_full(q):
            return None
        ids = q.push_data(kind, datas, priority, delay, *clock, tokens)
        if not delay and q.name in self.waiters:
            self._wake[q.name] = q
        return {"ok": True, "ids": ids}

    def _push_many(self, q: Queue, args: dict) -> dict:
        """A batch: ``messages`` is a list of ``(data, kind, priority, delay_ms)`` (priority and delay None: the
        request's own, or the defaults), or ``datas`` a list of JSON data's bytes (the request's priority and
        delay for all).  Every message is checked before any is stored, and they are stored
        together (one journal record) or not at all.  -> ``{"ok": true, "ids": [...]}`` in order."""
        token = self._token(args)
        if token is not None:
            stored = q.tokens.get(token)
            if stored is not None:  # sent again (a client's retry, a resend after a crash): one copy
                return self._repeat(q, stored, token, None)
        datas = args.get("datas")   # JSON data alone, the request's priority and delay for all (ndjson_ops)
        items = args["messages"] if datas is None else datas
        if type(items) is not list or not 1 <= len(items) <= MAX_BATCH:
            raise QueueError("invalid_messages", min=1, max=MAX_BATCH)
        priority = _int(args, "priority", DEFAULT_PRIORITY, 0, MAX_PRIORITY)
        max_delay = q.settings.max_delay_ms
        delay = _int(args, "delay_ms", 0, 0, max_delay)
        max_size = q.settings.max_message_bytes
        if datas is not None:
            sizes = [len(data) for data in datas]
            if max(sizes) > max_size:
                raise QueueError("message_too_large", max=max_size,
                                 index=next(i for i, size in enumerate(sizes) if size > max_size))
        else:
            checked = []
            sizes = []
            for i, (data, kind, p, d) in enumerate(items):
                if p is None:
                    p = priority
                elif type(p) is not int or not 0 <= p <= MAX_PRIORITY:
                    raise QueueError("invalid_priority", min=0, max=MAX_PRIORITY, index=i)
                if d is None:
                    d = delay
                elif type(d) is not int or not 0 <= d <= max_delay:
                    raise QueueError("invalid_delay", min=0, max=max_delay, index=i)
                size = len(data)
                if size > max_size:
                    raise QueueError("message_too_large", max=max_size, index=i)
                sizes.append(size)
                checked.append((kind, data, p, d))
        self._check_dead_letters(q, len(sizes))
        q.check_batch(sizes)
        now, wall = time.monotonic_ns(), time.time_ns()
        ids = q.push_many(checked, now, wall, token) if datas is None else \
            q.push_data(KIND_JSON, datas, priority, delay, now, wall, token)
        if q.name in self.waiters and q.visible:
            self._wake[q.name] = q
        return {"ok": True, "ids": ids}

    def _dead_letters_full(self, q: Queue) -> str:
        """The name of ``q``'s DLQ if it is at its bound, else "".  Dead letters are never dropped and never
        refused, so while the DLQ is full the queue takes no pushes: what the consumers end without an ack can
        only come from what the queue holds, and the two stay bounded together."""
        dlq = self.queues.get(q.dlq_name) if q.dlq_name else None
        if dlq is None:
            return ""
        s = dlq.settings
        return dlq.name if len(dlq.messages) >= s.max_messages or dlq.bytes >= s.max_bytes else ""

    def _check_dead_letters(self, q: Queue, pushes: int) -> None:
        dlq = self._dead_letters_full(q)
        if dlq:
            q.rejected += pushes
            raise QueueError("queue_full", retry=True, dlq=dlq)

    @staticmethod
    def _pushed(q: Queue, msg_id: str, args: dict) -> dict:
        """A push's result; ``report_visible`` (qlite's PUSH answers with it) adds the visible count after it."""
        if args.get("report_visible"):
            return {"ok": True, "id": msg_id, "visible": q.visible}
        return {"ok": True, "id": msg_id}

    def _recv(self, args: dict, holder: tuple, reply: Reply) -> dict | None:
        name = args.get("queue")
        q = self._look_up(name)
        settings = q.settings if q is not None else self._settings_of(name)
        count = _int(args, "max", 1, 1, MAX_BATCH)
        wait = _int(args, "wait_ms", 0, 0, MAX_WAIT_MS)
        visibility = _int(args, "visibility_ms", settings.visibility_ms, 0, settings.max_visibility_ms)
        release = args.get("release_on_close", False)
        if type(release) is not bool:   # "yes" was taken for true
            raise QueueError("invalid_release_on_close")
        user = args.get("user")
        if user is not None and not self.may_receive(user, name):
            # checked here too, at the owner: a receive still on its way when the user's permission was revoked
            raise QueueError("permission_denied")
        if q is None:   # nothing to receive: only a long poll makes the queue exist, to wait in
            if not wait:
                return {"ok": True, "messages": []}
            q = self._opened(name, args.get("party"))
        now = time.monotonic_ns()
        if q.name in self._wake:   # waiters that arrived earlier are served first: arrival order, all workers
            del self._wake[q.name]
            self._serve(q, now)
        if q.visible or not self.waiters.get(q.name):  # else earlier waiters first
            got = self._lease(q, count, visibility, release, holder, now)
            if got or not wait:
                return {"ok": True, "messages": got}
        queued = self.waiters.setdefault(q.name, collections.deque())
        if self._waiting.get(holder, 0) >= MAX_WAITERS_PER_CONNECTION or len(queued) >= MAX_WAITERS_PER_QUEUE:
            raise QueueError("too_many_waiters", retry=True)
        waiter = Waiter(reply, holder, user, count, visibility, release, now + wait * MS)
        queued.append(waiter)
        self._waiting[holder] = self._waiting.get(holder, 0) + 1
        self._holders.setdefault(holder, set()).add(q.name)
        self._wait_until(waiter.deadline, q)
        return None

    def _lease(self, q: Queue, count: int, visibility: int, release: bool, holder: tuple, now: int) -> list[tuple]:
        """-> the deliveries (``model.D_*`` tuples), in serving order."""
        out = q.lease(now, count, visibility, holder if release else None)
        if release and out:
            self._holders.setdefault(holder, set()).add(q.name)
        return out

    def _serve(self, q: Queue, now: int) -> None:
        """Visible messages and waiting receivers: the first waiter first, each served once."""
        queued = self.waiters.get(q.name)
        while queued and q.visible:
            w = queued.popleft()
            if w.done:
                continue
            if w.user is not None and not self.may_receive(w.user, q.name):
                self._finish(w, [], DENIED)   # revoked while it waited (recheck_waiters answers the others)
            else:   # noted: a failed journal write puts it back (_write_failed)
                self._served.append((q.name, w, self._finish(w, self._lease(q, w.max, w.visibility, w.release,
                                                                            w.holder, now))))
        if queued is not None and not queued:
            del self.waiters[q.name]

    def _finish(self, w: Waiter, messages: list[dict], error: dict | None = None) -> dict:
        w.done = True
        left = self._waiting[w.holder] - 1
        if left:
            self._waiting[w.holder] = left
        else:
            del self._waiting[w.holder]
        result = {"ok": True, "messages": messages} if error is None else dict(error)
        self._answer(w.reply, result)
        return result

    def recheck_waiters(self) -> None:
        """Users or permissions changed: receivers waiting that may no longer receive from their queue are told
        ``permission_denied`` now, before the change is acknowledged ("in force at once")."""
        for name, queued in list(self.waiters.items()):
            for w in queued:
                if not w.done and w.user is not None and not self.may_receive(w.user, name):
                    self._finish(w, [], DENIED)

    def _expire_waiters(self, name: str, now: int) -> None:
        queued = self.waiters.get(name)
        if not queued:
            return
        keep = collections.deque()
        for w in queued:
            if w.done:
                continue
            if w.deadline <= now:
                self._finish(w, [])
            else:
                keep.append(w)
        if keep:
            self.waiters[name] = keep
        else:
            del self.waiters[name]


    def _existing(self, args: dict) -> Queue:
        q = self._look_up(args.get("queue"))
        if q is None:  # a valid name with nothing in it: no receipt of it can be known
            raise QueueError("unknown_receipt")
        return q

    def _ack(self, args: dict, holder: tuple, reply: Reply) -> dict:
        many = args.get("receipts")
        if many is None:
            receipt = args.get("receipt")
            if canonical_receipt(receipt) is None:
                raise QueueError("invalid_receipt")
            many = [receipt]
        elif type(many) is not list or not 1 <= len(many) <= MAX_BATCH:
            raise QueueError("invalid_receipts", max=MAX_BATCH)
        q = self._existing(args)
        now = time.monotonic_ns()
        results = q.ack_many(many, now)
        if q.dead or q.visible:
            self._settle(q, now)
        if "receipts" in args:
            return {"ok": True, "results": results}
        return dict(results[0])

    def _one(self, args: dict) -> tuple[Queue, str, int]:
        receipt = canonical_receipt(args.get("receipt"))
        if receipt is None:
            raise QueueError("invalid_receipt")
        return self._existing(args), receipt, time.monotonic_ns()

    def _extend(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q, receipt, now = self._one(args)
        deadline = q.extend(receipt, now, args.get("visibility_ms"))  # none given: the lease's own again
        self._settle(q, now)
        return {"ok": True, "deadline_in_ms": max(0, (deadline - now) // MS)}

    def _nack(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q, receipt, now = self._one(args)
        went = q.nack(receipt, now, args.get("delay_ms", 0) or 0)
        self._settle(q, now)
        return {"ok": True, "state": went}

    def _dead(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q, receipt, now = self._one(args)
        q.terminate(receipt, now)
        self._settle(q, now)
        return {"ok": True}

    def _stat(self, args: dict, holder: tuple, reply: Reply) -> dict:
        name = args.get("queue")
        q = self._look_up(name)
        if q is None:
            q = self._new(name)  # an unknown valid name reads as an empty queue, which is not kept
        if args.get("brief"):  # the counts only, in O(1) (qlite's LEN): no scan for the oldest message
            return {"ok": True, "stat": {"queue": q.name, "visible": q.visible, "in_flight": q.in_flight,
                                         "delayed": q.delayed, "messages": len(q.messages)}}
        return {"ok": True, "stat": self._stat_of(q, time.time_ns())}

    def _stat_of(self, q: Queue, wall: int) -> dict:
        stat = q.stat(wall)
        stat["waiters"] = sum(1 for w in self.waiters.get(q.name, ()) if not w.done)
        stat["owner"] = self.index
        return stat

    def _purge(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q = self.queue(args.get("queue"))
        return {"ok": True, "purged": q.purge()}

    def _redrive(self, args: dict, holder: tuple, reply: Reply) -> dict:
        """Move dead letters back: from ``queue`` (a DLQ) to ``to``, by default the queue it belongs to (``<queue>``
        of ``<queue>.dlq``, placed here with it).  A ``to`` placed on another worker is refused: taking messages
        here and pushing them there could lose them in between."""
        src = self.queue(args.get("queue"))
        if not is_dlq(src.name):
            raise QueueError("not_a_dlq")
        target_name = args.get("to") or src.name[:-len(DLQ_SUFFIX)]
        if not self.owns(target_name):
            raise QueueError("target_elsewhere")  # docs/queues.md: redrive to the source, or a queue placed with it
        target = self.queue(target_name)
        count = _int(args, "max", MAX_BATCH, 1, 1_000_000)
        # no more than the target can take: a redrive never overfills a queue
        room_bytes = target.settings.max_bytes - target.bytes
        count = min(count, target.settings.max_messages - len(target.messages))
        picked = []
        for msg in src.peek_visible(count):
            room_bytes -= len(msg[DATA])
            if room_bytes < 0:
                break
            picked.append(msg)
        now, wall = time.monotonic_ns(), time.time_ns()
        moved = src.take(picked)
        for msg in moved:
            target.push(msg[KIND], msg[DATA], msg[PRIORITY], now, wall, 0, msg_id=msg[ID],
                        enqueued_at=msg[ENQUEUED], redriven=msg[REDRIVEN] + 1)
        self._settle(target, now)
        return {"ok": True, "moved": len(moved)}

    # -- dead letters and holders ---------------------------------------------------------------------------
    def _settle(self, q: Queue, now: int) -> None:
        """Move what ``q`` dead-lettered to its DLQ, and give freed messages to waiters."""
        if q.dead:
            dead, q.dead = q.dead, []
            # A DLQ's own dead letters (qdead there) stay in it, visible again: never dropped.
            dlq = q if is_dlq(q.name) else self.queue(q.name + DLQ_SUFFIX)
            wall = time.time_ns()
            for msg, deliveries, reason in dead:
                dlq.push(msg[KIND], msg[DATA], msg[PRIORITY], now, wall, 0, msg_id=msg[ID],
                         enqueued_at=msg[ENQUEUED], deliveries=deliveries, reason=reason,
                         source=msg[SOURCE] if dlq is q else q.name)
            if dlq is not q and dlq.visible and dlq.name in self.waiters:
                self._wake[dlq.name] = dlq
        if q.visible and q.name in self.waiters:
            self._wake[q.name] = q

    def drop_holder(self, holder: tuple) -> None:
        """The connection ``holder`` closed: its waiters go, and its release-on-close leases come back."""
        names = self._holders.pop(holder, ())
        now = time.monotonic_ns()
        for name in names:
            for w in self.waiters.get(name, ()):
                if w.holder == holder and not w.done:
                    self._finish(w, [])  # nobody reads it; the asking worker forgets the request
            q = self.queues.get(name)
            if q is not None and q.release_holder(holder):
                self._settle(q, now)
        if names:
            self._schedule_flush()

    def drop_worker(self, worker: int) -> None:
        """Worker ``worker`` died: every connection it held is gone."""
        for holder in [h for h in self._holders if h[0] == worker]:
            self.drop_holder(holder)

    # -- start-up and housekeeping --------------------------------------------------------------------------
    def replay(self) -> int:
        """Rebuild the queues from the journal (a replaced worker): leases resume with their remaining time,
        and whatever fell due while the worker was down is handled now.  -> records replayed."""
        count = 0
        clock = None
        run_name, run = "", []   # plain single pushes in a row to one queue, stored together (as ``pushes``)
        for name, record in self.journal.replay():
            count += 1
            # A push with no delay, no deliveries and no token is its message tuple stored, and a row of them (to
            # one queue, numbers rising, as pushes journal them) is a batch push's: one ``_store`` for the row
            # instead of one per record, which was most of a journal of single pushes' replay time.
            if record[0] == "push" and len(record) == 13 and not record[7] and not record[8] \
                    and record[12] is None and type(record[4]) is bytes and name:
                if name != run_name or (run and record[1] <= run[-1][0]):
                    if run:
                        self._replay_record(run_name, ("pushes", None, run, None))
                    run_name, run = name, []
                run.append(record[1:7] + record[9:12])
                continue
            if run:
                self._replay_record(run_name, ("pushes", None, run, None))
                run_name, run = "", []
            if not name:  # the shard's own: the clock the deadlines were taken on
                clock = record if record[0] == "clock" else clock
                continue
            self._replay_record(name, record)
        if run:
            self._replay_record(run_name, ("pushes", None, run, None))
        if clock is not None and clock[1] != _boot_id():
            self._rebase(clock)
        now = time.monotonic_ns()
        for q in self.queues.values():
            q.dead.clear()   # their DLQ pushes are records of their own, replayed already
            q.due_at = 0
            nxt = q.expire(now)
            if nxt:
                q._at(nxt)
            self._settle(q, now)
        if count:
            try:
                if clock is not None and clock[1] != _boot_id():
                    self.compact(force=True)   # the old boot's deadlines must not be replayed again: rewrite now
                else:   # while serving, a batch at a time
                    self.journal.commit()
                    self._start_rewrite()
            except OSError as exc:   # a full disk: the journal stays as it was, and the worker starts all the same
                log.error("work-queue journal: compaction at start failed: %s; the journal is kept as it is",
                          exc.strerror or exc)
                self._compact_after = time.monotonic() + _COMPACT_BACKOFF_S
        else:
            self.journal.append("", _clock())
        return count

    def _replay_record(self, name: str, record: tuple) -> None:
        try:
            self.queue(name).apply(record)
        except (KeyError, ValueError, TypeError) as exc:
            log.error("journal record %r of queue %r not applicable (%s); skipped", record[:2], name, exc)

    def _rebase(self, clock: tuple) -> None:
        """The journal was written before a reboot (a kept ``data_dir``): its monotonic deadlines mean nothing
        now.  Leases end (their messages visible again, deliveries kept: nobody can still hold them); delayed
        messages keep the wall-clock time they had left."""
        _, _, then_mono, then_wall = clock
        now_mono, now_wall = time.monotonic_ns(), time.time_ns()
        for q in self.queues.values():
            for receipt in list(q.leases):
                q.apply(("requeue", receipt, 0))
            # the time a delayed message had left when the journal was written, by the wall clock since
            q.rebase_delays(lambda ready_at: ready_at - then_mono - (now_wall - then_wall), now_mono)
        log.warning("worker %d: queues journaled before a reboot: their leases ended, delays carried over by the "
                    "wall clock", self.index)

    def compact(self, force: bool = False) -> None:
        """Rewrite the journal as the live state once it is large and mostly records of what is gone: a batch at
        a time while serving (``_rewrite_step``), at once when ``force``d (at start)."""
        journal = self.journal
        if journal.dirty:
            if not force:   # the turn's flush writes it (or it waits for a disk with room): compact next time
                return
            journal.commit()
        if journal.rewriting and not force:   # under way: its steps go on, and the turn it is written ends it
            return
        live = sum(q.bytes + 96 * (len(q.messages) + len(q.leases)) for q in self.queues.values())
        if force:
            journal.rewrite(self._snapshot())
            self.compactions += 1
        elif journal.size - live >= _COMPACT_DEAD and live * 2 < journal.size:
            self._start_rewrite()

    def _snapshot(self) -> Iterator[list[tuple[str, tuple]]]:
        """The live state as batches of journal records, taken now (``Queue.snapshot``), read as they are written."""
        return _named_batches(_clock(), [(q.name, q.snapshot()) for q in self.queues.values()])

    def _start_rewrite(self) -> None:
        """Compact while serving: one batch of the state as it is now per turn of the event loop, in between."""
        self.journal.start_rewrite(self._snapshot())
        self._schedule_flush()   # its steps: turn_done

    def turn_done(self) -> None:
        """The turn's replies are out (the hub's flush): the compaction under way writes its next batch now, or is
        put in place once written.  Done before the replies, a batch (``model.SNAPSHOT_RUN`` messages, a fraction
        of a millisecond) would hold back the replies of every turn the rewrite takes."""
        journal = self.journal
        if not journal.rewriting:
            return
        if journal.rewrite_unwritten:
            self._rewrite_step()
        elif journal.rewrite_written:
            self._finish_rewrite()

    def _rewrite_step(self) -> None:
        journal = self.journal
        try:
            if not journal.rewrite_step():
                if journal.rewriting:
                    self._schedule_flush()   # the next batch at the next turn's end, whether or not clients ask
                return
            flush = journal.rewrite_flush()
        except Exception as exc:   # a full disk; or a record that cannot be encoded (a bug): the journal is kept
            self._compaction_failed(exc)
            return
        assert flush is not None   # written just now, so not yet flushed
        # In a thread: the copy of what the journal gained meanwhile, an fsync that may take seconds, a writeback
        # that renaming would otherwise do in the loop (~50 ms).  Then the next turn's end puts it in place
        # (_rewrite_flushed, turn_done).
        self.loop.run_in_executor(None, flush).add_done_callback(self._rewrite_flushed)

    def _rewrite_flushed(self, done: asyncio.Future) -> None:
        if done.cancelled():       # the worker is stopping
            return
        exc = done.exception()
        if exc is not None:
            self.journal.abort_rewrite()
            self._compaction_failed(exc)
            return
        self._schedule_flush()

    def _finish_rewrite(self) -> None:
        journal = self.journal
        before = journal.size
        try:
            journal.finish_rewrite()
        except OSError as exc:
            self._compaction_failed(exc)
            return
        self.compactions += 1
        log.debug("worker %d: journal compacted while serving: %d bytes, was %d", self.index, journal.size, before)

    def _compaction_failed(self, exc: Exception) -> None:
        self._compact_after = time.monotonic() + _COMPACT_BACKOFF_S
        log.error("work-queue journal: compaction failed: %s; the journal is kept as it is, next try in %d s",
                  getattr(exc, "strerror", None) or exc, _COMPACT_BACKOFF_S)

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
        remembered goes with it (receipts acked, push tokens), which it keeps for history.SECONDS anyway."""
        self._forget_at = time.monotonic() + self.forget_idle_s
        idle, self._idle = self._idle, {}
        forgotten = 0
        for name, q in list(self.queues.items()):
            if q.messages or q.dead or name in self.waiters or name in self.configured:
                continue
            activity = q.activity()
            if idle.get(name) == activity:
                del self.queues[name]
                self._gone(name)
                forgotten += 1
            else:
                self._idle[name] = activity
        if forgotten:
            self.queues_forgotten += forgotten
            log.debug("worker %d: forgot %d idle queue(s)", self.index, forgotten)

    def stats(self, name: str | None = None) -> list[dict]:
        """``qstat`` of every queue here (or of ``name``), for /queuez."""
        wall = time.time_ns()
        return [self._stat_of(q, wall) for q in self.queues.values() if not name or q.name == name]


def _named_batches(clock: tuple, snapshots: list[tuple[str, Iterator[list[tuple]]]]
                   ) -> Iterator[list[tuple[str, tuple]]]:
    yield [("", clock)]
    for name, batches in snapshots:
        for batch in batches:
            yield [(name, record) for record in batch]


_OPS: dict[str, Callable] = {op.name: getattr(Shard, "_" + op.name) for op in OPERATIONS}
