"""When each message of an open-loop publisher should be sent: a function of the plan, never of responses.

Latency is measured from these intended times (wrk2's correction of coordinated omission): if the broker or the
generator stalls, the schedule runs on and the backlog shows in the numbers instead of vanishing from them.
"""

from __future__ import annotations

import math
import random


class Schedule:
    """Intended send times (ns on the monotonic clock) of one connection, from ``t0`` on.

    ``share`` is the connection's fraction of the workload's aggregate rate; stages change the rate piecewise, and
    each stage's arrivals start at its boundary.  Poisson arrivals draw exponential gaps from a generator seeded by
    the plan, so a run can be repeated exactly.
    """

    def __init__(self, t0: int, stages: list[tuple[float, float]], share: float, poisson: bool, seed: int):
        self._start = t0
        self._bounds = []          # (end ns, rate per ns) per stage
        at = t0
        for duration, rate in stages:
            at += int(duration * 1e9)
            self._bounds.append((at, rate * share / 1e9))
        self.end = at
        self._rng = random.Random(seed) if poisson else None
        self._stage = -1
        self.next: float | None = None
        self._enter(0, t0)

    def _enter(self, stage: int, at: float) -> None:
        """Moves to ``stage`` (skipping idle ones), whose first arrival is at ``at``, its start."""
        while stage < len(self._bounds) and self._bounds[stage][1] <= 0:
            at = self._bounds[stage][0]
            stage += 1
        self._stage = stage
        if stage >= len(self._bounds):
            self.next = None
            return
        end, per_ns = self._bounds[stage]
        # Uniform times are stage start + k / rate, never a running sum: summed gaps drift by rounding, and a drift
        # of a few ns at the boundary adds or drops one send per stage (the plan's count must be exact).
        self._stage_start, self._k = at, 0
        self._uniform_n = max(1, math.ceil((end - at) * per_ns - 1e-6))
        self.next = at

    def pop(self) -> int:
        """The current intended time; moves to the next one (``next`` is None once the schedule is over)."""
        t = self.next
        end, per_ns = self._bounds[self._stage]
        if self._rng:
            nxt = t + self._rng.expovariate(per_ns)
            if nxt >= end:
                self._enter(self._stage + 1, end)
            else:
                self.next = nxt
        else:
            self._k += 1
            if self._k >= self._uniform_n:
                self._enter(self._stage + 1, end)
            else:
                self.next = self._stage_start + self._k / per_ns
        return int(t)

    def due(self, now: int, limit: int) -> list[int]:
        """Intended times up to ``now``, at most ``limit`` of them (the rest stay due: they are late, not lost)."""
        out = []
        while self.next is not None and self.next <= now and len(out) < limit:
            out.append(self.pop())
        return out

    def planned(self, lo: int, hi: int) -> int:
        """How many sends the plan puts in [lo, hi) ns (the mean, for Poisson arrivals)."""
        total = 0.0
        start = self._start
        for end, per_ns in self._bounds:
            a, b = max(lo, start), min(hi, end)
            if b > a:
                total += (b - a) * per_ns
            start = end
        return round(total)
