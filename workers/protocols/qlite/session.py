"""A client connection speaking qlite's binary protocol (``protocols.qlite.codec``; docs/qlite.md), on one work queue.

One listener serves one queue, ``qlite.queue``: the protocol names none.  The session greets with a challenge; the
client proves bcrypt(qlite_secret ‖ challenge) as a publisher (role byte 0) or a subscriber (any other), then sends
requests, each answered in order (a request that waits on the queue's owner suspends the ones after it):

- ``PUSH;<bytes>`` (publishers) -> ``qpush`` of raw bytes; ``PASS;`` + u32 LE count of visible messages after it.
- ``HIDE;<u32 s>`` -> ``qrecv`` of one message leased for s seconds: ``PASS;`` + 16-byte receipt + ``;`` + body.
- ``POLL;<u32 s>[<u32 wait s>]`` -> the same, waiting up to ``qlite.max_polling_time`` for a message.
- ``DEL;<16 bytes>`` -> ``qack`` of that receipt; ``PASS;`` + the 16 bytes.
- ``LEN;`` (both roles) -> ``PASS;`` + u32 LE count of visible messages.
- Ours: ``EXT;<16><u32 s>`` (``qextend``), ``NACK;<16><u32 delay s>`` (``qnack``), ``STAT;`` (counts).

Decisions, beyond the codec's:
- Login needs a user of the broker's registry with a ``qlite_secret`` (the PBKDF2 password cannot serve: the
  handshake needs the secret itself), security on or off; with security on, also ``publish:<queue>`` for a
  publisher and ``subscribe:<queue>`` for a subscriber.  An unknown user, one without a secret and a wrong secret
  get the same answer after the same work (a bcrypt check of the client's cost), so names cannot be probed.
- bcrypt runs on a small pool of low-priority threads (pyca bcrypt releases the GIL), never on the event loop, and
  only for hashes of cost 4-12; a connection whose deadline passed while its check waited is not checked.
- Seats (``max_publishers``, ``max_subscribers``) are counted per worker process, after the login; connections
  still in their handshake are capped per worker too (``MAX_HANDSHAKES``).
- Time: the handshake must be done within 3 x ``io_timeout``; each frame must arrive within ``io_timeout`` of its
  first byte; an idle connection stays.
- A HIDE/POLL reply that finds its connection closed gives the lease back at once (the original cancels the hide
  when its reply cannot be written); otherwise a lease outlives its connection, as in the original.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from shardbroker.workers.auth import RateLimited
from shardbroker.workers.connection import Connection
from shardbroker.workers.message import KIND_RAW, as_bytes
from shardbroker.workers.protocols.qlite import codec
from shardbroker.workers.tally import Tally
from shardbroker.workers.workqueues.messages import D_DATA, D_KIND, D_RECEIPT
from shardbroker.workers.workqueues.receipts import receipt_bytes, receipt_text
from shardbroker.workers.workqueues.rules import DLQ_SUFFIX

if TYPE_CHECKING:
    from shardbroker.cluster.security.users import User
    from shardbroker.workers.hub import Hub

log = logging.getLogger("broker.qlite")

PROTOCOL = "qlite"
MAX_HANDSHAKES = 64          # per worker: connections between accept and PASS (each may cost one bcrypt check)
# ... of which one address may hold this many: 70 idle connections from one address held every seat, and every
# qlite client (all on the queue's owner) was refused until they timed out, again and again
MAX_HANDSHAKES_PER_ADDRESS = 8
HANDSHAKE_IOS = 3            # the handshake must be done within this many io_timeouts (as the original)
MAX_DELAY_S = 43_200         # NACK's delay, as the queues' (12 h)
REFUSAL = codec.REFUSAL     # the acceptor's, over limits.max_connections; ours, past MAX_HANDSHAKES

_HANDSHAKE = "handshake"
# Per worker process (one hub each): connections in their handshake, and the logged-in ones by role.
_seats: weakref.WeakKeyDictionary[Hub, dict[str, int]] = weakref.WeakKeyDictionary()
_handshaking: weakref.WeakKeyDictionary[Hub, Tally] = weakref.WeakKeyDictionary()   # by address
_pool: ThreadPoolExecutor | None = None
# Whether the owner's push result says how many messages are visible (then no stat goes with each PUSH).
_ERRORS = {   # the queues' error codes -> qlite's texts
    "message_too_large": codec.TOO_LARGE,
    "queue_full": codec.QUEUE_FULL,
    "queue_unavailable": codec.QUEUE_UNAVAILABLE,
    "journal_unavailable": codec.JOURNAL_UNAVAILABLE,
    "too_many_waiters": codec.TOO_MANY_WAITERS,
    "invalid_visibility": codec.HIDDEN_TOO_LONG,
    "invalid_delay": codec.DELAY_TOO_LONG,
    "lease_lost": codec.NOT_CORRELATED,
    "unknown_receipt": codec.NOT_CORRELATED,
    "invalid_receipt": codec.NOT_CORRELATED,
    "already_acked": codec.NOT_CORRELATED,
    "purged": codec.NOT_CORRELATED,
}


def _seats_of(hub: Hub) -> dict[str, int]:
    seats = _seats.get(hub)
    if seats is None:
        seats = _seats[hub] = {_HANDSHAKE: 0, codec.PUBLISHER: 0, codec.SUBSCRIBER: 0}
    return seats


def _bcrypt_pool() -> ThreadPoolExecutor:
    """Two low-priority threads per worker.  (The Authenticator's pool would do as well, but it is private to
    workers.auth; its thread set-up is reused.)"""
    global _pool
    if _pool is None:
        from shardbroker.workers.auth import yield_to_the_loop

        _pool = ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1), thread_name_prefix="qlite-bcrypt",
                                   initializer=yield_to_the_loop)
    return _pool


def _check(session: QliteSession, secret: bytes, challenge: bytes, hashed: bytes) -> bool:
    """On a pool thread: whether ``hashed`` is bcrypt(secret ‖ challenge)."""
    if session.closed:  # its handshake deadline passed while this waited for a thread: save the CPU
        return False
    import bcrypt  # here: a worker boots without it while qlite is off

    try:
        return bcrypt.checkpw(codec.bcrypt_input(secret, challenge), codec.normalized_hash(hashed))
    except ValueError:
        return False


def _error(result: dict) -> str:
    code = result.get("error", "")
    return _ERRORS.get(code) or f"error: {code}"


class QliteSession(Connection):
    protocol = PROTOCOL

    def __init__(self, hub: Hub, cid: int) -> None:
        super().__init__(hub, cid)
        cfg = hub.config.qlite
        self._cfg = cfg
        self.queue = cfg.queue
        self.role: str | None = None       # set at PASS
        self._deframer = codec.Deframer(codec.MAX_FRAME, codec.HANDSHAKE_FRAME_MAX)
        self._challenge = b""
        self._seat: str | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._max_wait_ms = int(round(cfg.max_polling_time * 1000))

    # -- life cycle -----------------------------------------------------------------------------------------
    def opened(self) -> None:
        seats = _seats_of(self.hub)
        by_address = _handshaking.setdefault(self.hub, Tally())
        address = self.peer[0]
        if seats[_HANDSHAKE] >= MAX_HANDSHAKES or by_address[address] >= MAX_HANDSHAKES_PER_ADDRESS:
            self.send(REFUSAL)
            self.close()
            return
        seats[_HANDSHAKE] += 1
        by_address.add(address)
        self._seat = _HANDSHAKE
        self._challenge = codec.new_challenge()
        self.send(codec.greeting(self._challenge))
        self._handshake_timer = self.hub.loop.call_later(HANDSHAKE_IOS * self._cfg.io_timeout,
                                                         self._handshake_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._handshake_timer, self._frame_timer):
            if timer is not None:
                timer.cancel()
        self._handshake_timer = self._frame_timer = None
        self._free_seat()
        super().connection_lost(exc)

    def close(self) -> None:
        super().close()
        self._free_seat()   # at once: the close may linger for the client's FIN

    def abort(self) -> None:
        super().abort()
        self._free_seat()

    def _free_seat(self) -> None:
        if self._seat is not None:
            _seats_of(self.hub)[self._seat] -= 1
            if self._seat == _HANDSHAKE:
                _handshaking[self.hub].remove(self.peer[0])
            self._seat = None

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if self.role is None and not self.closed:
            log.debug("qlite connection %d from %s: no login within %gs", self.cid, self.peer[0],
                      HANDSHAKE_IOS * self._cfg.io_timeout)
            self.close()   # as the original: without a word

    def info(self) -> dict:
        info = super().info()
        info["name"] = self.role or ""
        return info

    # -- input ----------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        frames = self._deframer.feed(data)
        self._watch_frame(bool(frames))
        if frames:
            self.process(frames)

    def _watch_frame(self, completed: bool) -> None:
        """A frame must arrive within io_timeout of its first byte: time the one in progress, if any."""
        if self._deframer.partial:
            if self._frame_timer is None or completed:   # a new frame began
                if self._frame_timer is not None:
                    self._frame_timer.cancel()
                self._frame_timer = self.hub.loop.call_later(self._cfg.io_timeout, self._frame_expired)
        elif self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _frame_expired(self) -> None:
        self._frame_timer = None
        if self.closed or not self._deframer.partial:
            return
        if self._paused:  # we stopped reading (a request in progress): the rest may be waiting in the kernel
            self._frame_timer = self.hub.loop.call_later(self._cfg.io_timeout, self._frame_expired)
            return
        log.debug("qlite connection %d from %s: a frame took more than %gs", self.cid, self.peer[0],
                  self._cfg.io_timeout)
        self.close()   # as the original: without a word

    def execute(self, item: bytes | codec.FrameTooLong) -> None:
        if isinstance(item, codec.FrameTooLong):
            # Past 10 MiB, the original's answer; a first frame past the handshake's limit cannot be a login.
            self.hub.breach("max_payload")
            self._fatal(codec.TOO_LONG if item.length > codec.MAX_FRAME else codec.AUTH_FORMAT)
        elif self.role is None:
            self._login(item)
        else:
            self._request(item)

    def _fatal(self, text: str) -> None:
        self.send(codec.fail(text))
        self.close()

    def _reply(self, data: bytes) -> None:
        if self.closed:
            return
        self.send(data)
        self.resume_held()

    # -- the handshake --------------------------------------------------------------------------------------
    def _login(self, payload: bytes) -> None:
        try:
            role, name, hashed = codec.parse_auth(payload)
        except codec.QliteError as exc:
            self._fatal(str(exc))
            return
        hub = self.hub
        if hub.auth.is_blocked(self.peer[0]):
            self._fatal(codec.AUTH_INVALID)
            return
        if not codec.acceptable_hash(hashed):   # refused without running bcrypt
            hub.auth_failed(self.peer[0])
            self._fatal(codec.AUTH_INVALID)
            return
        try:
            user = hub.auth.registry.get(name.decode())
        except UnicodeDecodeError:
            user = None
        secret = user.qlite_secret if user is not None else None
        self.suspend()   # what the client sent after its login waits for the answer
        asyncio.ensure_future(self._verify(role, user, secret, hashed))

    async def _verify(self, role: str, user: User | None, secret: str | None, hashed: bytes) -> None:
        # No user or no secret: a check of the same cost against a random secret, so the answer's time and text
        # say nothing about which names exist.
        key = secret.encode() if secret is not None else os.urandom(24)
        hub = self.hub

        async def check() -> bool:
            ok = await hub.loop.run_in_executor(_bcrypt_pool(), _check, self, key, self._challenge, hashed)
            # The registry may have changed during the check: the answer holds for the user as it is now.
            return (ok and user is not None and secret is not None and hub.auth.registry.get(user.name) is user
                    and user.qlite_secret == secret)
        try:
            ok = await hub.auth.attempt(self.peer[0], check)
        except RateLimited:
            ok = False
        except Exception:
            log.exception("qlite login check failed on connection %d", self.cid)
            ok = False
        if self.closed:
            return
        if not ok:
            self._fatal(codec.AUTH_INVALID)
            return
        if not self._may(role, user):
            self._fatal(codec.no_role(role))
            return
        cfg = self._cfg
        seats = _seats_of(hub)
        if seats[role] >= (cfg.max_publishers if role == codec.PUBLISHER else cfg.max_subscribers):
            self._fatal(codec.role_full(role))
            return
        self._free_seat()
        seats[role] += 1
        self._seat = role
        self.role = role
        self.user = user
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        self._reply(codec.ok())

    def _may(self, role: str, user: User) -> bool:
        """With security on, the role's permission on the queue (checked at login and at every request, so a
        permission taken away ends the session at its next request)."""
        if not self.hub.auth.enabled:
            return True
        perms = user.permissions
        return perms.may_publish(self.queue) if role == codec.PUBLISHER else perms.may_subscribe(self.queue)

    # -- requests -------------------------------------------------------------------------------------------
    def _request(self, payload: bytes) -> None:
        try:
            fn, data = codec.parse_request(payload)
        except codec.QliteError as exc:
            self.send(codec.fail(str(exc)))
            return
        verb = _VERBS.get(fn)
        if verb is None:
            self.send(codec.fail(codec.unknown_function(fn)))
            return
        handler, publisher_refusal = verb
        if self.role == codec.PUBLISHER and publisher_refusal:
            self.send(codec.fail(publisher_refusal))
            return
        if self.role == codec.SUBSCRIBER and fn == b"PUSH":
            self.send(codec.fail(codec.SUBSCRIBER_PUSH))
            return
        if not self._may(self.role, self.user):
            self._fatal(codec.no_role(self.role))
            return
        handler(self, data)

    def _ask(self, op: str, args: dict, done: Callable[[dict], None]) -> None:
        args["queue"] = self.queue
        self.hub.queue_service.request(self.cid, op, args, done)

    def _gather(self, n: int, finish: Callable[..., None]) -> list[Callable[[dict], None]]:
        """``n`` reply callbacks; ``finish`` gets the ``n`` results, in order, once all have come."""
        results: list = [None] * n
        left = [n]

        def one(i: int) -> Callable[[dict], None]:
            def got(result: dict) -> None:
                results[i] = result
                left[0] -= 1
                if not left[0]:
                    finish(*results)
            return got

        return [one(i) for i in range(n)]

    def op_push(self, data: bytes) -> None:
        if not data:
            self.send(codec.fail(codec.EMPTY_PUSH))
            return
        if len(data) > self._cfg.max_message_size:
            self.hub.breach("max_payload")
            self.send(codec.fail(codec.TOO_LARGE))
            return
        self.msgs_in += 1
        self.bytes_in += len(data)
        self.suspend()
        # report_visible: the owner's count of visible messages right after the push, in its result
        self._ask("push", {"data": data, "kind": KIND_RAW, "report_visible": True}, lambda push: self._reply(
            codec.ok(codec.u32(push["visible"])) if push.get("ok") else codec.fail(_error(push))))

    def op_hide(self, data: bytes) -> None:
        hidden = codec.seconds(data)
        if hidden is None:
            self.send(codec.fail(codec.HIDDEN_TIME_FORMAT))
        elif hidden > self._cfg.max_hidden_time:
            self.send(codec.fail(codec.HIDDEN_TOO_LONG))
        else:
            self._receive(hidden, 0, codec.QUEUE_EMPTY)

    def op_poll(self, data: bytes) -> None:
        args = codec.poll_args(data)
        if args is None:
            self.send(codec.fail(codec.HIDDEN_TIME_FORMAT))
            return
        hidden, wait = args
        if hidden > self._cfg.max_hidden_time:
            self.send(codec.fail(codec.HIDDEN_TOO_LONG))
            return
        wait_ms = min(wait * 1000, self._max_wait_ms) if wait else self._max_wait_ms
        self._receive(hidden, wait_ms, codec.POLL_TIMEOUT)

    def _receive(self, hidden: int, wait_ms: int, empty: str) -> None:
        # A long poll keeps reading: a client that leaves cancels its wait (docs/queues.md).
        self.suspend(keep_reading=bool(wait_ms))
        self._ask("recv", {"max": 1, "wait_ms": wait_ms, "visibility_ms": hidden * 1000},
                  lambda result: self._received(result, empty))

    def _received(self, result: dict, empty: str) -> None:
        if result.get("error") == "permission_denied":   # revoked while it waited: as at the next request
            self._fatal(codec.no_role(self.role))
            return
        if not result.get("ok"):
            self._reply(codec.fail(_error(result)))
            return
        messages = result["messages"]
        if not messages:
            self._reply(codec.fail(empty))
            return
        m = messages[0]   # a messages.D_* tuple
        if self.closed:   # nobody will read it: the lease goes back now (the original cancels an unsent hide)
            self._ask("nack", {"receipt": m[D_RECEIPT], "delay_ms": 0}, lambda result: None)
            self.hub.queue_service.connection_closed(self.cid)   # forget this connection again
            return
        body = as_bytes(m[D_KIND], m[D_DATA])
        self.msgs_out += 1
        self.bytes_out += len(body)
        self._reply(codec.ok(receipt_bytes(m[D_RECEIPT]) + b";" + body))

    def op_del(self, data: bytes) -> None:
        if len(data) != codec.RECEIPT_SIZE:
            self.send(codec.fail(codec.bad_id(len(data))))
            return
        self.suspend()

        def acked(result: dict) -> None:
            if result.get("ok") and not result.get("already_acked") and not result.get("purged"):
                self._reply(codec.ok(data))
            else:   # a second DEL fails, as in the original
                self._reply(codec.fail(_error(result) if not result.get("ok") else codec.NOT_CORRELATED))

        self._ask("ack", {"receipt": receipt_text(data)}, acked)

    def op_len(self, data: bytes) -> None:
        self.suspend()
        self._ask("stat", {"brief": True}, lambda result: self._reply(
            codec.ok(codec.u32(result["stat"]["visible"])) if result.get("ok") else codec.fail(_error(result))))

    def op_ext(self, data: bytes) -> None:
        args = codec.id_and_u32(data)
        if args is None:
            self.send(codec.fail(codec.EXT_FORMAT))
            return
        receipt, hidden = args
        if hidden > self._cfg.max_hidden_time:
            self.send(codec.fail(codec.HIDDEN_TOO_LONG))
            return
        self.suspend()
        self._ask("extend", {"receipt": receipt_text(receipt), "visibility_ms": hidden * 1000},
                  lambda result: self._reply(codec.ok(receipt) if result.get("ok") else codec.fail(_error(result))))

    def op_nack(self, data: bytes) -> None:
        args = codec.id_and_u32(data)
        if args is None:
            self.send(codec.fail(codec.NACK_FORMAT))
            return
        receipt, delay = args
        if delay > MAX_DELAY_S:
            self.send(codec.fail(codec.DELAY_TOO_LONG))
            return
        self.suspend()
        self._ask("nack", {"receipt": receipt_text(receipt), "delay_ms": delay * 1000},
                  lambda result: self._reply(codec.ok(receipt) if result.get("ok") else codec.fail(_error(result))))

    def op_stat(self, data: bytes) -> None:
        self.suspend()

        def stats(own: dict, dlq: dict) -> None:
            if not own.get("ok"):
                self._reply(codec.fail(_error(own)))
                return
            s = own["stat"]
            dead = dlq["stat"]["messages"] if dlq.get("ok") else 0
            self._reply(codec.ok(codec.stat_payload(s["visible"], s["in_flight"], s["delayed"], dead,
                                                    s["oldest_visible_age_ms"])))

        own_done, dlq_done = self._gather(2, stats)
        self._ask("stat", {}, own_done)
        # <queue>.dlq lives with <queue>: the same owner answers, right after
        self.hub.queue_service.request(self.cid, "stat", {"queue": self.queue + DLQ_SUFFIX}, dlq_done)


# verb -> (handler, the text a publisher gets for it, or "" where publishers may)
_VERBS: dict[bytes, tuple[Callable[[QliteSession, bytes], None], str]] = {
    b"PUSH": (QliteSession.op_push, ""),
    b"HIDE": (QliteSession.op_hide, codec.PUBLISHER_HIDE),
    b"POLL": (QliteSession.op_poll, codec.PUBLISHER_POLL),
    b"DEL": (QliteSession.op_del, codec.PUBLISHER_DEL),
    b"LEN": (QliteSession.op_len, ""),
    b"EXT": (QliteSession.op_ext, codec.PUBLISHER_EXT),
    b"NACK": (QliteSession.op_nack, codec.PUBLISHER_NACK),
    b"STAT": (QliteSession.op_stat, codec.PUBLISHER_STAT),
}
