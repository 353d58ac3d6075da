"""A client connection speaking Jolt's NDJSON protocol (see docs/protocol.md).

Every complete line of a read is handled in order; replies and deliveries are queued and leave together at the
end of the turn.  Requests that finish later (a subscription that must reach the other workers first, a password
check in the thread pool, an admin change) suspend the connection: the lines after it, and reading, wait until
its reply is queued, so replies stay in request order and a request sees the effect of the ones before it.

With security enabled, a connection must ``auth`` before anything but ``ping`` (unless ``security.no_auth_user`` is
set: then it starts as that user); ``pub`` and ``sub`` are checked against the user's permissions, and every
delivery against its subscribe permission at delivery time (the hub's routes ask ``may_receive``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Awaitable, Callable

from shardbroker.router.subjects import is_valid_literal, is_valid_pattern
from shardbroker.workers.auth import RateLimited
from shardbroker.workers.connection import Connection
from shardbroker.workers.hub import Hub
from shardbroker.workers.message import KIND_JSON
from shardbroker.workers.protocols.ndjson import admin, codec
from shardbroker.workers.protocols.ndjson.queue_verbs import OPS as QUEUE_OPS
from shardbroker.workers.protocols.ndjson.queue_verbs import PUSH, flush_pushes, push_run
from shardbroker.workers.speedups import ndjson_runs
from shardbroker.workers.subscription import Subscription

log = logging.getLogger("broker.ndjson")

ERR_INVALID_JSON = codec.error("invalid_json")
ERR_LINE_TOO_LONG = codec.error("line_too_long")
ERR_AUTH_TIMEOUT = codec.error("auth_timeout")
ERR_USER_DELETED = codec.error("user_deleted")
ERR_HANDSHAKE_TIMEOUT = codec.error("handshake_timeout")

_OPEN_OPS = ("auth", "ping")  # allowed before authentication


class NdjsonSession(Connection):
    protocol = "ndjson"

    def __init__(self, hub: Hub, cid: int) -> None:
        super().__init__(hub, cid)
        self._tail = b""
        self._max_line = hub.limits.max_line_bytes
        self._max_topic = hub.limits.max_topic_length
        self._secure = hub.auth.enabled
        self._auth_failures = 0
        self._auth_timer: asyncio.TimerHandle | None = None
        # Replies still awaited, in request order: a request answered later (a work-queue request, which goes to
        # the queue's owner) reserves its place, and what is sent after it waits behind it (``reserve``/``fill``).
        self._slots: collections.deque[list] = collections.deque()
        self.push_group = None   # single qpushes to one queue, gathered while a read is processed (queue_verbs)
        self.movable = hub.config.queues.move_connections

    # -- replies in request order, some of them later --------------------------------------------------------
    def send(self, data: bytes) -> None:
        if self._slots:
            self._slots.append([data])   # the head is a reply still awaited: this one goes after it
            return
        super().send(data)

    def reserve(self) -> list:
        """A place for a reply that comes later; requests after it go on, their replies wait behind it."""
        slot = [None]
        self._slots.append(slot)
        return slot

    def fill(self, slot: list, data: bytes) -> None:
        slot[0] = data
        slots = self._slots
        while slots and slots[0][0] is not None:
            Connection.send(self, slots.popleft()[0])
        if not slots and self.peer_eof and self.close_on_eof and self.answered():
            self.close()

    @property
    def pending_replies(self) -> int:
        return len(self._slots)

    def answered(self) -> bool:
        return not self._slots and super().answered()

    def opened(self) -> None:
        if self._secure:
            # security.no_auth_user: a connection starts as that user (an `auth` may still switch identity);
            # without it (or once that user is deleted) it must authenticate within auth_timeout.
            # tls.verify_and_map: a verified client certificate names the user, before no_auth_user.
            mapped = self.certificate_user()
            self.user = mapped or self.hub.auth.no_auth_user()
            if self.user is None:
                self._auth_timer = self.hub.loop.call_later(self.hub.auth.config.auth_timeout, self._auth_timeout)
            elif mapped is not None:   # a login like a password's: it counts towards max_connections_per_user
                self.suspend()
                asyncio.ensure_future(self._claim_certificate_user(mapped))

    def arrived(self, state: dict) -> None:
        """Taken over from another worker (workers/protocols/ndjson/moves.py): who it is, and what it sent that was not
        processed there, which goes before anything read here."""
        self.movable = False
        self.started = state["started"]
        name = state.get("user")
        if name is not None or self._secure:
            self.user = self.hub.auth.registry.get(name) if name is not None else None
            if self.user is None:   # deleted while it moved
                self.send(ERR_USER_DELETED)
                self.close()
                return
        # Processed here, in connection_made: whatever the socket yields next (more requests, the client's EOF)
        # comes after it.  (Pausing the transport in connection_made would not do: uvloop starts reading anyway.)
        self.data_received(state["data"].encode("latin-1"))

    def unprocessed(self) -> tuple[list, bytes]:
        """What was read and not processed: the held items, and the partial line after them."""
        return list(self._held or ()), self._tail

    async def _claim_certificate_user(self, user) -> None:
        if not await self.hub.claim(self, user.name):
            if not self.closed:
                self.send(codec.error("max_connections_per_user"))
                self.reason = "limits.max_connections_per_user"
                self.close()
            return
        self.resume_held()

    def handshake_timeout(self) -> None:
        self.send(ERR_HANDSHAKE_TIMEOUT)
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        super().connection_lost(exc)

    # -- input ----------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        lines, self._tail = codec.split_lines(self._tail, data, self._max_line)
        self.process(ndjson_runs(lines))

    def _run(self, items: list) -> None:
        super()._run(items)
        if self.push_group is not None:
            flush_pushes(self)

    def execute(self, line: bytes | tuple | None) -> None:
        if type(line) is tuple:
            if len(line) == 3:
                self._pub_run(*line)
            else:
                push_run(self, line)
        elif line is None:
            self.hub.breach("max_payload")
            self.send(ERR_LINE_TOO_LONG)
            self.close()
        else:
            self._handle(line)

    def _pub_run(self, topic_b: bytes, payloads: list[bytes], lines: list[bytes]) -> None:
        """A run of canonical publishes to one topic (``speedups.ndjson_runs``): checked once, routed and batched
        in one call, answered with one chunk of replies.  What needs more (a topic not routed yet, a wildcard,
        no login, a denied publish, a publisher subscribed to the topic, whose deliveries and replies interleave)
        takes the lines one at a time."""
        hub = self.hub
        topic = topic_b.decode()   # ASCII: ndjson_runs lets nothing else through
        route = hub.routes.get(topic)
        if route is None or route.wild or (self._secure and (self.user is None
                                                             or not self.user.permissions.may_publish(topic))) \
                or (self.subs and self in route.ndjson):
            for i, line in enumerate(lines):
                self._handle(line)
                if self.closed:
                    return
                if route is None and i + 1 < len(lines) and hub.routes.get(topic) is not None:
                    self._pub_run(topic_b, payloads[i + 1:], lines[i + 1:])   # the route is cached now
                    return
            return
        taken, nbytes, _ = hub.publish_run(route, KIND_JSON, payloads, None, self)
        if taken < len(payloads):
            self.leftover = (topic_b, payloads[taken:], lines[taken:])   # for the next turn
        self.msgs_in += taken
        self.bytes_in += nbytes
        self.send(codec.OK * taken)

    def _handle(self, line: bytes) -> None:
        req = codec.parse(line)
        if req is None:
            if not codec.is_blank(line):  # blank lines (an extra Enter in netcat) are ignored
                self.send(ERR_INVALID_JSON)
            return
        op = req.get("op")
        if op is None:
            op = req.get("cmd")  # older Jolt clients
        handler = _OPS.get(op) if type(op) is str else None
        if handler is None:
            handler = _admin_handler(op) if type(op) is str else None
            if handler is None:
                self.send(codec.reply(req, "unknown_op"))
                return
        if self._secure and self.user is None and op not in _OPEN_OPS:
            self.send(codec.reply(req, "auth_required"))
            return
        if self.push_group is not None and handler is not PUSH:
            flush_pushes(self)   # what comes after gathered pushes sees them done (a qrecv, a qstat)
        try:
            handler(self, req, line)
        except codec.TooDeep:   # raised before the request did anything
            self.send(codec.reply(req, "invalid_json"))

    # -- requests that finish later -------------------------------------------------------------------------
    def _suspend(self, work: Awaitable[bytes | None]) -> None:
        """Run ``work`` (which yields the reply), holding everything after this request until it is done."""
        self.suspend()
        asyncio.ensure_future(self._finish(work))

    async def _finish(self, work: Awaitable[bytes | None]) -> None:
        try:
            reply = await work
        except Exception:
            log.exception("request failed on connection %d", self.cid)
            reply = codec.error("internal_error")
        self._reply_and_resume(reply)

    def _reply_and_resume(self, reply: bytes | None) -> None:
        if self.closed:
            return
        if reply is not None:
            self.send(reply)
        self.resume_held()

    # -- operations -----------------------------------------------------------------------------------------
    def _topic(self, req: dict, valid: Callable[[str, int], bool]) -> str | None:
        """The request's topic, or None after replying with the reason it is unusable."""
        topic = req.get("topic")
        if topic is None or topic == "":
            self.send(codec.reply(req, "missing_topic"))
            return None
        if type(topic) is not str or not valid(topic, self._max_topic):
            self.send(codec.reply(req, "invalid_topic"))
            return None
        return topic

    def op_pub(self, req: dict, line: bytes) -> None:
        hub = self.hub
        topic = req.get("topic")
        route = hub.routes.get(topic) if type(topic) is str else None
        if route is None or route.wild:
            topic = self._topic(req, is_valid_literal)
            if topic is None:
                return
            route = hub.route_for(topic)
        if self._secure and not self.user.permissions.may_publish(topic):
            self.send(codec.reply(req, "permission_denied"))
            return
        payload = codec.encode_data(line, req.get("data"))
        self.msgs_in += 1
        self.bytes_in += len(payload)
        hub.publish(route, KIND_JSON, payload, None, None, self)
        self.send(codec.reply(req))

    def op_sub(self, req: dict, line: bytes) -> None:
        topic = self._topic(req, is_valid_pattern)
        if topic is None:
            return
        if self._secure and not self.user.permissions.may_subscribe(topic):
            self.send(codec.reply(req, "permission_denied"))
            return
        if topic in self.subs:
            self.send(codec.reply(req))
            return
        if self.hub.subscription_refused(self) is not None:
            self.send(codec.reply(req, "too_many_subscriptions"))
            return
        sub = Subscription(self, topic, topic)
        self.subs[topic] = sub
        if self.hub.subscribe(sub, lambda: self._reply_and_resume(codec.reply(req))):
            self.send(codec.reply(req))
        else:
            self.suspend()

    def op_unsub(self, req: dict, line: bytes) -> None:
        topic = self._topic(req, is_valid_pattern)
        if topic is None:
            return
        sub = self.subs.get(topic)
        if sub is None:
            self.send(codec.reply(req))
            return

        def unsubscribed() -> None:  # once what other workers already read is delivered (Hub.after_inflight)
            if self.subs.get(topic) is sub:
                del self.subs[topic]
                self.hub.unsubscribe(sub)
            self._reply_and_resume(codec.reply(req))

        self.suspend()
        self.hub.after_inflight(unsubscribed)

    def op_ping(self, req: dict, line: bytes) -> None:
        if self.crossed or self.subs:
            # The reply means: what this connection published before it is delivered, and so is what the other
            # workers had already read for its subscriptions (one round trip between workers; none if neither).
            self.crossed = False
            self.suspend()
            self.hub.after_inflight(lambda: self._reply_and_resume(codec.reply(req)))
        else:
            self.send(codec.reply(req))

    def op_info(self, req: dict, line: bytes) -> None:
        hub = self.hub
        info = {"server": "shardbroker", "worker": hub.index, "workers": hub.workers, "pid": os.getpid(),
                "cid": self.cid, "subscriptions": sorted(self.subs)}
        if self.user is not None:
            info["user"] = self.user.name
        self.send(codec.reply_with(req, {"info": info}))

    # -- authentication -------------------------------------------------------------------------------------
    def op_auth(self, req: dict, line: bytes) -> None:
        if not self._secure:
            self.send(codec.reply(req))  # as Jolt: always succeeds, does nothing
            return
        name, password = req.get("user"), req.get("pass")
        if not isinstance(name, str) or not isinstance(password, str) or not name or not password:
            self.send(codec.reply(req, "missing_credentials"))
            return
        if self.hub.auth.is_blocked(self.peer[0]):
            self._auth_failed(req, "rate_limited")
            return
        self._suspend(self._authenticate(req, name, password))

    async def _authenticate(self, req: dict, name: str, password: str) -> bytes | None:
        auth = self.hub.auth
        try:
            user = await auth.attempt(self.peer[0], lambda: auth.verify(name, password))
        except RateLimited:
            if not self.closed:
                self._auth_failed(req, "rate_limited")
            return None
        if self.closed:
            return None
        if user is None:
            self._auth_failed(req, "auth_failed")
            return None
        if not await self.hub.claim(self, user.name):
            if not self.closed:   # nats-server closes too, over an account's connection limit
                self.send(codec.reply(req, "max_connections_per_user"))
                self.reason = "limits.max_connections_per_user"
                self.close()
            return None
        if self.closed:
            return None
        self.user = user
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        self.drop_forbidden_subscriptions()
        return codec.reply(req)

    def _auth_failed(self, req: dict, reason: str) -> None:
        self._auth_failures += 1
        self.send(codec.reply(req, reason))
        if self._auth_failures >= self.hub.auth.config.max_auth_failures:
            log.warning("closing connection %d from %s after %d failed auth attempts",
                        self.cid, self.peer[0], self._auth_failures)
            self.reason = "authentication failure"
            self.close()

    def _auth_timeout(self) -> None:
        self._auth_timer = None
        if self.user is None and not self.closed:
            self.send(ERR_AUTH_TIMEOUT)
            self.reason = "authentication timeout"
            self.close()

    def user_deleted(self) -> None:
        self.send(ERR_USER_DELETED)
        self.reason = "user deleted"
        self.close()

    # -- admin protocol -------------------------------------------------------------------------------------
    def _admin(self, req: dict, run) -> None:
        if not self._secure:
            self.send(codec.reply(req, "security_disabled"))
            return
        if not self.user.permissions.admin:
            self.send(codec.reply(req, "permission_denied"))
            return
        self._suspend(self._admin_reply(req, run))

    async def _admin_reply(self, req: dict, run) -> bytes:
        try:
            fields = await run(self.hub, req)
        except admin.AdminError as exc:
            return codec.reply(req, exc.reason)
        return codec.reply_with(req, fields)


def _admin_handler(op: str):
    run = admin.OPERATIONS.get(op)
    if run is None:
        return None
    return lambda session, req, line: session._admin(req, run)


_OPS = {
    "pub": NdjsonSession.op_pub,
    "sub": NdjsonSession.op_sub,
    "unsub": NdjsonSession.op_unsub,
    "ping": NdjsonSession.op_ping,
    "auth": NdjsonSession.op_auth,
    "info": NdjsonSession.op_info,
    **QUEUE_OPS,   # qpush, qrecv, qack, ... (workers/workqueues)
}
