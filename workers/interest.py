"""Who is interested in which subjects: this worker's subscriptions, the other workers' patterns, and the gossip
between them.

- Local subscriptions live in a trie; the patterns other workers are interested in live in another, and queue
  groups in the group table (``workers.groups``).  A route (``workers.delivery.Route``) is what matching a subject
  against all three gives, made here for the route cache (``router.routes``); any change to them drops the cache
  (``Hub.invalidate``).
- A new subscription pattern is announced to every other worker over the fabric (``+``, and ``-`` when its last
  subscription goes; queue-group members as ``q+``/``q-``), and the subscriber is told ``ok`` only once every
  worker has processed the announcement: after ``ok``, a publish anywhere reaches it.
- A peer that says hello (a new link, or a replacement worker) gets a snapshot of both (``snap``, ``qsnap``), which
  replaces whatever was known of its predecessor; a peer that is gone has its patterns and members dropped.
- One party's subscriptions are bounded on each worker (``subscription_refused``): every worker holds every worker's
  patterns, so a bound per connection alone would let one party fill every worker's memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shardbroker.router import control, shardmap
from shardbroker.router.sublist import Sublist
from shardbroker.workers.delivery import Route
from shardbroker.workers.tally import Tally

if TYPE_CHECKING:
    from shardbroker.cluster.config import LimitsConfig
    from shardbroker.router.fabric import Fabric
    from shardbroker.workers.connection import Connection
    from shardbroker.workers.groups import GroupTable
    from shardbroker.workers.subscription import Subscription


class Host(Protocol):
    """What the interest needs of the worker's hub (``workers.hub.Hub``), so that this room does not import the
    hub's."""

    index: int
    workers: int
    limits: LimitsConfig
    fabric: Fabric | None
    groups: GroupTable

    def invalidate(self) -> None: ...
    def breach(self, limit: str) -> None: ...
    def schedule_flush(self) -> None: ...
    def handle(self, kinds: tuple[str, ...], handler: Callable[[int, tuple], None]) -> None: ...


class Leaf(Protocol):
    """The worker's leaf connections (``workers.protocols.leaf.leafnodes.Leafnodes``), as interest sees them."""

    def local_changed(self, pattern: str, queue: str | None, delta: int) -> None: ...
    def targets(self, subject: str, groups_here: set[str] | None) -> tuple: ...


class Interest:
    def __init__(self, hub: Host) -> None:
        self.hub = hub
        self.workers = hub.workers
        self.groups = hub.groups
        self.local = Sublist()
        self.patterns: dict[str, int] = {}    # local pattern -> its subscriptions here (announced while > 0)
        self._announcing: dict[str, int] = {}
        self.remote = Sublist()
        # The broker's own APIs on subjects (Hub.serve: $Q.> for the work queues), matched by the same trie as the
        # clients' subscriptions, as nats-server serves $JS.API.>: no session special-cases their subjects.
        self.services = Sublist()
        self._remote_by_peer: dict[int, set[str]] = {p: set() for p in range(hub.workers) if p != hub.index}
        self._by_party = Tally()   # subscriptions standing here per user (or client address)
        # The worker's leaf connections, when it has some (workers/protocols/leaf): they hear of every local
        # subscription added or removed, and say which hubs a route reaches.
        self.leaf: Leaf | None = None
        for kind, handler in ((control.INTEREST_ADD, self._interest_add), (control.INTEREST_DEL, self._interest_del),
                              (control.INTEREST_SNAPSHOT, self._interest_snapshot),
                              (control.GROUP_ADD, self._group_add), (control.GROUP_DEL, self._group_del),
                              (control.GROUP_SNAPSHOT, self._group_snapshot)):
            hub.handle((kind,), handler)

    # -- routes ---------------------------------------------------------------------------------------------
    def make_route(self, subject: str, cached: bool) -> Route:
        """The route of ``subject`` as the tries stand now (the route cache's ``make``); a route that will not be
        cached is not prepared for batching."""
        served = self.services.match(subject)
        if served:   # the broker's own API (Hub.serve): its handler alone receives what is published here
            route = Route(subject, (), (), (), (), False, shardmap.owner(subject, self.workers), False)
            route.service = served[0]
            return route
        ndjson: dict[Connection, None] = {}
        others: dict[Connection, None] = {}
        nats = []
        for sub in self.local.match(subject):
            conn = sub.conn
            if not conn.may_receive(subject):
                continue
            protocol = conn.protocol
            if protocol == "ndjson":
                ndjson[conn] = None
            elif protocol == "nats":
                nats.append(sub)
            else:
                others[conn] = None
        workers = self.remote.match(subject)
        remote = tuple(sorted(set(workers))) if workers else ()
        # ``cached`` is Route's ``batching``, passed by position: a class called with a keyword argument gets a
        # dict made for it, and a route is made per new subject (every reply inbox).
        if self.leaf is None:
            return Route(subject, tuple(ndjson), tuple(nats), tuple(others), remote, self.groups.matches(subject),
                         shardmap.owner(subject, self.workers), cached)
        # with leaf connections the groups' names are wanted too: one match of the group trie gives both
        groups = self.groups.names(subject)
        route = Route(subject, tuple(ndjson), tuple(nats), tuple(others), remote, bool(groups),
                      shardmap.owner(subject, self.workers), cached)
        route.leaf = self.leaf.targets(subject, groups or None)
        return route

    # -- subscriptions --------------------------------------------------------------------------------------
    def subscription_refused(self, conn: Connection) -> str | None:
        """The limit one more subscription of ``conn`` would break (and which is counted as broken), or None.
        Every worker holds every worker's patterns, so one connection's limit times many connections would let
        one party fill every worker's memory: its subscriptions on each worker are bounded too."""
        limits = self.hub.limits
        over = None
        if len(conn.subs) >= limits.max_subscriptions:
            over = "max_subscriptions"
        elif self._by_party[conn.party] >= limits.max_subscriptions_per_user:
            over = "max_subscriptions_per_user"
        if over is not None:
            self.hub.breach(over)
        return over

    def _counted_in(self, sub: Subscription) -> None:
        sub.party = sub.conn.party
        self._by_party.add(sub.party)

    def _counted_out(self, sub: Subscription) -> None:
        party, sub.party = sub.party, None
        if party is not None:
            self._by_party.remove(party)

    def subscribe(self, sub: Subscription, on_synced: Callable[[], None]) -> bool:
        """Add ``sub``.  True if it is in force on every worker now; otherwise ``on_synced`` is called once it is."""
        hub = self.hub
        pattern = sub.subject
        fabric = hub.fabric
        self._counted_in(sub)
        if self.leaf is not None:
            self.leaf.local_changed(pattern, sub.queue, 1)
        if sub.queue is not None:
            member = self.groups.add_local(sub)
            hub.invalidate()
            if fabric is None or not fabric.links:
                return True
            fabric.broadcast_control((control.GROUP_ADD, pattern, member))
            fabric.when_processed(on_synced)
            hub.schedule_flush()
            return False
        self.local.insert(pattern, sub)
        hub.invalidate()
        n = self.patterns.get(pattern, 0)
        self.patterns[pattern] = n + 1
        if fabric is None or not fabric.links:
            return True
        if n == 0:
            fabric.broadcast_control((control.INTEREST_ADD, pattern))
        elif pattern not in self._announcing:
            return True
        # Wait for the announcement (ours, or the one still in flight for an earlier subscriber).
        self._announcing[pattern] = self._announcing.get(pattern, 0) + 1

        def synced() -> None:
            left = self._announcing[pattern] - 1
            if left:
                self._announcing[pattern] = left
            else:
                del self._announcing[pattern]
            on_synced()

        fabric.when_processed(synced)
        hub.schedule_flush()
        return False

    def unsubscribe(self, sub: Subscription) -> None:
        hub = self.hub
        pattern = sub.subject
        if sub.queue is not None:
            member = self.groups.remove_local(sub)
            if member is not None:
                self._counted_out(sub)
                if self.leaf is not None:
                    self.leaf.local_changed(pattern, sub.queue, -1)
                hub.invalidate()
                if hub.fabric is not None and hub.fabric.links:
                    hub.fabric.broadcast_control((control.GROUP_DEL, pattern, member))
                    hub.schedule_flush()
            return
        if not self.local.remove(pattern, sub):
            return
        self._counted_out(sub)
        if self.leaf is not None:
            self.leaf.local_changed(pattern, None, -1)
        hub.invalidate()
        n = self.patterns[pattern] - 1
        if n:
            self.patterns[pattern] = n
            return
        del self.patterns[pattern]
        if hub.fabric is not None and hub.fabric.links:
            hub.fabric.broadcast_control((control.INTEREST_DEL, pattern))
            hub.schedule_flush()

    # -- the other workers ----------------------------------------------------------------------------------
    def _interest_add(self, src: int, item: tuple) -> None:
        if self.remote.insert(item[1], src):
            self._remote_by_peer[src].add(item[1])
            self.hub.invalidate()

    def _interest_del(self, src: int, item: tuple) -> None:
        if self.remote.remove(item[1], src):
            self._remote_by_peer[src].discard(item[1])
            self.hub.invalidate()

    def _interest_snapshot(self, src: int, item: tuple) -> None:
        self._forget_interest(src)
        for pattern in item[1]:
            self.remote.insert(pattern, src)
        self._remote_by_peer[src] = set(item[1])
        self.hub.invalidate()

    def _group_add(self, src: int, item: tuple) -> None:
        if self.groups.add_remote(src, item[1], item[2]):
            self.hub.invalidate()

    def _group_del(self, src: int, item: tuple) -> None:
        if self.groups.remove_remote(src, item[1], item[2]):
            self.hub.invalidate()

    def _group_snapshot(self, src: int, item: tuple) -> None:
        self.groups.drop_peer(src)
        for pattern, member in item[1]:
            self.groups.add_remote(src, pattern, member)
        self.hub.invalidate()

    def peer_hello(self, src: int) -> None:
        """Worker ``src`` said hello: tell it everything this worker's clients are subscribed to."""
        fabric = self.hub.fabric
        fabric.control(src, (control.INTEREST_SNAPSHOT, list(self.patterns)))
        fabric.control(src, (control.GROUP_SNAPSHOT, self.groups.snapshot()))

    def peer_reset(self, src: int) -> None:
        """Worker ``src`` is gone: its patterns and queue members with it."""
        self._forget_interest(src)
        self.groups.drop_peer(src)
        self.hub.invalidate()

    def _forget_interest(self, src: int) -> None:
        """The patterns ``src`` announced, out of the remote trie (its queue members stay)."""
        patterns = self._remote_by_peer[src]
        for pattern in patterns:
            self.remote.remove(pattern, src)
        patterns.clear()
