"""What the other workers send this one: their messages, delivered in order and within a turn's budget, and the
sync points and the end of traffic that ride with them.

A message crossing the fabric is ``(subject, kind, payload, reply, headers, extra)``, where ``payload`` is a list
for a run of messages without headers (``Hub.publish_run``: one fabric message however many the run holds);
``extra`` is None (deliver to local subscribers), ``("q", worker, cid, no_echo)`` (that, and you own the subject:
dispatch its queue groups for the publisher ``cid`` of ``worker``), or ``("m", [(group, cid, sid), ...])``
(deliver to these queue members only).

- A frame can carry thousands of messages, each for thousands of subscribers: what a turn's budget
  (``TURN_BUDGET``) has no room for waits in the backlog for the next turn, or until congested consumers drain
  (backpressure), with the fabric's input paused meanwhile so that later frames cannot overtake it.
- Acks are delivery receipts: a frame is finished (acknowledged) when its last message is delivered, or, if it
  made this worker forward queue-group messages to a third worker, once that worker has processed them.
- A sync point (``after_inflight``) is one round trip on every link; stopping (``drain``) is a ``fin`` on every
  link, answered by each peer's own once it has sent everything.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shardbroker.router import control, guard
from shardbroker.workers.turn import TURN_BUDGET

if TYPE_CHECKING:
    from shardbroker.router.fabric import Fabric
    from shardbroker.workers.backpressure import Backpressure
    from shardbroker.workers.delivery import Route

log = logging.getLogger("broker.hub")


class Host(Protocol):
    """What the inbox needs of the worker's hub (``workers.hub.Hub``), so that this room does not import the
    hub's."""

    loop: asyncio.AbstractEventLoop
    fabric: Fabric | None
    backpressure: Backpressure
    turn_work: int
    routes: dict[str, Route]

    def route_for(self, subject: str) -> Route: ...
    def run_room(self, route: Route, payloads: list[bytes], start: int = 0) -> tuple[int, int]: ...
    def deliver(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                origin: None) -> int: ...
    def deliver_run(self, route: Route, kind: int, payloads: list[bytes], nbytes: int, reply: str | None,
                    origin: None) -> int: ...
    def deliver_members(self, subject: str, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                        members: list) -> None: ...
    def dispatch_groups(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                        dispatch: tuple) -> bool: ...
    def schedule_flush(self) -> None: ...
    def handle(self, kinds: tuple[str, ...], handler: Callable[[int, tuple], None]) -> None: ...


class Inbox:
    def __init__(self, hub: Host) -> None:
        self.hub = hub
        # [messages from the fabric, next index, source worker, frame token, forwarded to a third worker]
        self.backlog: collections.deque[list] = collections.deque()
        self._scheduled = False
        self._waiters: list[Callable[[], None]] = []   # after_inflight callbacks waiting for the backlog
        self._fins: set[int] = set()
        self._fins_changed: asyncio.Event | None = None
        hub.handle((control.SYNC,), self._sync)
        hub.handle((control.FIN,), self._fin)

    def on_messages(self, src: int, messages: list, token: tuple[int, int] | None) -> None:
        self.backlog.append([messages, 0, src, token, False])
        if len(self.backlog) == 1:
            self._work()

    def _work(self) -> None:
        """Deliver what other workers sent, in order, at most a turn's budget at a time: one frame can carry
        thousands of messages, each for thousands of subscribers.  While a backlog remains, the fabric's input
        is paused (so later frames cannot overtake it) and the rest waits for the next turn.  A frame is finished
        (acknowledged) when its last message is delivered, or, if it made this worker forward queue-group messages to
        a third worker, once that worker has processed them: an ack means delivered, however many hops it took."""
        self._scheduled = False
        hub = self.hub
        backlog = self.backlog
        backpressure = hub.backpressure
        routes = hub.routes   # the route cache's, emptied in place (router.routes): held for the whole backlog
        while backlog:
            entry = backlog[0]
            messages, i = entry[0], entry[1]
            n = len(messages)
            while i < n:
                if hub.turn_work >= TURN_BUDGET or backpressure.active:
                    # Next turn, or once the congested consumers have drained (pressure_changed resumes it).
                    entry[1] = i
                    hub.fabric.pause_input("backlog", True)
                    if not self._scheduled and not backpressure.active:
                        self._scheduled = True
                        hub.loop.call_soon(self._work)
                    return
                subject, kind, payload, reply, headers, extra = messages[i]
                i += 1
                if extra is not None and extra[0] == "m":
                    hub.deliver_members(subject, kind, payload, reply, headers, extra[1])
                    continue
                route = routes.get(subject)
                if route is None:
                    route = hub.route_for(subject)
                if type(payload) is list:   # a run (publish_run): as much of it as the turn has room for
                    take, nbytes = hub.run_room(route, payload)
                    if take < len(payload):
                        i -= 1
                        messages[i] = (subject, kind, payload[take:], reply, headers, extra)
                        payload = payload[:take]
                    hub.deliver_run(route, kind, payload, nbytes, reply, None)
                    continue
                hub.deliver(route, kind, payload, reply, headers, None)
                if extra is not None and route.queued and hub.dispatch_groups(route, kind, payload, reply,
                                                                              headers, extra):
                    entry[4] = True
            backlog.popleft()
            self._finished(entry)
        if hub.fabric is not None:
            hub.fabric.pause_input("backlog", False)
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for callback in waiters:
                guard.call("a delivery barrier's callback", callback)

    def _finished(self, entry: list) -> None:
        _, _, src, token, forwarded = entry
        if token is None:
            return
        fabric = self.hub.fabric
        if forwarded:
            fabric.when_processed(lambda: fabric.finish(src, token))
        else:
            fabric.finish(src, token)

    def pressure_changed(self, pressure: bool) -> None:
        """Consumer backpressure began (pause the fabric's input) or ended (resume it, and the backlog)."""
        hub = self.hub
        if hub.fabric is not None:
            hub.fabric.pause_input("backpressure", pressure)
        if not pressure and self.backlog and not self._scheduled:
            self._scheduled = True
            hub.loop.call_soon(self._work)

    # -- sync points and the end of traffic -----------------------------------------------------------------
    def after_inflight(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every message queued here for other workers is delivered there, and every
        message the other workers had already taken from their clients is delivered here: one round trip on every
        link (links are FIFO, a peer acknowledges a frame once its messages are delivered, and its ack rides
        behind the messages it sent before it).  Pings and unsubscribes wait for this, so that "published before"
        means "delivered", as one process gives for free."""
        fabric = self.hub.fabric
        if fabric is None or not fabric.up_peers():
            callback()
            return

        def acked() -> None:
            if self.backlog:
                self._waiters.append(callback)
            else:
                callback()

        fabric.broadcast_control((control.SYNC,))
        fabric.when_processed(acked)
        self.hub.schedule_flush()

    def _sync(self, src: int, item: tuple) -> None:
        pass  # only its acknowledgement matters (after_inflight)

    def _fin(self, src: int, item: tuple) -> None:
        self._fins.add(src)
        if self._fins_changed is not None:
            self._fins_changed.set()

    def peer_reset(self, src: int) -> None:
        if self._fins_changed is not None:
            self._fins_changed.set()  # a dead peer will send no fin: stop waiting for it

    async def drain(self, deadline: float) -> bool:
        """Stopping, with clients no longer read: tell every peer this worker sends nothing more, and deliver
        what the peers still send until each has said the same.  Links are FIFO, so a peer's fin comes after
        all of its messages.  False if the deadline passed first."""
        fabric = self.hub.fabric
        if fabric is None or not fabric.links:
            return True
        self._fins_changed = asyncio.Event()
        fabric.broadcast_control((control.FIN,))
        self.hub.schedule_flush()
        while True:
            waiting = [p for p in fabric.up_peers() if p not in self._fins]
            if not waiting and not self.backlog:  # a fin can share a frame with messages still in the backlog
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
