"""/connz ``sort=``: nats-server's keys, applied on each worker before the page is cut.

Each worker orders its own connections and returns only the first ``offset + limit``; the supervisor merges those
lists with the same order and cuts the page.  The page is what one sort of every connection would give, and a
worker holding 10,000 connections ships a screenful, not all of them (nats-top asks ``sort=...&limit=N`` once a
second).  Ties go by cid, so pages are stable.  Error texts are nats-server's.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

# sort key -> (the /connz field it orders by, descending).  As in nats-server (server/monitor.go): only cid (and
# start, the same order) ascend; uptime ascends too (the newest connection first), and idle is last ascending.
SORT_KEYS: dict[str, tuple[str, bool]] = {
    "cid": ("cid", False),
    "start": ("cid", False),
    "subs": ("subscriptions", True),
    "pending": ("pending_bytes", True),
    "msgs_to": ("out_msgs", True),
    "msgs_from": ("in_msgs", True),
    "bytes_to": ("out_bytes", True),
    "bytes_from": ("in_bytes", True),
    "last": ("last_activity", True),
    "idle": ("last_activity", False),
    "uptime": ("start", True),
    "rtt": ("rtt", True),
}
CLOSED_ONLY = ("stop", "reason")   # valid keys of nats-server's, for closed connections, which are not kept here


def check(sort: str | None) -> str:
    """The sort key to use, or ValueError with nats-server's text."""
    if not sort:
        return "cid"
    if sort in CLOSED_ONLY:
        raise ValueError(f"sort by {sort} only valid on closed connections")
    if sort not in SORT_KEYS:
        raise ValueError(f"invalid sorting option: {sort}")
    return sort


def top(items: Iterable[T], sort: str, n: int | None, get: Callable[[T, str], float],
        cid: Callable[[T], int]) -> list[T]:
    """The first ``n`` of ``items`` (all with None) in ``sort``'s order; ``get(item, field)`` reads a field."""
    field, descending = SORT_KEYS[sort]
    if descending:
        def key(item):
            return -get(item, field), cid(item)
    else:
        def key(item):
            return get(item, field), cid(item)
    return sorted(items, key=key) if n is None else heapq.nsmallest(n, items, key=key)
