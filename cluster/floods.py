"""Floods of one log line aggregated into one line per interval.

journald drops a service's lines beyond its rate limit (10,000 per 30 s by default), and what it drops first is
whatever came next: the one line that explained the storm goes with the storm.  A slow-consumer wave, a
misbehaving client fleet hitting a protocol error, a password-guessing run: each is one message template logged
over and over.  So per template (logger, level and the unformatted message), the first ``burst`` records of an
interval are written, the rest are counted, and when the interval is over one line says how many there were::

    slow consumer: cid 1532 had more than 1048576 bytes pending; closing it (and 1527 more like it in the last 10s)

Every process aggregates its own lines.  Only INFO and WARNING are aggregated, where client-caused storms land:
DEBUG is asked for to see every line, and an ERROR (a worker died, a listener failed) is rare and each one counts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable


class _Window:
    __slots__ = ("start", "count", "suppressed", "last")

    def __init__(self, start: float) -> None:
        self.start = start
        self.count = 0
        self.suppressed = 0
        self.last: logging.LogRecord | None = None


class FloodFilter(logging.Filter):
    """A handler filter: lets ``burst`` records of each template through per ``interval`` seconds, then counts, and
    writes the count through ``emit`` once the interval is over (on a timer of the running event loop, or with
    the template's next record, whichever comes first)."""

    def __init__(self, emit: Callable[[logging.LogRecord], None], interval: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._emit = emit
        self.interval = interval
        self.burst = burst
        self._clock = clock
        self._windows: dict[tuple, _Window] = {}
        self._lock = threading.Lock()
        self._timer: asyncio.TimerHandle | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.INFO <= record.levelno < logging.ERROR or self.interval <= 0:
            return True
        if getattr(record, "suppressed", None) is not None:
            return True   # our own count line: counting it would hold it back, or count it again
        key = (record.name, record.levelno, record.msg if isinstance(record.msg, str) else type(record.msg))
        now = self._clock()
        due = None
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.start >= self.interval:
                due = self._windows.pop(key)
                window = None
            if window is None:
                window = self._windows[key] = _Window(now)
            window.count += 1
            passed = window.count <= self.burst
            if not passed:
                window.suppressed += 1
                window.last = record
        if due is not None and due.suppressed:
            self._summarize(due)
        if not passed:
            self._arm(window.start + self.interval - now)
        return passed

    def flush(self, everything: bool = False) -> None:
        """Write the counts of the intervals that are over (``everything``: of all of them, as at exit)."""
        now = self._clock()
        with self._lock:
            over = [k for k, w in self._windows.items() if everything or now - w.start >= self.interval]
            done = [self._windows.pop(k) for k in over]
        for window in done:
            if window.suppressed:
                self._summarize(window)

    def _summarize(self, window: _Window) -> None:
        last = window.last
        record = logging.makeLogRecord(last.__dict__)
        record.msg = "%s (and %d more like it in the last %gs)"
        record.args = (last.getMessage(), window.suppressed, self.interval)
        record.exc_info = record.exc_text = record.stack_info = None
        record.created = time.time()
        record.msecs = (record.created % 1) * 1000
        record.suppressed = window.suppressed
        self._emit(record)

    def _arm(self, delay: float) -> None:
        """A timer for the end of an interval, so the count is written even if the flood stopped for good."""
        if self._timer is not None and not self._timer.cancelled():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop in this thread: the next record of the template writes it
            return
        self._timer = loop.call_later(max(0.0, delay) + 0.01, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.flush()
        with self._lock:
            pending = [w.start for w in self._windows.values() if w.suppressed]
        if pending:
            self._arm(min(pending) + self.interval - self._clock())
