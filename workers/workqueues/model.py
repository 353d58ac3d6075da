"""One work queue as a state machine: messages, leases, receipts and counts, with no I/O and no clock of its own.

A message moves delayed → visible → leased → acked, or back to visible (the lease expired, a nack), or to the
dead-letter queue.  The shard that owns the queue (``shard``) drives it: it passes ``now`` (monotonic ns) into
every call, keeps one timer for all its queues, journals every change, and answers clients.  Replaying a journal
calls the same methods with the recorded values, so a queue rebuilt after a crash is the queue that was.

Decisions (``docs/queues.md`` has them for users; ``shared/reference/work-queues.md`` §4 the reasons):
- Every lease has a fresh receipt (16 random bytes).  Only the current receipt of a message may ack, extend, nack
  or dead-letter it; an earlier one gets ``lease_lost``, a repeated ack ``already_acked``, a receipt of a purged
  lease ``purged``, and one never issued (or long forgotten) ``unknown_receipt``.
- Visible messages are served by priority (9 first), then by sequence number, so a redelivered message goes back
  near the head, where it was, not behind everything pushed since.
- ``max_deliveries = N`` means at most N leases: when the N-th ends without an ack (expiry, nack), the message
  goes to ``<queue>.dlq`` with its id, enqueue time and delivery count, never dropped.
- Counts are exact, and bounds are checked before anything changes: a full queue rejects, it never trims.
"""

from __future__ import annotations

import base64
import collections
import heapq
import os
from dataclasses import dataclass
from typing import Callable

MS = 1_000_000  # ns
MAX_PRIORITY = 9
DLQ_SUFFIX = ".dlq"
_RECENT_RECEIPTS = 100_000      # per queue: what an old receipt became (acked, lost, purged), the newest kept
_RECENT_TOKENS = 100_000        # per queue: pushes already stored, by their sender's token (resends after a crash)


class QueueError(Exception):
    """A request this queue refuses: ``code`` is the wire's error string; ``retry`` says a retry may succeed."""

    def __init__(self, code: str, retry: bool = False, **extra: object) -> None:
        super().__init__(code)
        self.code = code
        self.retry = retry
        self.extra = extra


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


def new_receipt() -> bytes:
    """16 random bytes with no ``;`` and no NUL: qlite's wire carries a receipt raw, and clients that split its
    replies on ``;`` or hash it as a C string would break on those (more than 127 bits of entropy remain)."""
    while True:
        receipt = os.urandom(16)
        if b";" not in receipt and b"\0" not in receipt:
            return receipt


def new_id() -> str:
    return base64.urlsafe_b64encode(os.urandom(12)).decode()


class Message:
    __slots__ = ("seq", "id", "kind", "data", "priority", "enqueued_at", "deliveries", "ready_at", "lease",
                 "first_received", "dead_reason", "source", "redriven")

    def __init__(self, seq: int, msg_id: str, kind: int, data: bytes, priority: int, enqueued_at: int,
                 ready_at: int) -> None:
        self.seq = seq
        self.id = msg_id
        self.kind = kind                 # workers.message.KIND_*: how the producer's protocol encoded ``data``
        self.data = data
        self.priority = priority
        self.enqueued_at = enqueued_at   # wall clock, ns: reported only
        self.deliveries = 0
        self.ready_at = ready_at         # monotonic ns; 0: visible (or leased)
        self.lease: Lease | None = None
        self.first_received = 0          # wall clock ns of the first lease
        self.dead_reason = ""
        self.source = ""
        self.redriven = 0


class Lease:
    __slots__ = ("receipt", "message", "granted", "deadline", "visibility", "holder")

    def __init__(self, receipt: bytes, message: Message, granted: int, deadline: int, visibility: int,
                 holder: tuple | None) -> None:
        self.receipt = receipt
        self.message = message
        self.granted = granted          # monotonic ns
        self.deadline = deadline        # monotonic ns
        self.visibility = visibility    # ms, what touch() renews by
        self.holder = holder            # (worker, cid) to release on that connection's close, or None


class Queue:
    """One queue.  Every change is a record (a tuple, first item its kind) passed to ``_do``: applied here and
    handed to ``journal`` (the shard's), so replaying the records rebuilds the queue exactly (``apply``).
    Decisions (which message, dead-letter or not) are made before the record, never while applying it."""

    def __init__(self, name: str, settings: Settings, schedule: Callable[[int, "Queue"], None],
                 journal: Callable[[str, tuple], None]) -> None:
        self.name = name
        self.settings = settings
        self._schedule = schedule        # (monotonic ns, queue): look at this queue again then (the shard's timer)
        self._journal = journal          # (queue name, record)
        self.messages: dict[int, Message] = {}       # every live message (visible, delayed, leased) by seq
        self._ready: list[tuple[int, int, Message]] = []     # (-priority, seq, message)
        self._delayed: list[tuple[int, int, Message]] = []   # (ready_at, seq, message); stale entries skipped
        self.leases: dict[bytes, Lease] = {}
        self._deadlines: list[tuple[int, bytes]] = []        # (deadline, receipt); stale entries skipped
        # receipt -> (what became of it, the message's seq, its deliveries then): no Message kept, so an acked
        # message's data is freed at once
        self._recent: collections.OrderedDict[bytes, tuple[str, int, int]] = collections.OrderedDict()
        self.dead: list[tuple[Message, str]] = []   # dead-lettered here, for the shard to push to the DLQ
        self.tokens: collections.OrderedDict[tuple, str] = collections.OrderedDict()   # push token -> message id
        self.next_seq = 1
        self.bytes = 0
        self.pushed = self.delivered = self.redelivered = self.acked = self.nacked = self.dead_lettered = 0
        self.expired = self.extended = self.stale_receipts = self.duplicate_acks = self.rejected = 0

    # -- counts ---------------------------------------------------------------------------------------------
    @property
    def visible(self) -> int:
        return len(self._ready)

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    @property
    def delayed(self) -> int:
        return len(self.messages) - len(self._ready) - len(self.leases)

    # -- records --------------------------------------------------------------------------------------------
    def _do(self, record: tuple) -> None:
        self.apply(record)
        self._journal(self.name, record)

    def apply(self, record: tuple) -> None:
        kind = record[0]
        if kind == "push":
            (_, seq, msg_id, data_kind, data, priority, enqueued_at, ready_at, deliveries, reason, source,
             redriven, token) = record
            if token is not None:
                self.tokens[token] = msg_id
                if len(self.tokens) > _RECENT_TOKENS:
                    self.tokens.popitem(last=False)
            msg = Message(seq, msg_id, data_kind, data, priority, enqueued_at, ready_at)
            msg.deliveries, msg.dead_reason, msg.source, msg.redriven = deliveries, reason, source, redriven
            self.messages[seq] = msg
            self.next_seq = max(self.next_seq, seq + 1)
            self.bytes += len(data)
            self.pushed += 1
            self._make_ready(msg, ready_at)
        elif kind == "lease":
            _, seq, receipt, granted, deadline, visibility, first_received = record
            msg = self.messages[seq]
            ready = self._ready
            if msg.ready_at == -1:
                msg.ready_at = 0       # a snapshot's leased message, in no heap
            elif ready and ready[0][2] is msg:
                heapq.heappop(ready)   # live: always the head
            else:
                self._unready(msg)
            lease = Lease(receipt, msg, granted, deadline, visibility, None)
            msg.lease = lease
            msg.deliveries += 1
            msg.first_received = msg.first_received or first_received
            self.leases[receipt] = lease
            heapq.heappush(self._deadlines, (deadline, receipt))
            self._schedule(deadline, self)
            self.delivered += 1
            if msg.deliveries > 1:
                self.redelivered += 1
        elif kind == "deadline":
            _, receipt, deadline = record
            lease = self.leases[receipt]
            lease.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, receipt))
            self._schedule(deadline, self)
        elif kind == "ack":
            lease = self.leases[record[1]]
            self._end_lease(lease, "acked")
            self._drop(lease.message)
            self.acked += 1
        elif kind == "requeue":
            _, receipt, ready_at = record
            lease = self.leases[receipt]
            self._end_lease(lease, "lost")
            self._make_ready(lease.message, ready_at)
        elif kind == "dead":
            _, seq, reason = record
            msg = self.messages[seq]
            if msg.lease is not None:
                self._end_lease(msg.lease, "lost")
            else:
                self._unready(msg)
            self._drop(msg)
            self.dead_lettered += 1
            self.dead.append((msg, reason))
        elif kind == "take":
            taken = {seq for seq in record[1] if seq in self.messages}
            self._ready = [entry for entry in self._ready if entry[1] not in taken]
            heapq.heapify(self._ready)
            for seq in taken:
                self._drop(self.messages[seq])
        elif kind == "purge":
            for receipt, lease in self.leases.items():
                self._remember(receipt, "purged", lease.message)
            self.messages.clear()
            self._ready.clear()
            self._delayed.clear()
            self.leases.clear()
            self._deadlines.clear()
            self.bytes = 0
        else:
            raise ValueError(f"unknown queue record {kind!r}")

    def _make_ready(self, msg: Message, ready_at: int) -> None:
        msg.lease = None
        msg.ready_at = ready_at
        if ready_at == -1:   # a journal snapshot's leased message: its lease record comes next
            return
        if ready_at:
            heapq.heappush(self._delayed, (ready_at, msg.seq, msg))
            self._schedule(ready_at, self)
        else:
            heapq.heappush(self._ready, (-msg.priority, msg.seq, msg))

    def _unready(self, msg: Message) -> None:
        """Take a visible or delayed message out of its heap (rare: replay, redrive, dead-lettering)."""
        if msg.ready_at:
            msg.ready_at = 0  # its entry in _delayed is now stale and is skipped when it comes due
            return
        heap = self._ready
        for i, entry in enumerate(heap):
            if entry[2] is msg:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                return

    def _end_lease(self, lease: Lease, fate: str) -> None:
        del self.leases[lease.receipt]
        lease.message.lease = None
        self._remember(lease.receipt, fate, lease.message)

    def _remember(self, receipt: bytes, fate: str, msg: Message) -> None:
        recent = self._recent
        recent[receipt] = (fate, msg.seq, msg.deliveries)
        if len(recent) > _RECENT_RECEIPTS:
            recent.popitem(last=False)

    def _drop(self, msg: Message) -> None:
        del self.messages[msg.seq]
        self.bytes -= len(msg.data)

    # -- what clients ask ------------------------------------------------------------------------------------
    def check_push(self, size: int) -> None:
        """Whether a message of ``size`` bytes fits (the caller checked its priority and delay)."""
        s = self.settings
        if size > s.max_message_bytes:
            raise QueueError("message_too_large", max=s.max_message_bytes)
        if len(self.messages) >= s.max_messages or self.bytes + size > s.max_bytes:
            self.rejected += 1
            raise QueueError("queue_full", retry=True)

    def push(self, kind: int, data: bytes, priority: int, now: int, wall: int, delay_ms: int, *,
             msg_id: str | None = None, enqueued_at: int = 0, deliveries: int = 0, reason: str = "",
             source: str = "", redriven: int = 0, token: tuple | None = None) -> Message:
        """Store a message (checked by ``check_push``).  The optional fields carry a message over from another
        queue (dead-lettering, redrive); ``token`` names the request, so that a resent one is known."""
        seq = self.next_seq
        self._do(("push", seq, msg_id or new_id(), kind, data, priority, enqueued_at or wall,
                  now + delay_ms * MS if delay_ms else 0, deliveries, reason, source, redriven, token))
        return self.messages[seq]

    def lease(self, now: int, wall: int, visibility_ms: int, holder: tuple | None) -> Lease | None:
        """Lease the first visible message under a fresh receipt, or None if there is none."""
        if not self._ready:
            return None
        msg = self._ready[0][2]
        receipt = new_receipt()
        self._do(("lease", msg.seq, receipt, now, now + visibility_ms * MS, visibility_ms, wall))
        lease = self.leases[receipt]
        lease.holder = holder
        return lease

    def current(self, receipt: bytes, now: int) -> Lease:
        """The live lease of ``receipt``, or QueueError saying what became of it."""
        lease = self.leases.get(receipt)
        if lease is not None and lease.deadline > now:
            return lease
        if lease is not None:  # past its deadline, the timer not yet run: lost all the same
            self.expire(now)
        fate = self._recent.get(receipt)
        if fate is None:
            raise QueueError("unknown_receipt")
        what, seq, deliveries = fate
        if what == "lost":  # with the message's deliveries as they are now (it may have been leased again since)
            self.stale_receipts += 1
            msg = self.messages.get(seq)
            raise QueueError("lease_lost", deliveries=msg.deliveries if msg is not None else deliveries)
        raise QueueError("already_acked" if what == "acked" else what)

    def ack(self, receipt: bytes, now: int) -> dict:
        try:
            self.current(receipt, now)
        except QueueError as exc:
            if exc.code == "already_acked":
                self.duplicate_acks += 1
                return {"already_acked": True}
            if exc.code == "purged":
                return {"purged": True}
            raise
        self._do(("ack", receipt))
        return {}

    def extend(self, receipt: bytes, now: int, visibility_ms: int | None) -> int:
        """Deadline = now + visibility (None: the lease's own, a heartbeat), at most ``max_lease_ms`` after the
        grant.  -> the deadline (ns)."""
        lease = self.current(receipt, now)
        if visibility_ms is None:
            visibility_ms = lease.visibility
        if type(visibility_ms) is not int or not 0 <= visibility_ms <= self.settings.max_visibility_ms:
            raise QueueError("invalid_visibility", max=self.settings.max_visibility_ms)
        deadline = min(now + visibility_ms * MS, lease.granted + self.settings.max_lease_ms * MS)
        self._do(("deadline", receipt, deadline))
        self.extended += 1
        if deadline <= now:
            self.expire(now)
        return deadline

    def nack(self, receipt: bytes, now: int, delay_ms: int) -> str:
        """Back to visible (after ``delay_ms``), or to the DLQ after its last delivery.  -> where it went."""
        lease = self.current(receipt, now)
        if type(delay_ms) is not int or not 0 <= delay_ms <= self.settings.max_delay_ms:
            raise QueueError("invalid_delay", max=self.settings.max_delay_ms)
        self.nacked += 1
        return self._release(lease, now + delay_ms * MS if delay_ms else 0)

    def terminate(self, receipt: bytes, now: int) -> None:
        """A consumer's verdict: dead-letter the leased message now."""
        lease = self.current(receipt, now)
        self._do(("dead", lease.message.seq, "terminated"))

    def release_holder(self, holder: tuple) -> int:
        """A connection that received with ``release_on_close`` closed: its leases go back at once.  -> count."""
        mine = [lease for lease in self.leases.values() if lease.holder == holder]
        for lease in mine:
            self._release(lease, 0)
        return len(mine)

    def _release(self, lease: Lease, ready_at: int) -> str:
        limit = self.settings.max_deliveries
        if limit and lease.message.deliveries >= limit:
            self._do(("dead", lease.message.seq, "max_deliveries"))
            return "dead"
        self._do(("requeue", lease.receipt, ready_at))
        return "delayed" if ready_at else "visible"

    # -- time -----------------------------------------------------------------------------------------------
    def expire(self, now: int) -> int:
        """Make due delayed messages visible and lapse expired leases.  -> when to look next (0: nothing
        pending)."""
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            ready_at, _, msg = heapq.heappop(delayed)
            if msg.ready_at == ready_at and msg.lease is None and self.messages.get(msg.seq) is msg:
                msg.ready_at = 0
                heapq.heappush(self._ready, (-msg.priority, msg.seq, msg))
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, receipt = heapq.heappop(deadlines)
            lease = self.leases.get(receipt)
            if lease is not None and lease.deadline == deadline:
                self.expired += 1
                self._release(lease, 0)
        due = [heap[0][0] for heap in (delayed, deadlines) if heap]
        return min(due) if due else 0

    # -- administration -------------------------------------------------------------------------------------
    def purge(self) -> int:
        """Everything goes at once: visible, delayed and leased.  A later ack of a purged lease is ``purged``."""
        count = len(self.messages)
        self._do(("purge",))
        return count

    def peek_visible(self, limit: int) -> list[Message]:
        """Up to ``limit`` visible messages, in serving order, left where they are."""
        return [entry[2] for entry in heapq.nsmallest(limit, self._ready)]

    def take(self, messages: list[Message]) -> list[Message]:
        """Remove these visible messages (a redrive takes them from a DLQ)."""
        if messages:
            self._do(("take", [msg.seq for msg in messages]))
        return messages

    def stat(self, wall: int) -> dict:
        oldest = min((entry[2].enqueued_at for entry in self._ready), default=0)
        return {
            "queue": self.name, "visible": self.visible, "in_flight": self.in_flight, "delayed": self.delayed,
            "messages": len(self.messages), "bytes": self.bytes,
            "oldest_visible_age_ms": (wall - oldest) // MS if oldest else 0,
            "pushed": self.pushed, "delivered": self.delivered, "redelivered": self.redelivered,
            "acked": self.acked, "nacked": self.nacked, "expired": self.expired, "extended": self.extended,
            "dead_lettered": self.dead_lettered, "stale_receipts": self.stale_receipts,
            "duplicate_acks": self.duplicate_acks, "rejected": self.rejected,
        }


def is_dlq(name: str) -> bool:
    return name.endswith(DLQ_SUFFIX)
