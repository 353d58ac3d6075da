"""Counts per key (a user, an address) of things that come and go, which forget a key at zero: the limits per
party count what stands now, and a key nobody holds anything under must not stay behind."""

from __future__ import annotations

from collections.abc import Hashable


class Tally:
    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[Hashable, int] = {}

    def __getitem__(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    def add(self, key: Hashable) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def remove(self, key: Hashable) -> None:
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]
