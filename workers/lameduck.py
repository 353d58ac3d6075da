"""A worker's half of lame duck mode (SIGUSR2, ``brokerctl lameduck``; the supervisor's half is
cluster.supervisor.lameduck).

As nats-server does it: every NATS client is told at once (``INFO {"ldm":true}``, which nats-py turns into its
``lame_duck_mode_cb``); after the grace period the worker closes its clients one by one, spread so that they come
back (elsewhere, or to the next instance) gradually rather than all in the same second.  NDJSON, Bridge and qlite
clients have no such message and are simply closed on the same schedule.  A close is the graceful one: what is
queued for the client is sent first.

The pace is the cluster's, not the worker's: the supervisor counts ``total`` clients over all workers and the
interval between two closes anywhere, ``min(1 s, window / total)``, so all of them are closed within
``min(window, total s)``; each worker spreads its own share over that span, adjusting as its clients leave by
themselves.  Whatever is still open at the end of the window is closed then.  When the worker has no connection
left it tells the supervisor (``done``), which stops the workers once all are done.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardbroker.workers.connection import LINGER

if TYPE_CHECKING:
    from shardbroker.workers.hub import Hub

log = logging.getLogger("broker.lameduck")

MAX_INTERVAL = 1.0   # nats-server's cap on the time between two closes (over the whole server)


class LameDuck:
    def __init__(self, hub: Hub, grace: float, window: float, total: int, done: Callable[[], None]) -> None:
        self.hub = hub
        self.grace = grace
        self.window = window
        self.total = total
        self._done = done
        self.closed = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        told = 0
        for conn in list(self.hub.conns.values()):
            told += conn.lame_duck()
        log.info("lame duck: %d connection(s), %d NATS client(s) told; the first close in %gs",
                 len(self.hub.conns), told, self.grace)
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.grace)
        start = loop.time()
        hard_end = start + self.window
        end = start + min(self.window, self.total * min(MAX_INTERVAL, self.window / max(1, self.total)))
        if self.hub.conns:   # each worker starts its closes at a random phase: their first ones do not coincide
            await asyncio.sleep((end - start) / len(self.hub.conns) * random.random())
        while True:
            pending = [c for c in self.hub.conns.values() if not c.closed]
            if not pending:
                break
            now = loop.time()
            if now >= hard_end:
                log.warning("lame duck: the duration is over; closing the last %d connection(s)", len(pending))
                for conn in pending:
                    conn.close()
                self.closed += len(pending)
                break
            pending[0].close()   # the oldest first
            self.closed += 1
            if len(pending) > 1:
                interval = max(0.0, end - now) / len(pending)
                # Jittered (mean kept) so that workers' closes do not fall in step; never past the window.
                await asyncio.sleep(min(interval * random.uniform(0.5, 1.5), max(0.0, hard_end - now)))
        # The closes complete: each waits for its client's close, LINGER at most once its output has drained.
        # A client that reads too slowly to drain it is not waited for past the window (and two LINGERs).
        while self.hub.conns:
            if loop.time() > hard_end + 2 * LINGER:
                for conn in list(self.hub.conns.values()):
                    conn.abort()
                break
            await asyncio.sleep(0.05)
        log.info("lame duck: every connection closed (%d by us)", self.closed)
        self._done()
