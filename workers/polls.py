"""The long polls a worker's clients have waiting (work-queue receives with a wait), bounded per connection
(``limits.max_pending_polls``) and over the worker (``limits.max_pending_polls_per_worker``).

Counted here, at the worker the client is on, from the request until its reply, whichever worker owns the queue:
that is where a client can pile them up (a NATS connection may send any number of receives), and where its close
forgets them.  Each owner keeps its own bounds per queue besides (workers/workqueues/shard.py).  A receive over a
bound gets the queues' own refusal, ``too_many_waiters`` (retryable), which every protocol already words.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from shardbroker.cluster.config import LimitsConfig

Reply = Callable[[dict], None]
REFUSED = {"ok": False, "error": "too_many_waiters", "retry": True}
PER_CONNECTION = "max_pending_polls"
PER_WORKER = "max_pending_polls_per_worker"


class Host(Protocol):
    """What the bounds need of the worker (``workers.hub.Hub``): its limits as they stand (a reload changes
    them), its loop, and where a breach is counted."""

    loop: asyncio.AbstractEventLoop
    limits: LimitsConfig

    def breach(self, limit: str) -> None: ...


class PendingPolls:
    def __init__(self, hub: Host) -> None:
        self.hub = hub
        self._by_conn: dict[int, int] = {}
        self.total = 0

    def admit(self, cid: int, reply: Reply) -> Reply | None:
        """The reply to pass on for a long poll of connection ``cid`` (it counts the poll as done when called), or
        None when a bound refuses it: ``reply`` then gets the refusal in a later callback, as a queue's own reply
        would come."""
        hub = self.hub
        limits = hub.limits
        waiting = self._by_conn.get(cid, 0)
        over = PER_CONNECTION if waiting >= limits.max_pending_polls else \
            PER_WORKER if self.total >= limits.max_pending_polls_per_worker else None
        if over is not None:
            hub.breach(over)
            hub.loop.call_soon(reply, dict(REFUSED))
            return None
        self._by_conn[cid] = waiting + 1
        self.total += 1

        def answered(result: dict) -> None:
            self._done(cid)
            reply(result)
        return answered

    def _done(self, cid: int) -> None:
        waiting = self._by_conn.get(cid)
        if waiting is None:   # its connection closed first: forgotten already
            return
        self.total -= 1
        if waiting > 1:
            self._by_conn[cid] = waiting - 1
        else:
            del self._by_conn[cid]

    def forget(self, cid: int) -> None:
        """Connection ``cid`` closed: its polls are dropped by their owners, unanswered."""
        self.total -= self._by_conn.pop(cid, 0)

    def waiting(self, cid: int | None = None) -> int:
        return self.total if cid is None else self._by_conn.get(cid, 0)
