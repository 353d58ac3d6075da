"""What the load generator writes and looks for, per protocol: pre-encoded frames and byte markers.

Publishers send frames built once; subscribers count deliveries by counting a marker that starts every delivery
(``bytes.count`` on whole reads, never decoding a message), carrying the last bytes of a read over to the next so a
marker split between reads is still counted once.  Latency runs embed ``T`` and 19 digits of the send time
(``time.monotonic_ns()``, one clock for every process of the machine) at the start of the payload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from shardbroker.cli.wire import nats, ndjson, resp

STAMP = re.compile(rb"T(\d{19})")


def payload(size: int, stamp_ns: int | None = None) -> bytes:
    if stamp_ns is None:
        return b"x" * size
    head = b"T%019d" % stamp_ns
    return head + b"x" * max(0, size - len(head))


@dataclass(frozen=True)
class Wire:
    name: str
    delivery_marker: bytes      # one per delivered message
    reply_marker: bytes         # one per reply a publisher gets (b"" when publishers get none)
    greeting: bytes             # what the server sends first (b"" for none)

    def hello(self) -> bytes:
        return b""

    def subscribe(self, subject: str, sid: int) -> bytes:
        raise NotImplementedError

    def confirm(self) -> tuple[bytes, bytes]:
        """(what to send after subscribing, what comes back once the subscriptions are in force)."""
        raise NotImplementedError

    def publish(self, subject: str, data: bytes) -> bytes:
        raise NotImplementedError


class Ndjson(Wire):
    def __init__(self) -> None:
        super().__init__("ndjson", ndjson.DELIVERY, ndjson.REPLY, b"")

    def subscribe(self, subject: str, sid: int) -> bytes:
        return ndjson.request("sub", topic=subject)

    def confirm(self) -> tuple[bytes, bytes]:
        return ndjson.request("ping", id="ready"), b'"id":"ready"'

    def publish(self, subject: str, data: bytes) -> bytes:
        return ndjson.request("pub", topic=subject, data=data.decode())


class Nats(Wire):
    def __init__(self) -> None:
        super().__init__("nats", b"MSG ", b"", b"INFO ")

    def hello(self) -> bytes:
        return nats.connect({"verbose": False, "pedantic": False, "echo": False})

    def subscribe(self, subject: str, sid: int) -> bytes:
        return nats.sub(subject, sid)

    def confirm(self) -> tuple[bytes, bytes]:
        return nats.PING, nats.PONG

    def publish(self, subject: str, data: bytes) -> bytes:
        return nats.pub(subject, data)


class Resp(Wire):
    """Redis pub/sub in RESP."""

    def __init__(self) -> None:
        super().__init__("redis", b"$7\r\nmessage\r\n", b":", b"")

    def subscribe(self, subject: str, sid: int) -> bytes:
        return resp.command(b"SUBSCRIBE", subject.encode())

    def confirm(self) -> tuple[bytes, bytes]:
        # A subscribed connection may only PING; RESP2 answers with a ["pong", ""] array.
        return resp.command(b"PING"), b"$4\r\npong\r\n"

    def publish(self, subject: str, data: bytes) -> bytes:
        return resp.command(b"PUBLISH", subject.encode(), data)


WIRES = {"ndjson": Ndjson(), "nats": Nats(), "redis": Resp()}


class Counter:
    """Occurrences of a marker in a byte stream that arrives in pieces."""

    __slots__ = ("marker", "count", "_tail")

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.count = 0
        self._tail = b""

    def feed(self, data: bytes) -> int:
        if not self.marker:
            return 0
        chunk = self._tail + data
        n = chunk.count(self.marker)
        self.count += n
        keep = len(self.marker) - 1
        self._tail = chunk[-keep:] if keep else b""
        return n


# -- work queues ----------------------------------------------------------------------------------------------
# The queue scenarios' producers push pre-encoded frames; consumers take the (id, handle) pairs of a receive's reply
# with one regex pass and ack by handle (this broker's receipt, a Redis stream entry's id).  Latency runs stamp the
# payload as above, with the message's intended send time.

class QueueProtocolError(Exception):
    """A reply the queue generator cannot read: a server error, or a protocol it does not expect."""


_STAMP_FIELD = b"T" + b"0" * 19


class QueueWire:
    name = "?"

    def hello(self) -> bytes:
        """What a connection sends first (b"" for nothing)."""
        return b""

    def on(self, inbox: str) -> QueueWire:
        """The wire as one connection uses it, replies coming to ``inbox`` where the protocol needs one."""
        return self

    def consumer(self, queue: str, name: str, count: int, wait_ms: int) -> QueueConsumer:
        """One consumer's requests and replies."""
        return QueueConsumer(self, queue, name, count, wait_ms)

    def push(self, queue: str, data: bytes) -> bytes:
        raise NotImplementedError

    def push_many(self, queue: str, data: bytes, n: int) -> tuple[bytes, int]:
        """-> (a frame pushing ``n`` messages of ``data``, how many replies it gets).  A server without batch
        pushes gets ``n`` pipelined pushes (Redis: ``XADD``s, which is how Redis batches)."""
        return self.push(queue, data) * n, n

    def stamped(self, queue: str, size: int):
        """-> ``f(stamp_ns)``: a push frame whose payload carries that stamp (pre-encoded once, then spliced)."""
        pre, post = self.push(queue, payload(size, 0)).split(_STAMP_FIELD, 1)
        return lambda stamp: b"%sT%019d%s" % (pre, stamp, post)

    def recv(self, queue: str, consumer: str, count: int, wait_ms: int) -> bytes:
        raise NotImplementedError

    def ack(self, queue: str, handles: list[bytes]) -> bytes:
        raise NotImplementedError

    def push_replies(self, buf: bytes, batch: int = 1) -> tuple[list[bytes], int, bytes, bytes]:
        """-> (ids of the pushes acknowledged, pushes refused, the first refusal, the incomplete rest of ``buf``);
        ``batch``: messages per push request (``push_many``), each of whose refusals refuses that many."""
        raise NotImplementedError

    def consumer_replies(self, buf: bytes) -> tuple[list[tuple], bytes]:
        """-> (events, the incomplete rest): ``("msgs", ids, handles, stamps)`` for a receive (stamps: the payloads'
        leading ``T<19 digits>`` where present), ``("acked", ok, reply)`` for an ack."""
        raise NotImplementedError

    def ack_failures(self, reply, handles: list[bytes]) -> list[int]:
        """Which handles of an ack whose reply counted fewer successes than handles failed (indexes)."""
        return list(range(len(handles)))


class QueueConsumer:
    """A consumer of a wire whose replies can be read without remembering what was asked: the same receive each
    time, and the wire's own parsing."""

    def __init__(self, wire: QueueWire, queue: str, name: str, count: int, wait_ms: int) -> None:
        self.wire = wire
        self.queue = queue
        self._receive = wire.recv(queue, name, count, wait_ms)

    def receive(self) -> bytes:
        return self._receive

    def ack(self, handles: list[bytes]) -> bytes:
        return self.wire.ack(self.queue, handles)

    def replies(self, buf: bytes) -> tuple[list[tuple], bytes]:
        return self.wire.consumer_replies(buf)

    def ack_failures(self, reply, handles: list[bytes]) -> list[int]:
        return self.wire.ack_failures(reply, handles)


_NDJSON_PUSHED = re.compile(rb'\{"ok":true,"id":"([^"]+)"\}\n')
_NDJSON_BATCH_PUSHED = re.compile(rb'\{"ok":true,"ids":\[([^\]]*)\]\}\n')
_NDJSON_MESSAGE = re.compile(rb'"id":"([^"]+)","receipt":"([^"]+)","data":"?(T\d{19})?')


class QueueNdjson(QueueWire):
    """This broker's NDJSON queue requests (docs/queues.md)."""

    name = "ndjson"

    def push(self, queue: str, data: bytes) -> bytes:
        return ndjson.request("qpush", queue=queue, data=data.decode())

    def push_many(self, queue: str, data: bytes, n: int) -> tuple[bytes, int]:
        """One ``qpush`` of ``n`` messages (``messages``), answered with their ids in one reply."""
        return ndjson.request("qpush", queue=queue, messages=[{"data": data.decode()}] * n), 1

    def recv(self, queue: str, consumer: str, count: int, wait_ms: int) -> bytes:
        return ndjson.request("qrecv", queue=queue, max=count, wait_ms=wait_ms)

    def ack(self, queue: str, handles: list[bytes]) -> bytes:
        # spliced, not encoded: the handles are the receipts' bytes as the replies had them (hot: one per receive)
        return b'{"op":"qack","queue":%s,"receipts":["%s"]}\n' % (orjson.dumps(queue), b'","'.join(handles))

    def push_replies(self, buf: bytes, batch: int = 1) -> tuple[list[bytes], int, bytes, bytes]:
        end = buf.rfind(b"\n") + 1
        if not end:
            return [], 0, b"", buf
        done = buf[:end]
        if batch > 1:
            lists = _NDJSON_BATCH_PUSHED.findall(done)
            ids = [i[1:-1] for ids in lists for i in ids.split(b",")]
            refused = (done.count(b"\n") - len(lists)) * batch
        else:
            ids = _NDJSON_PUSHED.findall(done)
            refused = done.count(b"\n") - len(ids)
        first = b""
        if refused:
            first = next(line for line in done.split(b"\n") if line and not line.startswith(b'{"ok":true,"id'))
        return ids, refused, first, buf[end:]

    def consumer_replies(self, buf: bytes) -> tuple[list[tuple], bytes]:
        end = buf.rfind(b"\n") + 1
        if not end:
            return [], buf
        events = []
        for line in buf[:end - 1].split(b"\n"):
            if line.startswith(b'{"ok":true,"messages":'):
                found = _NDJSON_MESSAGE.findall(line)
                events.append(("msgs", [m[0] for m in found], [m[1] for m in found],
                               [int(m[2][1:]) for m in found if m[2]]))
            elif line.startswith(b'{"ok":true,"results":'):
                events.append(("acked", line.count(b'{"ok":true}'), line))
            else:
                raise QueueProtocolError(f"unexpected reply {line[:200]!r}")
        return events, buf[end:]

    def ack_failures(self, reply, handles: list[bytes]) -> list[int]:
        results = orjson.loads(reply)["results"]
        return [i for i, r in enumerate(results) if r != {"ok": True}]


_RESP_ID = re.compile(rb"\$\d+\r\n([0-9]+-[0-9]+)\r\n|-([^\r]*)\r\n")
_RESP_STREAM = re.compile(rb"\*1\r\n\*2\r\n\$(\d+)\r\n")
_RESP_COUNT = re.compile(rb"\*(\d+)\r\n")
_RESP_ENTRY = re.compile(rb"\*2\r\n\$\d+\r\n([0-9]+-[0-9]+)\r\n\*2\r\n\$1\r\nd\r\n\$(\d+)\r\n")
_RESP_LONGEST_HEAD = 128    # more than any entry's header: a mismatch with this much data is no partial read


class QueueRedisStreams(QueueWire):
    """Redis Streams with a consumer group: XADD, XREADGROUP ... COUNT n BLOCK ms STREAMS q >, XACK."""

    name = "redis"
    group = b"bench"

    def push(self, queue: str, data: bytes) -> bytes:
        return resp.command(b"XADD", queue.encode(), b"*", b"d", data)

    def recv(self, queue: str, consumer: str, count: int, wait_ms: int) -> bytes:
        return resp.command(b"XREADGROUP", b"GROUP", self.group, consumer.encode(), b"COUNT", b"%d" % count,
                            b"BLOCK", b"%d" % wait_ms, b"STREAMS", queue.encode(), b">")

    def ack(self, queue: str, handles: list[bytes]) -> bytes:
        return resp.command(b"XACK", queue.encode(), self.group, *handles)

    def push_replies(self, buf: bytes, batch: int = 1) -> tuple[list[bytes], int, bytes, bytes]:
        ids, refused, first, end = [], 0, b"", 0
        for m in _RESP_ID.finditer(buf):
            if m.start() != end:
                raise QueueProtocolError(f"unexpected reply {buf[end:end + 200]!r}")
            end = m.end()
            if m.group(1) is not None:
                ids.append(m.group(1))
            else:
                refused += 1
                first = first or m.group(2)
        return ids, refused, first, buf[end:]

    def consumer_replies(self, buf: bytes) -> tuple[list[tuple], bytes]:
        events, pos, n = [], 0, len(buf)
        while pos < n:
            got = self._one(buf, pos)
            if got is None:
                break
            event, pos = got
            events.append(event)
        return events, buf[pos:]

    @staticmethod
    def _one(buf: bytes, pos: int):
        """One reply at ``pos``: -> (event, end), or None if it is not all there yet."""
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        head = buf[pos:eol]
        if head[:1] == b":":
            return ("acked", int(head[1:]), head), eol + 2
        if head == b"*-1":                       # BLOCK timed out
            return ("msgs", [], [], []), eol + 2
        if head[:1] == b"-":
            raise QueueProtocolError(f"error reply {head[:200]!r}")
        m = _RESP_STREAM.match(buf, pos)
        if m is None:
            if len(buf) - pos < _RESP_LONGEST_HEAD:
                return None
            raise QueueProtocolError(f"unexpected reply {buf[pos:pos + 200]!r}")
        at = m.end() + int(m.group(1)) + 2
        m = _RESP_COUNT.match(buf, at)
        if m is None:
            return None if len(buf) - at < 16 else _fail(buf, at)
        count, at = int(m.group(1)), m.end()
        ids, stamps = [], []
        entry = _RESP_ENTRY.match
        for _ in range(count):
            m = entry(buf, at)
            if m is None:
                return None if len(buf) - at < _RESP_LONGEST_HEAD else _fail(buf, at)
            start = m.end()
            at = start + int(m.group(2)) + 2
            if at > len(buf):
                return None
            ids.append(m.group(1))
            if buf[start:start + 1] == b"T":
                stamps.append(int(buf[start + 1:start + 20]))
        return ("msgs", ids, ids, stamps), at


def _fail(buf: bytes, at: int):
    raise QueueProtocolError(f"unexpected reply {buf[at:at + 200]!r}")


def nats_frames(buf: bytes) -> tuple[list[tuple[bytes, bytes, bytes, bytes]], int]:
    """The complete NATS server frames at the start of ``buf``: ``(subject, reply, headers, payload)`` for each MSG
    and HMSG (``cli.wire.nats.parse``); -ERR raises QueueProtocolError.  -> (frames, bytes used)."""
    try:
        return nats.parse(buf)
    except nats.ServerError as exc:
        raise QueueProtocolError(f"nats-server: {exc}") from None


_JS_SEQ = re.compile(rb'"seq":\s*(\d+)')


class QueueJetStream(QueueWire):
    """nats-server JetStream as a work queue: a stream with work-queue retention in memory, and one durable pull
    consumer that every bench consumer pulls from (JetStream's competing consumers).  A push is a PUB with a reply
    subject, answered with a PubAck (the stream sequence is the message's id); a receive is a pull request; an ack is
    a PUB to the message's ack subject, one per message (JetStream has no batch ack with explicit acks)."""

    name = "jetstream"
    durable = b"bench"

    def __init__(self, inbox: str = "_INBOX.bench") -> None:
        self.inbox = inbox.encode()   # where this connection's replies come (each has its own: NATS delivers a
        # reply to every connection subscribed to its subject)

    def on(self, inbox: str) -> QueueJetStream:
        return QueueJetStream(inbox)

    @staticmethod
    def stream(queue: str) -> bytes:
        return queue.replace(".", "_").encode()   # a stream's name may not contain dots

    def hello(self) -> bytes:
        return (nats.connect({"verbose": False, "pedantic": False, "headers": True, "no_responders": True})
                + nats.sub(self.inbox + b".>", 1))

    def push(self, queue: str, data: bytes) -> bytes:
        return nats.pub(queue, data, self.inbox + b".p")

    def push_replies(self, buf: bytes, batch: int = 1) -> tuple[list[bytes], int, bytes, bytes]:
        frames, used = nats_frames(buf)
        ids, refused, first = [], 0, b""
        for _, _, headers, data in frames:
            m = _JS_SEQ.search(data) if not headers else None
            if m is not None and b'"error"' not in data:
                ids.append(m.group(1))
            else:   # an error reply (or a 503 status: no stream listens)
                refused += 1
                first = first or headers + data
        return ids, refused, first, buf[used:]

    def consumer(self, queue: str, name: str, count: int, wait_ms: int) -> JetStreamConsumer:
        return JetStreamConsumer(self.stream(queue), self.durable, count, wait_ms, self.inbox)


class JetStreamConsumer:
    """One pull consumer.  A pull request is answered with messages on their own subject, not the request's, and
    ends either when it has delivered its ``batch`` (no further word) or with a status on the request's inbox (404
    nothing there, 408 expired), so the consumer remembers what it asked.  A receive first takes what is there (up
    to ``count``, ``no_wait``); when that was nothing, the next one waits up to ``wait_ms`` for one message, as
    nats.py's ``fetch`` does, since a waiting pull of ``count`` would hold its first messages until it has them all.
    Acks get no reply (as JetStream clients send them); one is counted once a later reply shows that the server read
    past it, which on one connection means it was processed in order."""

    def __init__(self, stream: bytes, durable: bytes, count: int, wait_ms: int, inbox: bytes) -> None:
        subject = b"$JS.API.CONSUMER.MSG.NEXT.%s.%s" % (stream, durable)
        take = orjson.dumps({"batch": count, "no_wait": True})
        wait = orjson.dumps({"batch": 1, "expires": wait_ms * 1_000_000})
        self._take = nats.pub(subject, take, inbox + b".r")
        self._wait = nats.pub(subject, wait, inbox + b".r")
        self.count = count
        self.want = 0           # what the pull in progress may still deliver
        self.idle = False       # the last pull found nothing
        self.acks: list[int] = []
        self.ids: list[bytes] = []
        self.handles: list[bytes] = []
        self.stamps: list[int] = []

    def receive(self) -> bytes:
        self.want = 1 if self.idle else self.count
        return self._wait if self.idle else self._take

    def ack(self, handles: list[bytes]) -> bytes:
        self.acks.append(len(handles))
        return nats.empty_pubs(handles)

    def replies(self, buf: bytes) -> tuple[list[tuple], bytes]:
        frames, used = nats_frames(buf)
        events: list[tuple] = []
        for _, reply, headers, data in frames:
            if headers:
                code = headers[9:12]
                if code not in (b"404", b"408"):
                    raise QueueProtocolError(f"pull request ended with {headers.splitlines()[0]!r}")
                self._done(events)
                continue
            tokens = reply.split(b".")
            if tokens[:2] != [b"$JS", b"ACK"]:
                continue
            # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...; newer servers insert domain and account
            self.ids.append(tokens[5] if len(tokens) == 9 else tokens[7])
            self.handles.append(reply)
            if data[:1] == b"T":
                self.stamps.append(int(data[1:20]))
            self.want -= 1
            if not self.want:
                self._done(events)
        return events, buf[used:]

    def _done(self, events: list) -> None:
        events.extend(("acked", n, b"") for n in self.acks)
        self.acks.clear()
        events.append(("msgs", self.ids, self.handles, self.stamps))
        self.idle = not self.ids
        self.ids, self.handles, self.stamps = [], [], []

    def ack_failures(self, reply, handles: list[bytes]) -> list[int]:
        return []


QUEUE_WIRES = {"ndjson": QueueNdjson(), "redis": QueueRedisStreams(), "jetstream": QueueJetStream()}
