"""The broker as a leaf node of a real nats-server hub: traffic across the leaf connections.

Every worker holds one leaf connection to the hub (``sb-w<N>``, cluster ``sb``): the hub's /leafz shows them; plain
subscriptions, wildcards and headers cross both ways for nats-py, NDJSON and Bridge clients, each subscriber getting
exactly one copy; queue groups prefer local members on both sides, split by weight across workers, and reach the
hub only when the broker has no member; request/reply and no-responders work both ways; and purely local traffic
never reaches the hub (../shared/reference/leafnodes.md §2, §3, §9).

Interest crosses asynchronously (LS+ lines), so before counting anything a test waits for it with a *barrier*: a
``sync.*`` subscription made after the ones under test, on the same connection, and probed across until a probe
arrives.  A connection's subscriptions travel in order on one leaf connection (and the hub's reach every worker in
order), so once the probe arrives everything subscribed before it is known on the other side.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter

import nats
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from test_bridge import publish as bridge_publish
from test_bridge import read_n

from shardbroker.cli.client import AsyncClient

from support.harness import Raw, on_worker
from support.natshub import RawLeaf

pytestmark = pytest.mark.timeout(60)

_tokens = itertools.count()


def token() -> str:
    return f"t{next(_tokens)}"


# -- fixtures and connections ------------------------------------------------------------------------------------

def leaf_config(hub, **more) -> dict:
    return {"leafnodes": {"name": "sb", "remotes": [{"urls": [hub.leaf_url]}], "reconnect": 0.2, **more}}


@pytest.fixture
def leaf_broker(nats_hub, start_broker):
    """leaf_broker(workers=2, bridge=False) -> a started broker whose every worker is a leaf of ``nats_hub``
    (once the hub lists them all).  Requested after the hub, so it stops first."""
    def start(workers: int = 2, bridge: bool = False, config: dict | None = None):
        broker = start_broker(workers=workers, config={**leaf_config(nats_hub), **(config or {})},
                              args=["--bridge-port", "0"] if bridge else [])
        nats_hub.wait_leafs(workers)
        return broker

    return start


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


# -- 1. handshake ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2, 4])
def test_one_leaf_per_worker_on_the_hub(nats_hub, leaf_broker, workers):
    broker = leaf_broker(workers=workers)
    leafs = nats_hub.wait_leafs(workers)
    assert sorted(leaf["name"] for leaf in leafs) == [f"sb-w{i}" for i in range(workers)]
    for leaf in leafs:
        assert leaf["account"] == "$G" and leaf["compression"] == "not supported", leaf
        assert leaf["is_spoke"] is False   # the hub's view: the broker is the spoke
    # one $LDS for the whole instance, advertised by every worker
    lds = {s for leaf in leafs for s in leaf["subscriptions_list"] if s.startswith("$LDS.")}
    assert len(lds) == 1, leafs
    assert all(len([s for s in leaf["subscriptions_list"] if s.startswith("$LDS.")]) == 1 for leaf in leafs)

    async def test(clients):
        # each worker advertises its own clients' interest, and only that
        placed = {w: await clients.nats_on(broker, w) for w in range(workers)}
        for w, nc in placed.items():
            await nc.subscribe(f"hs.w{w}")
            await nc.subscribe("hs.all.>")
            await synced(nc)

        def seen() -> dict[str, set[str]]:
            return {leaf["name"]: set(leaf["subscriptions_list"]) for leaf in nats_hub.leafz()["leafs"]}

        await until(lambda: all({f"hs.w{w}", "hs.all.>"} <= seen().get(f"sb-w{w}", set()) for w in range(workers)),
                    what="every worker's subscriptions on the hub")
        for name, subjects in seen().items():
            mine = {s for s in subjects if s.startswith("hs.w")}
            assert mine == {f"hs.{name.split('-')[1]}"}, (name, subjects)

    run(test)


def weight_seen(leaf: RawLeaf, key: str, weight: int | None, timeout: float = 10.0) -> None:
    """Read ``leaf`` until the hub advertises ``key`` ("subject" or "subject queue") with ``weight`` (None: not at
    all)."""
    deadline = time.monotonic() + timeout
    while leaf.interest.get(key) != weight:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            leaf.next(max(0.01, left))
        except TimeoutError:
            raise AssertionError(f"the hub advertises {key!r} with {leaf.interest.get(key)}, not {weight}") from None


def test_interest_follows_subscriptions(nats_hub, leaf_broker):
    """What the workers advertise, as the hub passes it on to another leaf (a raw spoke of another cluster): plain
    interest while some subscription stands, a queue group's total member count on every change."""
    broker = leaf_broker(workers=2)

    async def test(clients):
        with RawLeaf(nats_hub.leaf_port) as probe_leaf:
            await asyncio.to_thread(probe_leaf.handshake, "probe", "probe")
            w0, w1 = await clients.nats_on(broker, 0), await clients.nats_on(broker, 1)
            # plain: two subscriptions on a worker, and one on the other
            a = await w0.subscribe("plain.x")
            b = await w0.subscribe("plain.x")
            c = await w1.subscribe("plain.>")
            await synced(w0, w1)
            await asyncio.to_thread(weight_seen, probe_leaf, "plain.x", 1)
            await asyncio.to_thread(weight_seen, probe_leaf, "plain.>", 1)
            by_name = {leaf["name"]: leaf.get("subscriptions_list", []) for leaf in nats_hub.leafz()["leafs"]}
            assert "plain.x" in by_name["sb-w0"] and "plain.>" in by_name["sb-w1"], by_name
            await a.unsubscribe()
            await c.unsubscribe()
            await synced(w0, w1)
            await asyncio.to_thread(weight_seen, probe_leaf, "plain.>", None)
            assert probe_leaf.interest.get("plain.x") == 1   # b still stands
            await b.unsubscribe()
            await synced(w0)
            await asyncio.to_thread(weight_seen, probe_leaf, "plain.x", None)
            # a queue group: 1 member on worker 0, 3 on worker 1: the hub's total follows every change
            await w0.subscribe("work", queue="wq")
            q1 = [await w1.subscribe("work", queue="wq") for _ in range(3)]
            await synced(w0, w1)
            await asyncio.to_thread(weight_seen, probe_leaf, "work wq", 4)
            for left, sub in zip((3, 2, 1), q1):
                await sub.unsubscribe()
                await synced(w1)
                await asyncio.to_thread(weight_seen, probe_leaf, "work wq", left)
            # a connection closing takes its subscriptions' interest with it
            await w1.subscribe("gone.*")
            await synced(w1)
            await asyncio.to_thread(weight_seen, probe_leaf, "gone.*", 1)
            await w0.close()
            await w1.close()
            await asyncio.to_thread(weight_seen, probe_leaf, "work wq", None)
            await asyncio.to_thread(weight_seen, probe_leaf, "gone.*", None)

    run(test)


# -- 2. pub/sub across -------------------------------------------------------------------------------------------

def test_pub_sub_both_ways_nats_ndjson_bridge_wildcards_headers(nats_hub, leaf_broker):
    broker = leaf_broker(workers=2, bridge=True)

    async def test(clients):
        hc = await clients.nats(nats_hub.url)
        bc = await clients.nats(broker_url(broker))
        nd = await clients.ndjson(broker.port)

        # hub -> broker: nats-py with * and >, NDJSON with >, a Bridge subscriber
        b_star, b_all = Collect(), Collect()
        await bc.subscribe("down.*", cb=b_star.cb)
        await bc.subscribe("down.>", cb=b_all.cb)
        await nd.sub("down.>")
        bridge_sub = await asyncio.to_thread(BridgeSub, broker, "down", "syncbr")
        try:
            await hub_knows(hc, bc)
            await nd.sub("sync.nd")
            nd_msgs = []

            async def nd_send():
                await hc.publish("sync.nd", b"sync")
                await hc.flush()
                try:
                    while True:
                        nd_msgs.append(await nd.next_message(timeout=0.05))
                except TimeoutError:
                    pass

            await probe(nd_send, lambda: any(m.topic == "sync.nd" for m in nd_msgs), what="the NDJSON probe")
            await bridge_knows(hc, bridge_sub)

            await hc.publish("down.a", b"plain")
            await hc.publish("down.a.b", b"with-headers", headers={"X-Test": "1", "Foo": "bar"})
            await hc.publish("down.r", b"\xff\x00\xfe", reply="hub.inbox.1")
            await hc.publish("bridge.down", b"to-bridge")
            await hc.publish("elsewhere", b"nobody")
            await hc.flush()
            await until(lambda: len(b_star) >= 2 and len(b_all) >= 3 and b"to-bridge" in bridge_sub.got,
                        what="the hub's messages at the broker")
            got_nd = [m for m in nd_msgs if m.topic.startswith("down.")]
            while len(got_nd) < 3:
                m = await nd.next_message(timeout=5)
                if m.topic.startswith("down."):
                    got_nd.append(m)
            await no_strays()
            assert b_star.msgs == [("down.a", b"plain", None), ("down.r", b"\xff\x00\xfe", None)]
            assert b_all.msgs == [("down.a", b"plain", None),
                                  ("down.a.b", b"with-headers", {"X-Test": "1", "Foo": "bar"}),
                                  ("down.r", b"\xff\x00\xfe", None)]
            assert b_all.replies == ["", "", "hub.inbox.1"]
            assert [(m.topic, m.data) for m in got_nd] == [("down.a", "plain"), ("down.a.b", "with-headers"),
                                                           ("down.r", "/wD+")]
            assert got_nd[1].extra == {"headers": "NATS/1.0\r\nX-Test: 1\r\nFoo: bar\r\n\r\n"}
            assert got_nd[2].extra == {"encoding": "base64", "reply": "hub.inbox.1"}
            late = []
            with pytest.raises(TimeoutError):
                while True:
                    late.append((await nd.next_message(timeout=0.3)).topic)
            assert set(late) <= {"sync.nd"}, late   # late probes only
            assert [p for p in bridge_sub.got if p != b"__sync__"] == [b"to-bridge"]
        finally:
            await asyncio.to_thread(bridge_sub.close)

        # broker -> hub: nats-py (with headers), NDJSON and Bridge publishers; the hub's * and > subscribers
        h_star, h_all, h_bridge = Collect(), Collect(), Collect()
        await hc.subscribe("up.*", cb=h_star.cb)
        await hc.subscribe("up.>", cb=h_all.cb)
        await hc.subscribe("bridge.up", cb=h_bridge.cb)
        await every_worker_knows(broker, hc)   # the Bridge publisher lands on any worker
        await bc.publish("up.x", b"nats")
        await bc.publish("up.x.y", b"nats-headers", headers={"K": "V"})
        await bc.flush()
        await until(lambda: len(h_all) >= 2, what="the nats-py messages at the hub")
        await nd.pub("up.nd", "ndjson text")
        await until(lambda: len(h_all) >= 3, what="the NDJSON message at the hub")
        assert await asyncio.to_thread(bridge_publish, broker, b"up".ljust(7), b"bridge bytes") == b"O"
        await until(lambda: len(h_bridge) >= 1, what="the Bridge message at the hub")
        await no_strays()
        assert h_star.msgs == [("up.x", b"nats", None), ("up.nd", b"ndjson text", None)]
        assert h_all.msgs == [("up.x", b"nats", None), ("up.x.y", b"nats-headers", {"K": "V"}),
                              ("up.nd", b"ndjson text", None)]
        assert h_bridge.msgs == [("bridge.up", b"bridge bytes", None)]
        # what came back to the broker's own subscribers: nothing twice (no echo over the leaf)
        assert len(b_star) == 2 and len(b_all) == 3

    run(test)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_exactly_one_copy_per_subscriber(nats_hub, leaf_broker, workers):
    broker = leaf_broker(workers=workers)
    n = 40

    async def test(clients):
        hubs = [await clients.nats(nats_hub.url) for _ in range(3)]
        hub_pub = hubs[0]
        # hub subscribers: two on one.>, one on one.*, one with both (two subscriptions on one connection)
        h_subs = [Collect() for _ in range(4)]
        await hubs[1].subscribe("one.>", cb=h_subs[0].cb)
        await hubs[2].subscribe("one.>", cb=h_subs[1].cb)
        await hubs[2].subscribe("one.*", cb=h_subs[2].cb)
        await hubs[1].subscribe("one.*", cb=h_subs[3].cb)
        # broker subscribers: one connection per worker (and one more), each with one.> and one.*; publishers: one
        # per worker
        b_conns = [await clients.nats_on(broker, w) for w in range(workers)] + [await clients.nats(
            broker_url(broker))]
        b_subs = []
        for nc in b_conns:
            for pattern in ("one.>", "one.*"):
                got = Collect()
                await nc.subscribe(pattern, cb=got.cb)
                b_subs.append(got)
        pubs = [await clients.nats_on(broker, w) for w in range(workers)]
        for nc in b_conns:
            await hub_knows(hub_pub, nc)
        for hub_nc in hubs[1:]:
            for nc in pubs:
                await broker_knows(hub_nc, nc)

        sources = [("hub", hub_pub)] + [(f"w{w}", nc) for w, nc in enumerate(pubs)]
        for i in range(n):
            for name, nc in sources:
                await nc.publish(f"one.{name}", b"%d" % i)
        for _, nc in sources:
            await nc.flush()
        expected = sorted((f"one.{name}", b"%d" % i) for i in range(n) for name, _ in sources)
        everyone = h_subs + b_subs
        await until(lambda: all(len(s) >= len(expected) for s in everyone), timeout=15,
                    what=f"{len(expected)} messages at every subscriber: {[len(s) for s in everyone]}")
        await no_strays()
        for i, s in enumerate(everyone):
            got = sorted((m[0], m[1]) for m in s.msgs)
            dupes = [k for k, c in Counter(got).items() if c > 1]
            assert got == expected, (f"subscriber {i}: {len(got)} messages, {len(expected)} expected; "
                                     f"duplicates {dupes[:5]}")
        # and in order from each publisher, for each subscriber
        for s in everyone:
            for name, _ in sources:
                assert [m[1] for m in s.msgs if m[0] == f"one.{name}"] == [b"%d" % i for i in range(n)]

    run(test)


def test_without_a_name_the_workers_still_share_one_cluster(nats_hub, start_broker):
    """No ``leafnodes.name``: the workers' connections still carry one cluster name (the instance's), so the hub
    never echoes one worker's messages to another."""
    config = leaf_config(nats_hub)
    del config["leafnodes"]["name"]
    broker = start_broker(workers=2, config=config)
    leafs = nats_hub.wait_leafs(2)
    prefixes = {leaf["name"].rsplit("-w", 1)[0] for leaf in leafs}
    assert len(prefixes) == 1 and sorted(leaf["name"][-3:] for leaf in leafs) == ["-w0", "-w1"], leafs

    async def test(clients):
        hc = await clients.nats(nats_hub.url)
        pub, sub = await clients.nats_on(broker, 0), await clients.nats_on(broker, 1)
        at_hub, at_broker = Collect(), Collect()
        await hc.subscribe("nn.>", cb=at_hub.cb)
        await sub.subscribe("nn.>", cb=at_broker.cb)
        await hub_knows(hc, sub)
        await broker_knows(hc, pub)
        for i in range(20):
            await pub.publish("nn.b", b"%d" % i)
            await hc.publish("nn.h", b"%d" % i)
        await pub.flush()
        await hc.flush()
        await until(lambda: len(at_hub) >= 40 and len(at_broker) >= 40, what="40 messages each")
        await no_strays()
        assert sorted((m[0], int(m[1])) for m in at_hub.msgs) == sorted(
            (subject, i) for i in range(20) for subject in ("nn.b", "nn.h"))
        assert sorted((m[0], int(m[1])) for m in at_broker.msgs) == sorted(
            (subject, i) for i in range(20) for subject in ("nn.b", "nn.h"))

    run(test)


# -- 3. queue groups ---------------------------------------------------------------------------------------------

def test_queue_groups_prefer_local_members_on_both_sides(nats_hub, leaf_broker):
    broker = leaf_broker(workers=2)

    async def test(clients):
        hc, hpub = await clients.nats(nats_hub.url), await clients.nats(nats_hub.url)
        bc, bpub = await clients.nats(broker_url(broker)), await clients.nats(broker_url(broker))
        hub_member, broker_member = Collect(), Collect()
        await hc.subscribe("work", queue="wq", cb=hub_member.cb)
        await bc.subscribe("work", queue="wq", cb=broker_member.cb)
        await hub_knows(hpub, bc)      # the hub knows the broker's member
        await broker_knows(hc, bpub)   # the publisher's worker knows the hub's member
        for i in range(20):
            await hpub.publish("work", b"hub-%d" % i)
        await hpub.flush()
        await until(lambda: len(hub_member) + len(broker_member) >= 20, what="20 messages from the hub")
        for i in range(20):
            await bpub.publish("work", b"broker-%d" % i)
        await bpub.flush()
        await until(lambda: len(hub_member) + len(broker_member) >= 40, what="20 messages from the broker")
        await no_strays()
        assert hub_member.data == [b"hub-%d" % i for i in range(20)]
        assert broker_member.data == [b"broker-%d" % i for i in range(20)]

    run(test)


def test_queue_weights_split_the_hubs_messages_across_workers(nats_hub, leaf_broker):
    broker = leaf_broker(workers=2)
    n = 400

    async def test(clients):
        hpub = await clients.nats(nats_hub.url)
        w0, w1 = await clients.nats_on(broker, 0), await clients.nats_on(broker, 1)
        on_w0, on_w1 = Collect(), Collect()
        await w0.subscribe("work", queue="wq", cb=on_w0.cb)
        for _ in range(3):
            await w1.subscribe("work", queue="wq", cb=on_w1.cb)
        await hub_knows(hpub, w0)   # the weights told so far (1 and 3) are the hub's
        await hub_knows(hpub, w1)
        for i in range(n):
            await hpub.publish("work", b"%d" % i)
        await hpub.flush()
        await until(lambda: len(on_w0) + len(on_w1) >= n, timeout=15,
                    what=f"{n} messages (have {len(on_w0)} + {len(on_w1)})")
        await no_strays()
        assert sorted(on_w0.data + on_w1.data) == sorted(b"%d" % i for i in range(n)), "each exactly once"
        assert 60 <= len(on_w0) <= 140 and 260 <= len(on_w1) <= 340, (len(on_w0), len(on_w1))

    run(test)


def test_a_workers_share_spreads_evenly_over_its_members(nats_hub, leaf_broker):
    """What the hub sends a worker for a group (``| wq``) goes to the worker's own members in turn, evenly, as a
    local publish does: 1 member on worker 0 and 3 on worker 1, 400 messages from the hub, worker 1's ~300 split
    ~100 each (nats-server's spoke picks among its local members uniformly)."""
    broker = leaf_broker(workers=2)
    n = 400

    async def test(clients):
        hpub = await clients.nats(nats_hub.url)
        w0, w1 = await clients.nats_on(broker, 0), await clients.nats_on(broker, 1)
        on_w0, on_w1 = Collect(), [Collect() for _ in range(3)]
        await w0.subscribe("work", queue="wq", cb=on_w0.cb)
        for got in on_w1:
            await w1.subscribe("work", queue="wq", cb=got.cb)
        await hub_knows(hpub, w0)
        await hub_knows(hpub, w1)
        for i in range(n):
            await hpub.publish("work", b"%d" % i)
        await hpub.flush()
        await until(lambda: len(on_w0) + sum(map(len, on_w1)) >= n, timeout=15, what=f"{n} messages")
        await no_strays()
        share = sum(map(len, on_w1))
        counts = [len(got) for got in on_w1]
        assert all(abs(c - share / 3) <= 30 for c in counts), f"worker 1's {share} split {counts}"

    run(test)


def test_the_hubs_queue_members_serve_only_when_the_broker_has_none(nats_hub, leaf_broker):
    broker = leaf_broker(workers=2)

    async def test(clients):
        hc = await clients.nats(nats_hub.url)
        # the member and the publisher on different workers: the publisher's worker knows the group over the fabric
        member, bpub = await clients.nats_on(broker, 0), await clients.nats_on(broker, 1)
        hub_member, broker_member = Collect(), Collect()
        await hc.subscribe("jobs", queue="wq", cb=hub_member.cb)
        sub = await member.subscribe("jobs", queue="wq", cb=broker_member.cb)
        await synced(member)
        await broker_knows(hc, bpub)
        for i in range(20):
            await bpub.publish("jobs", b"a%d" % i)
        await bpub.flush()
        await until(lambda: len(broker_member) >= 20, what="20 messages at the broker's member")
        await no_strays()
        assert broker_member.data == [b"a%d" % i for i in range(20)] and hub_member.msgs == []

        await sub.unsubscribe()
        await synced(member)

        async def send():   # until the publisher's worker knows the broker has no member left
            await bpub.publish("jobs", b"probe")
            await bpub.flush()

        await probe(send, lambda: len(hub_member), what="a message to the hub's member")
        for i in range(20):
            await bpub.publish("jobs", b"b%d" % i)
        await bpub.flush()
        await until(lambda: len([d for d in hub_member.data if d != b"probe"]) >= 20,
                    what="20 messages at the hub's member")
        await no_strays()
        assert [d for d in hub_member.data if d != b"probe"] == [b"b%d" % i for i in range(20)]
        assert len(broker_member) == 20

    run(test)


def test_exactly_one_delivery_per_group_per_message(nats_hub, leaf_broker):
    broker = leaf_broker(workers=2)
    n = 50

    async def test(clients):
        h1, h2, hpub = [await clients.nats(nats_hub.url) for _ in range(3)]
        w0, w1 = await clients.nats_on(broker, 0), await clients.nats_on(broker, 1)
        members: dict[str, list[Collect]] = {}

        async def member(nc, group: str) -> None:
            got = Collect()
            members.setdefault(group, []).append(got)
            await nc.subscribe("grp.*", queue=group, cb=got.cb)

        # mixed: on the hub and on both workers; hub only; broker only (both workers); hub and one worker
        for nc in (h1, w0, w1):
            await member(nc, "mixed")
        for nc in (h1, h2):
            await member(nc, "hubonly")
        for nc in (w0, w1, w1):
            await member(nc, "brokeronly")
        for nc in (h2, w1):
            await member(nc, "pair")
        plain_hub, plain_broker = Collect(), Collect()
        await h2.subscribe("grp.>", cb=plain_hub.cb)
        await w0.subscribe("grp.>", cb=plain_broker.cb)
        for nc in (w0, w1):
            await hub_knows(hpub, nc)
        for hub_nc in (h1, h2):
            for nc in (w0, w1):
                await broker_knows(hub_nc, nc)

        sources = {"hub": hpub, "w0": w0, "w1": w1}
        for i in range(n):
            for name, nc in sources.items():
                await nc.publish(f"grp.{name}", b"%d" % i)
        for nc in sources.values():
            await nc.flush()
        expected = sorted((f"grp.{name}", b"%d" % i) for i in range(n) for name in sources)

        def total(group):
            return sum(len(m) for m in members[group])

        await until(lambda: all(total(g) >= len(expected) for g in members) and len(plain_hub) >= len(expected)
                    and len(plain_broker) >= len(expected), timeout=15,
                    what=f"every group's messages: { {g: total(g) for g in members} }")
        await no_strays()
        for group, got in members.items():
            delivered = sorted((m[0], m[1]) for c in got for m in c.msgs)
            assert delivered == expected, (group, [len(c) for c in got],
                                           [k for k, c in Counter(delivered).items() if c > 1][:5])
        for plain in (plain_hub, plain_broker):
            assert sorted((m[0], m[1]) for m in plain.msgs) == expected
        # local preference: what the broker publishes stays in the broker for the groups it has members of
        assert not [m for m in members["mixed"][0].msgs if m[0] != "grp.hub"], "the hub member took broker messages"
        assert not [m for m in members["pair"][0].msgs if m[0] != "grp.hub"], "the hub member took broker messages"
        assert not [m for c in members["mixed"][1:] for m in c.msgs if m[0] == "grp.hub"], \
            "a broker member took the hub's message though the hub has a member"

    run(test)


# -- 4. request/reply --------------------------------------------------------------------------------------------

def test_request_reply_both_ways_and_no_responders(nats_hub, leaf_broker):
    broker = leaf_broker(workers=2)

    async def test(clients):
        hsvc, hclient = await clients.nats(nats_hub.url), await clients.nats(nats_hub.url)
        bsvc, bclient = await clients.nats(broker_url(broker)), await clients.nats(broker_url(broker))

        def responder(nc, tag: bytes):
            async def cb(msg):   # a reply with headers: they cross too
                await nc.publish(msg.reply, tag + b":" + msg.data, headers={"From": tag.decode()})
            return cb

        hub_plain = await hsvc.subscribe("svc.hub", cb=responder(hsvc, b"hub"))
        await hsvc.subscribe("svc.hubq", queue="q", cb=responder(hsvc, b"hubq"))
        await bsvc.subscribe("svc.broker", cb=responder(bsvc, b"broker"))
        await bsvc.subscribe("svc.brokerq", queue="q", cb=responder(bsvc, b"brokerq"))
        await hub_knows(hclient, bsvc)
        await broker_knows(hsvc, bclient)

        async def ask(nc, subject, i):
            return await nc.request(subject, b"%d" % i, timeout=5)

        for i in range(10):
            for nc, subject, tag in ((bclient, "svc.hub", "hub"), (bclient, "svc.hubq", "hubq"),
                                     (hclient, "svc.broker", "broker"), (hclient, "svc.brokerq", "brokerq")):
                reply = await ask(nc, subject, i)
                assert reply.data == b"%s:%d" % (tag.encode(), i) and reply.headers == {"From": tag}

        # nobody serves it, anywhere: answered at once, from either side
        for nc in (bclient, hclient):
            started = time.monotonic()
            with pytest.raises(NoRespondersError):
                await nc.request("svc.nobody", b"?", timeout=5)
            assert time.monotonic() - started < 2

        # a hub service going away becomes no-responders for the broker's clients, once its LS- has arrived (a
        # request already on its way to the hub meanwhile is lost there: a timeout, as with a nats-server leaf)
        await hub_plain.unsubscribe()
        await hsvc.flush()
        deadline = time.monotonic() + 10
        while True:
            try:
                await bclient.request("svc.hub", b"?", timeout=0.5)
            except NoRespondersError:
                break
            except NatsTimeout:
                pass
            else:
                raise AssertionError("svc.hub answered after its service left")
            assert time.monotonic() < deadline, "svc.hub never became no-responders"
            await asyncio.sleep(0.05)

    run(test)


# -- 5. regression: local traffic with a live leaf connection ----------------------------------------------------


def test_local_traffic_with_a_live_leaf_stays_local(nats_hub, leaf_broker):
    broker = leaf_broker(workers=2)

    async def test(clients):
        a, b = await clients.nats(broker_url(broker)), await clients.nats(broker_url(broker))
        # the hub has interest, in other subjects only
        hc = await clients.nats(nats_hub.url)
        elsewhere = Collect()
        await hc.subscribe("hubside.>", cb=elsewhere.cb)
        await broker_knows(hc, a)
        await asyncio.sleep(0.2)   # the barrier's last probes in

        def crossed() -> tuple[int, int]:
            leafs = nats_hub.wait_leafs(2)
            return sum(leaf["in_msgs"] for leaf in leafs), sum(leaf["out_msgs"] for leaf in leafs)

        before = await asyncio.to_thread(crossed)
        assert before[1] == 0
        # pub/sub with wildcards
        star, gt = Collect(), Collect()
        await b.subscribe("loc.*", cb=star.cb)
        await b.subscribe("loc.>", cb=gt.cb)
        # a queue group across the workers
        q_members = [await clients.nats_on(broker, w) for w in (0, 1)]
        q_got = [Collect(), Collect()]
        for nc, got in zip(q_members, q_got):
            await nc.subscribe("lq", queue="g", cb=got.cb)

        async def echo(msg):
            await msg.respond(b"re:" + msg.data)

        await b.subscribe("lsvc", cb=echo)
        await synced(b, *q_members)
        for i in range(30):
            await a.publish("loc.a", b"%d" % i)
            await a.publish("loc.a.b", b"%d" % i, headers={"H": str(i)})
            await a.publish("lq", b"%d" % i)
        await a.flush()
        for i in range(10):
            assert (await a.request("lsvc", b"%d" % i, timeout=5)).data == b"re:%d" % i
        with pytest.raises(NoRespondersError):
            await a.request("lnobody", b"?", timeout=5)
        await until(lambda: len(star) >= 30 and len(gt) >= 60 and sum(map(len, q_got)) >= 30,
                    what="the local messages")
        await no_strays()
        assert star.data == [b"%d" % i for i in range(30)]
        assert sorted(gt.msgs, key=lambda m: (m[0], int(m[1]))) == (
            [("loc.a", b"%d" % i, None) for i in range(30)] + [("loc.a.b", b"%d" % i, {"H": str(i)})
                                                               for i in range(30)])
        assert sorted(q_got[0].data + q_got[1].data, key=int) == [b"%d" % i for i in range(30)]

        # the hub saw the broker's interest, but no message crossed either way (besides the barrier's probes)
        assert elsewhere.msgs == []
        assert await asyncio.to_thread(crossed) == before

    run(test)


@pytest.mark.parametrize("scenario", [
    "test_nats_py_pub_sub_wildcards_and_flush",
    "test_nats_py_request_reply_and_no_responders",
    "test_nats_py_queue_groups_across_workers_exactly_once_and_fair",
    "test_nats_py_headers",
    "test_nats_py_unsubscribe_limit_and_drain",
    "test_nats_py_echo_false",
    "test_cross_protocol_delivery_both_ways",
])
def test_nats_suite_scenarios_with_a_live_leaf(nats_hub, leaf_broker, scenario):
    """tests/protocols/test_nats.py's scenarios, as they are, on a broker (3 workers, as their ``nb``) whose
    workers are leafs of a hub with no interest: they pass, and nothing reaches the hub."""
    import test_nats
    broker = leaf_broker(workers=3)
    getattr(test_nats, scenario)(broker)
    leafs = nats_hub.wait_leafs(3)
    assert all(leaf["in_msgs"] == 0 and leaf["out_msgs"] == 0 for leaf in leafs), leafs
