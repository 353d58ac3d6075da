"""What the leaf-node traffic tests share (tests/leaf/test_leaf_traffic.py, test_leaf_queue_groups.py,
test_leaf_local.py): clients of every protocol on both sides of a leaf connection, and the barrier that waits
for interest to cross before anything is counted (see test_leaf_traffic.py's docstring)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import nats
from test_bridge import read_n

from shardbroker.cli.client import AsyncClient

from support.harness import Raw, on_worker

_tokens = itertools.count()


def token() -> str:
    return f"t{next(_tokens)}"


# -- configuration and connections --------------------------------------------------------------------------------

def leaf_config(hub, **more) -> dict:
    return {"leafnodes": {"name": "sb", "remotes": [{"urls": [hub.leaf_url]}], "reconnect": 0.2, **more}}


def broker_url(broker) -> str:
    return f"nats://127.0.0.1:{broker.ports['nats']}"


class Clients:
    """nats-py and NDJSON connections made in a test, all closed at the end whatever happened."""

    def __init__(self) -> None:
        self.made: list = []

    async def nats(self, url: str, **kwargs):
        kwargs.setdefault("allow_reconnect", False)
        nc = await nats.connect(url, **kwargs)
        self.made.append(nc)
        return nc

    async def ndjson(self, port: int) -> AsyncClient:
        nd = await AsyncClient.connect("127.0.0.1", port)
        self.made.append(nd)
        return nd

    async def nats_on(self, broker, worker: int, tries: int = 32):
        """A nats-py connection to ``broker`` that landed on ``worker`` (found in /connz by its name); the others
        stay open meanwhile (the acceptor balances by live connections) and are closed at the end."""
        others = []
        try:
            for _ in range(tries):
                name = f"placed-{token()}"
                nc = await nats.connect(broker_url(broker), name=name, allow_reconnect=False)
                await nc.flush()
                conns = (await asyncio.to_thread(broker.http, "/connz?limit=1000"))[1]["connections"]
                if next((c["worker"] for c in conns if c.get("name") == name), None) == worker:
                    self.made.append(nc)
                    return nc
                others.append(nc)
            raise AssertionError(f"no nats-py connection landed on worker {worker}")
        finally:
            for nc in others:
                await nc.close()

    async def close(self) -> None:
        for conn in reversed(self.made):
            try:
                await conn.close()
            except Exception:   # already closed, or the broker went first
                pass


def run(test) -> None:
    """asyncio.run(test(clients)), the clients closed at the end."""
    async def main():
        clients = Clients()
        try:
            await test(clients)
        finally:
            await clients.close()

    asyncio.run(main())


async def synced(*clients) -> None:
    """Subscriptions made so far are in force in the broker (tests/protocols/test_nats.py's ``synced``)."""
    await asyncio.sleep(0)
    for c in clients:
        await c.flush()


async def until(cond, timeout: float = 10.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


class Collect:
    """Every message of a nats-py subscription (``cb=collect.cb``): ``msgs`` (subject, data, headers)."""

    def __init__(self) -> None:
        self.msgs: list[tuple[str, bytes, dict | None]] = []
        self.replies: list[str] = []

    async def cb(self, msg) -> None:
        self.msgs.append((msg.subject, msg.data, msg.headers))
        self.replies.append(msg.reply)

    def __len__(self) -> int:
        return len(self.msgs)

    @property
    def data(self) -> list[bytes]:
        return [m[1] for m in self.msgs]


async def probe(send, arrived, timeout: float = 10.0, every: float = 0.05, what: str = "a probe") -> None:
    """``await send()`` every ``every`` seconds until ``arrived()``."""
    deadline = time.monotonic() + timeout
    while not arrived():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never arrived in {timeout}s")
        await send()
        await asyncio.sleep(every)


async def hub_knows(hub_nc, nc) -> None:
    """A barrier: the hub knows every subscription ``nc`` (a nats-py client of the broker) made so far."""
    subject = f"sync.{token()}"
    got = Collect()
    await nc.subscribe(subject, cb=got.cb)
    await synced(nc)

    async def send():
        await hub_nc.publish(subject, b"sync")
        await hub_nc.flush()

    await probe(send, lambda: len(got), what=f"the hub's probe on {subject}")


async def broker_knows(hub_nc, nc) -> None:
    """A barrier: the worker of ``nc`` (a nats-py client of the broker) knows every subscription ``hub_nc`` (a
    client of the hub) made so far."""
    subject = f"sync.{token()}"
    got = Collect()
    await hub_nc.subscribe(subject, cb=got.cb)
    await hub_nc.flush()

    async def send():
        await nc.publish(subject, b"sync")
        await nc.flush()

    await probe(send, lambda: len(got), what=f"the broker's probe on {subject}")


async def every_worker_knows(broker, hub_nc) -> None:
    """A barrier on every worker: each knows every subscription ``hub_nc`` made so far (an NDJSON connection on
    each worker publishes probes until the hub gets one of its own)."""
    prefix = f"sync.{token()}"
    got = Collect()
    await hub_nc.subscribe(prefix + ".*", cb=got.cb)
    await hub_nc.flush()
    for worker in range(broker.workers):
        conn = await asyncio.to_thread(on_worker, broker.port, worker)
        try:
            subject = f"{prefix}.{worker}"

            async def send():
                assert (await asyncio.to_thread(conn.request, {"op": "pub", "topic": subject, "data": "s"}))["ok"]

            await probe(send, lambda: any(m[0] == subject for m in got.msgs), what=f"worker {worker}'s probe")
        finally:
            conn.close()


async def no_strays(wait: float = 0.5) -> None:
    """Time for a duplicate or a stray message to show up before the counts are checked."""
    await asyncio.sleep(wait)


# -- Bridge ------------------------------------------------------------------------------------------------------

class BridgeSub:
    """A Bridge subscriber (topics of ≤ 7 characters: ``bridge.<topic>`` in the subject space), its deliveries
    read by a thread into ``got`` (payloads: a Bridge delivery has no subject)."""

    def __init__(self, broker, *topics: str) -> None:
        self.conn = Raw(broker.ports["bridge"])
        self.got: list[bytes] = []
        for topic in topics:
            self.conn.send(b"S" + topic.encode().ljust(7))
            assert read_n(self.conn, 1) == b"O", topic
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        sock, buf, parts = self.conn.sock, self.conn.buf, []
        sock.settimeout(0.1)
        while not self._stop:
            while len(buf) >= 2 and len(buf) >= 2 + (size := int.from_bytes(buf[:2], "little")):
                chunk, buf = buf[2:2 + size], buf[2 + size:]
                if size == 4 and chunk == b"\r\n\r\n":   # the end marker: one delivery done
                    self.got.append(b"".join(parts))
                    parts = []
                else:
                    parts.append(chunk)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buf += data

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.conn.close()


async def bridge_knows(hub_nc, sub: BridgeSub, topic: str = "syncbr") -> None:
    """A barrier: the hub knows the Bridge subscriber's subscriptions (``topic`` must be its last one; the hub's
    probes carry a payload no test uses)."""
    async def send():
        await hub_nc.publish(f"bridge.{topic}", b"__sync__")
        await hub_nc.flush()

    await probe(send, lambda: b"__sync__" in sub.got, what="the hub's probe to the Bridge subscriber")
