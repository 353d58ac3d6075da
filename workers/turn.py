"""The end of an event-loop turn: an explicit, ordered list of phases that their owners register.

A client's read, a fabric frame, a timer: whatever a turn did is queued, not written (``STYLE.md``: queue, don't
write).  When the turn ends, ``Turn.run`` runs the phases below in this order, each whatever an earlier one raised
(``router.guard``): a phase that failed must not keep the fabric's frames or the other connections' output from
leaving.  The order is the contract:

1. ``counters``    the subject counters of this turn's routes folded by owner (the hub)
2. ``journal``     the work queues' changes written to their journal, before any reply to them leaves
3. ``batch``       the open batch of consecutive messages to one subject ends (the hub)
4. ``fabric``      one frame per other worker
5. ``connections`` one write per connection that has output (``mark_dirty``)
6. ``background``  the work queues' background work, now that the replies are out

A phase nobody registered (a worker without work queues) is skipped.  ``TURN_BUDGET`` bounds the work of one turn:
a read, or a fabric frame, that would do more waits for the next turn, so that no client holds the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from shardbroker.router import guard

# Units of work one turn may do before the rest of a read or of a fabric frame waits for the next: a publish, a
# delivery handled alone, a write to one subscriber of a batch and each KiB copied into batches
# (workers.fanout.batch_cost); a work-queue push counts as several (workqueues.service.PUSH_WORK).
TURN_BUDGET = 20_000

PHASES = ("counters", "journal", "batch", "fabric", "connections", "background")


class Flushable(Protocol):
    def flush(self) -> None: ...


class Turn:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_start: Callable[[], None]) -> None:
        self.loop = loop
        self._on_start = on_start   # a new turn's budget
        self._phases: dict[str, Callable[[], None]] = {}
        self._order: list[tuple[str, Callable[[], None]]] = []
        self._dirty: list[Flushable] = []
        self._scheduled = False
        self.add("connections", self._flush_connections)

    def add(self, phase: str, run: Callable[[], None]) -> None:
        """``run`` is phase ``phase`` (one of ``PHASES``) of every turn's end from now on."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}: one of {', '.join(PHASES)}")
        if phase in self._phases:
            raise ValueError(f"phase {phase!r} has an owner already")
        self._phases[phase] = run
        self._order = [(name, self._phases[name]) for name in PHASES if name in self._phases]

    def mark_dirty(self, conn: Flushable) -> None:
        """``conn`` has output: it is flushed once at the end of this turn."""
        self._dirty.append(conn)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.run)

    def schedule(self) -> None:
        """Something was queued that only the end of a turn sends: make sure that end comes."""
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        self._scheduled = False
        self._on_start()
        for name, run in self._order:
            guard.call(name, run)

    def _flush_connections(self) -> None:
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            try:
                conn.flush()
            except Exception:
                guard.failed("a connection's flush")
