"""A Python client for the broker's NDJSON protocol (and any Jolt server), in asyncio and blocking flavours.

    async with await AsyncClient.connect("127.0.0.1", 8080) as c:
        await c.sub("chat.*")
        await c.pub("chat.room1", {"text": "hi"})
        msg = await c.next_message(timeout=1)      # Delivery(topic="chat.room1", data={"text": "hi"}, extra={})

    with BlockingClient.connect("127.0.0.1", 8080) as c:
        c.pub("chat.room1", "hello")

Work queues (docs/queues.md): ``qpush``, ``qpush_many`` (a batch in one request), ``qrecv``, ``qack``,
``qextend``, ``qnack``, ``qdead``, ``qstat``, ``qpurge``, ``qredrive``, and ``consume``, which runs a handler per
message and extends its lease while the handler runs.  The blocking client sends the same requests with
``request("qpush", queue=..., data=...)``.

    async with await AsyncClient.connect("127.0.0.1", 8080) as c:
        await c.qpush("jobs", {"n": 1})
        await c.consume("jobs", handle)            # ack on return, nack on an exception

TLS: ``connect(..., tls=tls_context(ca="ca.pem"))`` (and ``cert=``, ``key=`` for a client certificate).

Replies come back in request order, so a request waits on a FIFO of pending replies; deliveries, which may arrive
between replies, go to a separate queue.  ``pub(..., wait=False)`` pipelines: the reply is consumed without
waiting, and an error in it is raised by the next call that waits.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from shardbroker.cli.wire import ndjson
from shardbroker.cli.wire.ndjson import Delivery


@dataclass(frozen=True)
class QueueMessageSpec:
    """One message of ``qpush_many`` with its own priority or delay (plain values take the batch's)."""
    data: Any
    priority: int | None = None
    delay_ms: int | None = None

    def as_item(self) -> dict:
        return {"data": self.data, **_given(priority=self.priority, delay_ms=self.delay_ms)}


class BrokerError(Exception):
    """The broker answered ``{"ok":false,"error":reason}``."""

    def __init__(self, reason: str, reply: dict | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.reply = reply or {}


class QueueMessage(NamedTuple):
    queue: str
    id: str
    receipt: str         # this delivery's: what ack, extend, nack and dead take
    data: Any
    deliveries: int
    extra: dict          # priority, enqueued_at (ms), and for dead letters dead_reason and source


def _queue_message(queue: str, m: dict) -> QueueMessage:
    extra = {k: v for k, v in m.items() if k not in ("id", "receipt", "data", "deliveries")}
    return QueueMessage(queue, m["id"], m["receipt"], m["data"], m["deliveries"], extra)


def tls_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """A client context for a broker with TLS: its certificate verified against ``ca`` (a PEM file; None: the
    system's CAs) and its name checked; ``cert`` and ``key``: this client's certificate, for a listener that asks
    for one (mutual TLS; with tls.verify_and_map it names the user, and no password is needed)."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def _given(**fields: Any) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


# -- asyncio --------------------------------------------------------------------------------------------------

class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.decoder = ndjson.Decoder()
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque[asyncio.Future | None] = collections.deque()
        self.deliveries: asyncio.Queue[Delivery | None] = asyncio.Queue()
        self.deferred_error: BrokerError | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for obj in self.decoder.feed(data):
            if not ndjson.is_reply(obj):
                self.deliveries.put_nowait(ndjson.delivery(obj))
                continue
            fut = self.pending.popleft() if self.pending else None
            if fut is None:
                if not obj.get("ok") and self.deferred_error is None:
                    self.deferred_error = BrokerError(obj.get("error", "unknown"), obj)
            elif not fut.done():
                fut.set_result(obj)

    def connection_lost(self, exc: Exception | None) -> None:
        err = ConnectionError("connection closed by the broker")
        while self.pending:
            fut = self.pending.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self.deliveries.put_nowait(None)
        if not self.closed.done():
            self.closed.set_result(None)


class AsyncClient:
    def __init__(self, protocol: _Protocol) -> None:
        self._p = protocol

    @classmethod
    async def connect(cls, host: str = "127.0.0.1", port: int = 8080, *, user: str | None = None,
                      password: str | None = None, timeout: float = 10.0, tls: ssl.SSLContext | None = None,
                      server_hostname: str | None = None) -> AsyncClient:
        """``tls``: a client context (``tls_context``) for a listener with TLS; the certificate must name
        ``server_hostname`` (default: ``host``)."""
        loop = asyncio.get_running_loop()
        extra = {"ssl": tls, "server_hostname": server_hostname or host} if tls is not None else {}
        _, proto = await asyncio.wait_for(loop.create_connection(_Protocol, host, port, **extra), timeout)
        client = cls(proto)
        if user is not None:
            await client.auth(user, password or "")
        return client

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def is_closed(self) -> bool:
        return self._p.closed.done()

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (for tests of malformed input)."""
        self._p.transport.write(data)

    async def request(self, op: str, *, timeout: float | None = 10.0, **fields: Any) -> dict:
        """Send one request and wait for its reply; raise BrokerError on ``ok:false``."""
        self._raise_deferred()
        if self.is_closed:
            raise ConnectionError("connection is closed")
        fut = asyncio.get_running_loop().create_future()
        self._p.pending.append(fut)
        self._p.transport.write(ndjson.request(op, **fields))
        reply = await asyncio.wait_for(fut, timeout)
        if not reply.get("ok"):
            raise BrokerError(reply.get("error", "unknown"), reply)
        return reply

    def _raise_deferred(self) -> None:
        err, self._p.deferred_error = self._p.deferred_error, None
        if err is not None:
            raise err

    async def auth(self, user: str, password: str) -> None:
        await self.request("auth", user=user, **{"pass": password})

    async def sub(self, topic: str) -> None:
        await self.request("sub", topic=topic)

    async def unsub(self, topic: str) -> None:
        await self.request("unsub", topic=topic)

    async def pub(self, topic: str, data: Any, *, wait: bool = True) -> None:
        if wait:
            await self.request("pub", topic=topic, data=data)
        else:
            self._raise_deferred()
            self._p.pending.append(None)
            self._p.transport.write(ndjson.request("pub", topic=topic, data=data))

    async def ping(self) -> None:
        await self.request("ping")

    async def info(self) -> dict:
        return (await self.request("info"))["info"]

    # -- work queues ----------------------------------------------------------------------------------------
    async def qpush(self, queue: str, data: Any, *, priority: int | None = None, delay_ms: int | None = None,
                    dedup_id: str | None = None) -> str:
        """Store a message; -> its id, once the broker has journaled it.  With ``dedup_id``, a push sent again
        with the same one (a retry after a lost connection or a retryable error) within 5 minutes is not stored
        again: its reply is the first one's id."""
        reply = await self.request("qpush", queue=queue, data=data,
                                   **_given(priority=priority, delay_ms=delay_ms, dedup_id=dedup_id))
        return reply["id"]

    async def qpush_many(self, queue: str, messages: list, *, priority: int | None = None,
                         delay_ms: int | None = None, dedup_id: str | None = None) -> list[str]:
        """Store up to 1000 messages with one request, together or not at all; -> their ids, in order, once the
        broker has journaled them.  Each item is a message's data, or a dict ``{"data": ..., "priority": ...,
        "delay_ms": ...}`` (``QueueMessageSpec``) for one with its own priority or delay; ``priority`` and
        ``delay_ms`` here apply to the rest.  A full queue raises BrokerError ``queue_full`` (nothing stored; its
        reply's ``room`` says how many would fit now).  ``dedup_id`` names the whole batch, as for ``qpush``."""
        items = [m.as_item() if isinstance(m, QueueMessageSpec) else {"data": m} for m in messages]
        reply = await self.request("qpush", queue=queue, messages=items,
                                   **_given(priority=priority, delay_ms=delay_ms, dedup_id=dedup_id))
        return reply["ids"]

    async def qrecv(self, queue: str, max: int = 1, *, wait_ms: int = 0, visibility_ms: int | None = None,
                    release_on_close: bool = False) -> list[QueueMessage]:
        """Lease up to ``max`` messages, waiting up to ``wait_ms`` for the first."""
        fields = _given(visibility_ms=visibility_ms, release_on_close=release_on_close or None)
        timeout = 10.0 + wait_ms / 1000
        reply = await self.request("qrecv", timeout=timeout, queue=queue, max=max, wait_ms=wait_ms, **fields)
        return [_queue_message(queue, m) for m in reply["messages"]]

    async def qack(self, queue: str, receipt: str) -> dict:
        return await self.request("qack", queue=queue, receipt=receipt)

    async def qack_many(self, queue: str, receipts: list[str]) -> list[dict]:
        """One result per receipt, in order: ``{"ok": true}`` or the reason it could not be acked."""
        return (await self.request("qack", queue=queue, receipts=receipts))["results"]

    async def qextend(self, queue: str, receipt: str, visibility_ms: int | None = None) -> int:
        """Renew a lease (by its own visibility unless given); -> ms until its new deadline."""
        reply = await self.request("qextend", queue=queue, receipt=receipt, **_given(visibility_ms=visibility_ms))
        return reply["deadline_in_ms"]

    async def qnack(self, queue: str, receipt: str, delay_ms: int = 0) -> str:
        """Give a message back (visible again after ``delay_ms``); -> where it went: visible, delayed, dead."""
        return (await self.request("qnack", queue=queue, receipt=receipt, delay_ms=delay_ms))["state"]

    async def qdead(self, queue: str, receipt: str) -> None:
        await self.request("qdead", queue=queue, receipt=receipt)

    async def qstat(self, queue: str) -> dict:
        return (await self.request("qstat", queue=queue))["stat"]

    async def qpurge(self, queue: str) -> int:
        return (await self.request("qpurge", queue=queue))["purged"]

    async def qredrive(self, queue: str, to: str | None = None, max: int | None = None) -> int:
        return (await self.request("qredrive", queue=queue, **_given(to=to, max=max)))["moved"]

    async def consume(self, queue: str, handler, *, visibility_ms: int = 30_000, batch: int = 1,
                      wait_ms: int = 20_000, stop: asyncio.Event | None = None) -> int:
        """Receive and handle messages until ``stop`` is set: ``await handler(message)`` for each; its return acks
        it, an exception nacks it (visible again at once).  While the handler runs, the lease is extended every
        half visibility, so a slow handler keeps its message.  -> how many were acked."""
        acked = 0
        while stop is None or not stop.is_set():
            for msg in await self.qrecv(queue, batch, wait_ms=wait_ms, visibility_ms=visibility_ms):
                work = asyncio.ensure_future(handler(msg))
                try:
                    while not (await asyncio.wait({work}, timeout=visibility_ms / 2000))[0]:
                        await self.qextend(queue, msg.receipt, visibility_ms)
                    if work.exception() is None:
                        await self.qack(queue, msg.receipt)
                        acked += 1
                    else:
                        await self.qnack(queue, msg.receipt)
                except BrokerError as exc:
                    if exc.reason != "lease_lost":
                        raise
                    # the lease lapsed (say the broker was unreachable for longer than it): the message is
                    # someone else's now, and the handler's work may be repeated: at-least-once
                    await asyncio.wait({work})
        return acked

    async def next_message(self, timeout: float | None = None) -> Delivery:
        item = await asyncio.wait_for(self._p.deliveries.get(), timeout)
        if item is None:
            self._p.deliveries.put_nowait(None)  # stay closed for later callers
            raise ConnectionError("connection closed by the broker")
        return item

    async def messages(self) -> AsyncIterator[Delivery]:
        while True:
            try:
                yield await self.next_message()
            except ConnectionError:
                return

    async def close(self) -> None:
        if self._p.transport is not None and not self.is_closed:
            self._p.transport.close()
            await self._p.closed


# -- blocking -------------------------------------------------------------------------------------------------

class BlockingClient:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._decoder = ndjson.Decoder()
        self._replies: collections.deque[dict] = collections.deque()
        self._deliveries: collections.deque[Delivery] = collections.deque()
        self._unwaited = 0
        self._deferred: BrokerError | None = None
        self.closed = False

    @classmethod
    def connect(cls, host: str = "127.0.0.1", port: int = 8080, *, user: str | None = None,
                password: str | None = None, timeout: float = 10.0, tls: ssl.SSLContext | None = None,
                server_hostname: str | None = None) -> BlockingClient:
        """``tls`` and ``server_hostname``: as ``AsyncClient.connect``."""
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=server_hostname or host)
            except BaseException:
                sock.close()
                raise
        client = cls(sock)
        if user is not None:
            client.auth(user, password or "")
        return client

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, deadline: float | None) -> None:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the broker in time")
            self._sock.settimeout(left)
        else:
            self._sock.settimeout(None)
        try:
            data = self._sock.recv(65536)
        except TimeoutError:
            raise TimeoutError("no answer from the broker in time") from None
        if not data:
            self.closed = True
            raise ConnectionError("connection closed by the broker")
        for obj in self._decoder.feed(data):
            if not ndjson.is_reply(obj):
                self._deliveries.append(ndjson.delivery(obj))
            elif self._unwaited:
                self._unwaited -= 1
                if not obj.get("ok") and self._deferred is None:
                    self._deferred = BrokerError(obj.get("error", "unknown"), obj)
            else:
                self._replies.append(obj)

    def request(self, op: str, *, timeout: float | None = 10.0, **fields: Any) -> dict:
        err, self._deferred = self._deferred, None
        if err is not None:
            raise err
        self._sock.sendall(ndjson.request(op, **fields))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._replies:
            self._read(deadline)
        reply = self._replies.popleft()
        if not reply.get("ok"):
            raise BrokerError(reply.get("error", "unknown"), reply)
        return reply

    def auth(self, user: str, password: str) -> None:
        self.request("auth", user=user, **{"pass": password})

    def sub(self, topic: str) -> None:
        self.request("sub", topic=topic)

    def unsub(self, topic: str) -> None:
        self.request("unsub", topic=topic)

    def pub(self, topic: str, data: Any, *, wait: bool = True) -> None:
        if wait:
            self.request("pub", topic=topic, data=data)
        else:
            self._unwaited += 1
            self._sock.sendall(ndjson.request("pub", topic=topic, data=data))

    def ping(self) -> None:
        self.request("ping")

    def info(self) -> dict:
        return self.request("info")["info"]

    def next_message(self, timeout: float | None = None) -> Delivery:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._deliveries:
            self._read(deadline)
        return self._deliveries.popleft()

    def messages(self) -> Iterator[Delivery]:
        while True:
            try:
                yield self.next_message()
            except ConnectionError:
                return

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()
