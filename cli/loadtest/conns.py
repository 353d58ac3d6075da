"""The load test's connections, one class per protocol: publish a batch of framed messages in one write, subscribe
and confirm, and hand every delivery and acknowledgement to a sink.

These speak the wire protocols directly (NDJSON, NATS, RESP: ``cli.wire``'s codecs) rather than through client
libraries, because the generator must stamp the write time of each batch and read deliveries without decoding their
payloads; the same classes drive this broker, nats-server and Redis.  Reads are timestamped once per
``data_received``: every message in one read arrived at the same moment as far as the process can tell.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque

import orjson

from shardbroker.cli.loadtest import frame
from shardbroker.cli.wire import nats, ndjson, resp

_now = time.monotonic_ns


class Sink:
    """What a connection reports to.  The task's recorder implements it."""

    def deliver(self, conn: Conn, pub_id: int, seq: int, t_int: int, t_w: int, t_recv: int) -> None: ...

    def acked(self, conn: Conn, entry: tuple, ok: bool, t_recv: int, detail=None) -> None: ...

    def lost_connection(self, conn: Conn, why: str) -> None: ...


class ProtocolError(Exception):
    pass


class Conn(asyncio.Protocol):
    """Common plumbing: a byte buffer, a FIFO of what awaits a reply, and a closed future."""

    def __init__(self, sink: Sink, index: int, verbose_acks: bool = False) -> None:
        self.sink = sink
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.pending: deque = deque()       # per request: (t_int, t_w, pub_id, seq) for publishes, or a Future
        self.closed = asyncio.get_running_loop().create_future()
        self.bytes_out = 0
        self.bytes_in = 0
        self.verbose_acks = verbose_acks
        self.paused = False
        self._drained: asyncio.Future | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(str(exc) if exc else "closed by the server")
        for p in self.pending:
            if isinstance(p, asyncio.Future) and not p.done():
                p.set_exception(ConnectionError("connection closed"))
        self.sink.lost_connection(self, self.closed.result())
        self._resume()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self._resume()

    def _resume(self) -> None:
        self.paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drained(self) -> None:
        if self.paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def data_received(self, data: bytes) -> None:
        self.bytes_in += len(data)
        self.buf = self.parse(self.buf + data if self.buf else data, _now())

    def write(self, data: bytes) -> None:
        if self.closed.done():
            raise ConnectionError(f"connection closed: {self.closed.result()}")
        self.bytes_out += len(data)
        self.transport.write(data)

    def _reply(self, ok: bool, detail, t_recv: int) -> None:
        entry = self.pending.popleft()
        if isinstance(entry, asyncio.Future):
            if not entry.done():
                entry.set_result((ok, detail))
        else:
            self.sink.acked(self, entry, ok, t_recv, detail)

    async def request(self, data: bytes, timeout: float):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        self.write(data)
        ok, detail = await asyncio.wait_for(fut, timeout)
        if not ok:
            raise ProtocolError(detail if isinstance(detail, str) else orjson.dumps(detail).decode())
        return detail

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # per protocol
    def parse(self, buf: bytes, t_recv: int) -> bytes:
        raise NotImplementedError

    async def handshake(self, user: str | None, password: str | None, timeout: float) -> None:
        return None

    def publish(self, subject: bytes, items: list[tuple[int, int, int]], size: int) -> None:
        raise NotImplementedError

    async def subscribe(self, subject: str, group: str, timeout: float) -> None:
        raise NotImplementedError


class NdjsonConn(Conn):
    """Jolt's NDJSON: every request gets a reply in order, so a publish's ``ok`` is its acknowledgement."""

    PUBLISH = b'{"op":"pub","topic":"'

    def parse(self, buf: bytes, t_recv: int) -> bytes:
        lines, rest = ndjson.lines(buf)
        delivery, ok = ndjson.DELIVERY, ndjson.OK
        for line in lines:
            if line.startswith(delivery):
                at = line.find(b'"data":"')
                if at >= 0:
                    self.sink.deliver(self, *frame.parse_text(line[at + 8:at + 64]), t_recv)
                continue
            if not self.pending:
                continue
            if line.startswith(ok):
                self._reply(True, line, t_recv)
            else:
                self._reply(False, ndjson.error_of(line), t_recv)
        return rest

    async def handshake(self, user, password, timeout) -> None:
        if user:
            await self.request(ndjson.request("auth", user=user, **{"pass": password or ""}), timeout)

    def publish(self, subject: bytes, items, size: int) -> None:
        t_w = _now()
        head = self.PUBLISH + subject + b'","data":"'
        out = []
        for pub_id, seq, t_int in items:
            out.append(head + frame.text(pub_id, seq, t_int, t_w, size).encode() + b'"}\n')
            self.pending.append((t_int, t_w, pub_id, seq))
        self.write(b"".join(out))

    async def subscribe(self, subject: str, group: str, timeout: float) -> None:
        await self.request(ndjson.request("sub", topic=subject), timeout)
        await self.request(ndjson.request("ping"), timeout)


class NatsConn(Conn):
    """NATS core.  Publishers get acknowledgements only in verbose mode (+OK per PUB), which the closed model uses."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._info = asyncio.get_running_loop().create_future()

    def parse(self, buf: bytes, t_recv: int) -> bytes:
        items, used = nats.parse(buf, controls=True, peek=frame.BIN_SIZE)
        for line in items:              # in order: control lines (bytes) and MSGs (subject, reply, headers, payload)
            if type(line) is tuple:
                self.sink.deliver(self, *frame.parse_binary(line[3]), t_recv)
                continue
            if line == b"PING":
                self.write(nats.PONG)
            elif line == b"+OK":
                # Verbose mode: CONNECT's +OK (a None placeholder), then one per PUB; PINGs get PONGs instead.
                if self.pending and self.pending[0] is None:
                    self.pending.popleft()
                elif self.pending and not isinstance(self.pending[0], asyncio.Future):
                    self._reply(True, None, t_recv)
            elif line == b"PONG":
                # PONGs answer our PINGs, which are Futures; in verbose mode +OKs for PINGs never come.
                for i, p in enumerate(self.pending):
                    if isinstance(p, asyncio.Future):
                        del self.pending[i]
                        if not p.done():
                            p.set_result((True, None))
                        break
            elif line.startswith(b"-ERR"):
                text = nats.error_text(line)
                if not self._info.done():
                    self._info.set_exception(ProtocolError(text))
                elif self.pending and not isinstance(self.pending[0], asyncio.Future):
                    self._reply(False, text, t_recv)
                else:
                    self.sink.lost_connection(self, f"server error: {text}")
            elif line.startswith(b"INFO "):
                if not self._info.done():
                    self._info.set_result(nats.info(line))
        return buf[used:]

    async def handshake(self, user, password, timeout) -> None:
        await asyncio.wait_for(self._info, timeout)
        connect = {"verbose": self.verbose_acks, "pedantic": False, "lang": "python", "version": "loadtest",
                   "protocol": 1, "name": f"loadtest-{os.getpid()}-{self.index}", "headers": False}
        if user:
            connect.update(user=user, **{"pass": password or ""})
        if self.verbose_acks:
            self.pending.append(None)   # the +OK of CONNECT
        self.write(nats.connect(connect))
        await self.ping(timeout)

    async def ping(self, timeout: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        self.write(nats.PING)
        await asyncio.wait_for(fut, timeout)

    def publish(self, subject: bytes, items, size: int) -> None:
        t_w = _now()
        head = nats.pub_head(subject, size)
        out = []
        for pub_id, seq, t_int in items:
            out.append(head + frame.binary(pub_id, seq, t_int, t_w, size) + b"\r\n")
            if self.verbose_acks:
                self.pending.append((t_int, t_w, pub_id, seq))
        self.write(b"".join(out))

    async def subscribe(self, subject: str, group: str, timeout: float) -> None:
        self.write(nats.sub(subject, self.index + 1, group))
        await self.ping(timeout)


class RedisConn(Conn):
    """Redis pub/sub over RESP2.  PUBLISH answers with the number of receivers: that reply is the acknowledgement."""

    def parse(self, buf: bytes, t_recv: int) -> bytes:
        replies, used = resp.replies(buf)
        for reply in replies:
            if type(reply) is list:
                if reply and reply[0] == b"message":
                    self.sink.deliver(self, *frame.parse_binary(reply[2]), t_recv)
                elif reply and reply[0] == b"subscribe" and self.pending:
                    self._reply(True, None, t_recv)
            elif self.pending:   # an integer (PUBLISH's receivers), a status (+OK) or an error
                text = reply.decode(errors="replace") if type(reply) is bytes else str(reply)
                self._reply(type(reply) is not resp.Error, text, t_recv)
        return buf[used:]

    async def handshake(self, user, password, timeout) -> None:
        if user or password:
            args = [b"AUTH"] + ([user.encode()] if user else []) + [(password or "").encode()]
            await self.request(resp.command(*args), timeout)

    def publish(self, subject: bytes, items, size: int) -> None:
        t_w = _now()
        out = []
        for pub_id, seq, t_int in items:
            out.append(resp.command(b"PUBLISH", subject, frame.binary(pub_id, seq, t_int, t_w, size)))
            self.pending.append((t_int, t_w, pub_id, seq))
        self.write(b"".join(out))

    async def subscribe(self, subject: str, group: str, timeout: float) -> None:
        await self.request(resp.command(b"SUBSCRIBE", subject.encode()), timeout)


class QueueConn(NdjsonConn):
    """Work queues over NDJSON: pushes are acknowledged with the message's id; consumers receive and ack in batches."""

    PUBLISH = b'{"op":"qpush","queue":"'

    def parse(self, buf: bytes, t_recv: int) -> bytes:
        lines, rest = ndjson.lines(buf)
        ok = ndjson.OK
        for line in lines:
            if not self.pending:
                continue
            if line.startswith(ok) and not isinstance(self.pending[0], asyncio.Future):
                self._reply(True, None, t_recv)       # a push's id: not needed, the frame says which message
                continue
            try:
                reply = orjson.loads(line)
            except orjson.JSONDecodeError:
                self._reply(False, line.decode(errors="replace"), t_recv)
                continue
            if isinstance(self.pending[0], asyncio.Future):
                entry = self.pending.popleft()
                if not entry.done():
                    entry.set_result((True, (reply, t_recv)))
            else:
                self._reply(bool(reply.get("ok")), reply.get("error"), t_recv)
        return rest

    async def call(self, obj: dict, timeout: float) -> tuple[dict, int]:
        """One request; its decoded reply (ok or not) and when it arrived."""
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        self.write(ndjson.encode(obj))
        _, detail = await asyncio.wait_for(fut, timeout)
        return detail

    async def subscribe(self, subject: str, group: str, timeout: float) -> None:
        return None     # a queue needs no subscription: consumers receive from it


CLASSES = {"ndjson": NdjsonConn, "nats": NatsConn, "redis": RedisConn, "queue": QueueConn}


async def open_conn(protocol: str, host: str, port: int, sink: Sink, index: int, user: str | None,
                    password: str | None, timeout: float, verbose_acks: bool = False) -> Conn:
    loop = asyncio.get_running_loop()
    cls = CLASSES[protocol]
    _, conn = await asyncio.wait_for(
        loop.create_connection(lambda: cls(sink, index, verbose_acks), host, port), timeout)
    try:
        await conn.handshake(user, password, timeout)
    except BaseException:
        conn.close()
        raise
    return conn
