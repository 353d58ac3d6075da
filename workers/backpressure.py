"""Backpressure from consumers that drain slower than publishers produce.

Without it, a publisher that outpaces a perfectly healthy subscriber (on a busy machine, say) fills the
subscriber's outbound buffer until it is cut as a slow consumer.  So, as nats-server stalls fast producers:

- a connection whose unsent output passes ``stall_bytes`` (a quarter of ``limits.max_pending_bytes``; the
  transport's high-water mark) is *congested*: while any connection of the worker is, the worker stops reading its
  publishing clients and stops reading the fabric (so publishers on other workers stall too, through the fabric's
  flow-control window);
- it stops being congested when its output drains below half of that (the low-water mark);
- a congested connection that makes no progress at all for ``PATIENCE`` checks (its client acknowledged none of
  its bytes) is not reading: it stops holding anyone back, and is cut when it reaches ``max_pending_bytes``.  So a
  client that does not read costs publishers a pause of a quarter of a second, once; a client that reads slowly
  sets the pace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("broker.backpressure")

CHECK_INTERVAL = 0.05
PATIENCE = 5


class Consumer(Protocol):
    """What the watch needs of a connection (``workers.connection.Connection``)."""

    cid: int
    closed: bool
    delivered_bytes: int
    pending_bytes: int


class Backpressure:
    def __init__(self, loop: asyncio.AbstractEventLoop, changed: Callable[[], None]) -> None:
        self._loop = loop
        self._changed = changed
        # conn -> [bytes its client had acknowledged at the last check, checks since without progress]
        self._congested: dict[Consumer, list] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.episodes = 0
        self.released = 0   # congested connections found not reading and let go

    @property
    def active(self) -> bool:
        return bool(self._congested)

    def congested(self, conn: Consumer) -> None:
        if conn in self._congested or conn.closed:
            return
        self._congested[conn] = [conn.delivered_bytes, 0]
        if len(self._congested) == 1:
            self.episodes += 1
            self._changed()
        if self._timer is None:
            self._timer = self._loop.call_later(CHECK_INTERVAL, self._check)

    def drained(self, conn: Consumer) -> None:
        if self._congested.pop(conn, None) is not None and not self._congested:
            self._changed()

    def _check(self) -> None:
        self._timer = None
        for conn, state in list(self._congested.items()):
            if conn.closed:
                del self._congested[conn]
                continue
            written = conn.delivered_bytes
            if written > state[0]:
                state[0], state[1] = written, 0
                continue
            state[1] += 1
            if state[1] >= PATIENCE:
                log.info("%s is not reading (%d bytes unsent): no longer holding publishers for it",
                         getattr(conn, "who", None) or f"cid {conn.cid}", conn.pending_bytes)
                self.released += 1
                del self._congested[conn]
        if not self._congested:
            self._changed()
        elif self._timer is None:
            self._timer = self._loop.call_later(CHECK_INTERVAL, self._check)
