"""One leaf connection from this worker to one remote (a nats-server hub) once it is up: what it reads from the hub,
what it sends there, and how it stays alive (../shared/reference/leafnodes.md §2-3, §5); how it is dialled and
redialled is ``dial.Dialing``'s, the half it inherits.

- What the hub advertises is kept per connection (``HubInterest``) and dropped with it: every connect resends
  everything both ways.
- Liveness: PINGs answered at once (ahead of queued messages), our own one second after connecting and then every
  ``ping_interval``; the link is stale after ``ping_max`` unanswered, and any byte received counts as an answer.
- Flow: messages to the hub are queued and leave at the end of the turn (one ``writelines``).  A hub that reads
  slower than the worker's clients publish holds them back as a slow client would (``workers.backpressure``); past
  ``max_pending_bytes`` waiting (queued or in the transport), a message is dropped and counted (``slow_consumer``),
  never waited for: the worker's loop and its other clients go on.  A message over the hub's ``max_payload`` is
  dropped and counted (``oversize``): the hub would close the link on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from shardbroker.cluster.config import LeafnodesConfig, LeafRemoteConfig, LeafUrl, parse_url
from shardbroker.workers.protocols.leaf import codec
from shardbroker.workers.protocols.leaf.dial import Closed, Dialing, Owner, penalty_for
from shardbroker.workers.protocols.leaf.hubinterest import HubInterest
from shardbroker.workers.protocols.leaf.permissions import LeafPermissions

log = logging.getLogger("broker.leaf")


class LeafLink(Dialing, asyncio.Protocol):
    def __init__(self, owner: Owner, remote: LeafRemoteConfig, settings: LeafnodesConfig) -> None:
        self.owner = owner
        self.remote = remote
        self.settings = settings
        self.name = f"{owner.cluster}-w{owner.index}"
        self.urls: list[LeafUrl] = [parse_url(u, "leafnodes.remotes[].urls") for u in remote.urls]
        if not remote.no_randomize:
            random.shuffle(self.urls)
        self._next_url = 0
        self.url: LeafUrl = self.urls[0]
        self.state = "connecting"          # connecting, connected, waiting (to redial), closed
        self.transport: asyncio.Transport | None = None
        self.parser = codec.Parser(1 << 26)
        self.perms = LeafPermissions(deny_imports=remote.deny_imports, deny_exports=remote.deny_exports)
        self.hub = HubInterest(settings.max_hub_subscriptions)
        self.advertised: dict[tuple[str, str | None], int] = {}   # what the hub was told: (pattern, queue) -> weight
        self.info: dict = {}               # the hub's INFO (the first, updated by later ones)
        self.account = ""                  # the hub-side account, from connect_info
        self.max_payload = 1 << 20
        # during the handshake, events wait for the coroutine that reads them
        self._early: list[tuple] = []
        self._wake: asyncio.Future | None = None
        self._lost: asyncio.Future | None = None
        self._out: list[bytes] = []
        self._queued = 0
        self._written = 0
        self._dirty = False
        self.cid = -1   # no client's: backpressure's log names a link by ``who``
        self._write_paused = False
        self._ping: asyncio.TimerHandle | None = None
        self._pings_out = 0
        self._ping_sent = 0.0
        self._dropping = False
        self._task: asyncio.Task | None = None
        self.connected_at = 0.0
        self.rtt = 0.0
        self.in_msgs = self.in_bytes = self.out_msgs = self.out_bytes = 0
        self.connects = self.reconnects = self.failures = self.slow_consumers = self.oversize = 0
        self.last_error = ""
        self.last_error_pending: tuple[str, float] | None = None   # an -ERR the hub sent before closing
        self.retry_at = 0.0

    # -- life ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def close(self) -> None:
        self.state = "closed"
        if self._task is not None:
            self._task.cancel()
        self._drop_connection()

    def _connected(self) -> None:
        self.state = "connected"
        self.connected_at = time.time()
        self.connects += 1
        self.last_error = ""
        stall = self.owner.stall_bytes
        self.transport.set_write_buffer_limits(high=stall, low=stall // 2)
        lines = [codec.ls_add(self.owner.lds.encode())]
        self.advertised = {}
        for pattern, queue, weight in self.owner.interest():
            line = self._advertise(pattern, queue, weight)
            if line:
                lines.append(line)
        self.transport.writelines(lines)
        log.info("leafnode %s (%s): connected to %s (account %s)", self.url.url, self.name,
                 self.info.get("server_name") or self.info.get("server_id"), self.account or "?")
        self._ping = self.owner.loop.call_later(1.0 + random.uniform(0, 0.2), self._send_ping)

    def _drop_connection(self) -> None:
        if self._ping is not None:
            self._ping.cancel()
            self._ping = None
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.abort()
        self._out = []
        self._queued = 0
        if self._write_paused:
            self._write_paused = False
            self.owner.drained(self)
        self._pings_out = 0
        self.advertised = {}
        if self.hub.clear():
            self.owner.hub_interest_changed()
        if self.state == "connected":
            self.state = "waiting"

    def fail(self, reason: str, penalty: float = 0.0, tell: bytes = b"") -> None:
        """End this connection (the run loop redials)."""
        if self.transport is not None and tell:
            self.transport.write(tell)
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(Closed(reason, penalty))
        if self.transport is not None:
            self.transport.close() if tell else self.transport.abort()

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is not None and not self._lost.done():
            reason = f"connection lost ({exc})" if exc else "the hub closed the connection"
            if self.last_error_pending:
                reason, penalty = self.last_error_pending
                self._lost.set_result(Closed(reason, penalty))
            else:
                self._lost.set_result(Closed(reason))
        self.last_error_pending = None
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def release(self) -> None:
        """Read again: the turn whose budget this link's read spent is over, or the hub stopped holding back."""
        if self.transport is not None:
            self.transport.resume_reading()

    # The transport's high-water mark is the worker's backpressure threshold, as for a client (workers.backpressure):
    # a hub that reads slower than this worker's clients publish to it sets their pace; one that reads nothing at
    # all is let go after a moment, and what waits for it is bounded by leafnodes.max_pending_bytes.
    def pause_writing(self) -> None:
        self._write_paused = True
        self.owner.congested(self)

    def resume_writing(self) -> None:
        self._write_paused = False
        self.owner.drained(self)

    @property
    def who(self) -> str:
        return f"leaf connection {self.name} to {self.url.url}"

    @property
    def closed(self) -> bool:
        return self.transport is None

    @property
    def delivered_bytes(self) -> int:
        return self._written - (self.transport.get_write_buffer_size() if self.transport is not None else 0)

    @property
    def pending_bytes(self) -> int:
        return self._queued + (self.transport.get_write_buffer_size() if self.transport is not None else 0)

    def data_received(self, data: bytes) -> None:
        self._pings_out = 0   # any byte from the hub says it is alive (a PONG may queue behind a busy link)
        events = self.parser.feed(data)
        if self.state != "connected":
            self._early.extend(events)
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)
            return
        for event in events:
            self._event(event)
            if self.transport is None:
                return
        changed = self.hub.take_changed()
        if changed:
            self.owner.hub_interest_changed()
        self.owner.read_done(self)

    def _event(self, event: tuple) -> None:
        op = event[0]
        if op == codec.MSG:
            _, subject, reply, queues, headers, payload = event
            self.in_msgs += 1
            self.in_bytes += len(payload) + (len(headers) if headers is not None else 0)
            self.owner.received(self, subject, reply, queues, headers, payload)
        elif op == codec.LS_ADD:
            subject = event[1]
            if subject.startswith(b"$LDS."):
                if subject == self.owner.lds.encode():
                    self._loop_detected()
                return
            if not self.hub.add(subject, event[2], event[3]):
                self.fail(f"the hub advertised more than {self.hub.limit} subscriptions (leafnodes."
                          "max_hub_subscriptions)")
        elif op == codec.LS_DEL:
            self.hub.remove(event[1], event[2])
        elif op == codec.PING:
            self.transport.write(codec.PONG_LINE)
        elif op == codec.PONG:
            if self._ping_sent:
                self.rtt = time.monotonic() - self._ping_sent
                self._ping_sent = 0.0
        elif op == codec.INFO:
            if event[1].get("leafnode_urls"):
                self.info["leafnode_urls"] = event[1]["leafnode_urls"]
        elif op == codec.REMOTE_ERR:
            text = event[1]
            log.warning("leafnode %s (%s): the hub said -ERR '%s'", self.url.url, self.name, text)
            self.last_error_pending = (f"the hub said -ERR '{text}'", penalty_for(text))
            self.last_error = f"-ERR '{text}'"
        elif op == codec.ERR:
            self.fail(f"protocol error from the hub: {event[1]}")

    def _loop_detected(self) -> None:
        text = (f"Loop detected for leafnode account=\"{self.remote.account}\". Delaying attempt to reconnect "
                f"for 30s")
        self.fail("Loop detected: the hub advertised this broker's own $LDS", 30.0, codec.err(text))

    # -- liveness -----------------------------------------------------------------------------------------------
    def _send_ping(self) -> None:
        self._ping = None
        if self.transport is None or self.state != "connected":
            return
        if self._pings_out >= self.settings.ping_max:
            self.fail("Stale Leaf Node Connection (no answer to PING)")
            return
        self._pings_out += 1
        self._ping_sent = time.monotonic()
        self.transport.write(codec.PING_LINE)
        self._ping = self.owner.loop.call_later(self.settings.ping_interval, self._send_ping)

    # -- to the hub ---------------------------------------------------------------------------------------------
    def send(self, data: bytes, size: int) -> bool:
        """Queue one LMSG/HMSG of ``size`` payload bytes; False if it was dropped."""
        if self.transport is None:
            return False
        if size > self.max_payload:
            self.oversize += 1
            return False
        return self.send_run(data, 1, size)

    def send_run(self, data: bytes, n: int, size: int) -> bool:
        """Queue ``n`` messages (none over the hub's max_payload) of ``size`` payload bytes in all, as one write."""
        if self.transport is None:
            return False
        waiting = self._queued + len(data)
        if self._write_paused:
            waiting += self.transport.get_write_buffer_size()
        if waiting > self.settings.max_pending_bytes:
            self.slow_consumers += n
            if not self._dropping:
                self._dropping = True
                log.warning("leafnode %s (%s): the hub is not keeping up (over leafnodes.max_pending_bytes "
                            "waiting); dropping messages to it (slow_consumer)", self.url.url, self.name)
            return False
        self._dropping = False
        self._out.append(data)
        self._queued += len(data)
        self.out_msgs += n
        self.out_bytes += size
        if not self._dirty:
            self._dirty = True
            self.owner.mark_dirty(self)
        return True

    def flush(self) -> None:
        self._dirty = False
        if self._out and self.transport is not None:
            self.transport.writelines(self._out)
            self._written += self._queued
        self._out = []
        self._queued = 0

    def local_changed(self, pattern: str, queue: str | None, weight: int) -> None:
        """Local interest changed: ``weight`` subscriptions (members, for a queue) now; 0: none."""
        if self.state != "connected" or self.transport is None:
            return
        key = (pattern, queue)
        if weight <= 0:
            if self.advertised.pop(key, None) is not None:
                self.transport.write(codec.ls_del(pattern.encode(), queue.encode() if queue else None))
            return
        line = self._advertise(pattern, queue, weight)
        if line:
            self.transport.write(line)

    def _advertise(self, pattern: str, queue: str | None, weight: int) -> bytes:
        key = (pattern, queue)
        if queue is None and key in self.advertised:
            return b""   # plain interest is told once (0 -> 1); queues tell every change of weight
        if not self.perms.may_import(pattern):
            return b""
        self.advertised[key] = weight
        if queue is None:
            return codec.ls_add(pattern.encode())
        return codec.ls_add(pattern.encode(), queue.encode(), weight)

    # -- monitoring ---------------------------------------------------------------------------------------------
    def leafz(self, subs: bool) -> dict:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        info = {
            # nats-server's spoke shows its own (local) account here; the hub's binding is remote_account
            "name": self.name, "is_spoke": True, "account": self.remote.account, "remote_account": self.account,
            "ip": peer[0] if peer else self.url.host, "port": peer[1] if peer else self.url.port,
            "rtt": _rtt(self.rtt), "in_msgs": self.in_msgs, "out_msgs": self.out_msgs, "in_bytes": self.in_bytes,
            "out_bytes": self.out_bytes, "subscriptions": len(self.advertised) + (self.state == "connected"),
            "compression": "not supported",
            # this broker's own: the link's life
            "url": self.url.url, "state": self.state, "hub": self.info.get("server_name") or "",
            "hub_subscriptions": len(self.hub), "connects": self.connects, "reconnects": self.reconnects,
            "failures": self.failures, "last_error": self.last_error, "slow_consumers": self.slow_consumers,
            "oversize": self.oversize,
        }
        if subs:
            listed = [self.owner.lds] if self.state == "connected" else []
            info["subscriptions_list"] = listed + sorted({p for p, _ in self.advertised})
        return info


def _rtt(seconds: float) -> str:
    """nats-server's Duration string: "1.234ms"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3f}ms"
    return f"{seconds:.3f}s"
