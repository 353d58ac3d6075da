"""In-process workers for baseline tests: hubs and protocol sessions in one event loop, no sockets, no processes.

- ``FakeTransport``: the parts of ``asyncio.Transport`` the sessions use, recording every byte written.  It can
  play a client that does not read (``reading_client=False``: what is written stays in the "kernel", counted by
  ``get_write_buffer_size``) and calls the protocol's ``pause_writing``/``resume_writing`` at the high- and
  low-water marks the session set, as asyncio's transports do.  ``close``/``abort`` call ``connection_lost`` on
  the next loop turn, as asyncio's do.
- ``Client``: a session over a fake transport, driven through the public entry points a worker uses
  (``connection_made``, ``data_received``, ``eof_received``), with helpers to read what it was sent.
- ``Broker``: ``workers`` hubs built the way ``workers.process.Worker._boot`` builds them (config from
  ``cluster.config.load``, an ``Authenticator`` with the registry the supervisor would hand over, the work-queue
  service on request), joined by the real ZeroMQ ``Fabric`` when there are several.

Everything must run inside ``asyncio.run`` (the hub takes the running loop).  Nothing here sleeps to let time pass:
``until`` yields to the loop (and, for fabric round trips and password checks on threads, waits a millisecond at a
time) until a condition holds, with a deadline.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable
from typing import Any

import orjson

from shardbroker.cluster.config import Config, load
from shardbroker.cluster.security import users
from shardbroker.router.fabric import Fabric
from shardbroker.workers.auth import Authenticator
from shardbroker.workers.hub import Hub

PEER = ("127.0.0.1", 40000)
SERVER_INFO = {"server_id": "INPROCESS", "server_name": "inprocess", "version": "2.10.0", "proto": 1,
               "headers": True, "max_payload": 1048576}


async def until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> None:
    """Yield to the loop until ``predicate()`` is true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    spins = 0
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        spins += 1
        # a few bare loop turns first (call_soon chains); then a millisecond at a time (threads, ZeroMQ)
        await asyncio.sleep(0 if spins < 20 else 0.001)


async def turns(n: int = 10) -> None:
    """Let ``n`` loop turns pass (call_soon chains: the hub's end-of-turn flush, resumed reads)."""
    for _ in range(n):
        await asyncio.sleep(0)


class FakeTransport(asyncio.Transport):
    def __init__(self, peer: tuple[str, int] = PEER, reading_client: bool = True) -> None:
        super().__init__()
        self.protocol: asyncio.Protocol | None = None
        self.peer = peer
        self.data = bytearray()          # everything written and not yet taken by the test
        self.written = 0                 # bytes written in all
        self.writes = 0                  # write/writelines calls
        self.reading_client = reading_client
        self.unread = 0                  # bytes a not-reading client left in the "kernel"
        self.reading = True
        self.pauses = 0
        self.eof_written = False
        self.closing = False
        self.aborted = False
        self.lost = False
        self.high = self.low = None
        self._writing_paused = False

    # -- writing --------------------------------------------------------------------------------------------
    def _writable(self) -> bool:
        """As asyncio's socket transports: an error after ``write_eof``, dropped once the connection is lost."""
        if self.eof_written:
            raise RuntimeError("Cannot call write() after write_eof()")
        return not self.lost

    def write(self, data: bytes) -> None:
        if not self._writable():
            return
        self.data += data
        self.written += len(data)
        self.writes += 1
        if not self.reading_client:
            self.unread += len(data)
            self._check_high()

    def writelines(self, chunks) -> None:
        if not self._writable():
            return
        n = 0
        for chunk in chunks:
            self.data += chunk
            n += len(chunk)
        self.written += n
        self.writes += 1
        if not self.reading_client:
            self.unread += n
            self._check_high()

    def get_write_buffer_size(self) -> int:
        return self.unread

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high, self.low = high, low

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self.low or 0, self.high or 0)

    def _check_high(self) -> None:
        if self.high is not None and not self._writing_paused and self.unread > self.high:
            self._writing_paused = True
            self.protocol.pause_writing()

    def client_reads(self, n: int | None = None) -> None:
        """The client takes ``n`` (all) of the bytes left unread; below the low-water mark, writing resumes."""
        self.unread = 0 if n is None else max(0, self.unread - n)
        if self._writing_paused and self.unread <= (self.low or 0):
            self._writing_paused = False
            self.protocol.resume_writing()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    # -- reading --------------------------------------------------------------------------------------------
    def pause_reading(self) -> None:
        if self.reading:
            self.pauses += 1
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    # -- life -----------------------------------------------------------------------------------------------
    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self._lose()

    def abort(self) -> None:
        self.aborted = True
        self._lose()

    def _lose(self) -> None:
        if self.closing:
            return
        self.closing = True
        asyncio.get_running_loop().call_soon(self._connection_lost)

    def _connection_lost(self) -> None:
        self.lost = True
        self.protocol.connection_lost(None)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self.peer
        return default   # no "socket": the sessions then skip TCP options and the kernel's queue size


class Client:
    """A session over a ``FakeTransport``, as the worker adopts a socket."""

    def __init__(self, session, transport: FakeTransport) -> None:
        self.session = session
        self.transport = transport
        transport.protocol = session
        session.connection_made(transport)

    # -- input ----------------------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.session.data_received(data)

    def send_json(self, *requests: dict) -> None:
        """NDJSON requests, all in one read."""
        self.send(b"".join(orjson.dumps(r) + b"\n" for r in requests))

    def half_close(self) -> bool:
        return self.session.eof_received()

    # -- output ---------------------------------------------------------------------------------------------
    def take(self) -> bytes:
        """Everything written to the client since the last take."""
        data = bytes(self.transport.data)
        self.transport.data.clear()
        return data

    async def read(self, n: int, timeout: float = 5.0) -> bytes:
        """Exactly the next ``n`` bytes written (waiting for them)."""
        await until(lambda: len(self.transport.data) >= n, timeout,
                    f"{n} bytes (have {bytes(self.transport.data)!r})")
        data = bytes(self.transport.data[:n])
        del self.transport.data[:n]
        return data

    async def expect(self, expected: bytes, timeout: float = 5.0) -> None:
        """The next bytes written are exactly ``expected``."""
        got = await self.read(len(expected), timeout)
        assert got == expected, f"expected {expected!r}, got {got!r} (then {bytes(self.transport.data)!r})"

    async def lines(self, n: int, timeout: float = 5.0) -> list[bytes]:
        """The next ``n`` newline-terminated lines written (NDJSON, or NATS control lines)."""
        await until(lambda: self.transport.data.count(b"\n") >= n, timeout,
                    f"{n} lines (have {bytes(self.transport.data)!r})")
        out = []
        for _ in range(n):
            i = self.transport.data.index(b"\n")
            out.append(bytes(self.transport.data[:i + 1]))
            del self.transport.data[:i + 1]
        return out

    async def json(self, n: int = 1, timeout: float = 5.0) -> list[dict]:
        return [orjson.loads(line) for line in await self.lines(n, timeout)]

    async def silent(self) -> None:
        """Nothing more is written once the loop has turned a few times."""
        await turns(20)
        assert not self.transport.data, f"unexpected output {bytes(self.transport.data)!r}"

    @property
    def closed(self) -> bool:
        """The session closed (or began to: a close half-closes first and lingers for the client's own)."""
        return self.session.closed


def make_config(doc: dict | None = None) -> Config:
    """A Config as the supervisor loads it: the embedded defaults, with ``doc``'s sections (whole top-level keys,
    or dotted keys) over them, checked and completed by ``cluster.config.load``."""
    return load(None, overrides=doc or {})


class Broker:
    """``workers`` hubs of one broker in this event loop, each as ``workers.process.Worker`` boots it."""

    def __init__(self, config: Config, runtime_dir: str, workers: int = 1, queues: bool = False) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        self.count = workers
        self.queues = queues
        self.hubs: list[Hub] = []
        self.auths: list[Authenticator] = []
        self._snapshot: list[dict] = []
        self._cids = 0
        self.clients: list[Client] = []
        self.asked: list[dict] = []          # what the hubs asked the supervisor (claims of logins)
        self.refuse_claims = False

    @classmethod
    async def start(cls, runtime_dir, doc: dict | None = None, workers: int = 1, queues: bool = False) -> Broker:
        os.makedirs(runtime_dir, exist_ok=True)
        broker = cls(make_config(doc), str(runtime_dir), workers, queues)
        await broker._boot()
        return broker

    async def _boot(self) -> None:
        # the registry the supervisor builds from the configuration and hands each worker (users.from_config)
        self._snapshot = users.from_config(self.config.security).snapshot()
        self.hubs = [self._hub(index) for index in range(self.count)]
        if self.count > 1:
            for hub in self.hubs:
                self._fabric(hub, epoch=1)
            await asyncio.gather(*(hub.fabric.join(5) for hub in self.hubs))
            # the hello exchange carries interest snapshots: let its acks settle before the test begins
            await turns(20)

    def _hub(self, index: int) -> Hub:
        cfg = self.config
        auth = Authenticator(cfg.security, self._snapshot)
        hub = Hub(index, self.count, cfg, auth)
        hub.server_info = dict(SERVER_INFO)
        hub.supervisor_request = self._supervisor
        self.auths.append(auth)
        if self.queues:
            hub.queue_service = _start_queues(index, cfg, self.runtime_dir, hub)
        return hub

    def _fabric(self, hub: Hub, epoch: int) -> None:
        cfg = self.config.fabric
        hub.fabric = Fabric(hub.index, self.count, epoch, self.runtime_dir, hub, hwm=cfg.hwm,
                            window_bytes=cfg.window_bytes, stall_timeout=cfg.stall_timeout)

    async def replace(self, index: int, epoch: int = 2) -> Hub:
        """Worker ``index`` dies (its fabric ends, its connections with it) and a new incarnation takes its place:
        a fresh hub, joined to the others as a replacement joins (hello, with a higher epoch)."""
        old = self.hubs[index]
        if old.queue_service is not None:
            old.queue_service.close(graceful=False)
        old.fabric.close()
        for conn in list(old.conns.values()):
            conn.transport.abort()
        hub = self.hubs[index] = self._hub(index)
        self._fabric(hub, epoch)
        await hub.fabric.join(5)
        await turns(20)
        return hub

    async def _supervisor(self, message: dict) -> dict:
        """The supervisor's side of ``Hub.supervisor_request``: a login's ``claim`` is granted (or refused)."""
        self.asked.append(message)
        return {"ok": not self.refuse_claims}

    def connect(self, session_cls, worker: int = 0, peer: tuple[str, int] | None = None,
                reading_client: bool = True) -> Client:
        self._cids += 1
        peer = peer or (PEER[0], PEER[1] + self._cids)
        client = Client(session_cls(self.hubs[worker], self._cids), FakeTransport(peer, reading_client))
        self.clients.append(client)
        return client

    async def close(self) -> None:
        await turns(5)
        for hub in self.hubs:
            if hub.queue_service is not None:
                hub.queue_service.close(graceful=True)
        for hub in self.hubs:
            if hub.fabric is not None:
                hub.fabric.close()
        for auth in self.auths:
            auth.close()

    async def __aenter__(self) -> Broker:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _start_queues(index: int, cfg: Config, runtime_dir: str, hub: Hub):
    """The work-queue service as the worker starts it (``workqueues.start``), without leaving the collector's
    settings of a worker process (``gc.freeze`` and a raised threshold) on the test process."""
    from shardbroker.workers import workqueues

    threshold = gc.get_threshold()
    try:
        return workqueues.start(index, cfg, runtime_dir, hub)
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def run(coro_fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``asyncio.run`` for a test's scenario."""
    return asyncio.run(coro_fn(*args, **kwargs))
