"""The core of one worker: where a message goes, and when bytes leave.

- A publish is matched once per subject: its route (``workers.delivery.Route``) comes from the route cache
  (``router.routes``), which asks the tries of who is interested in what (``workers.interest``) for a new one.
- A publish is delivered here and forwarded to the workers concerned, and neither writes: deliveries are queued
  (and batched) for each subscriber (``workers.fanout``, a base of the hub), and messages for other workers are
  appended to the fabric's per-destination batch (what they look like, and how the other workers' messages are
  delivered here: ``workers.inbox``).  At the end of the event-loop turn ``flush`` sends one fabric frame per
  destination and one ``writelines`` per touched connection.
- A client's read arrives as runs of publishes to one subject where it can (``publish_run``): routed, counted and
  batched once per run, in chunks that respect the turn's budget and a batch's size.
- Nothing waits and nothing runs unbounded: a turn does at most ``TURN_BUDGET`` units of work (the rest waits for
  the next turn), and consumers that drain slower than messages arrive hold publishers back (``backpressure``).
- The owner of a subject (``router.shardmap``) keeps its counters (every worker counts what its clients publish
  and ships the counts to the owner once a second) and picks the members of its queue groups (``groups``).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from shardbroker.router import guard
from shardbroker.router.fabric import Fabric
from shardbroker.router.routes import RouteCache
from shardbroker.workers import speedups
from shardbroker.workers.backpressure import Backpressure
from shardbroker.workers.counters import SubjectCounters
from shardbroker.workers.delivery import Route
from shardbroker.workers.fanout import BATCH_BYTES, Fanout, batch_cost
from shardbroker.workers.groups import GroupTable
from shardbroker.workers.inbox import Inbox
from shardbroker.workers.interest import Interest
from shardbroker.workers.polls import PER_CONNECTION as _POLLS
from shardbroker.workers.polls import PER_WORKER as _POLLS_PER_WORKER
from shardbroker.workers.polls import PendingPolls
from shardbroker.workers.turn import TURN_BUDGET, Turn

if TYPE_CHECKING:
    import socket

    from shardbroker.cluster.config import Config
    from shardbroker.workers.auth import Authenticator
    from shardbroker.workers.connection import Connection

log = logging.getLogger("broker.hub")

# Limits a client of this worker broke (the supervisor counts the connection limits), by the limit's name: /varz
# "breaches", /metrics shardbroker_limit_breaches.  "max_payload" is the protocol's own: NDJSON's line, NATS'
# payload, Bridge's publish, qlite's message.
BREACHES = ("max_subscriptions", "max_subscriptions_per_user", "max_payload", "max_control_line", "handshake_timeout",
            _POLLS, _POLLS_PER_WORKER)


async def _no_supervisor(message: dict) -> dict:
    raise RuntimeError("no supervisor to ask")


class Part(Protocol):
    """What a part of the worker that the hub hosts (the work-queue service) hears from it (``Hub.attach``)."""

    def peer_ready(self, peer: int) -> None: ...      # worker ``peer`` said hello: a new link, or its replacement
    def peer_reset(self, peer: int) -> None: ...      # worker ``peer`` is gone
    def connection_closed(self, cid: int) -> None: ...
    def users_changed(self) -> None: ...              # users or permissions changed, in force here now
    def tick(self) -> None: ...                       # about once a second
    def stats(self) -> dict: ...                      # added to the worker's stats


class Hub(Fanout):
    def __init__(self, index: int, workers: int, config: Config, auth: Authenticator) -> None:
        super().__init__()
        self.index = index
        self.workers = workers
        self.config = config
        self.limits = config.limits
        self.auth = auth
        self.loop = asyncio.get_running_loop()
        self.fabric: Fabric | None = None
        # Set by the worker process: ask the supervisor (admin changes), report an auth failure.
        self.supervisor_request: Callable[[dict], Awaitable[dict]] = _no_supervisor
        self.auth_failed: Callable[[str], None] = lambda address: None
        # Tell the supervisor a connection closed (cluster.supervisor.admission).
        self.report_closed: Callable[[int], None] = lambda cid: None
        # Give a connection to another worker through the supervisor (workers/protocols/ndjson/moves.py): False if
        # it cannot go.
        self.hand_over: Callable[[dict, socket.socket], bool] = lambda message, sock: False
        self.moved_in = self.moved_out = 0
        self.server_info: dict = {}   # what NATS clients are told in INFO, from the supervisor
        # The work-queue service, which the sessions' queue verbs use (set by the worker process; it attaches itself
        # as a part, and the hub knows it only as one).
        self.queue_service = None
        # The worker's leaf connections to NATS hubs, when configured (workers/protocols/leaf/leafnodes.py: it
        # sets itself here and on the interest).
        self.leafnodes = None

        self.groups = GroupTable(index)
        # Fabric control items (router.control) by kind: each room that owns some registers them (``handle``).
        self._control: dict[str, Callable[[int, tuple], None]] = {}
        self.interest = interest = Interest(self)
        self.inbox = inbox = Inbox(self)
        self.counters = counters = SubjectCounters(self, config.limits.max_tracked_subjects)
        self._counted = counters.counted          # bound once: a publish appends its route, first in a turn
        self.owned = counters.owned
        # The route cache's dicts and lookups, bound once: every publish looks its route up (router.routes).
        self.route_cache = cache = RouteCache(interest.make_route)
        self.routes = cache.routes
        self.routes_b = cache.routes_b
        self.route = cache.route
        self.route_for = cache.route_for
        self.current = cache.current
        # The connections' face to their subscriptions, and the fabric's to its frames, as they are hosted here.
        self.subscribe = interest.subscribe
        self.unsubscribe = interest.unsubscribe
        self.subscription_refused = interest.subscription_refused
        self.on_messages = inbox.on_messages

        # The end of every turn (workers.turn): what this room adds to it; the work queues add their own phases.
        self.parts: list[Part] = []
        self.turn = Turn(self.loop, self._new_turn)
        self.turn.add("counters", self._end_counters)
        self.turn.add("batch", self._end_batch)
        self.turn.add("fabric", self._flush_fabric)
        self.mark_dirty = self.turn.mark_dirty    # bound once: a connection calls it in every turn it has output
        self.schedule_flush = self.turn.schedule
        self.turn_work = 0                        # the units of work done in this event-loop turn (TURN_BUDGET)

        self.conns: dict[int, Connection] = {}
        self.stopping = False                       # a graceful stop began: process no more client input
        self.held: set[Connection] = set()          # publishers whose reading is paused while we hold back
        self.congested = False                      # the fabric's window to some worker is full
        self.backpressure = Backpressure(self.loop, self._hold_changed)
        self.stall_bytes = max(1024, config.limits.max_pending_bytes // 4)
        self.holding = False                        # either of the two: publishers must wait
        self.polls = PendingPolls(self)
        self.breaches = dict.fromkeys(BREACHES, 0)
        self.started = time.time()
        self.msgs_in = self.bytes_in = self.msgs_out = self.bytes_out = 0
        self.wire_bytes_out = 0   # of closed connections: everything written, framing and replies included
        self.slow_consumers = 0
        self.total_connections = 0

    # -- connections ----------------------------------------------------------------------------------------
    def register(self, conn: Connection) -> None:
        self.conns[conn.cid] = conn
        if conn.arriving is None:   # one moved from another worker was counted there
            self.total_connections += 1

    def unregister(self, conn: Connection) -> None:
        if self.conns.get(conn.cid) is not conn:
            return   # gone already, or moved away and (sent back by the supervisor) here again under its cid
        del self.conns[conn.cid]
        for sub in list(conn.subs.values()):
            self.unsubscribe(sub)
        conn.subs.clear()
        self.held.discard(conn)
        self.backpressure.drained(conn)
        self.msgs_out += conn.msgs_out
        self.bytes_out += conn.bytes_out
        self.wire_bytes_out += conn.flushed_total
        if conn.moved:
            return   # not a close: alive on another worker, which ends its leases and waits and reports its close
        for part in self.parts:
            part.connection_closed(conn.cid)
        self.polls.forget(conn.cid)
        self.report_closed(conn.cid)

    def breach(self, limit: str) -> None:
        """A client ran into ``limit`` (one of ``BREACHES``); the caller has told it, in its protocol's words."""
        self.breaches[limit] += 1

    async def claim(self, conn: Connection, name: str) -> bool:
        """Whether ``conn``, whose credentials proved it is user ``name``, may act as that user: the supervisor
        counts every worker's sessions per user (limits.max_connections_per_user).  A supervisor that does not
        answer lets the login through: a limit must not lock everyone out."""
        try:
            reply = await self.supervisor_request({"k": "claim", "cid": conn.cid, "user": name})
        except Exception as exc:
            log.warning("no answer from the supervisor about user %r (%s); letting the login through", name, exc)
            return True
        return bool(reply.get("ok"))

    def slow_consumer(self, conn: Connection) -> None:
        self.slow_consumers += 1
        conn.reason = "slow consumer (pending bytes)"
        log.warning("slow consumer: cid %d had more than %d bytes pending; closing it",
                    conn.cid, self.limits.max_pending_bytes, extra={"cid": conn.cid, "reason": conn.reason})

    # -- subscriptions --------------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """A trie or a permission changed: every route must be recomputed."""
        if self.batch is not None:
            self.end_batch()  # what was published before the change goes out as it would have
        self.route_cache.invalidate()

    def subscription_changed(self) -> None:
        """Something that filters deliveries (a permission) changed: routes must be recomputed."""
        self.invalidate()

    def users_changed(self, gone: set[str]) -> None:
        """A registry change is in force: close the sessions of deleted users; deliveries to everyone else are
        filtered anew against their permissions as they are now (subscriptions stay, deliveries stop)."""
        registry = self.auth.registry
        for conn in list(self.conns.values()):
            user = conn.user
            if user is None:
                continue
            if user.name in gone:
                conn.user_deleted()
            else:
                conn.user = registry.get(user.name)  # a reload makes new user objects
        self.invalidate()
        for part in self.parts:
            part.users_changed()

    # -- routing and delivery -------------------------------------------------------------------------------
    def publish(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                origin: Connection) -> bool:
        """A client of this worker published: count it (here and for the subject's owner), and ``send`` it."""
        n = len(payload) if headers is None else len(payload) + len(headers)
        self.msgs_in += 1
        self.bytes_in += n
        if not route.msgs:
            self._counted.append(route)
        route.msgs += 1
        route.bytes += n
        return self.send(route, kind, payload, reply, headers, origin)

    def send(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
             origin: Connection | None) -> bool:
        """Deliver here, forward to the workers concerned: what a publish does, and how the broker's own answers
        to requests go, from no client (``origin`` None: nobody's echo to skip, no barrier to hold).  False
        if nobody anywhere can receive it (what NATS' no-responders reports)."""
        self.turn_work += 1  # a publish is work even when every subscriber is elsewhere
        delivered = self.deliver(route, kind, payload, reply, headers, origin) if route.local else 0
        if route.leaf:
            self.leafnodes.forward(route, kind, payload, reply, headers)
            delivered += 1
        remote, queued = route.remote, route.queued
        if remote and not queued:
            self.fabric.send_to(remote, (route.subject, kind, payload, reply, headers, None), len(payload))
            if origin is not None:
                origin.crossed = True
            self.schedule_flush()
            return True
        if queued:
            if origin is not None:
                origin.crossed = True  # to the owner, or from here to members elsewhere: either way, a barrier waits
                dispatch = ("q", self.index, origin.cid, not origin.echo)
            else:
                dispatch = ("q", self.index, 0, False)
            owner = route.owner
            if owner == self.index:
                self.dispatch_groups(route, kind, payload, reply, headers, dispatch)
            elif owner not in remote:
                self.fabric.send(owner, (route.subject, kind, payload, reply, headers, dispatch), len(payload))
            plain = (route.subject, kind, payload, reply, headers, None)
            for w in remote:
                # The owner gets one copy: it delivers to its plain subscribers and dispatches the queue groups.
                self.fabric.send(w, (route.subject, kind, payload, reply, headers, dispatch) if w == owner else plain,
                                 len(payload))
            self.schedule_flush()
            return True
        if delivered:
            return True
        service = route.service
        if service is not None:   # an internal subscription (serve): the broker's own API answers it here
            service(origin, route.subject_b, reply, headers, kind, payload)
            return True
        return False

    def run_room(self, route: Route, payloads: list[bytes], start: int = 0) -> tuple[int, int]:
        """How many of ``payloads[start:]`` (a run to ``route``) to take in one go: what this turn's budget has
        room for (at least one, so that every turn makes progress), and at most a batch's bytes, so that a consumer
        falling behind is noticed (backpressure) as often as when messages came one at a time.  -> (how many, their
        bytes), the bytes counted here once for everything that follows."""
        left = len(payloads) - start
        fanout = route.fanout
        if route.members is None:   # delivered one by one: a unit per delivery
            room = (TURN_BUDGET - self.turn_work) // (fanout + 1)
        else:   # batched (workers.fanout.batch_cost), one write per subscriber if it opens the batch
            room = (TURN_BUDGET - self.turn_work - (fanout if route is not self.batch else 0)) \
                // batch_cost(fanout, len(payloads[start]))
        n = left if room >= left else max(1, room)
        # Look no further than a batch's bytes reach if the rest are no smaller than the first: a read of thousands
        # of messages is taken a chunk at a time, and summing all of what is left at every chunk was quadratic.
        first = len(payloads[start])
        if first and n > BATCH_BYTES // first:
            n = BATCH_BYTES // first + 1
        chunk = payloads[start:start + n] if start or n < left else payloads
        if (size := sum(map(len, chunk))) <= BATCH_BYTES + first:   # (payloads of one size: the common case)
            return n, size
        sizes = list(itertools.accumulate(map(len, chunk)))
        n = bisect.bisect_left(sizes, BATCH_BYTES) + 1
        return n, sizes[n - 1]

    def publish_run(self, route: Route, kind: int, payloads: list[bytes], reply: str | None,
                    origin: Connection) -> tuple[int, int, bool]:
        """``publish`` for a run of messages without headers to one route, a chunk (``run_room``) per call: one
        batch extension here, one fabric message per worker concerned.  Stops early when the turn's budget is
        spent or publishers must be held (the caller keeps the rest for later).  -> (messages taken, their payload
        bytes, whether anyone anywhere can receive them).  Queue groups pick a member per message, so a route
        with queue groups takes the messages one at a time."""
        taken = nbytes = 0
        anyone = False
        total = len(payloads)
        while taken < total:
            if route.queued or route.service is not None:
                n = 1
                anyone = self.publish(route, kind, payloads[taken], reply, None, origin) or anyone
                b = len(payloads[taken])
            else:
                n, b = self.run_room(route, payloads, taken)
                chunk = payloads if n == total else payloads[taken:taken + n]
                anyone = self._publish_chunk(route, kind, chunk, b, reply, origin) or anyone
            taken += n
            nbytes += b
            if self.turn_work >= TURN_BUDGET or self.holding or origin.closed:
                break
            route = self.current(route)   # a delivery (an UNSUB limit reached) may have changed the tries
        return taken, nbytes, anyone

    def _publish_chunk(self, route: Route, kind: int, payloads: list[bytes], nbytes: int, reply: str | None,
                       origin: Connection) -> bool:
        n = len(payloads)
        self.msgs_in += n
        self.bytes_in += nbytes
        self.turn_work += n
        if not route.msgs:
            self._counted.append(route)
        route.msgs += n
        route.bytes += nbytes
        delivered = self.deliver_run(route, kind, payloads, nbytes, reply, origin) if route.local else 0
        if route.leaf:
            self.leafnodes.forward_run(route, kind, payloads, reply)
            delivered += 1
        if route.remote:
            self.fabric.send_to(route.remote, (route.subject, kind, payloads, reply, None, None), nbytes)
            origin.crossed = True
            self.schedule_flush()
            return True
        return delivered > 0

    def dispatch_groups(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                        dispatch: tuple) -> bool:
        """This worker owns the subject: one member per queue group, wherever the members are.  -> whether some
        went to another worker."""
        _, origin_worker, origin_cid, no_echo = dispatch
        forwarded = False
        for worker, members in self.groups.pick(self.groups_of(route), origin_worker, origin_cid, no_echo).items():
            if worker == self.index:
                self.deliver_members(route.subject, kind, payload, reply, headers, members)
            else:
                self.fabric.send(worker, (route.subject, kind, payload, reply, headers, ("m", members)), len(payload))
                forwarded = True
        return forwarded

    def groups_of(self, route: Route) -> list:
        """The queue groups of ``route``'s subject, each of the members that may receive it (built once a route)."""
        if route.groups is None:
            route.groups = self.groups.groups(route.subject, self._member_may_receive if self.auth.enabled else None)
        return route.groups

    def _member_may_receive(self, name: str, subject: str) -> bool:
        """Whether user ``name`` may receive ``subject`` now, by this worker's copy of the users (which has every
        change before it is acknowledged): queue-group members are picked among those that may."""
        user = self.auth.registry.get(name)
        return user is not None and user.permissions.may_receive(subject)

    # -- end of turn ----------------------------------------------------------------------------------------
    def _new_turn(self) -> None:
        self.turn_work = 0

    def _end_counters(self) -> None:
        if self._counted:
            self.counters.fold()

    def _end_batch(self) -> None:
        if self.batch is not None:
            self.end_batch()

    def _flush_fabric(self) -> None:
        if self.fabric is not None:
            self.fabric.flush()

    def flush_now(self) -> None:
        self.turn.run()

    # -- fabric handler -------------------------------------------------------------------------------------
    def after_inflight(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once what is in flight between this worker and the others is delivered
        (``Inbox.after_inflight``)."""
        self.inbox.after_inflight(callback)

    def serve(self, pattern: str, handler: Callable) -> None:
        """What is published on subjects matching ``pattern`` goes to ``handler(origin, subject_b, reply, headers,
        kind, payload)`` alone, on the publishing worker: an internal subscription, the broker's own API (the
        work queues' ``$Q.>``).  No client subscription receives it and it never crosses the fabric."""
        self.interest.services.insert(pattern, handler)
        self.invalidate()

    def handle(self, kinds: tuple[str, ...], handler: Callable[[int, tuple], None]) -> None:
        """Fabric control items of these kinds (``router.control``) go to ``handler(src, item)``."""
        for kind in kinds:
            if kind in self._control:
                raise ValueError(f"control item kind {kind!r} has a handler already")
            self._control[kind] = handler

    def attach(self, part: Part) -> None:
        """``part`` hears of peers, closed connections, users changes and ticks, and adds to the stats."""
        self.parts.append(part)

    def on_control(self, src: int, item: tuple) -> None:
        handler = self._control.get(item[0])
        if handler is None:
            log.error("unknown fabric control item %r from worker %d", item[0], src)
        else:
            handler(src, item)

    def on_peer_hello(self, src: int) -> None:
        self.interest.peer_hello(src)
        for part in self.parts:
            part.peer_ready(src)

    def on_peer_reset(self, src: int) -> None:
        self.interest.peer_reset(src)
        for part in self.parts:
            part.peer_reset(src)
        self.inbox.peer_reset(src)

    def on_congestion(self, congested: bool) -> None:
        self.congested = congested
        self._hold_changed()

    def _hold_changed(self) -> None:
        """Fabric congestion or consumer backpressure began or ended: hold publishers (and, for backpressure,
        the fabric's input) or let them go."""
        pressure = self.backpressure.active
        self.inbox.pressure_changed(pressure)
        self.holding = self.congested or pressure
        if not self.holding:
            held, self.held = self.held, set()
            for conn in held:
                conn.release()

    async def drain_fabric(self, deadline: float) -> bool:
        """Stopping, with clients no longer read: the end of traffic with every peer (``Inbox.drain``).  False if
        the deadline passed first."""
        return await self.inbox.drain(deadline)

    # -- periodic -------------------------------------------------------------------------------------------
    def tick(self) -> None:
        """About once a second: ship subject counters to their owners."""
        self.counters.ship()
        if self.fabric is not None:
            self.fabric.tick()
        for part in self.parts:
            part.tick()

    def stats(self) -> dict:
        live = self.conns.values()
        pending = [c.pending_bytes for c in live]
        stats = {
            "worker": self.index,
            "hot_path": speedups.IMPLEMENTATION,
            "connections": len(self.conns),
            "total_connections": self.total_connections,
            "subscriptions": len(self.interest.local) + len(self.groups.local),
            "queue_subscriptions": len(self.groups.local),
            "queue_dropped": self.queue_dropped,
            "patterns": len(self.interest.patterns),
            "remote_patterns": len(self.interest.remote),
            "in_msgs": self.msgs_in,
            "in_bytes": self.bytes_in,
            "out_msgs": self.msgs_out + sum(c.msgs_out for c in live),
            "out_bytes": self.bytes_out + sum(c.bytes_out for c in live),
            "out_wire_bytes": self.wire_bytes_out + sum(c.flushed_total for c in live),
            "slow_consumers": self.slow_consumers,
            "callback_errors": guard.errors,   # exceptions that a callback raised and the others survived
            "moved_in": self.moved_in,     # connections taken over from other workers, and given to them
            "moved_out": self.moved_out,
            "breaches": dict(self.breaches),
            "pending_polls": self.polls.total,
            "pending_bytes": sum(pending),
            "pending_bytes_max": max(pending, default=0),   # the connection closest to being a slow consumer
            "backpressure_episodes": self.backpressure.episodes,
            "backpressure_released": self.backpressure.released,
            "route_cache": len(self.routes),
            "generation": self.route_cache.generation,
            "owned_subjects": len(self.owned),
            "fabric": self.fabric.stats() if self.fabric else {},
        }
        for part in self.parts:
            stats.update(part.stats())
        return stats
