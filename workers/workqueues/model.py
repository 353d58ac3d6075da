"""One work queue as a state machine: messages, leases, receipts and counts, with no I/O and no clock of its own.

A message moves delayed → visible → leased → acked, or back to visible (the lease expired, a nack), or to the
dead-letter queue.  The shard that owns the queue (``shard``) drives it: it passes ``now`` (monotonic ns) into
every call, keeps one timer for all its queues, journals every change, and answers clients.  Replaying a journal
calls the same methods with the recorded values, so a queue rebuilt after a crash is the queue that was.

Decisions (``docs/queues.md`` has them for users; ``shared/reference/work-queues.md`` §4 the reasons):
- Every lease has a fresh receipt (16 random bytes from the OS's CSPRNG, text form base64url).  Only the current
  receipt of a message may ack, extend, nack or dead-letter it; an earlier one gets ``lease_lost``, a repeated ack
  ``already_acked``, a receipt of a purged lease ``purged``, and one never issued (or long forgotten)
  ``unknown_receipt``.
- Visible messages are served by priority (9 first), then by sequence number, so a redelivered message goes back
  near the head, where it was, not behind everything pushed since.
- ``max_deliveries = N`` means at most N leases: when the N-th ends without an ack (expiry, nack), the message
  goes to ``<queue>.dlq`` with its id, enqueue time and delivery count, never dropped.
- Counts are exact, and bounds are checked before anything changes: a full queue rejects, it never trims.

Representation.  A queue may hold a million messages, so what it keeps per message is chosen for the cost per
message and for the garbage collector: a message is a tuple of atomic values (``SEQ`` … ``REDRIVEN``), which the
collector stops tracking at its first pass and never walks again (a message object per message, with its heap
entry, made every full collection walk millions of objects: 0.4 s with a million queued).  What changes during a
message's life is in flat maps by sequence number: ``deliveries``, ``leased`` (seq -> receipt), ``delay_at``
(seq -> due time); the visible messages are FIFOs of ints per priority (``ready.Ready``), and a lease is a tuple
``(seq, granted, deadline, visibility_ms, holder)`` under its receipt's text.  Receives and acks of many messages
are one journal record each (``leases``, ``acks``), as are batch pushes (``pushes``; ``pushcol`` where the
messages share a kind and a priority and have no delay: its data and ids as columns, a list and one string, which
``marshal`` writes in a quarter of the time a tuple per message takes).

Rooms.  ``Queue`` is one object, in three rooms: this one holds its state, its records (``apply``), the store, time
and administration; ``queue_pushes`` what a push does and ``queue_leases`` what a lease is, from a receive to its
end (mixins).  Around it: ``ready`` (the visible messages in serving order), ``receipts`` (receipts and ids),
``queue_snapshot`` (the records of a compaction), and below everything ``messages`` (the tuples and their fields)
and ``rules`` (``Settings``, ``QueueError``, the DLQ's name).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from shardbroker.workers.workqueues import core
from shardbroker.workers.workqueues.attempts import Attempts
from shardbroker.workers.workqueues.history import History
from shardbroker.workers.workqueues.messages import DATA, ENQUEUED, ID, L_DEADLINE, L_SEQ, MS, PRIORITY, SEQ
from shardbroker.workers.workqueues.queue_leases import DEADLINES_SLACK, Leases
from shardbroker.workers.workqueues.queue_pushes import Pushes
from shardbroker.workers.workqueues.queue_snapshot import LIMBO, snapshot_batches
from shardbroker.workers.workqueues.ready import Ready
from shardbroker.workers.workqueues.receipts import ID_CHARS, record_text
from shardbroker.workers.workqueues.rules import DLQ_SUFFIX, Settings, is_dlq


class Queue(Pushes, Leases):
    """One queue.  Every change is a record (a tuple, first item its kind): applied here and handed to ``journal``
    (the shard's), so replaying the records rebuilds the queue exactly (``apply``).  Decisions (which message,
    dead-letter or not) are made before the record, never while applying it.  The busiest records (``push``,
    ``pushes``, ``leases``, ``acks``) are applied by the live path directly (the same helpers as ``apply``, minus
    finding what the live path has in hand) and then journaled."""

    def __init__(self, name: str, settings: Settings, schedule: Callable[[int, Queue], None],
                 journal: Callable[[str, tuple], None]) -> None:
        self.name = name
        self.dlq_name = "" if is_dlq(name) else name + DLQ_SUFFIX   # where its dead letters go ("": itself)
        self.settings = settings
        self._schedule = schedule        # (monotonic ns, queue): look at this queue again then (the shard's timer)
        self._journal = journal          # (queue name, record)
        self.due_at = 0                  # the earliest time the shard was asked to look here (0: nothing pending)
        self.messages: dict[int, tuple] = {}         # every live message (visible, delayed, leased) by seq
        self._ready = Ready()                       # visible messages' seqs, in serving order
        self._delayed: list[tuple[int, int]] = []    # (ready_at, seq); stale entries skipped
        self.delay_at: dict[int, int] = {}           # seq -> when a delayed message becomes visible
        self.deliveries: dict[int, int] = {}         # seq -> leases so far (absent: none)
        self.leases: dict[str, tuple] = {}           # receipt -> (seq, granted, deadline, visibility_ms, holder)
        self.leased: dict[int, str] = {}             # seq -> the receipt of its lease
        self._deadlines: list[tuple[int, tuple]] = []    # (deadline, receipts); stale entries skipped
        self._deadline_refs = 0                          # receipts named in _deadlines, stale ones included
        # receipt -> (what became of its lease other than an ack, the message's seq, its deliveries then): no
        # message kept, so its data is freed at once
        self._recent = History()   # kept for history.SECONDS, at most history.LIMIT (workers/workqueues/history.py)
        # acked receipts, a batch of acks at a time (``History.add``), apart from the other fates: an expiry sets
        # an entry in ``_recent``, which would make a shared history settle the acks' batches each time
        self._acks = History()
        self.dead: list[tuple[tuple, int, str]] = []   # (message, deliveries, reason) for the shard to push to the DLQ
        self.tokens = History(seconds=settings.dedup_window_s)    # push token -> id(s), queues.dedup_window
        self.attempts = Attempts()   # receives named by an attempt id, and their leases (attempts.py)
        self.next_seq = 1
        self.bytes = 0
        self.pushed = self.delivered = self.redelivered = self.acked = self.nacked = self.dead_lettered = 0
        self.expired = self.extended = self.stale_receipts = self.duplicate_acks = self.rejected = 0
        self.duplicate_pushes = 0   # messages not stored again: their push's dedup_id named one stored before

    # -- counts ---------------------------------------------------------------------------------------------
    @property
    def visible(self) -> int:
        return self._ready.count

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    @property
    def delayed(self) -> int:
        return len(self.messages) - self._ready.count - len(self.leases)

    def activity(self) -> tuple:
        """What changes with anything done to the queue (a push, a receive, an ack, a nack, an expiry, a stale
        or repeated receipt...): equal twice, nothing was done in between."""
        return (self.next_seq, self.delivered, self.acked, self.nacked, self.expired, self.extended,
                self.dead_lettered, self.stale_receipts, self.duplicate_acks, self.rejected, self.duplicate_pushes,
                len(self.messages))

    def state(self, seq: int) -> str:
        """Where message ``seq`` is: "visible", "delayed" or "leased" (tests, tools)."""
        if seq in self.leased:
            return "leased"
        return "delayed" if seq in self.delay_at else "visible"

    # -- the shard's timer ------------------------------------------------------------------------------------
    def _at(self, when: int) -> None:
        """Something here falls due at ``when``: have the shard look then, unless it looks earlier already."""
        if not self.due_at or when < self.due_at:
            self.due_at = when
            self._schedule(when, self)

    # -- records --------------------------------------------------------------------------------------------
    def _do(self, record: tuple) -> None:
        self.apply(record)
        self._journal(self.name, record)

    def apply(self, record: tuple) -> None:
        kind = record[0]
        if kind == "pushcol":
            _, token, seq, ids, data_kind, datas, priority, wall = record
            ids = [ids[i:i + ID_CHARS] for i in range(0, len(ids), ID_CHARS)]
            if token is not None:
                self._tokens(token, ids)
            self._store_run(seq, ids, data_kind, datas, priority, wall)
        elif kind == "tokens":   # a compaction's: the pushes' tokens still remembered, which outlive the messages
            for token, ids in record[1]:
                self._token(token, ids)
        elif kind == "pushes":
            _, token, messages, ready_ats = record
            if token is not None:
                self._tokens(token, [m[ID] for m in messages])
            self._store(messages, ready_ats)
        elif kind == "push":
            (_, seq, msg_id, data_kind, data, priority, enqueued_at, ready_at, deliveries, reason, source,
             redriven, token) = record
            if token is not None:
                self._token(token, msg_id)
            if deliveries:
                self.deliveries[seq] = deliveries
            self._store([(seq, msg_id, data_kind, data, priority, enqueued_at, reason, source, redriven)],
                        [ready_at] if ready_at else None)
        elif kind == "leases":
            _, seqs, receipts, granted, deadline, visibility = record
            for seq in seqs:
                self._unready(seq)
            self._grant(seqs, [record_text(r) for r in receipts], granted, deadline, visibility, None)
        elif kind == "lease":          # one lease (journal snapshots, and journals from before ``leases``)
            _, seq, receipt, granted, deadline, visibility = record[:6]
            self._unready(seq)
            self._grant((seq,), [record_text(receipt)], granted, deadline, visibility, None)
        elif kind == "acks":
            self._acked(record[1])
        elif kind == "ack":
            self._acked((record_text(record[1]),))
        elif kind == "deadline":
            _, receipt, deadline = record
            receipt = record_text(receipt)
            lease = self.leases[receipt]
            self.leases[receipt] = (lease[0], lease[1], deadline, lease[3], lease[4])
            heapq.heappush(self._deadlines, (deadline, (receipt,)))
            self._deadline_refs += 1
            if self._deadline_refs > 2 * len(self.leases) + DEADLINES_SLACK:
                self._compact_deadlines()
            self._at(deadline)
        elif kind == "requeue":
            _, receipt, ready_at = record
            receipt = record_text(receipt)
            seq = self._end_lease(receipt, "lost")
            self._make_ready(seq, ready_at)
        elif kind == "dead":
            _, seq, reason = record
            receipt = self.leased.get(seq)
            if receipt is not None:
                self._end_lease(receipt, "lost")
            else:
                self._unready(seq)
            deliveries = self.deliveries.get(seq, 0)
            msg = self._drop(seq)
            self.dead_lettered += 1
            self.dead.append((msg, deliveries, reason))
        elif kind == "take":
            taken = {seq for seq in record[1] if seq in self.messages}
            self._ready.discard(taken)
            for seq in taken:
                self.delay_at.pop(seq, None)
                self._drop(seq)
        elif kind == "purge":
            for receipt, lease in self.leases.items():
                self._remember(receipt, "purged", lease[L_SEQ])
            self.messages.clear()
            self._ready.clear()
            self._delayed.clear()
            self.delay_at.clear()
            self.deliveries.clear()
            self.leases.clear()
            self.leased.clear()
            self._deadlines.clear()
            self._deadline_refs = 0
            self.bytes = 0
        else:
            raise ValueError(f"unknown queue record {kind!r}")

    def _token(self, token: tuple, ids: object) -> None:
        tokens = self.tokens
        tokens[token] = ids

    def _tokens(self, token: tuple | str | list, ids: list[str]) -> None:
        """The token of a record of several messages: a batch's (one for all of them), or a list of single pushes'
        own, one per message (None: that push has none)."""
        if type(token) is not list:
            self._token(token, tuple(ids))
            return
        for one, msg_id in zip(token, ids):
            if one is not None:
                self._token(one, msg_id)

    def _store(self, messages: list, ready_ats: list | None) -> None:
        """New messages (tuples, in increasing sequence order, as every record lists them), visible or
        (``ready_ats``, per message, 0: visible) delayed."""
        size = core.store_put(self.messages, messages)
        if ready_ats is None:
            self._ready.extend([msg[0] for msg in messages], [msg[4] for msg in messages])
        else:
            for msg, ready_at in zip(messages, ready_ats):
                self._make_ready(msg[0], ready_at)
        seq = messages[-1][0]
        if seq >= self.next_seq:
            self.next_seq = seq + 1
        self.bytes += size
        self.pushed += len(messages)

    def _store_run(self, seq: int, ids: list[str], kind: int, datas: list[bytes], priority: int, wall: int) -> None:
        """New visible messages of one kind and priority, sequence numbers from ``seq`` on (``pushcol``): what
        ``_store`` would store, made and stored in one compiled loop (``core.store_run``)."""
        n = len(datas)
        if not n:
            return
        self.bytes += core.store_run(self.messages, seq, ids, kind, datas, priority, wall)
        self._ready.extend_run(range(seq, seq + n), priority)
        if seq + n > self.next_seq:
            self.next_seq = seq + n
        self.pushed += n

    def _make_ready(self, seq: int, ready_at: int) -> None:
        if ready_at:
            self.delay_at[seq] = ready_at
            if ready_at == LIMBO:   # a journal snapshot's leased message: its lease record comes next
                return
            heapq.heappush(self._delayed, (ready_at, seq))
            self._at(ready_at)
        else:
            self._ready.add(seq, self.messages[seq][PRIORITY])

    def _unready(self, seq: int) -> None:
        """Take a visible or delayed message out of its heap (replay, redrive, dead-lettering; the live receive
        pops the heap itself)."""
        if self.delay_at.pop(seq, 0):
            return   # its entry in _delayed is now stale and is skipped when it comes due
        self._ready.remove(seq, self.messages[seq][PRIORITY])

    def _drop(self, seq: int) -> tuple:
        msg = self.messages.pop(seq)
        self.deliveries.pop(seq, None)
        self.bytes -= len(msg[DATA])
        return msg

    # -- time -----------------------------------------------------------------------------------------------
    def expire(self, now: int) -> int:
        """Make due delayed messages visible and lapse expired leases.  -> when to look next (0: nothing
        pending)."""
        delayed = self._delayed
        delay_at = self.delay_at
        while delayed and delayed[0][0] <= now:
            ready_at, seq = heapq.heappop(delayed)
            if delay_at.get(seq) == ready_at:
                del delay_at[seq]
                self._ready.add(seq, self.messages[seq][PRIORITY])
        deadlines = self._deadlines
        leases = self.leases
        while deadlines and deadlines[0][0] <= now:
            deadline, receipts = heapq.heappop(deadlines)
            self._deadline_refs -= len(receipts)
            for receipt in receipts:
                lease = leases.get(receipt)
                if lease is not None and lease[L_DEADLINE] == deadline:
                    self.expired += 1
                    self._release(receipt, lease, 0)
        due = [heap[0][0] for heap in (delayed, deadlines) if heap]
        return min(due) if due else 0

    def rebase_delays(self, left: Callable[[int], int], now: int) -> None:
        """Give every delayed message a new due time, ``left(old due time)`` ns from ``now`` (a journal replayed
        after a reboot, whose monotonic times mean nothing now): due already, it is visible at once."""
        self._delayed.clear()
        for seq, ready_at in list(self.delay_at.items()):
            if ready_at == LIMBO:
                continue
            del self.delay_at[seq]
            remaining = left(ready_at)
            self._make_ready(seq, now + remaining if remaining > 0 else 0)

    # -- administration -------------------------------------------------------------------------------------
    def purge(self) -> int:
        """Everything goes at once: visible, delayed and leased.  A later ack of a purged lease is ``purged``."""
        count = len(self.messages)
        self._do(("purge",))
        return count

    def peek_visible(self, limit: int) -> list[tuple]:
        """Up to ``limit`` visible messages, in serving order, left where they are."""
        store = self.messages
        return [store[seq] for seq in self._ready.peek(limit)]

    def take(self, messages: list[tuple]) -> list[tuple]:
        """Remove these visible messages (a redrive takes them from a DLQ)."""
        if messages:
            self._do(("take", [msg[SEQ] for msg in messages]))
        return messages

    def snapshot(self) -> Iterator[list[tuple]]:
        """The records that rebuild this queue as it is now (journal compaction), in batches of ``SNAPSHOT_RUN``
        messages or about ``SNAPSHOT_BYTES`` of their data (``queue_snapshot``).  The state is taken now, the
        messages themselves (tuples, never changed) and copies of the maps that change, so the batches may be written
        over many turns while the queue goes on changing (``Journal.start_rewrite``).  Then the push tokens still
        remembered (``tokens`` records): a client's retry with its ``dedup_id``, or a worker's resend after a crash,
        must find its first copy after a compaction and a crash as before them, though the message may be long
        gone."""
        tokens = self.tokens.items()
        return snapshot_batches(list(self.messages.values()), dict(self.leased), dict(self.leases),
                                dict(self.deliveries), dict(self.delay_at), tokens)

    def stat(self, wall: int) -> dict:
        store = self.messages
        oldest = min((store[seq][ENQUEUED] for seq in self._ready.seqs()), default=0)
        return {
            "queue": self.name, "visible": self.visible, "in_flight": self.in_flight, "delayed": self.delayed,
            "messages": len(self.messages), "bytes": self.bytes,
            "oldest_visible_age_ms": (wall - oldest) // MS if oldest else 0,
            "pushed": self.pushed, "delivered": self.delivered, "redelivered": self.redelivered,
            "acked": self.acked, "nacked": self.nacked, "expired": self.expired, "extended": self.extended,
            "dead_lettered": self.dead_lettered, "stale_receipts": self.stale_receipts,
            "duplicate_acks": self.duplicate_acks, "rejected": self.rejected, "duplicate_pushes": self.duplicate_pushes,
        }
