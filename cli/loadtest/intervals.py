"""A load-test task's interval rows: one closed per interval on the agreed clock, with what is not counted as it
happens (the open model's target, the bytes, the CPU), and the progress datagram each sends to the driver.

``Intervals`` is mixed into ``TaskRun`` (cli/loadtest/task.py), which holds the recorder and the connections;
the rows themselves are the recorder's (cli/loadtest/recorder.py).  Apart from the task because closing an
interval on time is the same work whatever the task's role.
"""

from __future__ import annotations

import asyncio
import socket
import time

import orjson

_now = time.monotonic_ns


class Intervals:
    """A ``TaskRun``'s interval clock.  It reads the task's state (``spec``, ``rec``, ``t0``, ``pubs``,
    ``all_conns``, ``proc``) and keeps its own counters on it (``bytes_counted``, ``cpu_peak``, ``_rolling``)."""

    async def intervals(self) -> None:
        while True:
            end = self.t0 + (self.rec.index + 1) * self.interval_ns
            await asyncio.sleep(max(0.0, (end - _now()) / 1e9))
            # Shielded: cancelling the ticker at the end must not lose an interval half rolled.
            self._rolling = asyncio.ensure_future(self.roll_async())
            self.progress(await asyncio.shield(self._rolling))

    async def roll_async(self) -> dict:
        steps = self.rec.roll_steps(self._close_counters())
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            await asyncio.sleep(0)

    def roll(self) -> dict:
        return self.rec.roll(self._close_counters())

    def _close_counters(self) -> float:
        """Fills the current interval's counters that are not counted as they happen: what the plan meant to send in
        it (the open model's target) and the bytes; returns the CPU use since the last interval."""
        if self.publishing and not self.closed_model:
            lo = self.t0 + self.rec.index * self.interval_ns
            self.rec.cur.target = sum(p.schedule.planned(lo, lo + self.interval_ns) for p in self.pubs
                                      if p.schedule is not None)
        out = sum(c.bytes_out for c in self.all_conns)
        inb = sum(c.bytes_in for c in self.all_conns)
        self.rec.cur.bytes_out, self.rec.cur.bytes_in = out - self.bytes_counted[0], inb - self.bytes_counted[1]
        self.bytes_counted = (out, inb)
        pct = self.cpu_pct()
        if self.rec.phase(self.rec.index) == "measure":
            # Only whole measure-phase intervals decide `generator_bound`: the last, partial interval (closed
            # after the drain) can be a few ms of wall time, and a few ms of closing work read as 100 % of a core.
            self.cpu_peak = max(self.cpu_peak, pct)
        return pct

    def cpu_pct(self) -> float:
        """This process's CPU since the last call, in % of one core."""
        cpu, t = self.proc.cpu_times(), time.monotonic()
        pct = 100.0 * ((cpu.user + cpu.system) - self._cpu_last) / max(1e-6, t - self._t_last)
        self._cpu_last, self._t_last = cpu.user + cpu.system, t
        return pct

    def progress(self, row: dict) -> None:
        where = self.spec.get("progress")
        if not where:
            return
        msg = {"task": self.spec["task"], "workload": self.w["name"], "role": self.role, "i": row["interval"],
               "sent": row["sent"], "acked": row["acked"], "received": row["received"],
               "p99": self.rec.last_p99_us}
        try:
            with socket.socket(socket.AF_INET6 if ":" in where[0] else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(orjson.dumps(msg), (where[0], where[1]))
        except OSError:
            pass    # progress is a courtesy; the rows carry the results
