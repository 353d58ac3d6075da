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
(seq -> due time); the visible messages are FIFOs of ints per priority (``_Ready``), and a lease is a tuple
``(seq, granted, deadline, visibility_ms, holder)`` under its receipt's text.  Receives and acks of many messages
are one journal record each (``leases``, ``acks``), as are batch pushes (``pushes``; ``pushcol`` where the
messages share a kind and a priority and have no delay: its data and ids as columns, a list and one string, which
``marshal`` writes in a quarter of the time a tuple per message takes).
"""

from __future__ import annotations

import base64
import collections
import heapq
import itertools
import operator
import os
from dataclasses import dataclass
from typing import Callable, Iterator

from shardbroker.workers.workqueues import core
from shardbroker.workers.workqueues.history import History

MS = 1_000_000  # ns
MAX_PRIORITY = 9
DLQ_SUFFIX = ".dlq"
# The lease deadlines' heap keeps an entry until its deadline even when the lease ended long before (acked: the
# usual case).  Once the receipts its entries name are more than twice the live leases plus this, the heap is
# rebuilt with the live ones only: its size follows the leases held, not the ack rate times the visibility timeout
# (measured before: 80 B per message acked within its visibility timeout, 30 s by default, up to 12 h).
_DEADLINES_SLACK = 1024

# A message: (seq, id, kind, data, priority, enqueued_at, dead_reason, source, redriven).
SEQ, ID, KIND, DATA, PRIORITY, ENQUEUED, REASON, SOURCE, REDRIVEN = range(9)
# A lease: (seq, granted, deadline, visibility_ms, holder) under its receipt (text).
L_SEQ, L_GRANTED, L_DEADLINE, L_VISIBILITY, L_HOLDER = range(5)
# A delivery, what a receive hands the protocol: (id, receipt, kind, data, deliveries, priority, enqueued_at_ms,
# dead_reason, source).  Plain tuples: they cross between workers with marshal, and nothing is built per field.
D_ID, D_RECEIPT, D_KIND, D_DATA, D_DELIVERIES, D_PRIORITY, D_ENQUEUED, D_REASON, D_SOURCE = range(9)

_LIMBO = -1                      # delay_at of a journal snapshot's leased message until its lease record
# A batch of a journal snapshot (one step of a rewrite while serving): this many messages, or about this much of
# their data.  ~0.04 ms a batch of 128-byte messages: a step runs at the end of a turn, and a request that arrives
# meanwhile waits for it (1,024 a batch: ~0.16 ms; scripts/serving_latency.py --during compaction).
SNAPSHOT_RUN = 256
SNAPSHOT_BYTES = 1 << 18
SNAPSHOT_PUSHCOL = 8             # runs of messages pushed together this long or longer: pushcol records


_NO_RUNS: tuple = ()   # a priority's FIFO of runs until it gets one (``_Ready``)


def _append_run(fifo: collections.deque[range], run: range) -> None:
    """``run`` (numbers after all of the FIFO's) at the FIFO's end: one run with the last if it continues it."""
    if fifo and fifo[-1].stop == run.start:
        fifo[-1] = range(fifo[-1].start, run.stop)
    else:
        fifo.append(run)


class _Ready:
    """The visible messages' sequence numbers in serving order: priority 9 first, then by sequence number.

    Per priority, a FIFO of the sequence numbers that arrived in increasing order (new pushes: nearly all of them;
    taking from it is O(1), where a heap of a million entries cost half a microsecond a message), and a heap of
    those that did not (a message coming back after a lease or a delay keeps its place near the head).  The next
    message of a priority is the smaller of the two heads.

    The FIFO holds runs of consecutive numbers as ``range``s: a batch is one run, and so are single pushes in a
    row.  A deque of the numbers themselves is a container the collector walks whole on every full pass, and on a
    queue growing by a million messages those passes cost 20-70 ms each (``qwork1`` in the bench); a run is one
    entry."""

    __slots__ = ("fifo", "back", "count", "top")

    def __init__(self) -> None:
        # a priority's FIFO is made when it first gets a run: ten empty deques were 7.6 KB of every queue's ~12
        self.fifo: list[collections.deque[range] | tuple] = [_NO_RUNS] * (MAX_PRIORITY + 1)
        self.back: list[list[int]] = [[] for _ in range(MAX_PRIORITY + 1)]
        self.count = 0
        self.top = -1            # no priority above this one has messages

    def __len__(self) -> int:
        return self.count

    def add(self, seq: int, priority: int) -> None:
        fifo = self.fifo[priority]
        if not fifo or seq >= fifo[-1].stop:
            if fifo is _NO_RUNS:
                fifo = self.fifo[priority] = collections.deque()
            _append_run(fifo, range(seq, seq + 1))
        else:
            heapq.heappush(self.back[priority], seq)
        self.count += 1
        if priority > self.top:
            self.top = priority

    def extend(self, seqs: list[int], priorities: list[int]) -> None:
        """``add`` each (seqs in increasing order), in one step where they are of one priority."""
        p = priorities[0]
        if priorities.count(p) != len(priorities):
            for seq, priority in zip(seqs, priorities):
                self.add(seq, priority)
            return
        self.extend_run(seqs, p)

    def extend_run(self, seqs: list[int] | range, priority: int) -> None:
        """``add`` each (in increasing order, all of ``priority``), in one step where they are new pushes with
        consecutive numbers (a ``range``, or a list that is one)."""
        if not seqs:
            return
        fifo = self.fifo[priority]
        if type(seqs) is not range:
            if seqs[-1] - seqs[0] != len(seqs) - 1:   # increasing, so not consecutive
                for seq in seqs:
                    self.add(seq, priority)
                return
            seqs = range(seqs[0], seqs[-1] + 1)
        if fifo and seqs.start < fifo[-1].stop:
            for seq in seqs:
                self.add(seq, priority)
            return
        if fifo is _NO_RUNS:
            fifo = self.fifo[priority] = collections.deque()
        _append_run(fifo, seqs)
        self.count += len(seqs)
        if priority > self.top:
            self.top = priority

    def pop_many(self, n: int) -> list[int]:
        """The next ``n`` (at most ``count``) in serving order, taken out."""
        out: list[int] = []
        p = self.top
        while len(out) < n:
            fifo, back = self.fifo[p], self.back[p]
            if not fifo and not back:
                p -= 1
                continue
            want = n - len(out)
            # the FIFO's head runs while the heap's head is not before them (it is never inside one: a number is
            # in one place only)
            while want and fifo and not (back and back[0] < fifo[0].start):
                head = fifo[0]
                if want >= len(head):
                    out.extend(head)
                    fifo.popleft()
                    want -= len(head)
                else:
                    out.extend(head[:want])
                    fifo[0] = head[want:]
                    want = 0
            while want and back and (not fifo or back[0] < fifo[0].start):
                out.append(heapq.heappop(back))
                want -= 1
        while p >= 0 and not self.fifo[p] and not self.back[p]:
            p -= 1
        self.top = p
        self.count -= len(out)
        return out

    def remove(self, seq: int, priority: int) -> None:
        """Take one message out, wherever it is (replay, dead-lettering: rare; the ends of the FIFO are O(1))."""
        fifo, back = self.fifo[priority], self.back[priority]
        if back and back[0] == seq:
            heapq.heappop(back)
        else:
            # the head run (taken from the front), the newest (a push undone: shard._roll_back, newest first),
            # then the rest
            at = 0 if fifo and seq in fifo[0] else len(fifo) - 1 if fifo and seq in fifo[-1] else None
            if at is None:
                at = next((i for i, run in enumerate(fifo) if seq in run), None)
            if at is None:
                back.remove(seq)
                heapq.heapify(back)
            else:
                run = fifo[at]
                parts = [part for part in (run[:seq - run.start], run[seq - run.start + 1:]) if part]
                if len(parts) == 1:
                    fifo[at] = parts[0]
                else:
                    del fifo[at]
                    for part in reversed(parts):
                        fifo.insert(at, part)
        self.count -= 1

    def discard(self, taken: set) -> None:
        """Take these out (a redrive)."""
        for p in range(MAX_PRIORITY + 1):
            old, fifo = self.fifo[p], collections.deque()
            self.fifo[p] = fifo
            for seq in itertools.chain.from_iterable(old):
                if seq not in taken:
                    _append_run(fifo, range(seq, seq + 1))
            self.back[p] = [seq for seq in self.back[p] if seq not in taken]
            heapq.heapify(self.back[p])
        self.count = sum(sum(map(len, f)) + len(b) for f, b in zip(self.fifo, self.back))

    def peek(self, limit: int) -> list[int]:
        """The first ``limit`` in serving order, left where they are."""
        out: list[int] = []
        for p in range(MAX_PRIORITY, -1, -1):
            for seq in heapq.merge(itertools.chain.from_iterable(self.fifo[p]), sorted(self.back[p])):
                if len(out) >= limit:
                    return out
                out.append(seq)
        return out

    def seqs(self):
        for fifo, back in zip(self.fifo, self.back):
            yield from itertools.chain.from_iterable(fifo)
            yield from back

    def clear(self) -> None:
        self.fifo[:] = [_NO_RUNS] * (MAX_PRIORITY + 1)
        for back in self.back:
            back.clear()
        self.count = 0
        self.top = -1


class QueueError(Exception):
    """A request this queue refuses: ``code`` is the wire's error string; ``retry`` says a retry may succeed."""

    def __init__(self, code: str, retry: bool = False, **extra: object) -> None:
        super().__init__(code)
        self.code = code
        self.retry = retry
        self.extra = extra

    def result(self) -> dict:
        """The request's reply: ``{"ok": false, "error": code, ...}``."""
        result = {"ok": False, "error": self.code, **self.extra}
        if self.retry:
            result["retry"] = True
        return result


@dataclass(frozen=True)
class Settings:
    """What one queue may hold and how it behaves; the configuration's ``queues`` section, per queue overridable."""
    visibility_ms: int = 30_000
    max_visibility_ms: int = 12 * 3600 * 1000
    max_lease_ms: int = 12 * 3600 * 1000           # a lease's deadline, extensions included, from its grant
    max_delay_ms: int = 12 * 3600 * 1000
    max_deliveries: int = 20                        # 0: no limit (never dead-lettered for deliveries)
    max_message_bytes: int = 1 << 20
    max_messages: int = 1_000_000
    max_bytes: int = 256 << 20


# -- receipts and ids --------------------------------------------------------------------------------------------
try:   # OpenSSL's generator (a CTR-DRBG the OS seeds, reseeded after a fork): what TLS keys come from, and 7x
    # cheaper than the getrandom system call for the 28 bytes each message takes (a receive's receipt, a push's id)
    from ssl import RAND_bytes as _random_bytes
except ImportError:   # a Python built without ssl
    _random_bytes = os.urandom
_receipt_pool: list[str] = []
_id_pool: list[str] = []
_POOL = 256                     # receipts (ids) drawn at once when the pool runs dry


def _forget_pools() -> None:
    """A forked child must not hand out the receipts (ids) its parent drew: it draws its own."""
    _receipt_pool.clear()
    _id_pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def receipt_text(receipt: bytes) -> str:
    return base64.urlsafe_b64encode(receipt).rstrip(b"=").decode()


def receipt_bytes(text: object) -> bytes | None:
    """The 16 bytes of a receipt's text form, or None if it cannot be one."""
    if type(text) is not str or len(text) != 22:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "==")
    except (ValueError, TypeError):
        return None
    return raw if len(raw) == 16 else None


def canonical_receipt(text: object) -> str | None:
    """The text under which the receipt ``text`` names a lease (its canonical base64url), or None if it is not a
    receipt at all (``invalid_receipt``)."""
    raw = receipt_bytes(text)
    return None if raw is None else receipt_text(raw)


def _draw_receipts(n: int) -> list[str]:
    """``n`` fresh receipts' texts.  16 bytes each from a CSPRNG (``_random_bytes``) with no ``;`` and no NUL
    (qlite's wire carries a receipt raw, and clients that split its replies on ``;`` or hash it as a C string would
    break on those): those two byte values are dropped from the random stream, which leaves every other byte value
    equally likely and independent, 254^16 receipts (more than 127 bits).  One draw and one base64 pass for all
    ``n``."""
    need = 16 * n
    raw = b""
    while len(raw) < need:
        raw += _random_bytes(need - len(raw) + 16 + (need >> 6)).translate(None, b";\0")
    return core.b64url_chunks(raw[:need], 16)


def new_receipts(n: int) -> list[str]:
    """``n`` fresh receipts (text), from a pool refilled ``_POOL`` at a time: a receive of one message costs no
    system call of its own."""
    pool = _receipt_pool
    if len(pool) < n:
        pool.extend(_draw_receipts(max(n - len(pool), _POOL)))
    out = pool[-n:]
    del pool[-n:]
    return out


def new_receipt() -> str:
    return new_receipts(1)[0]


ID_CHARS = 16   # a message id's length: 12 random bytes, base64url
RECEIPT_CHARS = 22   # a receipt's canonical text: 16 random bytes, base64url


def new_ids(n: int) -> list[str]:
    """``n`` message ids: 12 random bytes each, base64url (16 characters)."""
    pool = _id_pool
    if len(pool) < n:
        pool.extend(core.b64url_chunks(_random_bytes(12 * max(n - len(pool), _POOL)), 12))
    out = pool[-n:]
    del pool[-n:]
    return out


def new_id() -> str:
    pool = _id_pool
    if not pool:
        new_ids(1)
        pool = _id_pool
    return pool.pop()


def _text(receipt: object) -> str:
    """A receipt as kept: its text (journals written before receipts were kept as text hold the 16 bytes)."""
    return receipt if type(receipt) is str else receipt_text(receipt)  # type: ignore[arg-type]


record_text = _text


_ACKED = {"ok": True}                               # shared: many of them in one reply cost one (marshal's refs)
_ALREADY_ACKED = {"ok": True, "already_acked": True}
_PURGED = {"ok": True, "purged": True}


class Queue:
    """One queue.  Every change is a record (a tuple, first item its kind): applied here and handed to ``journal``
    (the shard's), so replaying the records rebuilds the queue exactly (``apply``).  Decisions (which message,
    dead-letter or not) are made before the record, never while applying it.  The busiest records (``push``,
    ``pushes``, ``leases``, ``acks``) are applied by the live path directly (the same helpers as ``apply``, minus
    finding what the live path has in hand) and then journaled."""

    def __init__(self, name: str, settings: Settings, schedule: Callable[[int, "Queue"], None],
                 journal: Callable[[str, tuple], None]) -> None:
        self.name = name
        self.dlq_name = "" if is_dlq(name) else name + DLQ_SUFFIX   # where its dead letters go ("": itself)
        self.settings = settings
        self._schedule = schedule        # (monotonic ns, queue): look at this queue again then (the shard's timer)
        self._journal = journal          # (queue name, record)
        self.due_at = 0                  # the earliest time the shard was asked to look here (0: nothing pending)
        self.messages: dict[int, tuple] = {}         # every live message (visible, delayed, leased) by seq
        self._ready = _Ready()                       # visible messages' seqs, in serving order
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
        self.tokens = History()    # push token -> id(s), as long
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
            self._grant(seqs, [_text(r) for r in receipts], granted, deadline, visibility, None)
        elif kind == "lease":          # one lease (journal snapshots, and journals from before ``leases``)
            _, seq, receipt, granted, deadline, visibility = record[:6]
            self._unready(seq)
            self._grant((seq,), [_text(receipt)], granted, deadline, visibility, None)
        elif kind == "acks":
            self._acked(record[1])
        elif kind == "ack":
            self._acked((_text(record[1]),))
        elif kind == "deadline":
            _, receipt, deadline = record
            receipt = _text(receipt)
            lease = self.leases[receipt]
            self.leases[receipt] = (lease[0], lease[1], deadline, lease[3], lease[4])
            heapq.heappush(self._deadlines, (deadline, (receipt,)))
            self._deadline_refs += 1
            if self._deadline_refs > 2 * len(self.leases) + _DEADLINES_SLACK:
                self._compact_deadlines()
            self._at(deadline)
        elif kind == "requeue":
            _, receipt, ready_at = record
            receipt = _text(receipt)
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
            if ready_at == _LIMBO:   # a journal snapshot's leased message: its lease record comes next
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

    def _grant(self, seqs, receipts: list[str], granted: int, deadline: int, visibility: int,
               holder: tuple | None) -> None:
        """Lease the messages ``seqs`` (out of every heap already) under ``receipts``."""
        again = core.grant(self.leases, self.leased, self.deliveries, seqs, receipts, granted, deadline, visibility,
                           holder)
        heapq.heappush(self._deadlines, (deadline, tuple(receipts)))
        refs = self._deadline_refs = self._deadline_refs + len(receipts)
        if refs > 2 * len(self.leases) + _DEADLINES_SLACK:
            self._compact_deadlines()
        self._at(deadline)
        self.delivered += len(receipts)
        self.redelivered += again

    def _acked(self, receipts: list | tuple) -> None:
        leases, leased, store, deliveries = self.leases, self.leased, self.messages, self.deliveries
        size = 0
        for receipt in receipts:
            seq = leases.pop(receipt)[0]
            del leased[seq]
            deliveries.pop(seq, None)
            size += len(store.pop(seq)[3])
        self._remember_acks(receipts)
        self.bytes -= size
        self.acked += len(receipts)

    def _end_lease(self, receipt: str, fate: str) -> int:
        seq = self.leases.pop(receipt)[L_SEQ]
        del self.leased[seq]
        self._remember(receipt, fate, seq)
        return seq

    def _remember(self, receipt: str, fate: str, seq: int) -> None:
        recent = self._recent
        recent[receipt] = (fate, seq, self.deliveries.get(seq, 0))

    def _drop(self, seq: int) -> tuple:
        msg = self.messages.pop(seq)
        self.deliveries.pop(seq, None)
        self.bytes -= len(msg[DATA])
        return msg

    # -- what clients ask ------------------------------------------------------------------------------------
    def check_push(self, size: int) -> None:
        """Whether a message of ``size`` bytes fits (the caller checked its priority and delay)."""
        s = self.settings
        if size > s.max_message_bytes:
            raise QueueError("message_too_large", max=s.max_message_bytes)
        if len(self.messages) >= s.max_messages or self.bytes + size > s.max_bytes:
            self.rejected += 1
            raise QueueError("queue_full", retry=True)

    def check_batch(self, sizes: list[int]) -> None:
        """Whether all these messages fit together (each checked for ``max_message_bytes`` already): a batch is
        stored whole or not at all.  ``queue_full`` says how many of them would fit now (``room``)."""
        s = self.settings
        total = sum(sizes)
        if len(self.messages) + len(sizes) <= s.max_messages and self.bytes + total <= s.max_bytes:
            return
        room, left = 0, s.max_bytes - self.bytes
        for size in sizes[:max(0, s.max_messages - len(self.messages))]:
            left -= size
            if left < 0:
                break
            room += 1
        self.rejected += len(sizes)
        raise QueueError("queue_full", retry=True, room=room)

    def push(self, kind: int, data: bytes, priority: int, now: int, wall: int, delay_ms: int, *,
             msg_id: str | None = None, enqueued_at: int = 0, deliveries: int = 0, reason: str = "",
             source: str = "", redriven: int = 0, token: tuple | None = None) -> str:
        """Store a message (checked by ``check_push``).  The optional fields carry a message over from another
        queue (dead-lettering, redrive); ``token`` names the request, so that a resent one is known.  -> its id."""
        seq = self.next_seq
        msg_id = msg_id or new_id()
        record = ("push", seq, msg_id, kind, data, priority, enqueued_at or wall,
                  now + delay_ms * MS if delay_ms else 0, deliveries, reason, source, redriven, token)
        if delay_ms or deliveries:
            self.apply(record)
        else:   # the common case, applied directly (as apply's "push" would)
            if token is not None:
                self._token(token, msg_id)
            self.bytes += core.store_put(self.messages, [(seq, msg_id, kind, data, priority, enqueued_at or wall,
                                                          reason, source, redriven)])
            self._ready.add(seq, priority)
            self.next_seq = seq + 1
            self.pushed += 1
        self._journal(self.name, record)
        return msg_id

    def push_many(self, items: list[tuple], now: int, wall: int, token: tuple | str | list | None = None) -> list[str]:
        """Store a batch of checked messages, ``(kind, data, priority, delay_ms)`` each, in one record (``token``:
        ``_tokens``).  -> ids."""
        seq = self.next_seq
        ids = new_ids(len(items))
        messages = [(seq + i, ids[i], kind, data, priority, wall, "", "", 0)
                    for i, (kind, data, priority, _) in enumerate(items)]
        ready_ats = None
        if any(item[3] for item in items):
            ready_ats = [now + delay * MS if delay else 0 for _, _, _, delay in items]
        self._do(("pushes", token, messages, ready_ats))
        return ids

    def push_data(self, kind: int, datas: list[bytes], priority: int, delay_ms: int, now: int, wall: int,
                  token: tuple | str | list | None = None) -> list[str]:
        """Store a batch of checked data of one kind, priority and delay, in one record (``pushcol`` without a
        delay: applied here directly, as ``apply`` would, without splitting its ids again; ``token``: ``_tokens``).
        -> ids."""
        if delay_ms:   # a pushcol has no delays: a delayed batch is a pushes record, as push_many makes it
            return self.push_many([(kind, data, priority, delay_ms) for data in datas], now, wall, token)
        seq = self.next_seq
        ids = new_ids(len(datas))
        if token is not None:
            self._tokens(token, ids)
        self._store_run(seq, ids, kind, datas, priority, wall)
        self._journal(self.name, ("pushcol", token, seq, "".join(ids), kind, datas, priority, wall))
        return ids

    def lease(self, now: int, count: int, visibility_ms: int, holder: tuple | None) -> list[tuple]:
        """Lease up to ``count`` visible messages, in serving order, each under a fresh receipt; one record for
        all.  -> their deliveries (``D_*`` tuples)."""
        ready = self._ready
        n = min(count, ready.count)
        if not n:
            return []
        seqs = ready.pop_many(n)
        receipts = new_receipts(n)
        deadline = now + visibility_ms * MS
        self._grant(seqs, receipts, now, deadline, visibility_ms, holder)
        self._journal(self.name, ("leases", seqs, receipts, now, deadline, visibility_ms))
        return core.delivered(self.messages, self.deliveries, seqs, receipts, MS)

    def current(self, receipt: str, now: int) -> tuple:
        """The live lease of ``receipt`` (text, canonical), or QueueError saying what became of it."""
        lease = self.leases.get(receipt)
        if lease is not None and lease[L_DEADLINE] > now:
            return lease
        if lease is not None:  # past its deadline, the timer not yet run: lost all the same
            self.expire(now)
        fate = self._recent.get(receipt)
        if fate is None:
            raise QueueError("already_acked" if receipt in self._acks else "unknown_receipt")
        what, seq, deliveries = fate
        if what == "lost":  # with the message's deliveries as they are now (it may have been leased again since)
            self.stale_receipts += 1
            raise QueueError("lease_lost", deliveries=self.deliveries.get(seq, 0)
                             if seq in self.messages else deliveries)
        raise QueueError(what)

    def ack_many(self, receipts: list, now: int) -> list[dict]:
        """Ack each receipt (text, as the client sent it), in order, and journal those that ended a lease as one
        record (``acks``; applying it is ``_acked``, done here inline).  -> one result per receipt."""
        leases, leased, store, deliveries = self.leases, self.leased, self.messages, self.deliveries
        results = []
        done = []
        remembered = 0   # done[:remembered] are in _acks already
        size = 0
        i = 0
        while True:
            # the live leases named as issued, in one run each (core.ack_run), up to the first receipt that is not
            i, run_size = core.ack_run(leases, leased, store, deliveries, receipts, i, now, done, results, _ACKED)
            size += run_size
            if i == len(receipts):
                break
            if len(done) > remembered:   # a repeat in this batch finds its lease gone, like any repeat
                self._remember_acks(done[remembered:])
                remembered = len(done)
            receipt = self._ack_other(receipts[i], now)
            i += 1
            if type(receipt) is dict:
                results.append(receipt)
                continue
            seq = leases.pop(receipt)[0]   # a live receipt spelled in another (non-canonical) way
            del leased[seq]
            deliveries.pop(seq, None)
            size += len(store.pop(seq)[3])
            done.append(receipt)
            results.append(_ACKED)
        if len(done) > remembered:
            self._remember_acks(done[remembered:] if remembered else done)
        if done:
            self.bytes -= size
            self.acked += len(done)
            self._journal(self.name, ("acks", done))
        return results

    def _remember_acks(self, receipts: list[str] | tuple[str, ...]) -> None:
        """Acked receipts into the acks' history, joined, so that it holds one object for them, not one each.
        They are the leases' keys, canonical texts of one length; were one not, the length check keeps the list."""
        packed = "".join(receipts)
        if len(packed) == RECEIPT_CHARS * len(receipts):
            self._acks.add(packed, True, RECEIPT_CHARS)
        else:
            self._acks.add(receipts, True)

    def _ack_other(self, receipt: object, now: int) -> dict | str:
        """An ack whose receipt is not a live lease as sent: what the client is told, or the receipt's canonical
        text if that is a live lease."""
        text = canonical_receipt(receipt)
        if text is None:
            return {"ok": False, "error": "invalid_receipt"}
        try:
            self.current(text, now)   # a non-canonical spelling of a live receipt gets here
        except QueueError as exc:
            if exc.code == "already_acked":
                self.duplicate_acks += 1
                return _ALREADY_ACKED
            if exc.code == "purged":
                return _PURGED
            return exc.result()
        return text

    def ack(self, receipt: str, now: int) -> dict:
        """One ack (tests, tools): ``{}``, ``{"already_acked": True}``, ``{"purged": True}``, or QueueError."""
        result = self.ack_many([receipt], now)[0]
        if not result["ok"]:
            extra = {k: v for k, v in result.items() if k not in ("ok", "error")}
            raise QueueError(result["error"], **extra)
        return {k: v for k, v in result.items() if k != "ok"}

    def extend(self, receipt: str, now: int, visibility_ms: int | None) -> int:
        """Deadline = now + visibility (None: the lease's own, a heartbeat), at most ``max_lease_ms`` after the
        grant.  -> the deadline (ns)."""
        lease = self.current(receipt, now)
        if visibility_ms is None:
            visibility_ms = lease[L_VISIBILITY]
        if type(visibility_ms) is not int or not 0 <= visibility_ms <= self.settings.max_visibility_ms:
            raise QueueError("invalid_visibility", max=self.settings.max_visibility_ms)
        deadline = min(now + visibility_ms * MS, lease[L_GRANTED] + self.settings.max_lease_ms * MS)
        self._do(("deadline", receipt, deadline))
        self.extended += 1
        if deadline <= now:
            self.expire(now)
        return deadline

    def nack(self, receipt: str, now: int, delay_ms: int) -> str:
        """Back to visible (after ``delay_ms``), or to the DLQ after its last delivery.  -> where it went."""
        lease = self.current(receipt, now)
        if type(delay_ms) is not int or not 0 <= delay_ms <= self.settings.max_delay_ms:
            raise QueueError("invalid_delay", max=self.settings.max_delay_ms)
        self.nacked += 1
        return self._release(receipt, lease, now + delay_ms * MS if delay_ms else 0)

    def terminate(self, receipt: str, now: int) -> None:
        """A consumer's verdict: dead-letter the leased message now."""
        lease = self.current(receipt, now)
        self._do(("dead", lease[L_SEQ], "terminated"))

    def release_holder(self, holder: tuple) -> int:
        """A connection that received with ``release_on_close`` closed: its leases go back at once.  -> count."""
        mine = [(receipt, lease) for receipt, lease in self.leases.items() if lease[L_HOLDER] == holder]
        for receipt, lease in mine:
            self._release(receipt, lease, 0)
        return len(mine)

    def _release(self, receipt: str, lease: tuple, ready_at: int) -> str:
        limit = self.settings.max_deliveries
        seq = lease[L_SEQ]
        if limit and self.deliveries.get(seq, 0) >= limit:
            self._do(("dead", seq, "max_deliveries"))
            return "dead"
        self._do(("requeue", receipt, ready_at))
        return "delayed" if ready_at else "visible"

    def _compact_deadlines(self) -> None:
        """Rebuild the deadlines' heap (in place) with the entries of live leases only (see _DEADLINES_SLACK):
        each live lease has one entry at its current deadline.  O(entries), once per as many new ones."""
        leases = self.leases
        held = leases.__contains__
        live = []
        refs = 0
        for deadline, receipts in self._deadlines:
            # most entries are of batches acked whole: the receipts still leased first (a loop in C), then theirs
            keep = tuple(filter(held, receipts))
            if keep:
                keep = tuple(r for r in keep if leases[r][L_DEADLINE] == deadline)
            if keep:
                live.append((deadline, keep))
                refs += len(keep)
        heapq.heapify(live)
        self._deadlines[:] = live
        self._deadline_refs = refs

    # -- undoing what could not be journaled ------------------------------------------------------------------
    def undo_push(self, record: tuple, off_heap: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
        """Take back a client's ``push`` or ``pushes`` record that was never written (a failed journal write), as if
        never made: the messages, their token, their counts.  Only right for the newest records, newest first,
        before anything else touched these messages (shard._roll_back sees to it; a lease of them in the same
        turn is undone first, with ``undo_leases``, and named in ``off_heap``).  -> the messages' ids."""
        items, token = pushed_seqs(record), record[12] if record[0] == "push" else record[1]
        for one in token if type(token) is list else (token,):
            if one is not None:
                self.tokens.pop(one, None)
        store, delay_at, ready = self.messages, self.delay_at, self._ready
        ids = []
        for seq in reversed(items):
            msg = store[seq]
            if seq in delay_at:
                del delay_at[seq]   # its entry in _delayed is stale now, skipped when due
            elif seq not in off_heap:   # leased in its turn: undo_leases left it in no heap
                ready.remove(seq, msg[PRIORITY])
            self._drop(seq)
            ids.append(msg[ID])
        self.pushed -= len(items)
        return ids

    def undo_leases(self, seqs: list[int], receipts: list, gone: set[int]) -> None:
        """Take back a ``leases`` record that was never written: the messages are visible again where they were,
        with the deliveries they had, and the receipts never existed (those in ``gone`` are pushes undone next: they
        go back to no heap)."""
        leases, leased, deliveries, ready, store = self.leases, self.leased, self.deliveries, self._ready, \
            self.messages
        for seq, receipt in zip(seqs, receipts):
            del leases[_text(receipt)]   # its entry in _deadlines is stale now
            del leased[seq]
            d = deliveries.get(seq, 1) - 1
            if d:
                deliveries[seq] = d
                self.redelivered -= 1
            else:
                deliveries.pop(seq, None)
            self.delivered -= 1
            if seq not in gone:
                ready.add(seq, store[seq][PRIORITY])

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
            if ready_at == _LIMBO:
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
        messages or about ``SNAPSHOT_BYTES`` of their data.  The state is taken now, the messages themselves
        (tuples, never changed) and copies of the maps that change, so the batches may be written over many turns
        while the queue goes on changing (``Journal.start_rewrite``).  Then the push tokens still remembered
        (``tokens`` records): a client's retry with its ``dedup_id``, or a worker's resend after a crash, must find
        its first copy after a compaction and a crash as before them, though the message may be long gone."""
        tokens = self.tokens.items()
        return itertools.chain(_snapshot_batches(list(self.messages.values()), dict(self.leased), dict(self.leases),
                                                 dict(self.deliveries), dict(self.delay_at)),
                               ([("tokens", tokens[i:i + SNAPSHOT_RUN])] for i in range(0, len(tokens), SNAPSHOT_RUN)))

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


def _snapshot_batches(messages: list[tuple], leased: dict, leases: dict, deliveries: dict, delay_at: dict
                      ) -> Iterator[list[tuple]]:
    """``Queue.snapshot``'s batches.  A batch of visible messages never leased, in the order of their numbers (as
    the store holds them), is stored as pushes store them: ``pushcol`` records for its runs of one kind, priority
    and time (messages pushed together), ``pushes`` records for the rest (``core.snapshot_pushes``); any other
    has a ``push`` record per message (a leased one as in no heap, then its lease)."""
    special = leased.keys() | deliveries.keys() | delay_at.keys()
    data_of, seq_of = operator.itemgetter(DATA), operator.itemgetter(SEQ)
    i = 0
    while i < len(messages):
        batch = messages[i:i + SNAPSHOT_RUN]
        if sum(map(len, map(data_of, batch))) > SNAPSHOT_BYTES:
            size = n = 0
            while n < len(batch) and size <= SNAPSHOT_BYTES:
                size += len(batch[n][DATA])
                n += 1
            batch = batch[:n]
        i += len(batch)
        seqs = list(map(seq_of, batch))
        if special.isdisjoint(seqs) and seqs == sorted(seqs):
            yield core.snapshot_pushes(batch, ID_CHARS, SNAPSHOT_PUSHCOL)
            continue
        records = []
        for m in batch:
            seq = m[SEQ]
            receipt = leased.get(seq)
            d = deliveries.get(seq, 0)
            records.append(("push", seq, m[ID], m[KIND], m[DATA], m[PRIORITY], m[ENQUEUED],
                            delay_at.get(seq, 0) if receipt is None else _LIMBO, d - 1 if receipt is not None else d,
                            m[REASON], m[SOURCE], m[REDRIVEN], None))
            if receipt is not None:
                lease = leases[receipt]
                records.append(("lease", seq, receipt, lease[L_GRANTED], lease[L_DEADLINE], lease[L_VISIBILITY]))
        yield records


def pushed_seqs(record: tuple) -> list[int] | range:
    """The messages a ``push``, ``pushes`` or ``pushcol`` record stores, by sequence number, in order."""
    kind = record[0]
    if kind == "push":
        return [record[1]]
    if kind == "pushcol":
        return range(record[2], record[2] + len(record[5]))
    return [m[0] for m in record[2]]


def is_dlq(name: str) -> bool:
    return name.endswith(DLQ_SUFFIX)
