"""The broker as a leaf node of a real nats-server hub: queue groups across the leaf connections (local members
first on both sides, the hub's weights split across workers and within a worker, the hub's members only when
the broker has none, one delivery per group and message) and request/reply with no-responders both ways
(../shared/reference/leafnodes.md §3, §9).  The barrier before counting: test_leaf_traffic.py's docstring."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from leafclients import (
    Collect,
    broker_knows,
    broker_url,
    hub_knows,
    no_strays,
    probe,
    run,
    synced,
    until,
)
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

pytestmark = pytest.mark.timeout(60)


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
