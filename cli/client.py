"""A Python client for the broker's NDJSON protocol (and any Jolt server), in asyncio and blocking flavours.

    async with await AsyncClient.connect("127.0.0.1", 8080) as c:
        await c.sub("chat.*")
        await c.pub("chat.room1", {"text": "hi"})
        msg = await c.next_message(timeout=1)      # Delivery(topic="chat.room1", data={"text": "hi"}, extra={})

    with BlockingClient.connect("127.0.0.1", 8080) as c:
        c.pub("chat.room1", "hello")

Replies come back in request order, so a request waits on a FIFO of pending replies; deliveries, which may arrive
between replies, go to a separate queue.  ``pub(..., wait=False)`` pipelines: the reply is consumed without
waiting, and an error in it is raised by the next call that waits.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import Any, AsyncIterator, Iterator, NamedTuple

import orjson


class BrokerError(Exception):
    """The broker answered ``{"ok":false,"error":reason}``."""

    def __init__(self, reason: str, reply: dict | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.reply = reply or {}


class Delivery(NamedTuple):
    topic: str
    data: Any
    extra: dict          # any other fields of the delivery (reply, headers, encoding)


def encode(op: str, **fields: Any) -> bytes:
    return orjson.dumps({"op": op, **fields}) + b"\n"


class _Core:
    """Sans-IO: bytes in, replies and deliveries out."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[dict]:
        data = self._tail + data
        end = data.rfind(b"\n")
        if end < 0:
            self._tail = data
            return []
        self._tail = data[end + 1:]
        return [orjson.loads(line) for line in data[:end].split(b"\n") if line.strip()]

    @staticmethod
    def is_reply(obj: dict) -> bool:
        return "ok" in obj

    @staticmethod
    def delivery(obj: dict) -> Delivery:
        extra = {k: v for k, v in obj.items() if k not in ("topic", "data")}
        return Delivery(obj.get("topic", ""), obj.get("data"), extra)


# -- asyncio --------------------------------------------------------------------------------------------------

class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.core = _Core()
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque[asyncio.Future | None] = collections.deque()
        self.deliveries: asyncio.Queue[Delivery | None] = asyncio.Queue()
        self.deferred_error: BrokerError | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for obj in self.core.feed(data):
            if not self.core.is_reply(obj):
                self.deliveries.put_nowait(self.core.delivery(obj))
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
                      password: str | None = None, timeout: float = 10.0) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        _, proto = await asyncio.wait_for(loop.create_connection(_Protocol, host, port), timeout)
        client = cls(proto)
        if user is not None:
            await client.auth(user, password or "")
        return client

    async def __aenter__(self) -> "AsyncClient":
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
        self._p.transport.write(encode(op, **fields))
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
            self._p.transport.write(encode("pub", topic=topic, data=data))

    async def ping(self) -> None:
        await self.request("ping")

    async def info(self) -> dict:
        return (await self.request("info"))["info"]

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
        self._core = _Core()
        self._replies: collections.deque[dict] = collections.deque()
        self._deliveries: collections.deque[Delivery] = collections.deque()
        self._unwaited = 0
        self._deferred: BrokerError | None = None
        self.closed = False

    @classmethod
    def connect(cls, host: str = "127.0.0.1", port: int = 8080, *, user: str | None = None,
                password: str | None = None, timeout: float = 10.0) -> "BlockingClient":
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = cls(sock)
        if user is not None:
            client.auth(user, password or "")
        return client

    def __enter__(self) -> "BlockingClient":
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
        except socket.timeout:
            raise TimeoutError("no answer from the broker in time") from None
        if not data:
            self.closed = True
            raise ConnectionError("connection closed by the broker")
        for obj in self._core.feed(data):
            if not self._core.is_reply(obj):
                self._deliveries.append(self._core.delivery(obj))
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
        self._sock.sendall(encode(op, **fields))
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
            self._sock.sendall(encode("pub", topic=topic, data=data))

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
