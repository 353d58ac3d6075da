"""A client connection speaking the NATS core protocol, so NATS clients (nats-py, nats.go, ...) work unchanged.

Behaviour follows nats-server where a client can tell (see docs/nats.md and shared reference transcripts): INFO on
connect; CONNECT options (verbose, pedantic, echo, headers, no_responders, user/pass, auth_token; nkey and jwt are
refused); PING/PONG both ways, with stale connections closed; PUB/HPUB, SUB with queue groups, UNSUB with a limit;
MSG/HMSG; ``+OK`` in verbose mode; the ``-ERR`` texts of nats-server and whether each closes the connection.

Ordering: a SUB is in force locally at once; other workers learn of it asynchronously, and a PING (what a client's
``flush()`` sends) is answered only once every earlier SUB is in force on every worker, and every message published
before it is delivered to its subscribers' connections on every worker.  So after ``flush()``, a publish from any
client reaches the new subscription, and a subscriber told to stop after a publisher's ``flush()`` has them all.
An UNSUB takes effect once what the other workers already read is delivered.  A CONNECT with credentials holds
everything after it until the password check (in a thread pool) is done.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from shardbroker.router.subjects import covers, is_valid_pattern
from shardbroker.workers.connection import Connection
from shardbroker.workers.delivery import Outgoing
from shardbroker.workers.hub import Hub
from shardbroker.workers.message import KIND_RAW
from shardbroker.workers.protocols.nats import codec, greeting
from shardbroker.workers.protocols.nats import queue_verbs as queue_ops
from shardbroker.workers.protocols.nats.handshake import (
    ERR_AUTH_TIMEOUT,
    ERR_AUTH_VIOLATION,
    ERR_INVALID_PUB_SUBJECT,
    ERR_INVALID_SUBJECT,
    ERR_MAX_SUBS,
    ERR_STALE,
    Handshake,
)
from shardbroker.workers.subscription import Subscription

log = logging.getLogger("broker.nats")

_OP_SEND = 100  # a reply held back until earlier subscriptions are in force (verbose +OK)

_BREACHES = {codec.ERR_MAX_PAYLOAD: "max_payload", codec.ERR_CONTROL_LINE: "max_control_line"}


_UNDECODABLE = object()
_PUBS = (codec.OP_PUB, codec.OP_PUBS)   # work-queue requests among them: queue_ops decides what comes first


def _text(reply_b: bytes | None):
    """A reply subject as text (None: no reply); ``_UNDECODABLE`` if it is not UTF-8, and then the message is
    dropped: nobody could subscribe to that subject."""
    if reply_b is None:
        return None
    try:
        return reply_b.decode()
    except UnicodeDecodeError:
        return _UNDECODABLE


def _quoted(text: str) -> str:
    """Go's %q for what a subject can hold."""
    return orjson.dumps(text).decode()


class NatsSession(Handshake, Connection):
    protocol = "nats"

    def __init__(self, hub: Hub, cid: int) -> None:
        super().__init__(hub, cid)
        cfg = hub.config.nats
        self._cfg = cfg
        self._parser = codec.Parser(cfg.max_control_line, cfg.max_payload)
        self._secure = hub.auth.enabled
        # nats-server's defaults before (and without) CONNECT; CONNECT overrides the keys it carries.
        self.verbose = True
        self.pedantic = True
        self.echo = True
        self.headers = False
        self.no_responders = False
        self.name = self.lang = self.version = ""
        self.connected = False
        self._waiting_syncs = False
        self._syncs = 0
        self._pong_at = -1   # flushed_total when a PONG was queued: while it has not moved, the PONG is unsent
        self._pings_out = 0
        self._pinged = False
        self._ping_sent = 0.0   # when our unanswered PING left (monotonic), for the RTT
        self.rtt = 0.0
        self._last_read = time.monotonic()
        self._ping_timer: asyncio.TimerHandle | None = None
        self._auth_timer: asyncio.TimerHandle | None = None
        self._greeted = False   # INFO went out before the TLS handshake (tls_greeting)
        self.gathered = None   # work-queue pushes or acks gathered while a read is processed (queue_ops)

    # -- life cycle -----------------------------------------------------------------------------------------
    def opened(self) -> None:
        if self._secure:
            self._auth_timer = self.hub.loop.call_later(self.hub.auth.config.auth_timeout, self._auth_timeout)
        if not self._greeted:
            self.send(greeting.info_line(self._info()))

    def lame_duck(self) -> int:
        """nats-server's lame duck INFO, to a client past its CONNECT (earlier, a client would take it for the
        greeting): nats-py calls its ``lame_duck_mode_cb``, nats.go its ``LameDuckModeHandler``."""
        if self.closed or not self.connected:
            return 0
        self.send(greeting.info_line(self._info() | {"ldm": True}))
        return 1

    def handshake_timeout(self) -> None:
        # nats-server's words for a CONNECT that did not come in time (it times CONNECT only with auth on)
        self._fail(ERR_AUTH_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._ping_timer, self._auth_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _fail(self, text: str | None) -> None:
        """nats-server's way out: the -ERR (if the error has one), then close."""
        if not self.closed:
            self.reason = text or "protocol error"
            log.info("cid:%d %s:%d nats: %s; closing", self.cid, self.peer[0], self.peer[1], self.reason,
                     extra={"cid": self.cid, "peer": f"{self.peer[0]}:{self.peer[1]}", "reason": self.reason})
        if text is not None:
            self.send(codec.err(text))
        self.close()

    # -- input ----------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._last_read = time.monotonic()
        self.process(self._parser.feed(data))

    def _run(self, items: list) -> None:
        super()._run(items)
        if self.gathered is not None:
            queue_ops.flush_gathered(self)

    def execute(self, cmd: tuple) -> None:
        op = cmd[0]
        if self.gathered is not None and op not in _PUBS:
            queue_ops.flush_gathered(self)   # what comes after gathered requests sees them done (a PUB: _pub)
        if self._secure and self.user is None and op not in (codec.OP_CONNECT, codec.OP_ERR, _OP_SEND):
            self._fail(ERR_AUTH_VIOLATION)
            return
        if op == codec.OP_PUBS:
            self._pubs(cmd[1], cmd[2], cmd[3])
        elif op == codec.OP_PUB:
            self._pub(cmd[1], cmd[2], cmd[3], cmd[4])
        elif op == codec.OP_PING:
            if self.crossed or self.subs:
                # A publisher's PONG: what it published is delivered.  A subscriber's: what the other workers had
                # already read for it is delivered (nats-py's drain() trusts that PONG to have flushed them).
                self._barrier()
            self._reply(codec.PONG)
        elif op == codec.OP_SUB:
            self._sub(cmd[1], cmd[2], cmd[3])
        elif op == codec.OP_UNSUB:
            self._unsub(cmd[1], cmd[2])
        elif op == codec.OP_PONG:
            self._pings_out = 0
            if self._ping_sent:  # the answer to our PING: nats-server's RTT (/connz rtt)
                self.rtt, self._ping_sent = time.monotonic() - self._ping_sent, 0.0
        elif op == codec.OP_CONNECT:
            self._connect(cmd[1])
        elif op == _OP_SEND:
            self._reply(cmd[1])
        elif op == codec.OP_ERR:
            if cmd[1] in _BREACHES:
                self.hub.breach(_BREACHES[cmd[1]])
            self._fail(cmd[1])
        # OP_INFO from a client carries nothing we use

    # -- holding: replies wait for subscriptions, everything waits for a password check ---------------------
    def _barrier(self) -> None:
        """Replies from here on wait until what this connection published, and what the other workers had read,
        is delivered (``Hub.after_inflight``)."""
        self.crossed = False
        self._syncs += 1
        self.hub.after_inflight(self._synced)

    def _reply(self, data: bytes) -> None:
        """Send ``data`` once every sync point before it is reached (a held reply waits as itself, so that a
        PING's barrier is made once)."""
        if self._syncs:
            self._hold_until_synced((_OP_SEND, data))
            return
        self.send(data)
        if data is codec.PONG:
            self._pong_at = self.flushed_total if self.out else -1

    def _hold_until_synced(self, cmd: tuple | None) -> None:
        """Hold ``cmd`` (if any) and everything read after it until every sync point before it is reached."""
        self.suspend([cmd] if cmd is not None else None)
        self._waiting_syncs = True

    def _synced(self) -> None:
        self._syncs -= 1
        if not self._syncs and self.corked:
            self.corked = False
            self.flush()
        if not self._syncs and self._waiting_syncs:
            self._waiting_syncs = False
            self.resume_held()

    def flush(self) -> None:
        """nats-server writes a PONG after processing the whole read it came in, so a client sees it only once
        the commands read with it have taken effect.  nats-py relies on that: its ``flush()`` puts the PING
        ahead of the SUBs and PUBs it has not written yet.  Here a SUB takes effect once the other workers know
        it and a PUB once they delivered it, so a PONG still unsent when commands after it are unsettled waits,
        with all output after it, until they are (``corked``; the order of bytes never changes)."""
        if self._pong_at == self.flushed_total and (self.crossed or self._syncs) and self.out \
                and not self.corked and not self.closed:
            self.corked = True   # first: with no other worker, after_inflight calls back at once
            self.dirty = False
            if self.crossed:
                self._barrier()
            return
        super().flush()

    # -- PUB / HPUB -----------------------------------------------------------------------------------------
    def queue_api(self, subject_b: bytes, reply: str | None, headers: bytes | None, payload: bytes) -> None:
        """A PUB on ``$Q.…``, which the work queues serve (``Hub.serve``): NATS' spelling of their API."""
        queue_ops.handle(self, subject_b, reply, headers, payload)

    def _pub(self, subject_b: bytes, reply_b: bytes | None, headers: bytes | None, payload: bytes) -> None:
        hub = self.hub
        route = hub.routes_b.get(subject_b)
        if route is None:
            route = self._new_route(subject_b)
            if route is None:
                return
        elif route.wild and self.pedantic:
            self.send(codec.err(ERR_INVALID_PUB_SUBJECT))  # and delivers it all the same, as nats-server does
        if headers is not None and not self.headers:
            self._fail(None)  # HPUB without negotiating headers: nats-server closes, without -ERR
            return
        if route.service is not None:
            self._serve(route, reply_b, headers, payload)
            return
        if self.gathered is not None:
            queue_ops.flush_gathered(self)   # what comes after gathered requests sees them done
        if self._secure and not self.user.permissions.may_publish(route.subject):
            self.send(codec.err(f"Permissions Violation for Publish to {_quoted(route.subject)}"))
            return
        reply = _text(reply_b)
        if reply is _UNDECODABLE:
            return
        if self.verbose:
            self.send(codec.OK)  # before the delivery, as nats-server: a publisher subscribed to it sees +OK first
        self.msgs_in += 1
        self.bytes_in += len(payload) if headers is None else len(payload) + len(headers)
        if not hub.publish(route, KIND_RAW, payload, reply, headers, self) and reply is not None \
                and self.no_responders:
            self._no_responders(reply, reply_b)

    def _serve(self, route, reply_b: bytes | None, headers: bytes | None, payload: bytes) -> None:
        """A PUB on a subject the broker serves itself (``$Q.…``): the service applies its own permissions (a
        queue's: docs/queues.md) and answers as its API does; no +OK, and not a message of the subject's counters."""
        reply = _text(reply_b)
        if reply is not _UNDECODABLE:
            self.hub.send(route, KIND_RAW, payload, reply, headers, self)

    def _pubs(self, subject_b: bytes, reply_b: bytes | None, payloads: list[bytes]) -> None:
        """A run of PUBs to one subject: checked once, routed and batched in one call.  What needs a word per
        message (verbose +OK, a wildcard subject in pedantic mode, a route not cached yet, a denied publish, a
        work-queue subject) goes one message at a time instead."""
        route = self.hub.routes_b.get(subject_b)
        if route is None or self.verbose or (route.wild and self.pedantic) or route.service is not None \
                or (self._secure and not self.user.permissions.may_publish(route.subject)):
            pub = self._pub
            for i, payload in enumerate(payloads):
                pub(subject_b, reply_b, None, payload)
                if self.closed:
                    return
                if route is None and i + 1 < len(payloads) and self.hub.routes_b.get(subject_b) is not None:
                    self._pubs(subject_b, reply_b, payloads[i + 1:])   # the route is cached now: the rest can run
                    return
            return
        reply = _text(reply_b)
        if reply is _UNDECODABLE:
            return
        taken, nbytes, anyone = self.hub.publish_run(route, KIND_RAW, payloads, reply, self)
        if taken < len(payloads):
            self.leftover = (codec.OP_PUBS, subject_b, reply_b, payloads[taken:])   # for the next turn
        self.msgs_in += taken
        self.bytes_in += nbytes
        if not anyone and reply is not None and self.no_responders:
            for _ in range(taken):
                self._no_responders(reply, reply_b)

    def _new_route(self, subject_b: bytes):
        """A subject not in the route cache: validate it (nats-server drops what no subscription can match)."""
        try:
            subject = subject_b.decode()
        except UnicodeDecodeError:
            subject = ""
        if not is_valid_pattern(subject, self.hub.limits.max_topic_length):
            if self.pedantic:
                self.send(codec.err(ERR_INVALID_PUB_SUBJECT))
            return None
        route = self.hub.route_for(subject)
        if route.wild and self.pedantic:
            self.send(codec.err(ERR_INVALID_PUB_SUBJECT))
        return route

    def _no_responders(self, reply: str, reply_b: bytes) -> None:
        """Nobody was subscribed: tell the requester at once (a 503 status on its own inbox subscription)."""
        for sub in self.subs.values():
            if covers(sub.subject, reply):
                self.send(codec.no_responders(reply_b, sub.sid))
                return

    # -- SUB / UNSUB ----------------------------------------------------------------------------------------
    def _sub(self, subject_b: bytes, queue_b: bytes | None, sid: bytes) -> None:
        try:
            subject = subject_b.decode()
            queue = queue_b.decode() if queue_b is not None else None
        except UnicodeDecodeError:
            subject, queue = "", None
        if not is_valid_pattern(subject, self.hub.limits.max_topic_length):
            self.send(codec.err(ERR_INVALID_SUBJECT))
            return
        if self._secure and not self.user.permissions.may_subscribe(subject):
            text = f"Permissions Violation for Subscription to {_quoted(subject)}"
            if queue is not None:
                text += f" using queue {_quoted(queue)}"
            self.send(codec.err(text))
            return
        if sid in self.subs:  # a duplicate sid is ignored, the first subscription stays (as nats-server)
            if self.verbose:
                self.send(codec.OK)
            return
        if self.hub.subscription_refused(self) is not None:
            self.send(codec.err(ERR_MAX_SUBS))
            return
        sub = Subscription(self, subject, sid, queue)
        self.subs[sid] = sub
        if not self.hub.subscribe(sub, self._synced):
            self._syncs += 1
        if self.verbose:
            self._reply(codec.OK)  # held until the subscription is in force everywhere

    def _unsub(self, sid: bytes, limit: int | None) -> None:
        sub = self.subs.get(sid)
        if sub is not None:
            self.hub.settle(self)  # sub.delivered must count what is batched for it
            if limit and limit > sub.delivered:
                sub.max_msgs = limit
                self.hub.subscription_changed()  # routes precompute which subscriptions have no limit
            else:
                # In force once what other workers already read is delivered (Hub.after_inflight).  Everything
                # this connection sent after it waits until then (as NDJSON's unsub does): a PUB read with it
                # must not reach the subscription, and after the PONG nothing more arrives for it.
                self._syncs += 1
                self.hub.after_inflight(lambda: self._unsubscribed(sub))
                if self.subs.get(sid) is sub and self._held is None:
                    self._hold_until_synced(None)
        if self.verbose:
            self._reply(codec.OK)

    def _unsubscribed(self, sub: Subscription) -> None:
        self.remove_subscription(sub)
        self._synced()

    def remove_subscription(self, sub: Subscription) -> None:
        if self.subs.get(sub.sid) is sub:  # keyed by sid here: no need to search
            del self.subs[sub.sid]
            self.hub.unsubscribe(sub)

    # -- delivery -------------------------------------------------------------------------------------------
    def frame_for(self, sub: Subscription, out: Outgoing) -> bytes:
        """A message with headers: HMSG if this client negotiated them, MSG with the payload alone otherwise."""
        if self.headers and out.hbody:
            return out.hmsg_line(sub.sid) + out.hbody
        return out.msg_line(sub.sid) + out.body

    def payload_size(self, out: Outgoing) -> int:
        """What ``frame_for`` delivers, as nats-server counts it: the header block (if sent) and the payload."""
        return len(out.hbody) - 2 if self.headers and out.hbody else len(out.body) - 2

    # -- keepalive and timeouts -----------------------------------------------------------------------------
    def _ping_tick(self) -> None:
        """As nats-server: a first PING shortly after CONNECT, then one per interval unless the client was heard
        from within it; more than ``ping_max`` unanswered and the connection is stale."""
        self._ping_timer = None
        if self.closed:
            return
        interval = self._cfg.ping_interval
        if not self._pinged or time.monotonic() - self._last_read >= interval:
            if self._pings_out + 1 > self._cfg.ping_max:
                self._fail(ERR_STALE)
                return
            self._pings_out += 1
            self._pinged = True
            self._ping_sent = self._ping_sent or time.monotonic()
            self.send(codec.PING)
        self._ping_timer = self.hub.loop.call_later(interval, self._ping_tick)

    def user_deleted(self) -> None:
        self._fail(ERR_AUTH_VIOLATION)

    def info(self) -> dict:
        return super().info() | {"name": self.name, "lang": self.lang, "version": self.version, "rtt": self.rtt}
