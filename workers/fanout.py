"""Local fan-out: a message handed to this worker's subscribers, encoded once and queued, never written.

- Delivery queues, it does not write: a delivery is encoded once for all its subscribers (``workers.delivery``)
  and appended to each subscriber's outbound list; the end of the event-loop turn writes (``workers.turn``: one
  ``writelines`` per touched connection).
- Consecutive messages to one subject are batched (``_batch_add``): the route collects their encodings, and each
  subscriber gets the whole run as one joined chunk when the run ends (another subject, a reply to one of its
  subscribers, a size bound, the end of the turn).  Per delivery that is C-level copying instead of a Python call,
  and each subscriber still sees every message in publish order.

``Fanout`` is a base of the hub (``workers.hub.Hub``) rather than a part that it holds: every delivery runs through
here, several times per message, and a part would cost an attribute lookup (the hub's ``turn_work``, its open
batch) each time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from shardbroker.workers.delivery import Outgoing, Route, msg_tail, ndjson_deliveries, ndjson_delivery
from shardbroker.workers.message import KIND_RAW, as_bytes
from shardbroker.workers.speedups import msg_tails

if TYPE_CHECKING:
    from shardbroker.workers.connection import Connection
    from shardbroker.workers.groups import GroupTable
    from shardbroker.workers.subscription import Subscription

# A batch of consecutive messages to one subject ends at this many bytes of encoded messages, or when the copies
# its subscribers get (each NATS subscriber its own: its sid is in every line) would take this many bytes: its
# chunks are what a turn writes at once, so this bounds the memory a batch adds to the outbound queues.
BATCH_BYTES = 64 * 1024
BATCH_COPIES = 4 * 1024 * 1024


def batch_cost(fanout: int, size: int) -> int:
    """What one message of ``size`` payload bytes in a batch to ``fanout`` connections adds to a turn's work
    (``workers.turn.TURN_BUDGET``): the message, and its bytes copied to every subscriber, a unit a KiB (a delivery
    line is ~64 bytes more than its payload).  The write each subscriber gets is counted once per batch
    (``_open_batch``), not per message: with thousands of subscribers, the writes are what a turn costs, and a turn
    that carries more messages in each of them is cheaper per message."""
    return 1 + ((size + 64) * fanout >> 10)


class Fanout:
    """This worker's deliveries to its own subscribers, and the open batch."""

    # What the hub provides: the publishes and deliveries of this turn (workers.turn.TURN_BUDGET), the end of the
    # turn that ends the open batch, a route as of now (router.routes), and the queue groups' members.
    turn_work: int
    schedule_flush: Callable[[], None]
    current: Callable[[Route], Route]
    groups: GroupTable

    def __init__(self) -> None:
        self.batch: Route | None = None   # the route whose consecutive messages are being batched
        self.queue_dropped = 0            # queue-group deliveries whose member had gone or may not receive

    def deliver_run(self, route: Route, kind: int, payloads: list[bytes], nbytes: int, reply: str | None,
                    origin: Connection | None) -> int:
        """``deliver`` for a run of messages without headers, of ``nbytes`` payload bytes; -> how many
        deliveries."""
        members = route.members
        if members is not None and (origin is None or origin.echo or origin not in members):
            return self._batch_add_run(route, kind, payloads, nbytes, reply)
        deliver, current = self.deliver, self.current
        return sum([deliver(current(route), kind, payload, reply, None, origin) for payload in payloads])

    def deliver(self, route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
                origin: Connection | None) -> int:
        """To this worker's plain subscribers; -> how many deliveries."""
        members = route.members
        if members is not None and headers is None and (origin is None or origin.echo or origin not in members):
            return self._batch_add(route, kind, payload, reply)
        if self.batch is not None:
            self.end_batch()
        count = 0
        size = len(payload)
        if route.ndjson:
            line = ndjson_delivery(route.prefix, kind, payload, reply, headers)
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

    def _open_batch(self, route: Route) -> None:
        """``route``'s batch is the open one from now (ending any other): each of its connections will get one chunk,
        one write, which is counted now."""
        if self.batch is not None:
            self.end_batch()
        self.batch = route
        self.turn_work += route.fanout
        self.schedule_flush()

    def _batch_add(self, route: Route, kind: int, payload: bytes, reply: str | None) -> int:
        """Queue a message in ``route``'s batch, which is opened (ending any other) if it is not the open one."""
        if route is not self.batch:
            self._open_batch(route)
        size = 0
        if route.ndjson:
            line = ndjson_delivery(route.prefix, kind, payload, reply, None)
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
        self.turn_work += batch_cost(count, len(payload))
        # Bound what one batch turns into: its bytes, and their copies (a NATS subscriber gets its own).
        if route.batched_bytes * count >= BATCH_COPIES or route.batched_bytes >= BATCH_BYTES:
            self.end_batch()
        return count

    def _batch_add_run(self, route: Route, kind: int, payloads: list[bytes], payload_bytes: int,
                       reply: str | None) -> int:
        """``_batch_add`` for a run: the encodings of all its messages made in one call per protocol."""
        if route is not self.batch:
            self._open_batch(route)
        n = len(payloads)
        size = 0
        if route.ndjson:
            lines = ndjson_deliveries(route.prefix, kind, payloads, reply)
            route.lines += lines
            size = sum(map(len, lines))
        if route.nats:
            reply_b = reply.encode() if reply else None
            tails = msg_tails(payloads if kind == KIND_RAW else [as_bytes(kind, p) for p in payloads], reply_b)
            route.tails += tails
            # A tail is its payload and " <reply> <size>\r\n...\r\n": the batch's bounds need no closer count
            # than "size" as 4 digits (summing the tails was a tenth of a worker's CPU in N→N).
            size += payload_bytes + n * (9 + (len(reply_b) + 1 if reply_b else 0))
        for conn in route.others:
            for payload in payloads:
                conn.deliver_message(route.subject, kind, payload, reply, None)
        route.batched += n
        route.batched_bytes += size
        route.batched_payload += payload_bytes
        self.turn_work += n + ((payload_bytes + 64 * n) * route.fanout >> 10)   # batch_cost, for n messages
        if route.batched_bytes * route.fanout >= BATCH_COPIES or route.batched_bytes >= BATCH_BYTES:
            self.end_batch()
        return route.fanout * n

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

    def settle(self, conn: Connection) -> None:
        """``conn`` is about to be written to (or closed) outside the open batch: deliver the batch first."""
        batch = self.batch
        if batch is not None and conn in batch.members:
            self.end_batch()

    def send_frames(self, sub: Subscription, frames: list[bytes], size: int) -> None:
        """``len(frames)`` messages from the broker to ``sub`` alone (the answers to a connection's own queue
        requests), each already a whole frame of its protocol; ``size``: their payloads' bytes, which the out
        counters count."""
        if self.batch is not None:
            self.end_batch()   # deliveries batched before them go first, as in deliver
        n = len(frames)
        sub.conn.deliver_batch(b"".join(frames), n, size)
        sub.delivered += n
        self.turn_work += 2 * n   # what send counts: a publish and a delivery each

    def deliver_members(self, subject: str, kind: int, payload: bytes, reply: str | None, headers: bytes | None,
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
