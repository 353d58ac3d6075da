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

Rooms.  ``Shard`` is one object over one state (``__init__``): this room holds that state, the queue table (a
queue's creation, placement and limits) and the entry point with its dispatch, which reads the table of operations
(``operations.OPERATIONS``: ``handle`` runs ``Shard._<name>``).  The rest are mixins, one room per family:
``shard_push`` (push, pushes), ``shard_receive`` (recv, long polls, holders), ``shard_settle`` (ack, extend, nack,
dead; dead letters to the DLQ), ``shard_admin`` (stat, purge, redrive), ``shard_commit`` (the turn's commit, replies,
a failed write), ``shard_timer`` (the timer, the tick), ``shard_replay`` (replay, compaction); what they share is
``shard_requests``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable

from shardbroker.router.subjects import is_valid_literal
from shardbroker.workers.tally import Tally
from shardbroker.workers.workqueues.journal import Journal
from shardbroker.workers.workqueues.model import Queue
from shardbroker.workers.workqueues.operations import OPERATIONS
from shardbroker.workers.workqueues.rules import DLQ_SUFFIX, QueueError, Settings, is_dlq
from shardbroker.workers.workqueues.shard_admin import Administration
from shardbroker.workers.workqueues.shard_commit import Committing
from shardbroker.workers.workqueues.shard_push import Pushing
from shardbroker.workers.workqueues.shard_receive import Receiving, Waiter
from shardbroker.workers.workqueues.shard_replay import Replaying
from shardbroker.workers.workqueues.shard_requests import Reply
from shardbroker.workers.workqueues.shard_settle import Settling
from shardbroker.workers.workqueues.shard_timer import FORGET_IDLE_S, Timing


class Shard(Pushing, Receiving, Settling, Administration, Committing, Timing, Replaying):
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
        # queue -> (its activity when a sweep first found it idle, when that was)
        self._idle: dict[str, tuple[tuple, float]] = {}
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


# The dispatch: each row of the table of operations runs ``Shard._<name>``, wherever its family's room defines it
# (a row with no handler fails here, at import).
_OPS: dict[str, Callable] = {op.name: getattr(Shard, "_" + op.name) for op in OPERATIONS}
