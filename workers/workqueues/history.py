"""What a queue remembers of what is over: an acked (lost, purged) receipt's fate, so that a repeated ack is
answered ``already_acked`` and a late one ``lease_lost``; a stored push's token, so that a push resent after a
crash is not stored twice.

Kept for a time, not for ever: memory must follow the rate of messages, not how long the broker has run.  Two
generations of plain dicts: entries go into the newer, and when it is ``seconds`` old (or holds half of ``limit``)
it becomes the older and the older one is dropped whole.  So every entry is remembered for at least ``seconds``
unless ``limit`` entries came after it, and the whole holds at most ``limit`` and about twice ``seconds`` worth of
traffic, without a timestamp per entry.
"""

from __future__ import annotations

import time

SECONDS = 300.0      # at least this long: as SQS's deduplication interval; a crash's resend comes within seconds
LIMIT = 100_000      # and at most this many entries per queue and kind, however fast they come

_MISSING = object()


class History:
    __slots__ = ("limit", "seconds", "_new", "_old", "_since", "_clock")

    def __init__(self, limit: int = LIMIT, seconds: float = SECONDS, clock=time.monotonic) -> None:
        self.limit = limit
        self.seconds = seconds
        self._clock = clock
        self._new: dict = {}
        self._old: dict = {}
        self._since = clock()

    def _room(self, n: int) -> dict:
        """The generation ``n`` new entries go into: a fresh one if they would not fit in the newer, or it is old."""
        new = self._new
        if len(new) + n > self.limit // 2 or self._clock() - self._since >= self.seconds:
            self._old, new = new, {}
            self._new = new
            self._since = self._clock()
        return new

    # A key set again is not looked for in the older generation: ``get`` looks in the newer first, so the newest
    # value wins all the same, and the stale one goes with its generation.  (Most keys are receipts that just
    # ended their leases, which no generation holds; looking for each in a dict of 50,000 cost ~0.3 µs an ack.)
    def __setitem__(self, key, value) -> None:
        self._room(1)[key] = value

    def update(self, items: dict) -> None:
        """Many entries at once (a batch of acks): one look at the clock, and the dict's own update."""
        self._room(len(items)).update(items)

    def get(self, key, default=None):
        value = self._new.get(key, _MISSING)
        if value is _MISSING:
            return self._old.get(key, default)
        return value

    def __getitem__(self, key):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key) -> bool:
        return key in self._new or key in self._old

    def pop(self, key, default=None):
        value = self._new.pop(key, _MISSING)
        old = self._old.pop(key, _MISSING)
        if value is _MISSING:
            value = old
        return default if value is _MISSING else value

    def __len__(self) -> int:
        """Entries held (a key set again while its older value is kept counts twice)."""
        return len(self._new) + len(self._old)

    def clear(self) -> None:
        self._new = {}
        self._old = {}
