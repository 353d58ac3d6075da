"""One subscription of one connection, whatever its protocol: what the hub's tries hold and deliver to."""

from __future__ import annotations

from typing import Any


class Subscription:
    __slots__ = ("conn", "subject", "sid", "queue", "delivered", "max_msgs", "party")

    # ``conn`` is a workers.connection.Connection, not imported: that room's face to the hub names subscriptions.
    def __init__(self, conn: Any, subject: str, sid: bytes | str, queue: str | None = None) -> None:
        self.conn = conn
        self.subject = subject
        self.sid = sid              # NATS: the client's sid, echoed in MSG; NDJSON: the topic
        self.queue = queue
        self.delivered = 0
        self.max_msgs = 0           # NATS UNSUB <sid> <max>: unsubscribe after this many (0: no limit)
        self.party: str | None = None   # whose share it counts against while it stands (Interest.subscribe)
