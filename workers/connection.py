"""What every client connection has, whatever its protocol: an outbound queue, its bound, and its life cycle.

Writes are queued (``send``) and leave once per event-loop turn (``flush``, one ``writelines``), driven by the hub,
or earlier when a burst reaches ``flush_at``.  What the transport still holds after a write is what the client has
not read; past ``limits.max_pending_bytes`` the client is a slow consumer and is disconnected at once, so that
nobody waits for it and the worker's memory stays bounded (by the limit plus one burst).

Reading is paused, never blocked, for two reasons that may overlap: a request still being completed (a
subscription reaching the other workers, a password check), and the worker holding its publishers back (fabric
congestion, or a consumer draining slower than they produce: ``backpressure``).

A connection must complete its first frame (a line, a command, a login frame) within ``limits.handshake_timeout``
of being adopted, or it is closed with its protocol's words for it (``handshake_timeout``): one that opens and
sends nothing, or half a line, holds a descriptor and memory for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shardbroker.router import guard
from shardbroker.workers.connz_view import ConnzView
from shardbroker.workers.turn import TURN_BUDGET

try:
    import fcntl
    import termios
except ImportError:  # not a POSIX system
    fcntl = termios = None

if TYPE_CHECKING:
    from shardbroker.cluster.config import LimitsConfig
    from shardbroker.cluster.security.users import User
    from shardbroker.workers.auth import Authenticator
    from shardbroker.workers.backpressure import Backpressure
    from shardbroker.workers.groups import GroupTable
    from shardbroker.workers.subscription import Subscription

log = logging.getLogger("broker.conn")

PAUSE_SYNC = 1
PAUSE_HOLD = 2  # the worker holds its publishers back (fabric congestion, consumer backpressure)
_LINGER_RESET = struct.pack("ii", 1, 0)
# Linux: unacknowledged bytes in a TCP socket's send queue (SIOCOUTQ, the same number as TIOCOUTQ).
_SIOCOUTQ = termios.TIOCOUTQ if termios is not None and sys.platform.startswith("linux") else None
LINGER = 2.0  # seconds a closing connection waits for the client's own close once its output has drained
_HELD_MAX = 1024  # items read while a request is pending (see suspend) before reading pauses


class Host(Protocol):
    """What a connection needs of the worker that holds it (``workers.hub.Hub``), so that this room does not
    import the hub's."""

    loop: asyncio.AbstractEventLoop
    limits: LimitsConfig
    auth: Authenticator
    backpressure: Backpressure
    groups: GroupTable
    held: set
    holding: bool
    stopping: bool
    stall_bytes: int
    turn_work: int

    def register(self, conn: Connection) -> None: ...
    def unregister(self, conn: Connection) -> None: ...
    def breach(self, limit: str) -> None: ...
    def slow_consumer(self, conn: Connection) -> None: ...
    def settle(self, conn: Connection) -> None: ...
    def mark_dirty(self, conn: Connection) -> None: ...
    def subscribe(self, sub: Subscription, on_synced: Callable[[], None]) -> bool: ...
    def unsubscribe(self, sub: Subscription) -> None: ...
    def subscription_changed(self) -> None: ...


class Connection(ConnzView, asyncio.Protocol):
    protocol = "?"
    echo = True  # whether this connection receives its own messages (NATS CONNECT echo:false turns it off)
    close_on_eof = True  # a client's half-close ends the session once it is answered (Bridge subscribers stay)
    # Set by workers.tls before the handshake: over TLS; client certificates required; and they name the user.
    tls = False
    tls_verify = False
    tls_map = False
    # Moving to the owner of the work queue it uses (workers/protocols/ndjson/moves.py): may it still (its first queue
    # request
    # decides), has it gone (then its close here is no close), and what it brings when it arrives.
    movable = False
    moved = False
    arriving: dict | None = None

    def __init__(self, hub: Host, cid: int) -> None:
        self.hub = hub
        self.cid = cid
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] = ("", 0)
        self.subs: dict = {}   # the protocol's key (NDJSON topic, NATS sid) -> Subscription
        self.user: User | None = None   # None: not authenticated (or security off)
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.flushed_total = 0   # every byte handed to the transport: minus what it and the kernel still hold,
        #                          what the client has taken
        self.max_pending = hub.limits.max_pending_bytes
        self.flush_at = min(256 * 1024, self.max_pending // 4)
        self.dirty = False
        self.closed = False
        self.peer_eof = False     # the client half-closed: nothing more to read
        self._held: list | None = None   # items waiting for a suspended one to complete
        self._yielded = False            # ... or only for a later turn (budget, or the worker's hold)
        self.started = time.time()
        self.last_activity = self.started   # the last read from the client or write to it (/connz sort=last)
        self.reason = ""   # why it was closed, when the broker knows better than the transport (debug log)
        self._paused = 0
        # Published to another worker since the last ping: the ping's reply waits until those messages are
        # delivered there (Hub.after_inflight), so a reply to a ping means "delivered", as in one process.
        self.crossed = False
        self.corked = False   # output waits (NatsSession: a PONG waits for the commands read with it to settle)
        # Messages published and delivered, and their payload bytes (headers included for HPUB/HMSG), as
        # nats-server counts them; what went over the wire, framing and replies included, is flushed_total.
        self.msgs_in = self.bytes_in = self.msgs_out = self.bytes_out = 0
        self._first_frame: asyncio.TimerHandle | None = None   # the handshake deadline, until the first frame
        self.leftover = None   # set by ``execute``: the rest of an item (a run of publishes) for the next turn

    # -- asyncio.Protocol -----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # (TCP_NODELAY is the listener's, which every accepted socket inherits: cluster.supervisor.acceptor)
        transport.set_write_buffer_limits(high=self.hub.stall_bytes, low=self.hub.stall_bytes // 2)
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = (peer[0], peer[1])
        self.hub.register(self)
        if self.arriving is not None:   # from another worker, which greeted it
            try:
                self.arrived(self.arriving)
            except Exception:
                self._failed("a moved connection's arrival")
            return
        self._first_frame = self.hub.loop.call_later(self.hub.limits.handshake_timeout, self._first_frame_expired)
        log.debug("cid:%d %s:%d %s connection created", self.cid, self.peer[0], self.peer[1], self.protocol,
                  extra={"cid": self.cid, "peer": f"{self.peer[0]}:{self.peer[1]}", "protocol": self.protocol})
        self.opened()

    def connection_lost(self, exc: Exception | None) -> None:
        we_closed = self.closed
        self.closed = True
        if self._first_frame is not None:
            self._first_frame.cancel()
            self._first_frame = None
        self.out = []
        self.hub.unregister(self)
        if log.isEnabledFor(logging.DEBUG):
            reason = self.reason or (f"read error: {exc}" if exc else "client closed" if self.peer_eof else
                                     "server shutdown" if self.hub.stopping else
                                     "server closed" if we_closed else "client closed")
            log.debug("cid:%d %s:%d %s connection closed after %.3fs: %s", self.cid, self.peer[0], self.peer[1],
                      self.protocol, time.time() - self.started, reason,
                      extra={"cid": self.cid, "peer": f"{self.peer[0]}:{self.peer[1]}", "protocol": self.protocol,
                             "reason": reason})

    def eof_received(self) -> bool:
        """The client will send nothing more (``printf ... | nc -N``): answer what it sent, then close.  A request
        still being completed (a password check, a subscription reaching the other workers) finishes first."""
        if self.closed:
            return False  # we had half-closed already: both directions are done, let the transport go
        self.peer_eof = True
        if self.close_on_eof and self.answered():
            self.close()
        # keep the transport: the replies (or deliveries) still have to go out.  TLS has no half-close here:
        # asyncio closes after the client's close_notify whatever this says (and warns if it says True).
        return not self.tls

    def answered(self) -> bool:
        """Whether every request read so far has its reply queued (then a half-closed client can be let go)."""
        return not self._paused & PAUSE_SYNC

    def opened(self) -> None:
        """Hook for sessions that greet their client."""

    def arrived(self, state: dict) -> None:
        """Hook: taken over from another worker (workers/protocols/ndjson/moves.py), which sent ``state``."""
        raise NotImplementedError

    def greeted(self) -> None:
        """The first complete frame has arrived: the handshake deadline is met."""
        if self._first_frame is not None:
            self._first_frame.cancel()
            self._first_frame = None

    def _first_frame_expired(self) -> None:
        self._first_frame = None
        if self.closed:
            return
        self.hub.breach("handshake_timeout")
        self.reason = "no complete frame within limits.handshake_timeout"
        self.handshake_timeout()

    def handshake_timeout(self) -> None:
        """Hook: the client sent no complete frame in time.  A protocol that has words for it says them first."""
        self.close()

    def lame_duck(self) -> int:
        """Hook: the worker is in lame duck mode and will close this connection soon (workers.lameduck).  A
        protocol that can say so to its client does, and returns 1."""
        return 0

    # -- the client's requests, in order --------------------------------------------------------------------
    # A session turns each read into items (lines, commands) and ``execute``s them in order.  An item whose
    # completion comes later (a subscription reaching the other workers, a password check) suspends the rest:
    # they wait in ``_held``, and reading pauses, until ``resume_held``.  A turn that has done its share of
    # deliveries yields the rest to the next turn the same way, so no read can monopolise the event loop.
    def execute(self, item) -> None:
        raise NotImplementedError

    def process(self, items: list) -> None:
        self.last_activity = time.time()
        if self._first_frame is not None and items:
            self.greeted()
        if self._held is not None:
            self._held.extend(items)
            if len(self._held) >= _HELD_MAX:
                self.pause(PAUSE_SYNC)  # a suspension that keeps reading holds only so much
            return
        if self._run_guarded(items) and self.hub.holding and not self.closed:
            self.hold()

    def _run_guarded(self, items: list) -> bool:
        """``_run``; False if it raised (then the connection is closed: ``_failed``)."""
        try:
            self._run(items)
        except Exception:
            self._failed("a client's request")
            return False
        return True

    def _failed(self, where: str) -> None:
        """A bug met while serving this client (``guard``: counted, logged at most once a minute per place): the
        connection's state cannot be trusted, so it is closed, and nobody else is affected."""
        guard.failed(where)
        self.reason = f"internal error in {where}"
        self.close()

    def _run(self, items: list) -> None:
        hub = self.hub
        it = iter(items)
        for item in it:
            self.execute(item)
            if self._held is not None:
                self._held.extend(it)
                return
            if self.closed:
                return
            if hub.turn_work >= TURN_BUDGET or hub.holding or self.leftover is not None:
                # The turn has done its share, or the worker holds publishers back: the rest of this read waits
                # (for the next turn, or for the hold to end: see release).
                rest = list(it)
                if self.leftover is not None:   # the part of a run the turn had no room for goes first
                    rest.insert(0, self.leftover)
                    self.leftover = None
                if rest:
                    self.suspend(rest)
                    self._yielded = True
                    if hub.holding:
                        self.hold()
                    else:
                        hub.loop.call_soon(self.resume_held)
                return

    def suspend(self, items: list | None = None, keep_reading: bool = False) -> None:
        """Hold ``items`` and everything after the current item until ``resume_held``.  ``keep_reading`` (a long
        poll, which may wait minutes): later input is held but still read, up to ``_HELD_MAX`` items, so that a
        client that goes away is noticed (its waits are cancelled) instead of holding a place in a queue."""
        self._held = list(items or ())
        if not keep_reading:
            self.pause(PAUSE_SYNC)

    def resume_held(self) -> None:
        self._yielded = False
        if self.closed or self.hub.stopping:
            # Stopping: what was read but not yet processed was never acknowledged, and processing it now would
            # send messages after this worker told the others it sends nothing more.
            return
        held, self._held = self._held or [], None
        if self._run_guarded(held) and self._held is None:
            self.resume(PAUSE_SYNC)

    # -- outbound -------------------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        if self.closed:
            return
        self.hub.settle(self)  # messages batched for this connection go before what is sent now
        self.out.append(data)
        self.out_bytes += len(data)
        if self.out_bytes >= self.flush_at:
            # A burst (one turn may process many fabric frames): hand it to the kernel now, so that what stays
            # pending is what the client has not read, not what this turn happened to produce.
            self.flush()
        elif not self.dirty:
            self.dirty = True
            self.hub.mark_dirty(self)

    def deliver(self, data: bytes, size: int) -> None:
        """``send`` for a message delivery of ``size`` payload bytes, which the out counters count.  The hot path:
        ``send`` inlined."""
        if self.closed:
            return
        n = len(data)
        self.msgs_out += 1
        self.bytes_out += size
        self.out.append(data)
        self.out_bytes += n
        if self.out_bytes >= self.flush_at:
            self.flush()
        elif not self.dirty:
            self.dirty = True
            self.hub.mark_dirty(self)

    def deliver_batch(self, data: bytes, n: int, size: int) -> None:
        """``n`` deliveries of ``size`` payload bytes in all, in one chunk (the hub's batches)."""
        if not self.closed:
            self.msgs_out += n - 1
            self.deliver(data, size)

    def flush(self) -> None:
        self.dirty = False
        if self.closed or not self.out or self.corked:
            return
        out, self.out = self.out, []
        self.last_activity = time.time()
        self.flushed_total += self.out_bytes
        self.out_bytes = 0
        if self.tls and len(out) > 1:
            # asyncio's (and uvloop's) TLS encrypts each item alone: a turn's hundred small replies would be a
            # hundred records.  Joined, they fill 16 KiB records; TLS copies the bytes anyway.
            out = [b"".join(out)]
        self.transport.writelines(out)
        if self.transport.get_write_buffer_size() > self.max_pending:
            self.hub.slow_consumer(self)
            self.abort()

    @property
    def delivered_bytes(self) -> int:
        """Bytes the client's side has acknowledged so far: what backpressure calls progress.  The kernel's send
        buffer (megabytes, autotuned) is subtracted too, or a client reading steadily would look stuck while the
        kernel only refills that buffer in large steps."""
        return self.flushed_total - self.transport.get_write_buffer_size() - self._kernel_unacked()

    def _kernel_unacked(self) -> int:
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None or _SIOCOUTQ is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    @property
    def pending_bytes(self) -> int:
        if self.closed or self.transport is None:
            return 0
        return self.out_bytes + self.transport.get_write_buffer_size()

    # -- reading --------------------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused != 0

    def pause(self, reason: int) -> None:
        if not self._paused and not self.closed:
            self.transport.pause_reading()
        self._paused |= reason

    def resume(self, reason: int) -> None:
        was = self._paused
        self._paused &= ~reason
        if reason == PAUSE_SYNC and self.peer_eof and self.close_on_eof and self.answered():
            self.close()  # the client said all it had to say; everything is answered now
            return
        if was and not self._paused and not self.closed:
            self.transport.resume_reading()

    def hold(self) -> None:
        self.pause(PAUSE_HOLD)
        self.hub.held.add(self)

    def release(self) -> None:
        self.resume(PAUSE_HOLD)
        if self._yielded:  # the rest of a read waited for the hold to end
            self.resume_held()

    # transport flow control: the high-water mark is the backpressure threshold (see backpressure.py)
    def pause_writing(self) -> None:
        self.hub.backpressure.congested(self)

    def resume_writing(self) -> None:
        self.hub.backpressure.drained(self)

    # -- closing --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Send what is queued, then close without losing it.

        Closing a socket that still has unread input makes the kernel send RST, and the client's kernel then
        throws away whatever it had not yet read, replies included.  So: flush, half-close (FIN after the
        buffered bytes), keep reading and discarding until the client closes too, and only then close, or once
        the output has drained and ``LINGER`` seconds have passed.
        """
        if self.closed:
            return
        self.hub.settle(self)
        self.corked = False
        self.flush()
        self.closed = True
        transport = self.transport
        if self.peer_eof or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self._paused:
            self._paused = 0
            transport.resume_reading()
        self.hub.loop.call_later(LINGER, self._linger_over)

    def _linger_over(self) -> None:
        transport = self.transport
        if transport.is_closing():
            return
        if transport.get_write_buffer_size():
            self.hub.loop.call_later(LINGER, self._linger_over)  # still sending: the client is reading
        else:
            transport.abort()

    def abort(self) -> None:
        """Close now, dropping what is queued, here and in the kernel (RST: a slow consumer's socket buffers
        would otherwise keep megabytes trickling out to it after the close)."""
        if self.transport is None:
            return
        self.closed = True
        self.out = []
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            except OSError:
                pass
        self.transport.abort()

    # -- security -------------------------------------------------------------------------------------------
    def may_receive(self, subject: str) -> bool:
        """Whether deliveries on ``subject`` may reach this connection now (checked when routes are built,
        which every permission change invalidates)."""
        if not self.hub.auth.enabled:
            return True
        return self.user is not None and self.user.permissions.may_receive(subject)

    def drop_forbidden_subscriptions(self) -> None:
        """After a (re-)authentication: the subscriptions the user may not hold are dropped."""
        for key, sub in list(self.subs.items()):
            if not self.user.permissions.may_subscribe(sub.subject):
                del self.subs[key]
                self.hub.unsubscribe(sub)
            elif sub.queue is not None and self.hub.groups.user_of(sub) != self.user.name:
                # a queue-group member is picked by the user it names: announced again, as the new one
                self.hub.unsubscribe(sub)
                self.hub.subscribe(sub, lambda: None)
        self.hub.subscription_changed()

    def certificate_user(self) -> User | None:
        """The user this client's verified certificate names (tls.verify_and_map), or None."""
        if not self.tls_map or self.transport is None:
            return None
        return self.hub.auth.by_certificate(self.transport.get_extra_info("peercert"))

    def user_deleted(self) -> None:
        """The connection's user was deleted: it has no business staying connected."""
        self.reason = "user deleted"
        self.close()

    @property
    def party(self) -> str:
        """Whom the per-user limits count this connection against: its user, else (security off, or not logged
        in yet) its address."""
        return self.user.name if self.user is not None else self.peer[0]
