"""With a live leaf connection, purely local traffic stays local: nothing reaches the hub that it has no interest
in, and the NATS suite's scenarios behave as without a leaf (the issue's regression test)."""

from __future__ import annotations

import asyncio

import pytest
from leafclients import (
    Collect,
    broker_knows,
    broker_url,
    no_strays,
    run,
    synced,
    until,
)
from nats.errors import NoRespondersError

pytestmark = pytest.mark.timeout(60)


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
