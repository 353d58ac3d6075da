"""What systemd hears from the supervisor while it runs: watchdog pings, the status line, stop-timeout extensions.

- Watchdog: ``WATCHDOG=1`` every half ``WatchdogSec``, from a task on the supervisor's own event loop, so a ping
  proves that loop runs (a blocked or stopped supervisor sends none, and systemd aborts and restarts it).  Pings
  are withheld only when the broker cannot heal by itself: no worker ready for longer than half the interval.  One
  stuck or dead worker is the supervisor's to handle (heartbeat kill, replacement), not a reason for a restart.
- ``STATUS=``: at once on a change of state (ready, a worker lost, reloading, lame duck, stopping), and a line of
  counters (workers, connections, messages per second in and out) at most every ``STATUS_EVERY`` seconds.
- Stops: ``STOPPING=1``, then ``EXTEND_TIMEOUT_USEC`` every ``EXTEND_EVERY`` seconds while the drain makes
  progress, so the unit's ``TimeoutStopSec`` can stay short: a stop that is moving is given time, a stuck one is
  not (systemd kills it once the last extension runs out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from shardbroker.cluster.supervisor.systemd import Notifier

log = logging.getLogger("broker.systemd")

STATUS_EVERY = 10.0
EXTEND_EVERY = 2.0
EXTEND_BY = 3 * EXTEND_EVERY   # each extension outlives the next two: one late tick does not get us killed
PROGRESS_WINDOW = 5.0          # a drain whose count has not fallen for this long is not making progress


class Cluster(Protocol):
    """What this reads of the supervisor (cluster.supervisor.core.Supervisor), named here: it imports this."""

    state: str                   # "starting", "ready", "reloading", "lame duck", "stopping"
    nworkers: int
    slots: list[Any]             # WorkerSlot or None: .state, .index, .pid

    async def query(self, message: dict, timeout: float = 2.0, slots: list | None = None) -> list[dict]: ...


class ServiceStatus:
    def __init__(self, notifier: Notifier, watchdog_usec: int, cluster: Cluster) -> None:
        self.notifier = notifier
        self.sup = cluster
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else 0.0
        self._tasks: list[asyncio.Task] = []
        self._none_ready_since: float | None = None
        self._withholding = False
        self._counters: dict[int, tuple[int, int, int, float]] = {}   # worker -> (pid, in, out, when)
        self._last_line = ""
        self._due = 0.0       # monotonic: no counters line before this (STATUS_EVERY after any STATUS=)
        self._drain: asyncio.Task | None = None

    def start(self) -> None:
        if self.watchdog_interval:
            log.info("watchdog: pinging every %.3gs", self.watchdog_interval)
            self._tasks.append(asyncio.ensure_future(self._watchdog()))
        if self.notifier.enabled:
            self._tasks.append(asyncio.ensure_future(self._counters_loop()))

    def close(self) -> None:
        for task in self._tasks + ([self._drain] if self._drain else []):
            task.cancel()

    def set(self, text: str) -> None:
        """A change of state: said at once."""
        self._last_line = ""
        self._said(text)

    def _said(self, text: str) -> None:
        self._due = time.monotonic() + STATUS_EVERY
        self.notifier.send(STATUS=text)

    # -- watchdog -------------------------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        while True:
            if self._may_ping():
                self.notifier.send(WATCHDOG=1)
            await asyncio.sleep(self.watchdog_interval)

    def _may_ping(self) -> bool:
        if self.sup.state not in ("ready", "reloading"):
            return True   # booting has its own timeout, stopping its own deadline
        if any(s is not None and s.state == "ready" for s in self.sup.slots):
            if self._withholding:
                log.warning("watchdog: a worker is ready again; pinging")
            self._none_ready_since, self._withholding = None, False
            return True
        now = time.monotonic()
        if self._none_ready_since is None:
            self._none_ready_since = now
        if now - self._none_ready_since <= self.watchdog_interval:
            return True
        if not self._withholding:
            self._withholding = True
            log.error("watchdog: no worker ready for %.1fs; withholding pings (systemd restarts the service "
                      "unless one comes back)", now - self._none_ready_since)
            self.set("no worker ready: watchdog pings withheld")
        return False

    # -- the counters line ----------------------------------------------------------------------------------
    async def _counters_loop(self) -> None:
        """The interval counts from the last STATUS= of any kind, READY=1's included: the supervisor says that one
        itself, so becoming ready is noticed here (within a second) and taken as a line said, and the counts then
        are the base of the first line's rates (else it would always say 0 msg/s)."""
        ready = False
        while True:
            await asyncio.sleep(max(1.0, self._due - time.monotonic()) if ready else 1.0)
            if self.sup.state != "ready":
                ready = self.sup.state == "reloading" and ready   # a reload ends in "ready" again
                continue
            if not ready:
                ready = True
                self._due = time.monotonic() + STATUS_EVERY
                await self.counters_line()
                continue
            if time.monotonic() < self._due:
                continue   # a change of state was said meanwhile
            line = await self.counters_line()
            self._due = time.monotonic() + STATUS_EVERY
            if line != self._last_line and self.sup.state == "ready":
                self._last_line = line
                self._said(line)

    async def counters_line(self) -> str:
        replies = [r for r in await self.sup.query({"k": "stats"}) if not r.get("unresponsive")]
        now = time.monotonic()
        rate_in = rate_out = 0.0
        for r in replies:
            pid, msgs_in, msgs_out = r.get("pid", 0), r.get("in_msgs", 0), r.get("out_msgs", 0)
            before = self._counters.get(r["worker"])
            if before is not None and before[0] == pid and now > before[3]:  # a new pid counts from zero
                rate_in += (msgs_in - before[1]) / (now - before[3])
                rate_out += (msgs_out - before[2]) / (now - before[3])
            self._counters[r["worker"]] = (pid, msgs_in, msgs_out, now)
        ready = sum(1 for s in self.sup.slots if s is not None and s.state == "ready")
        conns = sum(r.get("connections", 0) for r in replies)
        return (f"serving: {ready}/{self.sup.nworkers} workers ready, {conns} connections, "
                f"{rate_in:.0f} msg/s in, {rate_out:.0f} msg/s out")

    # -- stopping -------------------------------------------------------------------------------------------
    def drain(self, what: str, left: Callable[[], tuple[int, str]], deadline: float,
              quiet_until: float = 0.0) -> None:
        """A drain began (``what``: "stopping", "lame duck"): ``STOPPING=1`` now, then extensions while the count
        ``left()`` returns (connections, workers; with the words for it) keeps falling, or until ``quiet_until`` (a
        planned wait, such as the lame duck's grace period), and never past ``deadline`` (monotonic), which the
        supervisor enforces itself."""
        self.notifier.send(STOPPING=1, STATUS=f"{what}: {left()[1]}")
        if self._drain is not None:
            self._drain.cancel()
        if self.notifier.enabled:
            self._drain = asyncio.ensure_future(self._extend(what, left, deadline, quiet_until))

    async def _extend(self, what: str, left: Callable[[], tuple[int, str]], deadline: float,
                      quiet_until: float) -> None:
        last, moved = left()[0], time.monotonic()
        while True:
            await asyncio.sleep(EXTEND_EVERY)
            now, (count, text) = time.monotonic(), left()
            if count < last:
                last, moved = count, now
            if now >= deadline:
                return
            if now < quiet_until or now - moved < PROGRESS_WINDOW:
                usec = int(min(EXTEND_BY, deadline - now + 1.0) * 1e6)
                self.notifier.send(EXTEND_TIMEOUT_USEC=usec, STATUS=f"{what}: {text}")
            else:
                self.notifier.send(STATUS=f"{what}: {text}, no progress for {now - moved:.0f}s")
