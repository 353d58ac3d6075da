"""The ZeroMQ fabric between workers.

Every worker binds one PUB socket at ``ipc://<runtime dir>/fabric-<index>.ipc`` and connects one SUB socket to every
other worker's PUB, subscribed to its own index only, so PUB/SUB works as a set of one-way links: a frame reaches the
single worker it is addressed to.  On top of that:

- Batching: messages and control items are queued per destination and sent as one frame per destination per
  event-loop turn (``flush``), which is what makes ZeroMQ fast from Python.
- Sequence numbers per link: a gap is detected and counted (frames and messages), never silent.
- Acks and flow control: every frame carries the highest sequence number its sender has processed from the
  destination, and a frame of its own that carries only that is sent when the peer asked for it (``WANT_ACK``: it
  waits on a sync point below, its window is a quarter full, its frame carried control items) or about once a second
  (``tick``), not after every frame: at a low rate, that frame cost each side as much as the one it acknowledged
  (``frames``).  Processed means done: a frame's messages count only once the handler has handed every one of them
  to its subscribers' connections (``finish``), which may be turns later (a bounded turn leaves a backlog) or only
  once messages it forwarded in turn are processed (a queue group's owner dispatching to another worker).  So an ack
  is a delivery receipt, which is what makes a client's PING/PONG mean "delivered" across workers.  A sender keeps
  at most ``window_bytes`` (and half the HWM in frames) unacknowledged on a link; past that it reports congestion so
  the worker stops reading from publishing clients (as nats-server stalls fast producers), and PUB never reaches its
  high-water mark, where it would drop.  A peer whose window stays full with no ack at all for ``stall_timeout`` (a
  stuck worker, until the supervisor replaces it; a slow one still acknowledges as it goes) is declared lagging and
  no longer holds anyone up: messages for it beyond the window are dropped here and counted (``dropped_messages``),
  so memory stays bounded.
- Sync points: ``when_processed(callback)`` calls back once every peer has processed every frame queued so far,
  which is how a subscription is known to be in force on all workers before its client is told ``ok``.
- Hello: a worker that starts sends hello to every peer until each answers; the answer carries the peer's interest
  snapshot (added by the handler), and the worker is ready once every peer has answered.
Control traffic rides the same links as data, so it is ordered with data and covered by the same sequence numbers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from shardbroker.router import frames, guard
from shardbroker.router.link import Link

log = logging.getLogger("broker.fabric")

HELLO = "hello"
HELLO_ACK = "hello_ack"

_RECV_BUDGET = 512  # frames per callback before yielding to client I/O
_MAX_FRAME_MESSAGES = 4096  # split a destination's batch above this, to bound frame size and latency
# ... and above this many payload bytes: a frame of megabytes is allocated, copied and freed four times on its way
# (marshal, ZeroMQ's message, the receiver's copy), each time in fresh pages that the kernel faults in and zeroes
# (a quarter of a worker's CPU in N→N); frames under malloc's mmap threshold (128 KiB) reuse the heap's.
_FRAME_BYTES = 64 * 1024


class FabricHandler(Protocol):
    def on_messages(self, src: int, messages: list, token: tuple[int, int] | None) -> None:
        """Deliver ``messages``, then call ``Fabric.finish(src, token)`` (at once or later); None: nothing to
        acknowledge (frames of a peer's previous incarnation)."""
    def on_control(self, src: int, item: tuple) -> None: ...
    def on_peer_hello(self, src: int) -> None: ...
    def on_peer_reset(self, src: int) -> None: ...
    def on_congestion(self, congested: bool) -> None: ...
    def schedule_flush(self) -> None: ...


def endpoint(runtime_dir: str, index: int) -> str:
    return f"ipc://{os.path.join(runtime_dir, f'fabric-{index}.ipc')}"


class Fabric:
    def __init__(self, index: int, workers: int, epoch: int, runtime_dir: str, handler: FabricHandler, *,
                 hwm: int, window_bytes: int, stall_timeout: float) -> None:
        self.index = index
        self.epoch = epoch
        self.handler = handler
        self.window_bytes = window_bytes
        self.window_frames = max(16, hwm // 2)
        self.stall_timeout = stall_timeout
        self.links = {p: Link(p) for p in range(workers) if p != index}
        self._dirty: set[int] = set()
        # Sync points: the callbacks added since the last flush, then one entry per flush that had any (what each
        # peer must acknowledge, the callbacks in the order they came).  Thousands of clients subscribing at once
        # add thousands of callbacks a turn; an ack checks one entry per flush, not one per callback.
        self._unfixed: list[Callable[[], None]] = []
        self._waiters: list[tuple[dict[int, int], list[Callable[[], None]]]] = []
        self._asking = False   # a sync point was added since the last flush: the peers are asked for acks
        self._congested = False
        self._input_paused: set[str] = set()
        self._ready = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()
        self._hello_timer: asyncio.TimerHandle | None = None
        self._closed = False

        self._ctx = zmq.Context(io_threads=1)
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        path = endpoint(runtime_dir, index)[len("ipc://"):]
        if os.path.exists(path):  # left by the worker this one replaces
            os.unlink(path)
        self.pub.bind(endpoint(runtime_dir, index))
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, hwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RECONNECT_IVL, 10)       # a replaced worker's endpoint comes back in ~0.2 s:
        self.sub.setsockopt(zmq.RECONNECT_IVL_MAX, 100)  # find it again promptly, not after seconds
        self.sub.setsockopt(zmq.SUBSCRIBE, frames.prefix(index))
        for p in self.links:
            self.sub.connect(endpoint(runtime_dir, p))
        self._fd = self.sub.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._on_readable)
        self._loop.call_soon(self._on_readable)  # frames may already be queued: the fd is edge-triggered

    # -- startup --------------------------------------------------------------------------------------------
    async def join(self, timeout: float) -> None:
        """Say hello to every peer until each answers; raise TimeoutError naming the silent ones."""
        if not self.links:
            return
        self._send_hellos()
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            silent = sorted(p for p, link in self.links.items() if not link.up)
            raise TimeoutError(f"no answer on the fabric from worker(s) {silent}") from None
        finally:
            if self._hello_timer:
                self._hello_timer.cancel()

    def _send_hellos(self) -> None:
        for link in self.links.values():
            if not link.up:
                self.control(link.peer, (HELLO,))
        self.handler.schedule_flush()
        # The first hello is usually lost (a SUB connects asynchronously: ZeroMQ's slow joiner); retry soon, it
        # is what a start waits for
        self._hello_timer = self._loop.call_later(0.01, self._send_hellos)

    # -- sending --------------------------------------------------------------------------------------------
    def send(self, dst: int, message: tuple, size: int) -> None:
        """Queue ``message`` (``frames.Message``) for ``dst``; ``size``: its payload bytes."""
        link = self.links[dst]
        link.out_msgs.append(message)
        link.out_bytes += size
        self._dirty.add(dst)

    def send_to(self, dsts: tuple[int, ...], message: tuple, size: int) -> None:
        links = self.links
        for dst in dsts:
            link = links[dst]
            link.out_msgs.append(message)
            link.out_bytes += size
        self._dirty.update(dsts)

    def control(self, dst: int, item: tuple) -> None:
        self.links[dst].out_ctrl.append(item)
        self._dirty.add(dst)

    def broadcast_control(self, item: tuple) -> None:
        for link in self.links.values():
            link.out_ctrl.append(item)
            self._dirty.add(link.peer)

    def when_processed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every up peer has processed every frame queued to it so far."""
        self._unfixed.append(callback)  # its requirement is fixed at the next flush, when seqs are known
        self._asking = True

    def flush(self) -> None:
        """Send what this turn queued: one frame per destination, plus acks owed.  Called once per loop turn."""
        if self._closed:
            return
        send = self.pub.send
        asking, self._asking = self._asking, False
        asked: set[int] = set()
        quarter_bytes, quarter_frames = self.window_bytes // 4, self.window_frames // 4
        for dst in self._dirty:
            link = self.links[dst]
            msgs, ctrl, nbytes = link.out_msgs, link.out_ctrl, link.out_bytes
            link.out_msgs, link.out_ctrl, link.out_bytes = [], [], 0
            if link.lagging and self._window_full(link) and msgs:
                if link.dropped_messages == link.dropped_at_lag:
                    log.error("worker %d lags: dropping messages for it until it catches up", dst)
                link.dropped_messages += len(msgs)
                msgs = []
                if not ctrl:
                    continue
            # In frames of at most _MAX_FRAME_MESSAGES messages and about _FRAME_BYTES, of even shares
            parts = max(1, -(-len(msgs) // _MAX_FRAME_MESSAGES), nbytes // _FRAME_BYTES)
            step = -(-len(msgs) // parts)
            while True:
                chunk, msgs = (msgs[:step], msgs[step:]) if parts > 1 else (msgs, [])
                link.out_seq += 1
                flags = frames.WANT_ACK if (asking or ctrl or not link.up or link.inflight_bytes > quarter_bytes
                                            or len(link.inflight) > quarter_frames) else 0
                if flags:
                    asked.add(dst)
                frame = frames.encode(dst, self.index, self.epoch, link.out_seq, link.out_msg_count,
                                      link.processed, max(0, link.in_epoch), chunk, ctrl, flags)
                ctrl = []
                count = frames.count(chunk)
                link.out_msg_count += count
                link.messages_out += count
                link.frames_out += 1
                link.inflight_bytes += len(frame)
                if not link.inflight:
                    link.waiting_since = time.monotonic()
                link.inflight.append((link.out_seq, len(frame)))
                link.ack_owed = False
                send(frame, zmq.NOBLOCK)  # copied: cheaper than zero-copy tracking (pyzmq's GC thread)
                if not msgs:
                    break
        self._dirty.clear()
        for link in self.links.values():
            # asked, with no frame of ours to carry the question: frames sent before the sync point are unacked
            ask = asking and link.up and link.acked < link.out_seq and link.peer not in asked
            if link.ack_owed or ask:
                link.ack_owed = False
                link.acks_out += 1
                send(frames.encode(link.peer, self.index, self.epoch, 0, link.out_msg_count, link.processed,
                                   max(0, link.in_epoch), [], [], frames.WANT_ACK if ask else 0), zmq.NOBLOCK)
        if self._unfixed:
            self._fix_waiters()
        self._check_congestion()

    def _fix_waiters(self) -> None:
        req = {p: link.out_seq for p, link in self.links.items() if link.up and link.acked < link.out_seq}
        self._waiters.append((req, self._unfixed))
        self._unfixed = []
        self._release_waiters()

    def _release_waiters(self) -> None:
        keep = []
        waiters, self._waiters = self._waiters, []   # a callback may add sync points: they stay
        for req, callbacks in waiters:
            # Satisfied by the ack, or by the peer being gone or lagging (stuck: it holds nobody up).
            for p in [p for p, seq in req.items()
                      if self.links[p].acked >= seq or not self.links[p].up or self.links[p].lagging]:
                del req[p]
            if req:
                keep.append((req, callbacks))
                continue
            for cb in callbacks:
                guard.call("a fabric sync point's callback", cb)
        self._waiters = keep + self._waiters

    # -- receiving ------------------------------------------------------------------------------------------
    def pause_input(self, reason: str, paused: bool) -> None:
        """Stop (or resume) processing frames, for ``reason`` (several may overlap): unprocessed frames are not
        acknowledged, so senders' windows fill and they hold their publishers back."""
        was = bool(self._input_paused)
        if paused:
            self._input_paused.add(reason)
        else:
            self._input_paused.discard(reason)
        if was and not self._input_paused:
            self._loop.call_soon(self._on_readable)  # the fd is edge-triggered: frames may be waiting already

    def _on_readable(self) -> None:
        if self._closed or self._input_paused:
            return
        recv = self.sub.recv
        for _ in range(_RECV_BUDGET):
            if self._input_paused:  # a frame just delivered made a consumer congested: stop here
                break
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._handle(frame)
            except ValueError as exc:
                log.error("dropping malformed fabric frame: %s", exc)
            except Exception:
                guard.failed("the fabric reader")   # and read on: nobody else would (the fd is edge-triggered)
        else:
            self._loop.call_soon(self._on_readable)  # more may be waiting: yield to client I/O first
        self.handler.schedule_flush()

    def _handle(self, frame: bytes) -> None:
        src, epoch, seq, msgs_before, ack, ack_epoch, flags, messages, control = frames.decode(frame)
        link = self.links.get(src)
        if link is None:
            raise ValueError(f"frame from unknown worker {src}")
        if epoch < link.in_epoch:
            # Sent by the incarnation this peer replaced, still queued: its messages were published, deliver them.
            if messages:
                self.handler.on_messages(src, messages, None)
            return
        if epoch > link.in_epoch:
            if link.in_epoch >= 0:
                log.info("worker %d restarted (epoch %d -> %d)", src, link.in_epoch, epoch)
                self.handler.on_peer_reset(src)
            link.restart(epoch, msgs_before)
        acked = ack and ack_epoch == self.epoch  # an ack of our frames, not of our predecessor's
        if seq == 0:
            if flags & frames.WANT_ACK:
                self._ack_wanted(link, link.in_seq)
            if acked:
                self._on_ack(link, ack)
            return  # ack-only
        if link.in_seq and seq != link.in_seq + 1:
            lost = seq - link.in_seq - 1
            lost_msgs = msgs_before - link.in_msg_count
            link.lost_frames += lost
            link.lost_messages += lost_msgs
            log.error("fabric link %d->%d lost %d frame(s), %d message(s)", src, self.index, lost, lost_msgs)
        link.in_seq = seq
        if flags & frames.WANT_ACK:
            link.ack_wanted = seq    # acknowledged when finished (which may be right below)
        count = frames.count(messages)
        link.in_msg_count = msgs_before + count
        link.unfinished.append(seq)
        link.frames_in += 1
        link.messages_in += count
        for item in control:
            kind = item[0]
            if kind == HELLO:
                self.control(src, (HELLO_ACK,))
                self.handler.on_peer_hello(src)
            elif kind == HELLO_ACK:
                pass  # the ack number in the header is what proves the link; see _on_ack
            else:
                guard.call("a fabric control item", self.handler.on_control, src, item)
        if not messages or not guard.call("a fabric frame's delivery", self.handler.on_messages, src, messages,
                                          (epoch, seq)):
            self.finish(src, (epoch, seq))   # a failed delivery must not hold the peer's window for good
        if acked:
            # After the messages: the peer sent them before it processed what it acknowledges, so a sync point
            # released by this ack finds them handed to the handler (Hub.after_inflight relies on it).
            self._on_ack(link, ack)

    def finish(self, src: int, token: tuple[int, int]) -> None:
        """Every message of the frame ``token`` names is delivered: acknowledge it once the frames before it are."""
        link = self.links.get(src)
        epoch, seq = token
        if link is None or link.in_epoch != epoch:
            return  # the peer restarted since: it waits for nothing of its predecessor's
        if link.finish(seq) and link.ack_wanted:
            self._ack_wanted(link, link.ack_wanted)

    def _ack_wanted(self, link: Link, upto: int) -> None:
        """The peer wants acks until every frame up to ``upto`` is processed: one at the next flush, and one after
        each frame finished until then (``finish``), so that a backlog worked off acknowledges as it goes."""
        link.ack_owed = True
        self.handler.schedule_flush()
        link.ack_wanted = 0 if link.processed >= upto else max(link.ack_wanted, upto)

    def _on_ack(self, link: Link, ack: int) -> None:
        link.take_ack(ack)
        if not link.up:
            link.up = True
            if not self._ready.done() and all(lk.up for lk in self.links.values()):
                self._ready.set_result(None)
        if self._waiters:
            self._release_waiters()
        if self._congested:
            self._check_congestion()

    # -- flow control ---------------------------------------------------------------------------------------
    def _window_full(self, link: Link) -> bool:
        return link.window_full(self.window_bytes, self.window_frames)

    def _check_congestion(self) -> None:
        now = time.monotonic()
        congested = False
        for link in self.links.values():
            if self._window_full(link) and not link.lagging:
                if not link.congested_since:
                    link.congested_since = now
                    link.stalls += 1
                elif now - max(link.congested_since, link.acked_at) > self.stall_timeout:
                    # Full, and no ack for the whole stall timeout: stuck, not merely slow (a peer held back by
                    # its own consumers still acknowledges frames as they drain).
                    link.lagging = True
                    link.dropped_at_lag = link.dropped_messages
                    self._release_waiters()
                    log.warning("worker %d lags behind (%d bytes unacknowledged, no ack for %.1fs); no longer "
                                "waiting for it", link.peer, link.inflight_bytes,
                                now - max(link.congested_since, link.acked_at))
                    continue
                congested = True
            elif link.inflight_bytes <= self.window_bytes // 2 and len(link.inflight) <= self.window_frames // 2:
                link.congested_since = 0.0
                if link.lagging:
                    link.lagging = False
                    log.warning("worker %d caught up; %d message(s) for it were dropped while it lagged",
                                link.peer, link.dropped_messages - link.dropped_at_lag)
        if congested != self._congested:
            self._congested = congested
            self.handler.on_congestion(congested)

    @property
    def congested(self) -> bool:
        return self._congested

    def tick(self) -> None:
        """Periodic (about 1 s): send acks (those not asked for; and an ack-only frame can be dropped) and re-check
        a stall."""
        for link in self.links.values():
            if link.in_epoch >= 0:
                link.ack_owed = True
        self._check_congestion()
        self.handler.schedule_flush()
        if not self._input_paused and not self._closed and self.sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            # Frames wait and nothing is reading: the descriptor is edge-triggered, so a wake-up missed is never
            # repeated.  Reading again costs nothing when the reader was merely about to run.
            self._loop.call_soon(self._on_readable)

    # -- membership -----------------------------------------------------------------------------------------
    def peer_down(self, peer: int, epoch: int) -> None:
        """The supervisor saw incarnation ``epoch`` of ``peer`` die: stop waiting for it, forget what it had not
        acknowledged.  Ignored if a newer incarnation has already said hello (the notice raced it)."""
        link = self.links.get(peer)
        if link is None or link.in_epoch > epoch:
            return
        link.up = False
        link.forget_inflight()
        link.out_msgs.clear()
        link.out_bytes = 0
        self.handler.on_peer_reset(peer)
        self._release_waiters()
        self._check_congestion()

    def unacked_for(self, peer: int) -> float:
        """Seconds frames to ``peer`` have waited with no ack moving (0: none wait).  A live peer acknowledges at
        least once a second, so seconds here mean it is stopped or stuck, before its heartbeat says so."""
        since = self.links[peer].waiting_since
        return time.monotonic() - since if since else 0.0

    def up_peers(self) -> list[int]:
        return [p for p, link in self.links.items() if link.up]

    # -- introspection --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        now = time.monotonic()
        links = {str(p): lk.stats(now) for p, lk in self.links.items()}
        total = lambda key: sum(getattr(lk, key) for lk in self.links.values())  # noqa: E731
        return {
            "links": links,
            "lost_frames": total("lost_frames"),
            "lost_messages": total("lost_messages"),
            "dropped_messages": total("dropped_messages"),
            "stalls": total("stalls"),
            "congested": self._congested,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hello_timer:
            self._hello_timer.cancel()
        try:
            self._loop.remove_reader(self._fd)
        except (ValueError, OSError):
            pass
        self.pub.close(linger=0)
        self.sub.close(linger=0)
        self._ctx.term()
