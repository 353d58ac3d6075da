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
import time
from collections import Counter

import pytest
from leafclients import (
    BridgeSub,
    Collect,
    bridge_knows,
    broker_knows,
    broker_url,
    every_worker_knows,
    hub_knows,
    leaf_config,
    no_strays,
    probe,
    run,
    synced,
    until,
)
from test_bridge import publish as bridge_publish

from support.natshub import RawLeaf

pytestmark = pytest.mark.timeout(60)


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
