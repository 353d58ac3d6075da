"""How late this worker's event loop runs a timer: its event-loop lag, sampled ten times a second.

One worker's connections share one loop, so a timer that fires 40 ms late means each of them waited up to 40 ms
for its turn: the latency a publisher or subscriber of this worker sees on top of the network.  Kept as cumulative
counts in Prometheus' bucket layout (the supervisor ships them as a histogram, whose rate over any window gives the
distribution in it) and as the worst sample of the last 10 to 20 seconds, for a live console.  Ten wake-ups a second
cost nothing measurable; a loop blocked for 3 s shows as one 3 s sample when it comes back.
"""

from __future__ import annotations

import asyncio
import bisect
import time

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PERIOD = 0.1
WINDOW = 10.0


class LoopLag:
    def __init__(self) -> None:
        self._counts = [0] * (len(BUCKETS) + 1)   # per bucket, the last one above the largest bound
        self.sum = 0.0
        self.count = 0
        self.last = 0.0
        self._max = self._max_before = 0.0
        self._window_start = time.monotonic()
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._due = time.monotonic() + PERIOD
        self._handle = self._loop.call_later(PERIOD, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = time.monotonic()
        lag = max(0.0, now - self._due)
        self._counts[bisect.bisect_left(BUCKETS, lag)] += 1
        self.sum += lag
        self.count += 1
        self.last = lag
        if now - self._window_start >= WINDOW:
            self._max_before, self._max, self._window_start = self._max, 0.0, now
        if lag > self._max:
            self._max = lag
        self._due = now + PERIOD
        self._handle = self._loop.call_later(PERIOD, self._tick)

    def stats(self) -> dict:
        """``seconds``: the last sample; ``max_seconds``: the worst of the last 10-20 s; ``buckets``: cumulative
        counts of samples at or below each of ``bounds`` (the total is ``count``), ``sum`` in seconds."""
        cumulative, running = [], 0
        for n in self._counts[:-1]:
            running += n
            cumulative.append(running)
        return {"seconds": round(self.last, 6), "max_seconds": round(max(self._max, self._max_before), 6),
                "count": self.count, "sum": round(self.sum, 6), "bounds": BUCKETS, "buckets": cumulative}
