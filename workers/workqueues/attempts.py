"""Receives named by an attempt id, and the groups of leases they make (docs/queues.md#attempts): what a consumer
that may run the same receive twice needs, Spark's source first (docs/spark.md).

- A receive with an ``attempt`` id leases as any receive and remembers the deliveries under its id.  The same id
  again, while any of those leases lives, gets the same deliveries back (same messages, same receipts), whatever
  became of the connection that asked first: a retried task, or a query replaying its batch after a restart, reads
  exactly what the first read.  Once none lives (acked, or expired and so visible again: never lost), the id
  receives anew.  SQS FIFO's ``ReceiveRequestAttemptId``, generalised to any queue.
- An ack or an extend naming attempt ids acts on every live lease of those receives, in one request.
- Kept in the owner's memory, per queue, until the group is acked or all its leases are past their deadline
  (however they were extended: by the group or one by one), at most ``MAX_PER_QUEUE`` (the oldest go first).
  A crash of the owner forgets them: a replay then receives anew, and the first receive's leases come back when
  they expire (journaled like every lease).
"""

from __future__ import annotations

from shardbroker.workers.workqueues.messages import D_RECEIPT, L_DEADLINE
from shardbroker.workers.workqueues.rules import QueueError

MAX_ATTEMPT_ID = 256       # characters
MAX_PER_QUEUE = 10_000     # attempts remembered per queue


def check_id(value: object) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_ATTEMPT_ID:
        raise QueueError("invalid_attempt", min=1, max=MAX_ATTEMPT_ID)
    return value


class Attempts:
    """One queue's attempts: id -> (deliveries, the latest deadline among their leases, in ns)."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: dict[str, tuple[list[tuple], int]] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def replay(self, attempt: str, leases: dict, now: int) -> list[tuple] | None:
        """The deliveries of ``attempt`` whose leases live (``leases``: the queue's receipt -> lease), or None
        if it is unknown or none lives (then it is forgotten, and the caller receives anew under it)."""
        group = self.groups.get(attempt)
        if group is None:
            return None
        live = [d for d in group[0] if _live(leases.get(d[D_RECEIPT]), now)]
        if not live:
            del self.groups[attempt]
            return None
        return live

    def record(self, attempt: str, deliveries: list[tuple], deadline: int) -> None:
        groups = self.groups
        groups.pop(attempt, None)
        while len(groups) >= MAX_PER_QUEUE:
            del groups[next(iter(groups))]
        groups[attempt] = (deliveries, deadline)

    def receipts(self, attempts: list, forget: bool) -> tuple[list[str], list[str]]:
        """(the receipts of the known attempts among ``attempts``, the unknown ones); ``forget``: the groups go
        (an ack ends them)."""
        out: list[str] = []
        unknown: list[str] = []
        for attempt in attempts:
            group = self.groups.pop(attempt, None) if forget else self.groups.get(attempt)
            if group is None:
                unknown.append(attempt)
            else:
                out.extend(d[D_RECEIPT] for d in group[0])
        return out, unknown

    def extended(self, attempts: list, deadline: int) -> None:
        for attempt in attempts:
            group = self.groups.get(attempt)
            if group is not None and group[1] < deadline:
                self.groups[attempt] = (group[0], deadline)

    def sweep(self, now: int, leases: dict) -> None:
        """Forget the groups all of whose leases are past their deadline (``leases``: the queue's receipt ->
        lease).  A group past its own deadline whose leases were extended one by one (by receipt) lives on."""
        for attempt in [a for a, (_, deadline) in self.groups.items() if deadline <= now]:
            deliveries = self.groups[attempt][0]
            latest = max((lease[L_DEADLINE] for lease in map(leases.get, (d[D_RECEIPT] for d in deliveries))
                          if lease is not None), default=0)
            if latest > now:
                self.groups[attempt] = (deliveries, latest)
            else:
                del self.groups[attempt]


def _live(lease: tuple | None, now: int) -> bool:
    return lease is not None and lease[L_DEADLINE] > now


def check_ids(value: object, most: int) -> list[str]:
    if type(value) is not list or not 0 < len(value) <= most:
        raise QueueError("invalid_attempts", max=most)
    return [check_id(v) for v in value]
