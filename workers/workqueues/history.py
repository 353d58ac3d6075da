"""What a queue remembers of what is over: an acked (lost, purged) receipt's fate, so that a repeated ack is
answered ``already_acked`` and a late one ``lease_lost``; a stored push's token, so that a push resent after a
crash is not stored twice.

Kept for a time, not for ever: memory must follow the rate of messages, not how long the broker has run.  Two
generations of plain dicts: entries go into the newer, and when it is ``seconds`` old (or holds half of ``limit``)
it becomes the older and the older one is dropped whole.  So every entry is remembered for at least ``seconds``
unless ``limit`` entries came after it, and the whole holds at most ``limit`` and about twice ``seconds`` worth of
traffic, without a timestamp per entry.  A worker's queues together are held to a budget as well (``trim``, the
shard's ``HISTORY_BUDGET``): traffic spread over many queues is within each one's ``limit``, and would otherwise
be bounded only by its rate times ``seconds``.

Remembered in batches, looked up rarely: nearly every acked receipt is never named again, so ``add`` keeps a
batch's keys as the list they came in (one append), and a generation's batches become dict entries only when
something looks in it or sets an entry.  At 250,000 acks a second, a dict entry per receipt, in a dict of 50,000
that no cache holds, cost about a tenth of the owner's time for a receive and ack; a lookup now pays for the
entries added since the last one, which is at most what those acks paid before, but at once: up to half of
``limit`` for a receipt the newer generation holds (~9 ms for 50,000 on the machine of docs/performance.md), all of
it for one it does not.  So the acks have a history of their own (``model.Queue._acks``), which only a repeated or
an unknown receipt looks in; the other fates (a lease lost to its deadline, purged) are set one by one in another.
"""

from __future__ import annotations

import heapq
import time

SECONDS = 300.0      # at least this long: as SQS's deduplication interval; a crash's resend comes within seconds
LIMIT = 100_000      # and at most this many entries per queue and kind, however fast they come

_MISSING = object()


class History:
    __slots__ = ("limit", "seconds", "_new", "_old", "_new_batches", "_old_batches", "_new_batched", "_old_batched",
                 "_since", "_old_since", "_clock")

    def __init__(self, limit: int = LIMIT, seconds: float = SECONDS, clock=time.monotonic) -> None:
        self.limit = limit
        self.seconds = seconds
        self._clock = clock
        self._since = self._old_since = clock()   # when the newer (older) generation began
        self.clear()

    def _room(self, n: int) -> None:
        """Room for ``n`` new entries in the newer generation: a fresh one if they would not fit, or it is old."""
        if len(self._new) + self._new_batched + n > self.limit // 2 or self._clock() - self._since >= self.seconds:
            self._old, self._old_batches, self._old_batched = self._new, self._new_batches, self._new_batched
            self._new, self._new_batches, self._new_batched = {}, [], 0
            self._old_since, self._since = self._since, self._clock()

    def oldest(self) -> float:
        """When the oldest generation holding anything began (``drop_oldest`` drops it)."""
        return self._old_since if self._old or self._old_batched else self._since

    def drop_oldest(self) -> int:
        """Forget the older generation, or the newer one if the older is empty: what a worker does when all its
        queues' histories together hold more than it allows (``trim``).  -> entries dropped."""
        if self._old or self._old_batched:
            n = len(self._old) + self._old_batched
            self._old, self._old_batches, self._old_batched = {}, [], 0
            return n
        n = len(self._new) + self._new_batched
        self._new, self._new_batches, self._new_batched = {}, [], 0
        self._since = self._clock()
        return n

    def _settle_new(self) -> None:
        """The newer generation's batches into its dict, oldest first (they are all newer than what the dict
        holds: whatever sets an entry settles them first)."""
        _settle(self._new, self._new_batches)
        self._new_batched = 0

    def _settle_old(self) -> None:
        _settle(self._old, self._old_batches)
        self._old_batched = 0

    # A key set again is not looked for in the older generation: ``get`` looks in the newer first, so the newest
    # value wins all the same, and the stale one goes with its generation.  (Most keys are receipts that just
    # ended their leases, which no generation holds; looking for each in a dict of 50,000 cost ~0.3 µs an ack.)
    def __setitem__(self, key, value) -> None:
        self._room(1)
        if self._new_batches:
            self._settle_new()
        self._new[key] = value

    def add(self, keys: list | str, value, width: int = 0) -> None:
        """``value`` for each of ``keys``, kept as the list itself until something is looked up: the caller
        leaves the list as it is from now on.  With ``width``, ``keys`` is one str of keys that long each, joined:
        one object kept instead of one per key (acked receipts: theirs are freed at once, while the caches still
        hold them, rather than with their generation)."""
        n = len(keys) // width if width else len(keys)
        self._room(n)
        self._new_batches.append((keys, value, width))
        self._new_batched += n

    def get(self, key, default=None):
        """The older generation's batches are settled only when the newer does not hold ``key``: a repeated ack
        is usually of a recent receipt."""
        if self._new_batches:
            self._settle_new()
        value = self._new.get(key, _MISSING)
        if value is _MISSING:
            if self._old_batches:
                self._settle_old()
            return self._old.get(key, default)
        return value

    def __getitem__(self, key):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def pop(self, key, default=None):
        if self._new_batches:
            self._settle_new()
        if self._old_batches:
            self._settle_old()
        value = self._new.pop(key, _MISSING)
        old = self._old.pop(key, _MISSING)
        if value is _MISSING:
            value = old
        return default if value is _MISSING else value

    def items(self) -> list[tuple]:
        """Every entry, the older generation's first (so that setting them in order keeps the newest value)."""
        if self._new_batches:
            self._settle_new()
        if self._old_batches:
            self._settle_old()
        return [*self._old.items(), *self._new.items()]

    def __len__(self) -> int:
        """Entries held (a key set again while its older value is kept counts twice)."""
        return len(self._new) + len(self._old) + self._new_batched + self._old_batched

    def clear(self) -> None:
        self._new: dict = {}
        self._old: dict = {}
        self._new_batches: list = []   # (keys, value, width) that ``add`` kept, not yet in the dict: newer than it
        self._old_batches: list = []
        self._new_batched = self._old_batched = 0   # keys in those batches


def trim(histories: list[History], budget: int) -> int:
    """Drop the oldest generations among ``histories`` until they hold ``budget`` entries or fewer: each queue's
    are bounded by ``LIMIT``, but a worker's many queues together only by their rate times ``SECONDS``.  So the
    time each is kept shrinks, oldest first, whichever queue it is in, once a worker's traffic fills the budget
    within ``SECONDS``.  -> entries dropped."""
    held = sum(map(len, histories))
    if held <= budget:
        return 0
    heap = [(h.oldest(), i) for i, h in enumerate(histories) if len(h)]
    heapq.heapify(heap)
    dropped = 0
    while held - dropped > budget and heap:
        _, i = heapq.heappop(heap)
        h = histories[i]
        dropped += h.drop_oldest()
        if len(h):
            heapq.heappush(heap, (h.oldest(), i))
    return dropped


def _settle(gen: dict, batches: list) -> None:
    for keys, value, width in batches:
        if width:
            keys = [keys[i:i + width] for i in range(0, len(keys), width)]
        gen.update(dict.fromkeys(keys, value))
    batches.clear()
