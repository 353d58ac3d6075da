"""The core of one worker: who is subscribed to what, where a message goes, and when bytes leave.

- Local subscriptions live in a trie; the patterns other workers are interested in live in another.  A publish is
  matched once per subject and the result (a ``Route``) is cached until the next change of either trie or of a
  permission: the generation counter moves and the cache is dropped whole.  A subject is cached from its second
  route on: most reply inboxes are used once, and a route kept costs the cyclic garbage collector's walks until
  it is dropped (with a cache full of them, a full collection took ~100 ms).
- Delivery queues, it does not write: a delivery is encoded once for all its subscribers and appended to each
  subscriber's outbound list; messages for other workers are appended to the fabric's per-destination batch.  At the
  end of the event-loop turn ``flush`` sends one fabric frame per destination and one ``writelines`` per touched
  connection.
- A client's read arrives as runs of publishes to one subject where it can (``publish_run``): routed, counted and
  batched once per run, in chunks that respect the turn's budget and a batch's size.
- Consecutive messages to one subject are batched (``_batch_add``): the route collects their encodings, and each
  subscriber gets the whole run as one joined chunk when the run ends (another subject, a reply to one of its
  subscribers, a size bound, the end of the turn).  Per delivery that is C-level copying instead of a Python call,
  and each subscriber still sees every message in publish order.
- A new subscription pattern is announced to every other worker over the fabric, and the subscriber is told
  ``ok`` only once every worker has processed the announcement: after ``ok``, a publish anywhere reaches it.
- Nothing waits and nothing runs unbounded: a turn makes at most ``TURN_BUDGET`` publishes and deliveries (the
  rest of a read, or of a fabric frame, waits for the next turn), and consumers that drain slower than messages
  arrive hold publishers back (``backpressure``).
- The owner of a subject (``router.shardmap``) keeps its counters (every worker counts what its clients publish
  and ships the counts to the owner once a second) and picks the members of its queue groups (``groups``).

A message crossing the fabric is ``(subject, kind, payload, reply, headers, extra)``, where ``payload`` is a list
for a run of messages without headers (``publish_run``: one fabric message however many the run holds); ``extra``
is None (deliver to local subscribers), ``("q", worker, cid, no_echo)`` (that, and you own the subject: dispatch
its queue groups for the publisher ``cid`` of ``worker``), or ``("m", [(group, cid, sid), ...])`` (deliver to these
queue members only).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from shardbroker.router import control, guard, shardmap
from shardbroker.router.fabric import Fabric
from shardbroker.router.subjects import is_literal
from shardbroker.router.sublist import Sublist

from shardbroker.workers.protocols.ndjson import codec as ndjson_codec
from shardbroker.workers import speedups
from shardbroker.workers.backpressure import Backpressure
from shardbroker.workers.message import KIND_RAW, as_bytes
from shardbroker.workers.protocols.nats.codec import Outgoing, msg_tail
from shardbroker.workers.polls import PER_CONNECTION as _POLLS, PER_WORKER as _POLLS_PER_WORKER, PendingPolls
from shardbroker.workers.groups import GroupTable
from shardbroker.workers.shardstate import SubjectTable
from shardbroker.workers.speedups import msg_tails
from shardbroker.workers.subscription import Subscription
from shardbroker.workers.tally import Tally
from shardbroker.workers.turn import TURN_BUDGET, Turn

if TYPE_CHECKING:
    import socket

    from shardbroker.cluster.config import Config

    from shardbroker.workers.auth import Authenticator
    from shardbroker.workers.connection import Connection

log = logging.getLogger("broker.hub")

_ROUTE_CACHE_MAX = 65536
_SEEN_MAX = 65536   # subjects routed, remembered as strings (which the collector never walks) to cache the next
# A batch of consecutive messages to one subject ends at this many deliveries or bytes of encoded messages: its
# chunks are what a turn writes at once, so this bounds the memory a batch adds to the outbound queues.
_BATCH_DELIVERIES = 4096
_BATCH_BYTES = 64 * 1024

# Fabric control items (router.control): interest changes, queue-group members, snapshots, subject counters, sync
# points and the end of a worker's traffic when it stops.
_INTEREST_ADD, _INTEREST_DEL, _INTEREST_SNAPSHOT = control.INTEREST_ADD, control.INTEREST_DEL, control.INTEREST_SNAPSHOT
_QUEUE_ADD, _QUEUE_DEL, _QUEUE_SNAPSHOT = control.GROUP_ADD, control.GROUP_DEL, control.GROUP_SNAPSHOT
_COUNTERS, _FIN, _SYNC = control.COUNTERS, control.FIN, control.SYNC


# Limits a client of this worker broke (the supervisor counts the connection limits), by the limit's name: /varz
# "breaches", /metrics shardbroker_limit_breaches.  "max_payload" is the protocol's own: NDJSON's line, NATS'
# payload, Bridge's publish, qlite's message.
BREACHES = ("max_subscriptions", "max_subscriptions_per_user", "max_payload", "max_control_line", "handshake_timeout",
            _POLLS, _POLLS_PER_WORKER)


async def _no_supervisor(message: dict) -> dict:
    raise RuntimeError("no supervisor to ask")


class Route:
    """Where a message to one subject goes, as of one generation of the tries."""

    __slots__ = ("subject", "subject_b", "msg_head", "ndjson", "nats", "nats_plain", "others", "local", "remote",
                 "queued", "groups", "owner", "prefix", "wild", "msgs", "bytes", "fanout", "members", "lines",
                 "tails", "batched", "batched_bytes", "batched_payload", "generation")

    def __init__(self, subject: str, ndjson: tuple, nats: tuple, others: tuple, remote: tuple[int, ...],
                 queued: bool, owner: int, batching: bool = True) -> None:
        self.subject = subject
        self.subject_b = subject_b = subject.encode()
        self.msg_head = head = b"MSG " + subject_b + b" "
        self.ndjson = ndjson          # NDJSON connections, one entry per connection however many patterns match
        self.nats = nats              # NATS subscriptions (plain): one delivery per matching subscription
        self.others = others          # other protocols' connections (Bridge)
        self.fanout = fanout = len(ndjson) + len(nats) + len(others)
        self.local = fanout > 0
        # Batching (Hub._batch_add), where the caller wants it, needs the common NATS case: no UNSUB limits
        # (counted per message), and one subscription per connection (batching two of one connection would
        # reorder them relative to each other).  Then the NATS subscribers are precomputed as (connection,
        # subscription, "MSG <subject> <sid>"), and ``members`` is who a batch holds messages for; None: no
        # batching, each message delivered as it comes.  (One loop, no comprehensions or generators: a route is
        # made for every new subject, a reply's inbox included, and this is most of what making one costs.)
        self.nats_plain = ()
        self.members = None
        if batching:
            plain = []
            members = set(ndjson)
            for sub in nats:
                conn = sub.conn
                if sub.max_msgs or conn in members:
                    break
                members.add(conn)
                plain.append((conn, sub, head + sub.sid))
            else:
                self.nats_plain = tuple(plain)
                self.members = members
        # The open batch: NDJSON delivery lines; NATS tails (" <size>\r\n<payload>\r\n") after an empty first
        # item, so that joining them with a subscriber's "MSG <subject> <sid>" puts it before every tail.
        self.lines: list[bytes] = []
        self.tails: list[bytes] = [b""]
        # The open batch's messages, bytes and payload bytes (what the out_bytes counters count); the messages and
        # bytes published here in this turn (folded into Hub._counts at its end); the generation of the tries it
        # was matched against (Hub.route_for).
        self.batched = self.batched_bytes = self.batched_payload = self.msgs = self.bytes = self.generation = 0
        self.remote = remote          # workers with a matching plain subscriber
        self.queued = queued          # some queue group of the cluster matches: the owner dispatches
        self.groups = None            # the owner's queue groups for this subject, built when first needed
        self.owner = owner
        self.prefix = ndjson_codec.delivery_prefix(subject) if ndjson else b""   # for NDJSON deliveries alone
        # NATS may publish to "foo.*" as a literal; NDJSON may not
        self.wild = ("*" in subject or ">" in subject) and not is_literal(subject)


class Part(Protocol):
    """What a part of the worker that the hub hosts (the work-queue service) hears from it (``Hub.attach``)."""

    def peer_ready(self, peer: int) -> None: ...      # worker ``peer`` said hello: a new link, or its replacement
    def peer_reset(self, peer: int) -> None: ...      # worker ``peer`` is gone
    def connection_closed(self, cid: int) -> None: ...
    def users_changed(self) -> None: ...              # users or permissions changed, in force here now
    def tick(self) -> None: ...                       # about once a second
    def stats(self) -> dict: ...                      # added to the worker's stats


class Hub:
    def __init__(self, index: int, workers: int, config: "Config", auth: "Authenticator") -> None:
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
        self.report_closed: Callable[[int], None] = lambda cid: None   # tell the supervisor (cluster.supervisor.admission)
        # Give a connection to another worker through the supervisor (workers/protocols/ndjson/moves.py): False if it cannot go.
        self.hand_over: Callable[[dict, socket.socket], bool] = lambda message, sock: False
        self.moved_in = self.moved_out = 0
        self.server_info: dict = {}   # what NATS clients are told in INFO, from the supervisor
        # The work-queue service, which the sessions' queue verbs use (set by the worker process; it attaches itself
        # as a part, and the hub knows it only as one).
        self.queue_service = None

        self.local = Sublist()
        self._local_refs: dict[str, int] = {}
        self._announcing: dict[str, int] = {}
        self.remote = Sublist()
        self._remote_by_peer: dict[int, set[str]] = {p: set() for p in range(workers) if p != index}
        self.groups = GroupTable(index)
        self.queue_dropped = 0
        self._by_party = Tally()   # subscriptions standing here per user (or client address)
        self.routes: dict[str, Route] = {}
        self.routes_b: dict[bytes, Route] = {}   # the same routes by the subject's bytes, as NATS clients send it
        self._seen: set[str] = set()              # subjects routed since it was last emptied (route_for)
        self.generation = 0

        # The end of every turn (workers.turn): what this room adds to it; the work queues add their own phases.
        self.parts: list[Part] = []
        self._control: dict[str, Callable[[int, tuple], None]] = {
            _INTEREST_ADD: self._interest_add, _INTEREST_DEL: self._interest_del,
            _INTEREST_SNAPSHOT: self._interest_snapshot, _QUEUE_ADD: self._group_add, _QUEUE_DEL: self._group_del,
            _QUEUE_SNAPSHOT: self._group_snapshot, _COUNTERS: self._counters, _SYNC: self._sync, _FIN: self._fin}
        self.turn = Turn(self.loop, self._new_turn)
        self.turn.add("counters", self._end_counters)
        self.turn.add("batch", self._end_batch)
        self.turn.add("fabric", self._flush_fabric)
        self.mark_dirty = self.turn.mark_dirty    # bound once: a connection calls it in every turn it has output
        self.schedule_flush = self.turn.schedule
        self.turn_work = 0                        # publishes and deliveries made in this event-loop turn
        self.batch: Route | None = None           # the route whose consecutive messages are being batched
        # [messages from the fabric, next index, source worker, frame token, forwarded to a third worker]
        self._backlog: collections.deque[list] = collections.deque()
        self._backlog_scheduled = False
        self._backlog_waiters: list[Callable[[], None]] = []   # after_inflight callbacks waiting for the backlog
        self._counted: list[Route] = []           # routes published to in this turn
        # owner -> {subject: (messages, bytes)} since the last shipment: what tick ships (or merges) as it is
        self._counts: dict[int, dict[str, tuple]] = {}
        self.owned = SubjectTable(config.limits.max_tracked_subjects)

        self._fins: set[int] = set()
        self._fins_changed: asyncio.Event | None = None
        self.conns: dict[int, "Connection"] = {}
        self.stopping = False                       # a graceful stop began: process no more client input
        self.held: set["Connection"] = set()        # publishers whose reading is paused while we hold back
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
    def register(self, conn: "Connection") -> None:
        self.conns[conn.cid] = conn
        if conn.arriving is None:   # one moved from another worker was counted there
            self.total_connections += 1

    def unregister(self, conn: "Connection") -> None:
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

    async def claim(self, conn: "Connection", name: str) -> bool:
        """Whether ``conn``, whose credentials proved it is user ``name``, may act as that user: the supervisor
        counts every worker's sessions per user (limits.max_connections_per_user).  A supervisor that does not
        answer lets the login through: a limit must not lock everyone out."""
        try:
            reply = await self.supervisor_request({"k": "claim", "cid": conn.cid, "user": name})
        except Exception as exc:
            log.warning("no answer from the supervisor about user %r (%s); letting the login through", name, exc)
            return True
        return bool(reply.get("ok"))

    def slow_consumer(self, conn: "Connection") -> None:
        self.slow_consumers += 1
        conn.reason = "slow consumer (pending bytes)"
        log.warning("slow consumer: cid %d had more than %d bytes pending; closing it",
                    conn.cid, self.limits.max_pending_bytes, extra={"cid": conn.cid, "reason": conn.reason})

    # -- subscriptions --------------------------------------------------------------------------------------
    def _invalidate(self) -> None:
        if self.batch is not None:
            self.end_batch()  # what was published before the change goes out as it would have
        self.generation += 1
        self.routes = {}
        self.routes_b = {}

    def subscription_refused(self, conn: "Connection") -> str | None:
        """The limit one more subscription of ``conn`` would break (and which is counted as broken), or None.
        Every worker holds every worker's patterns, so one connection's limit times many connections would let
        one party fill every worker's memory: its subscriptions on each worker are bounded too."""
        limits = self.limits
        over = None
        if len(conn.subs) >= limits.max_subscriptions:
            over = "max_subscriptions"
        elif self._by_party[conn.party] >= limits.max_subscriptions_per_user:
            over = "max_subscriptions_per_user"
        if over is not None:
            self.breach(over)
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
        pattern = sub.subject
        fabric = self.fabric
        self._counted_in(sub)
        if sub.queue is not None:
            member = self.groups.add_local(sub)
            self._invalidate()
            if fabric is None or not fabric.links:
                return True
            fabric.broadcast_control((_QUEUE_ADD, pattern, member))
            fabric.when_processed(on_synced)
            self.schedule_flush()
            return False
        self.local.insert(pattern, sub)
        self._invalidate()
        n = self._local_refs.get(pattern, 0)
        self._local_refs[pattern] = n + 1
        if fabric is None or not fabric.links:
            return True
        if n == 0:
            fabric.broadcast_control((_INTEREST_ADD, pattern))
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
        self.schedule_flush()
        return False

    def unsubscribe(self, sub: Subscription) -> None:
        pattern = sub.subject
        if sub.queue is not None:
            member = self.groups.remove_local(sub)
            if member is not None:
                self._counted_out(sub)
                self._invalidate()
                if self.fabric is not None and self.fabric.links:
                    self.fabric.broadcast_control((_QUEUE_DEL, pattern, member))
                    self.schedule_flush()
            return
        if not self.local.remove(pattern, sub):
            return
        self._counted_out(sub)
        self._invalidate()
        n = self._local_refs[pattern] - 1
        if n:
            self._local_refs[pattern] = n
            return
        del self._local_refs[pattern]
        if self.fabric is not None and self.fabric.links:
            self.fabric.broadcast_control((_INTEREST_DEL, pattern))
            self.schedule_flush()

    def subscription_changed(self) -> None:
        """Something that filters deliveries (a permission) changed: routes must be recomputed."""
        self._invalidate()

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
        self._invalidate()
        for part in self.parts:
            part.users_changed()

    # -- routing and delivery -------------------------------------------------------------------------------
    def route(self, subject: str) -> Route:
        """The route of a subject the caller has validated: the cached one, or a new one (``route_for``)."""
        return self.routes.get(subject) or self.route_for(subject)

    def route_for(self, subject: str) -> Route:
        """The route of a subject the caller has validated; cached until the next generation if the subject was
        routed before (``_seen``)."""
        ndjson: dict["Connection", None] = {}
        others: dict["Connection", None] = {}
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
        # A subject routed for the first time is used once, most likely (a request's reply inbox): its route is
        # neither cached nor batched (its message goes straight to the subscribers: a batch of one only costs).
        seen = self._seen
        first = subject not in seen
        route = Route(subject, tuple(ndjson), tuple(nats), tuple(others), remote, self.groups.matches(subject),
                      shardmap.owner(subject, self.workers), batching=not first)
        route.generation = self.generation
        if first:
            if len(seen) >= _SEEN_MAX:
                self._seen = seen = set()
            seen.add(subject)
            return route
        if len(self.routes) >= _ROUTE_CACHE_MAX:
            self.routes = {}
            self.routes_b = {}
        self.routes[subject] = route
        self.routes_b[route.subject_b] = route
        return route

    def publish(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                origin: "Connection") -> bool:
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
             origin: "Connection | None") -> bool:
        """Deliver here, forward to the workers concerned: what a publish does, and how the broker's own answers
        to requests go, from no client (``origin`` None: nobody's echo to skip, no barrier to hold).  False
        if nobody anywhere can receive it (what NATS' no-responders reports)."""
        self.turn_work += 1  # a publish is work even when every subscriber is elsewhere
        delivered = self._deliver(route, kind, payload, reply, headers, origin) if route.local else 0
        remote, queued = route.remote, route.queued
        if remote and not queued:
            self.fabric.send_to(remote, (route.subject, kind, payload, reply, headers, None))
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
                self._dispatch_groups(route, kind, payload, reply, headers, dispatch)
            elif owner not in remote:
                self.fabric.send(owner, (route.subject, kind, payload, reply, headers, dispatch))
            plain = (route.subject, kind, payload, reply, headers, None)
            for w in remote:
                # The owner gets one copy: it delivers to its plain subscribers and dispatches the queue groups.
                self.fabric.send(w, (route.subject, kind, payload, reply, headers, dispatch) if w == owner else plain)
            self.schedule_flush()
            return True
        return delivered > 0

    def send_frames(self, sub: Subscription, frames: list[bytes], size: int) -> None:
        """``len(frames)`` messages from the broker to ``sub`` alone (the answers to a connection's own queue
        requests), each already a whole frame of its protocol; ``size``: their payloads' bytes, which the out
        counters count."""
        if self.batch is not None:
            self.end_batch()   # deliveries batched before them go first, as in _deliver
        n = len(frames)
        sub.conn.deliver_batch(b"".join(frames), n, size)
        sub.delivered += n
        self.turn_work += 2 * n   # what send counts: a publish and a delivery each

    def run_room(self, route: Route, payloads: list[bytes], start: int = 0) -> int:
        """How many of ``payloads[start:]`` (a run to ``route``) to take in one go: what this turn's budget has
        room for (at least one, so that every turn makes progress), and at most a batch's bytes, so that a consumer
        falling behind is noticed (backpressure) as often as when messages came one at a time."""
        left = len(payloads) - start
        room = (TURN_BUDGET - self.turn_work) // (route.fanout + 1)
        n = left if room >= left else max(1, room)
        chunk = payloads[start:start + n] if start or n < left else payloads
        if sum(map(len, chunk)) < _BATCH_BYTES:
            return n
        return bisect.bisect_left(list(itertools.accumulate(map(len, chunk))), _BATCH_BYTES) + 1

    def publish_run(self, route: Route, kind: int, payloads: list[bytes], reply: str | None,
                    origin: "Connection") -> tuple[int, int, bool]:
        """``publish`` for a run of messages without headers to one route, a chunk (``run_room``) per call: one
        batch extension here, one fabric message per worker concerned.  Stops early when the turn's budget is
        spent or publishers must be held (the caller keeps the rest for later).  -> (messages taken, their payload
        bytes, whether anyone anywhere can receive them).  Queue groups pick a member per message, so a route
        with queue groups takes the messages one at a time."""
        taken = nbytes = 0
        anyone = False
        total = len(payloads)
        while taken < total:
            if route.queued:
                n = 1
                anyone = self.publish(route, kind, payloads[taken], reply, None, origin) or anyone
                b = len(payloads[taken])
            else:
                n = self.run_room(route, payloads, taken)
                chunk = payloads if n == total else payloads[taken:taken + n]
                b = sum(map(len, chunk))
                anyone = self._publish_chunk(route, kind, chunk, b, reply, origin) or anyone
            taken += n
            nbytes += b
            if self.turn_work >= TURN_BUDGET or self.holding or origin.closed:
                break
            route = self.current(route)   # a delivery (an UNSUB limit reached) may have changed the tries
        return taken, nbytes, anyone

    def _publish_chunk(self, route: Route, kind: int, payloads: list[bytes], nbytes: int, reply: str | None,
                       origin: "Connection") -> bool:
        n = len(payloads)
        self.msgs_in += n
        self.bytes_in += nbytes
        self.turn_work += n
        if not route.msgs:
            self._counted.append(route)
        route.msgs += n
        route.bytes += nbytes
        delivered = self._deliver_run(route, kind, payloads, reply, origin) if route.local else 0
        if route.remote:
            self.fabric.send_to(route.remote, (route.subject, kind, payloads, reply, None, None))
            origin.crossed = True
            self.schedule_flush()
            return True
        return delivered > 0

    def _deliver_run(self, route: Route, kind: int, payloads: list[bytes], reply: str | None,
                     origin: "Connection | None") -> int:
        """``_deliver`` for a run of messages without headers; -> how many deliveries."""
        members = route.members
        if members is not None and (origin is None or origin.echo or origin not in members):
            return self._batch_add_run(route, kind, payloads, reply)
        deliver, current = self._deliver, self.current
        return sum([deliver(current(route), kind, payload, reply, None, origin) for payload in payloads])

    def current(self, route: Route) -> Route:
        """``route`` as of now: a delivery (an UNSUB limit reached) may have changed the tries mid-run."""
        if route.generation == self.generation:
            return route
        return self.route(route.subject)

    def _deliver(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                 origin: "Connection | None") -> int:
        """To this worker's plain subscribers; -> how many deliveries."""
        members = route.members
        if members is not None and headers is None and (origin is None or origin.echo or origin not in members):
            return self._batch_add(route, kind, payload, reply)
        if self.batch is not None:
            self.end_batch()
        count = 0
        size = len(payload)
        if route.ndjson:
            line = ndjson_codec.delivery(route.prefix, kind, payload, reply, headers)
            for conn in route.ndjson:
                conn.deliver(line, size)
            count += len(route.ndjson)
        if route.nats:
            # Only the sid differs between subscribers, unless headers make it HMSG for those that negotiated them.
            body = as_bytes(kind, payload)
            out = None
            if headers is not None:
                out = Outgoing(route.subject_b, reply.encode() if reply else None, headers, body)
            tail = msg_tail(reply, body) if out is None else b""
            head = route.msg_head
            for sub in route.nats:
                conn = sub.conn
                if conn is origin and not conn.echo:
                    continue
                if out is None:
                    conn.deliver(head + sub.sid + tail, size)
                else:
                    conn.deliver(conn.frame_for(sub, out), conn.payload_size(out))
                count += 1
                sub.delivered += 1
                if sub.max_msgs and sub.delivered >= sub.max_msgs:
                    conn.remove_subscription(sub)
        for conn in route.others:
            conn.deliver_message(route.subject, kind, payload, reply, headers)
            count += 1
        self.turn_work += count
        return count

    def _batch_add(self, route: Route, kind: int, payload: bytes, reply: str | None) -> int:
        """Queue a message in ``route``'s batch, which is opened (ending any other) if it is not the open one."""
        if route is not self.batch:
            if self.batch is not None:
                self.end_batch()
            self.batch = route
            self.schedule_flush()
        size = 0
        if route.ndjson:
            line = ndjson_codec.delivery(route.prefix, kind, payload, reply, None)
            route.lines.append(line)
            size = len(line)
        if route.nats:
            tail = msg_tail(reply, as_bytes(kind, payload))
            route.tails.append(tail)
            size += len(tail)
        for conn in route.others:
            conn.deliver_message(route.subject, kind, payload, reply, None)
        route.batched += 1
        route.batched_bytes += size
        route.batched_payload += len(payload)
        count = route.fanout
        self.turn_work += count
        # Bound what one batch turns into: deliveries (a NATS subscriber gets its own copy) and bytes.
        if route.batched * count >= _BATCH_DELIVERIES or route.batched_bytes >= _BATCH_BYTES:
            self.end_batch()
        return count

    def _batch_add_run(self, route: Route, kind: int, payloads: list[bytes], reply: str | None) -> int:
        """``_batch_add`` for a run: the encodings of all its messages made in one call per protocol."""
        if route is not self.batch:
            if self.batch is not None:
                self.end_batch()
            self.batch = route
            self.schedule_flush()
        n = len(payloads)
        size = 0
        if route.ndjson:
            lines = ndjson_codec.deliveries(route.prefix, kind, payloads, reply)
            route.lines += lines
            size = sum(map(len, lines))
        if route.nats:
            tails = msg_tails(payloads if kind == KIND_RAW else [as_bytes(kind, p) for p in payloads],
                              reply.encode() if reply else None)
            route.tails += tails
            size += sum(map(len, tails))
        for conn in route.others:
            for payload in payloads:
                conn.deliver_message(route.subject, kind, payload, reply, None)
        route.batched += n
        route.batched_bytes += size
        route.batched_payload += sum(map(len, payloads))
        count = route.fanout * n
        self.turn_work += count
        if route.batched * route.fanout >= _BATCH_DELIVERIES or route.batched_bytes >= _BATCH_BYTES:
            self.end_batch()
        return count

    def end_batch(self) -> None:
        """Hand the open batch to its subscribers: one chunk each, in the order the messages came."""
        route, self.batch = self.batch, None
        n = route.batched
        if not n:
            return
        size = route.batched_payload
        route.batched = route.batched_bytes = route.batched_payload = 0
        if route.ndjson:
            lines, route.lines = route.lines, []
            data = lines[0] if n == 1 else b"".join(lines)
            for conn in route.ndjson:
                conn.deliver_batch(data, n, size)
        if route.nats:
            tails, route.tails = route.tails, [b""]
            for conn, sub, prefix in route.nats_plain:
                conn.deliver_batch(prefix.join(tails), n, size)
                sub.delivered += n

    def settle(self, conn: "Connection") -> None:
        """``conn`` is about to be written to (or closed) outside the open batch: deliver the batch first."""
        batch = self.batch
        if batch is not None and conn in batch.members:
            self.end_batch()

    def _dispatch_groups(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                         dispatch: tuple) -> bool:
        """This worker owns the subject: one member per queue group, wherever the members are.  -> whether some
        went to another worker."""
        if route.groups is None:
            route.groups = self.groups.groups(route.subject, self._member_may_receive if self.auth.enabled else None)
        _, origin_worker, origin_cid, no_echo = dispatch
        forwarded = False
        for worker, members in self.groups.pick(route.groups, origin_worker, origin_cid, no_echo).items():
            if worker == self.index:
                self._deliver_members(route.subject, kind, payload, reply, headers, members)
            else:
                self.fabric.send(worker, (route.subject, kind, payload, reply, headers, ("m", members)))
                forwarded = True
        return forwarded

    def _member_may_receive(self, name: str, subject: str) -> bool:
        """Whether user ``name`` may receive ``subject`` now, by this worker's copy of the users (which has every
        change before it is acknowledged): queue-group members are picked among those that may."""
        user = self.auth.registry.get(name)
        return user is not None and user.permissions.may_receive(subject)

    def _deliver_members(self, subject: str, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                         members: list) -> None:
        if self.batch is not None:
            self.end_batch()
        out = None
        for group, cid, sid in members:
            sub = self.groups.member(group, cid, sid, subject)
            if sub is None or not sub.conn.may_receive(subject):
                self.queue_dropped += 1
                continue
            if out is None:
                out = Outgoing(subject.encode(), reply.encode() if reply else None, headers, as_bytes(kind, payload))
            conn = sub.conn
            conn.deliver(conn.frame_for(sub, out), conn.payload_size(out))
            self.turn_work += 1
            sub.delivered += 1
            if sub.max_msgs and sub.delivered >= sub.max_msgs:
                conn.remove_subscription(sub)

    def _work_backlog(self) -> None:
        """Deliver what other workers sent, in order, at most a turn's budget at a time: one frame can carry
        thousands of messages, each for thousands of subscribers.  While a backlog remains, the fabric's input
        is paused (so later frames cannot overtake it) and the rest waits for the next turn.  A frame is finished
        (acknowledged) when its last message is delivered, or, if it made this worker forward queue-group messages to
        a third worker, once that worker has processed them: an ack means delivered, however many hops it took."""
        self._backlog_scheduled = False
        backlog = self._backlog
        while backlog:
            entry = backlog[0]
            messages, i = entry[0], entry[1]
            n = len(messages)
            while i < n:
                if self.turn_work >= TURN_BUDGET or self.backpressure.active:
                    # Next turn, or once the congested consumers have drained (_hold_changed resumes it).
                    entry[1] = i
                    self.fabric.pause_input("backlog", True)
                    if not self._backlog_scheduled and not self.backpressure.active:
                        self._backlog_scheduled = True
                        self.loop.call_soon(self._work_backlog)
                    return
                subject, kind, payload, reply, headers, extra = messages[i]
                i += 1
                if extra is not None and extra[0] == "m":
                    self._deliver_members(subject, kind, payload, reply, headers, extra[1])
                    continue
                route = self.routes.get(subject)
                if route is None:
                    route = self.route_for(subject)
                if type(payload) is list:   # a run (publish_run): as much of it as the turn has room for
                    take = self.run_room(route, payload)
                    if take < len(payload):
                        i -= 1
                        messages[i] = (subject, kind, payload[take:], reply, headers, extra)
                        payload = payload[:take]
                    self._deliver_run(route, kind, payload, reply, None)
                    continue
                self._deliver(route, kind, payload, reply, headers, None)
                if extra is not None and route.queued and self._dispatch_groups(route, kind, payload, reply,
                                                                                headers, extra):
                    entry[4] = True
            backlog.popleft()
            self._finished(entry)
        if self.fabric is not None:
            self.fabric.pause_input("backlog", False)
        if self._backlog_waiters:
            waiters, self._backlog_waiters = self._backlog_waiters, []
            for callback in waiters:
                guard.call("a delivery barrier's callback", callback)

    # -- end of turn ----------------------------------------------------------------------------------------
    def _new_turn(self) -> None:
        self.turn_work = 0

    def _end_counters(self) -> None:
        if self._counted:
            self._fold_counts()

    def _end_batch(self) -> None:
        if self.batch is not None:
            self.end_batch()

    def _flush_fabric(self) -> None:
        if self.fabric is not None:
            self.fabric.flush()

    def flush_now(self) -> None:
        self.turn.run()

    # -- fabric handler -------------------------------------------------------------------------------------
    def on_messages(self, src: int, messages: list, token: tuple[int, int] | None) -> None:
        self._backlog.append([messages, 0, src, token, False])
        if len(self._backlog) == 1:
            self._work_backlog()

    def _finished(self, entry: list) -> None:
        _, _, src, token, forwarded = entry
        if token is None:
            return
        fabric = self.fabric
        if forwarded:
            fabric.when_processed(lambda: fabric.finish(src, token))
        else:
            fabric.finish(src, token)

    def after_inflight(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every message queued here for other workers is delivered there, and every
        message the other workers had already taken from their clients is delivered here: one round trip on every
        link (links are FIFO, a peer acknowledges a frame once its messages are delivered, and its ack rides
        behind the messages it sent before it).  Pings and unsubscribes wait for this, so that "published before"
        means "delivered", as one process gives for free."""
        fabric = self.fabric
        if fabric is None or not fabric.up_peers():
            callback()
            return

        def acked() -> None:
            if self._backlog:
                self._backlog_waiters.append(callback)
            else:
                callback()

        fabric.broadcast_control((_SYNC,))
        fabric.when_processed(acked)
        self.schedule_flush()

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

    def _interest_add(self, src: int, item: tuple) -> None:
        if self.remote.insert(item[1], src):
            self._remote_by_peer[src].add(item[1])
            self._invalidate()

    def _interest_del(self, src: int, item: tuple) -> None:
        if self.remote.remove(item[1], src):
            self._remote_by_peer[src].discard(item[1])
            self._invalidate()

    def _interest_snapshot(self, src: int, item: tuple) -> None:
        self._forget_interest(src)
        for pattern in item[1]:
            self.remote.insert(pattern, src)
        self._remote_by_peer[src] = set(item[1])
        self._invalidate()

    def _group_add(self, src: int, item: tuple) -> None:
        if self.groups.add_remote(src, item[1], item[2]):
            self._invalidate()

    def _group_del(self, src: int, item: tuple) -> None:
        if self.groups.remove_remote(src, item[1], item[2]):
            self._invalidate()

    def _group_snapshot(self, src: int, item: tuple) -> None:
        self.groups.drop_peer(src)
        for pattern, member in item[1]:
            self.groups.add_remote(src, pattern, member)
        self._invalidate()

    def _counters(self, src: int, item: tuple) -> None:
        self.owned.merge(item[1])

    def _sync(self, src: int, item: tuple) -> None:
        pass  # only its acknowledgement matters (after_inflight)

    def _fin(self, src: int, item: tuple) -> None:
        self._fins.add(src)
        if self._fins_changed is not None:
            self._fins_changed.set()

    def on_peer_hello(self, src: int) -> None:
        self.fabric.control(src, (_INTEREST_SNAPSHOT, list(self._local_refs)))
        self.fabric.control(src, (_QUEUE_SNAPSHOT, self.groups.snapshot()))
        for part in self.parts:
            part.peer_ready(src)

    def on_peer_reset(self, src: int) -> None:
        self._drop_peer_interest(src)
        for part in self.parts:
            part.peer_reset(src)
        if self._fins_changed is not None:
            self._fins_changed.set()  # a dead peer will send no fin: stop waiting for it

    def _drop_peer_interest(self, src: int) -> None:
        self._forget_interest(src)
        self.groups.drop_peer(src)
        self._invalidate()

    def _forget_interest(self, src: int) -> None:
        """The patterns ``src`` announced, out of the remote trie (its queue members stay)."""
        patterns = self._remote_by_peer[src]
        for pattern in patterns:
            self.remote.remove(pattern, src)
        patterns.clear()

    def on_congestion(self, congested: bool) -> None:
        self.congested = congested
        self._hold_changed()

    def _hold_changed(self) -> None:
        """Fabric congestion or consumer backpressure began or ended: hold publishers (and, for backpressure,
        the fabric's input) or let them go."""
        pressure = self.backpressure.active
        if self.fabric is not None:
            self.fabric.pause_input("backpressure", pressure)
        if not pressure and self._backlog and not self._backlog_scheduled:
            self._backlog_scheduled = True
            self.loop.call_soon(self._work_backlog)
        self.holding = self.congested or pressure
        if not self.holding:
            held, self.held = self.held, set()
            for conn in held:
                conn.release()

    async def drain_fabric(self, deadline: float) -> bool:
        """Stopping, with clients no longer read: tell every peer this worker sends nothing more, and deliver
        what the peers still send until each has said the same.  Links are FIFO, so a peer's fin comes after
        all of its messages.  False if the deadline passed first."""
        fabric = self.fabric
        if fabric is None or not fabric.links:
            return True
        self._fins_changed = asyncio.Event()
        fabric.broadcast_control((_FIN,))
        self.schedule_flush()
        while True:
            waiting = [p for p in fabric.up_peers() if p not in self._fins]
            if not waiting and not self._backlog:  # a fin can share a frame with messages still in the backlog
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("stopping without the end of traffic from worker(s) %s", waiting)
                return False
            self._fins_changed.clear()
            try:
                await asyncio.wait_for(self._fins_changed.wait(), min(left, 0.05) if not waiting else left)
            except TimeoutError:
                pass

    # -- periodic -------------------------------------------------------------------------------------------
    def _fold_counts(self) -> None:
        """At the end of a turn: what its routes counted, by subject until the next shipment (``tick``), so that
        no route is kept alive for the counters' sake (an inbox's would be, a second for nothing)."""
        counted, self._counted = self._counted, []
        by_owner = self._counts
        owner = -1
        counts: dict[str, tuple] = {}
        for route in counted:
            if route.owner != owner:
                owner = route.owner
                if owner not in by_owner:
                    by_owner[owner] = {}
                counts = by_owner[owner]
            subject = route.subject
            entry = counts.get(subject)
            counts[subject] = (route.msgs, route.bytes) if entry is None else \
                (entry[0] + route.msgs, entry[1] + route.bytes)
            route.msgs = route.bytes = 0

    def tick(self) -> None:
        """About once a second: ship subject counters to their owners."""
        self._fold_counts()
        by_owner, self._counts = self._counts, {}
        for owner, counts in by_owner.items():
            if owner == self.index:
                self.owned.merge(counts)
            else:
                self.fabric.control(owner, (_COUNTERS, counts))
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
            "subscriptions": len(self.local) + len(self.groups.local),
            "queue_subscriptions": len(self.groups.local),
            "queue_dropped": self.queue_dropped,
            "patterns": len(self._local_refs),
            "remote_patterns": len(self.remote),
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
            "generation": self.generation,
            "owned_subjects": len(self.owned),
            "fabric": self.fabric.stats() if self.fabric else {},
        }
        for part in self.parts:
            stats.update(part.stats())
        return stats
