"""The route cache: where a message to a subject goes, matched once and kept until something changes it.

A publish is matched against the tries once per subject and the result (a route) is cached until the next change
of either trie or of a permission: the generation counter moves and the cache is dropped whole.  A subject is
cached from its second route on: most reply inboxes are used once, and a route kept costs the cyclic garbage
collector's walks until it is dropped (with a cache full of them, a full collection took ~100 ms).

What a route holds, and how the tries make one, is the worker's business (``workers.delivery.Route``, made by
``workers.interest``): this room only keeps them, so that the router's layer knows nothing of connections.  The
caches are plain dicts that stay the same objects for the cache's life (emptied in place), so that the hot paths
may hold them: a publish looks its route up with one dict hit (``routes``, or ``routes_b`` for the subject's bytes
as NATS clients send it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

ROUTE_CACHE_MAX = 65536
SEEN_MAX = 65536   # subjects routed, remembered as strings (which the collector never walks) to cache the next


class Cacheable(Protocol):
    subject: str
    subject_b: bytes
    generation: int


R = TypeVar("R", bound=Cacheable)


class RouteCache(Generic[R]):
    def __init__(self, make: Callable[[str, bool], R]) -> None:
        # make(subject, cached): the route of a subject as the tries are now; ``cached`` says whether it will be
        # kept (the subject was routed before), and so is worth preparing for the messages that follow.
        self._make = make
        self.routes: dict[str, R] = {}
        self.routes_b: dict[bytes, R] = {}   # the same routes by the subject's bytes, as NATS clients send it
        self._seen: set[str] = set()          # subjects routed since it was last emptied (route_for)
        self.generation = 0

    def route(self, subject: str) -> R:
        """The route of a subject the caller has validated: the cached one, or a new one (``route_for``)."""
        return self.routes.get(subject) or self.route_for(subject)

    def route_for(self, subject: str) -> R:
        """The route of a subject the caller has validated; cached until the next generation if the subject was
        routed before (``_seen``)."""
        # A subject routed for the first time is used once, most likely (a request's reply inbox): its route is
        # not cached (nor batched: its message goes straight to the subscribers, a batch of one only costs).
        seen = self._seen
        first = subject not in seen
        route = self._make(subject, not first)
        route.generation = self.generation
        if first:
            if len(seen) >= SEEN_MAX:
                self._seen = seen = set()
            seen.add(subject)
            return route
        routes = self.routes
        if len(routes) >= ROUTE_CACHE_MAX:
            routes.clear()
            self.routes_b.clear()
        routes[subject] = route
        self.routes_b[route.subject_b] = route
        return route

    def current(self, route: R) -> R:
        """``route`` as of now: a delivery (an UNSUB limit reached) may have changed the tries mid-run."""
        if route.generation == self.generation:
            return route
        return self.route(route.subject)

    def invalidate(self) -> None:
        """A trie or a permission changed: every route is stale."""
        self.generation += 1
        self.routes.clear()
        self.routes_b.clear()
