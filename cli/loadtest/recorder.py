"""Per-task measurement: latencies into plain arrays during an interval, one HdrHistogram blob per metric when it
ends, and the counters of the interval's row.

Recording a value is an ``array.append`` (0.1 µs); the histogram is built once per interval from a ``Counter`` of
the values, which costs far less than a ``record_value`` per message.  Values outside the histogram's range are
clamped and counted, negative ones counted and recorded as 0: none is dropped.
"""

from __future__ import annotations

from array import array
from collections import Counter

from hdrh.histogram import HdrHistogram

METRICS = ("e2e_corrected", "e2e_raw", "e2e_cross", "send_lag", "ack_corrected", "ack_raw")
LOWEST_US, HIGHEST_US, DIGITS = 1, 60_000_000, 3
CHUNK = 20_000               # values counted per step at an interval's end
COUNTERS = ("target", "sent", "acked", "send_errors", "received", "redelivered", "bytes_out", "bytes_in")


def histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)


class Interval:
    __slots__ = METRICS + COUNTERS

    def __init__(self) -> None:
        for m in METRICS:
            setattr(self, m, array("q"))
        for c in COUNTERS:
            setattr(self, c, 0)


class Recorder:
    """One task's intervals.  ``cur`` is the interval being filled; ``roll`` closes it into a row."""

    def __init__(self, run_id: str, workload: str, task: int, interval_s: float, warmup_s: float,
                 duration_s: float) -> None:
        self.base = {"run_id": run_id, "workload": workload, "task": task}
        self.interval_s = interval_s
        self.warmup_n = round(warmup_s / interval_s)
        self.measure_end = self.warmup_n + round(duration_s / interval_s)
        self.cur = Interval()
        self.index = 0
        self.rows: list[dict] = []
        self.clamped = 0
        self.negative = 0
        # Whole-measure-phase histograms this task needs itself (send lag decides `generator_bound`).
        self.measure_send_lag = histogram()
        self.last_p99_us = 0
        self.totals = Counter()

    def phase(self, index: int) -> str:
        return "warmup" if index < self.warmup_n else "measure" if index < self.measure_end else "drain"

    def _blob(self, values: array, keep: HdrHistogram | None = None):
        """Steps (a generator) that build one interval's histogram blob; it yields between chunks so a task's loop
        never stalls for long at an interval's end (at 150k values the whole job takes ~15 ms), and returns
        (blob, p99)."""
        if not values:
            return "", 0
        counts: Counter = Counter()
        for at in range(0, len(values), CHUNK):
            counts.update(values[at:at + CHUNK])
            yield
        h = histogram()
        for i, (v, n) in enumerate(counts.items()):
            if v < 0:
                self.negative += n
                v = 0
            elif v > HIGHEST_US:
                self.clamped += n
                v = HIGHEST_US
            h.record_value(v, n)
            if keep is not None:
                keep.record_value(v, n)
            if i % 1000 == 999:
                yield
        return h.encode(), h.get_value_at_percentile(99)

    def roll_steps(self, cpu_pct: float):
        """Ends the current interval: steps (a generator) whose return value is the row, also appended to
        ``rows``."""
        iv, self.cur = self.cur, Interval()
        index = self.index
        self.index += 1
        phase = self.phase(index)
        row = dict(self.base, interval=index, interval_start_ms=round(index * self.interval_s * 1000), phase=phase,
                   cpu_pct=cpu_pct)
        for c in COUNTERS:
            row[c] = getattr(iv, c)
            self.totals[c] += row[c]
        for m in METRICS:
            keep = self.measure_send_lag if m == "send_lag" and phase == "measure" else None
            row[m + "_hdr"], p99 = yield from self._blob(getattr(iv, m), keep)
            if m == "e2e_corrected" and p99:
                self.last_p99_us = p99
        row["clamped"], row["negative_e2e"] = self.clamped, self.negative
        self.clamped = self.negative = 0
        self.rows.append(row)
        return row

    def roll(self, cpu_pct: float) -> dict:
        steps = self.roll_steps(cpu_pct)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
