"""What the hub advertised on one leaf connection (LS+/LS-): matched for every local publish that may go there.

Kept per connection and dropped with it: the hub resends all of it on every connect, and state kept across a
reconnect is how nats-server's own stale-interest bugs came about (../shared/reference/leafnodes.md §7).  Bounded
(``limit``): an LS+ flood closes the connection rather than fill the worker's memory.
"""

from __future__ import annotations

from shardbroker.router.subjects import is_valid_pattern
from shardbroker.router.sublist import Sublist

PLAIN = ""   # the trie's value for plain interest; a queue group's is its name


class HubInterest:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.trie = Sublist()
        self.weights: dict[tuple[bytes, bytes | None], int] = {}
        self._changed = False

    def __len__(self) -> int:
        return len(self.weights)

    def add(self, subject: bytes, queue: bytes | None, weight: int) -> bool:
        """An LS+ (a repeated one updates a queue's weight).  False: over the limit."""
        key = (subject, queue)
        if key not in self.weights:
            if len(self.weights) >= self.limit:
                return False
            try:
                pattern = subject.decode()
                name = queue.decode() if queue is not None else PLAIN
            except UnicodeDecodeError:
                return True   # nothing here can publish to it
            if not is_valid_pattern(pattern, 1 << 16) or name == PLAIN and queue is not None:
                return True
            self.trie.insert(pattern, name)
            self._changed = True
        self.weights[key] = weight
        return True

    def remove(self, subject: bytes, queue: bytes | None) -> None:
        if self.weights.pop((subject, queue), None) is None:
            return
        try:
            self.trie.remove(subject.decode(), queue.decode() if queue is not None else PLAIN)
        except UnicodeDecodeError:
            return
        self._changed = True

    def clear(self) -> bool:
        """Forget everything (the connection is gone); whether there was anything."""
        had = bool(self.weights)
        self.weights = {}
        self.trie = Sublist()
        self._changed = False
        return had

    def take_changed(self) -> bool:
        changed, self._changed = self._changed, False
        return changed

    def match(self, subject: str) -> tuple[bool, list[str]]:
        """(whether the hub has plain interest in ``subject``, its queue groups' names)."""
        names = set(self.trie.match(subject))
        plain = PLAIN in names
        names.discard(PLAIN)
        return plain, sorted(names)
