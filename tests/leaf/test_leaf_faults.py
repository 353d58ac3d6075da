"""The broker as a leaf node when things go wrong: a hub restarted, a hub frozen (SIGSTOP) under a flood, a worker
killed, a burst from the hub bigger than a turn.  Loops, hub clusters and the hub's limits: test_leaf_topology.py.

Real nats-servers (tests/support/natshub.py) and real brokers (tests/support/harness.py), nats-py on both sides;
loopback and ephemeral ports only.  What the broker did is read from its log and from the hubs' /leafz
(leafprobes.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
from leafprobes import (
    assert_no_crash,
    broker_leafz,
    connect,
    connects,
    hub_subs,
    leaf_config,
    nats_url,
    redials,
    remote,
    until_received,
    wait_hub_interest,
    worker_index,
)

from support.harness import NatsFrames, nats_on_worker

pytestmark = pytest.mark.timeout(60)


# -- 2. hub restart -------------------------------------------------------------------------------------------------

@pytest.mark.exclusive   # the reconnect has a deadline
def test_hub_restart_reconnects_with_the_same_interest(nats_hub, start_broker):
    broker = start_broker(workers=2, config=leaf_config(remote(nats_hub)))
    nats_hub.wait_leafs(2)

    async def run():
        bn = await connect(nats_url(broker))
        down = await bn.subscribe("down.>")
        work = await bn.subscribe("work", queue="wq")
        await bn.flush()
        wait_hub_interest(nats_hub, "down.>")
        wait_hub_interest(nats_hub, "work")
        before = hub_subs(nats_hub)
        assert set(before) == {"sb-w0", "sb-w1"}

        nats_hub.restart()
        ready = time.monotonic()
        leafs = nats_hub.wait_leafs(2, timeout=2.5)   # reconnect 0.2 s (+ up to 0.2 s, doubling while it fails)
        took = time.monotonic() - ready
        assert {leaf["name"] for leaf in leafs} == {"sb-w0", "sb-w1"}
        deadline = time.monotonic() + 2
        while hub_subs(nats_hub) != before and time.monotonic() < deadline:   # the interest follows the CONNECT
            await asyncio.sleep(0.05)
        assert hub_subs(nats_hub) == before, (before, hub_subs(nats_hub))

        # traffic both ways, with a new hub client (the old one went with the hub)
        hn = await connect(nats_hub.url)
        up = await hn.subscribe("up.x")
        await hn.flush()
        got = await until_received(bn, "up.x", up, b"after-restart-up")
        assert got.data == b"after-restart-up"
        await hn.publish("down.y", b"after-restart-down")
        await hn.publish("work", b"job")
        await hn.flush()
        assert (await down.next_msg(timeout=5)).data == b"after-restart-down"
        assert (await work.next_msg(timeout=5)).data == b"job"
        await hn.close()
        await bn.close()
        return took

    took = asyncio.run(run())
    assert took < 2.5
    # each link: connected, lost, (maybe refused while the hub was down), connected again, for the same names
    assert sorted(connects(broker)) == ["sb-w0", "sb-w0", "sb-w1", "sb-w1"], broker.log()
    assert_no_crash(broker)


# -- 3. hub frozen while a broker client floods it ------------------------------------------------------------------

def test_frozen_hub_bounded_memory_drops_counted_and_recovery(nats_hub, start_broker):
    broker = start_broker(workers=1, config=leaf_config(remote(nats_hub), max_pending_bytes=1 << 20,
                                                        ping_interval=1.0))
    nats_hub.wait_leafs(1)
    workers = [psutil.Process(pid) for pid in broker.worker_pids()]

    def rss() -> int:
        return sum(p.memory_info().rss for p in workers)

    async def run():
        hn = await connect(nats_hub.url, pending_size=1 << 26)
        seen = {"n": 0, "after": 0}

        async def count(msg):
            seen["n"] += 1
            seen["after"] += msg.data.startswith(b"after")

        await hn.subscribe("flood.x", cb=count, pending_msgs_limit=1 << 22, pending_bytes_limit=1 << 30)
        await hn.flush()
        bn = await connect(nats_url(broker))
        probe = await hn.subscribe("flood.probe")
        await until_received(bn, "flood.probe", probe)
        base = rss()

        stop = asyncio.Event()
        payload = b"x" * 1024

        async def flood():   # ~20k messages/s (20 MB/s): fills 1 MiB and the sockets' buffers well before it is
            # stale (3 PINGs 1 s apart), and not more than the hub's nats-py client keeps up with
            while not stop.is_set():
                for _ in range(200):
                    await bn.publish("flood.x", payload)
                await asyncio.sleep(0.01)

        task = asyncio.create_task(flood())
        await asyncio.sleep(0.5)
        nats_hub.pause()
        peak = 0
        frozen = time.monotonic()
        while time.monotonic() - frozen < 5:
            await asyncio.sleep(0.2)
            peak = max(peak, rss())
        nats_hub.resume()
        stop.set()
        await task
        # after the thaw: new messages arrive (the broker has redialled: its old link went stale)
        deadline = time.monotonic() + 10
        i = 0
        while not seen["after"] and time.monotonic() < deadline:
            await bn.publish("flood.x", b"after-%d" % i)
            await bn.flush()
            i += 1
            await asyncio.sleep(0.1)
        assert seen["after"], (seen, broker.log()[-3000:])
        await bn.close()
        await hn.close()
        return base, peak

    base, peak = asyncio.run(run())
    log = broker.log()
    assert "slow_consumer" in log, log[-3000:]
    assert "Stale Leaf Node Connection" in log, log[-3000:]   # 1 s pings, 2 unanswered
    # 1 MiB of pending messages per link: the workers' memory stays within a few MiB of where it was
    assert peak - base < 32 << 20, f"worker RSS {base >> 20} MiB before, {peak >> 20} MiB at the peak"
    leafz = broker_leafz(broker)
    if leafz is not None:
        assert sum(link.get("slow_consumers", 0) for link in leafz) > 0, leafz
    assert_no_crash(broker)


# -- 6. a worker killed ----------------------------------------------------------------------------------------------

def test_a_killed_worker_is_replaced_and_its_replacement_rejoins(nats_hub, start_broker):
    broker = start_broker(workers=2, config=leaf_config(remote(nats_hub)))
    nats_hub.wait_leafs(2)
    by_index = {worker_index(pid): pid for pid in broker.worker_pids()}
    keep = nats_on_worker(broker, 0, "keep")   # a subscription on the worker that survives (raw NATS, sid 1)
    try:
        wait_hub_interest(nats_hub, "keep.*", name="sb-w0")

        os.kill(by_index[1], signal.SIGKILL)
        broker.wait_log(r"worker 1 \(pid %d\) died .*; replacing it" % by_index[1])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pids = broker.worker_pids()
            if len(pids) == 2 and by_index[1] not in pids:
                break
            time.sleep(0.05)
        new = {worker_index(pid): pid for pid in broker.worker_pids()}
        assert new[0] == by_index[0] and new[1] != by_index[1], (by_index, new)
        leafs = nats_hub.wait_leafs(2, timeout=15)
        assert {leaf["name"] for leaf in leafs} == {"sb-w0", "sb-w1"}

        async def run():
            hn = await connect(nats_hub.url)
            # the survivor's subscription still works
            await hn.publish("keep.1", b"to-survivor")
            await hn.flush()
            keep.settimeout(5)
            assert NatsFrames(keep).take(1) == [("1", b"", b"to-survivor")]
            # a new subscription on the replacement: its interest reaches the hub, and messages come
            fresh = nats_on_worker(broker, 1, "fresh")
            try:
                wait_hub_interest(nats_hub, "fresh.*", name="sb-w1")
                await hn.publish("fresh.2", b"to-replacement")
                await hn.flush()
                fresh.settimeout(5)
                assert NatsFrames(fresh).take(1) == [("2", b"", b"to-replacement")]
            finally:
                fresh.close()
            await hn.close()

        asyncio.run(run())
    finally:
        keep.close()
    assert connects(broker).count("sb-w1") == 2 and connects(broker).count("sb-w0") == 1, broker.log()


# -- a burst from the hub -------------------------------------------------------------------------------------------

def test_a_burst_from_the_hub_bigger_than_a_turn_keeps_the_link(nats_hub, start_broker):
    """More messages from the hub than a worker's turn budget (workers/turn.py: 20,000) in one go: the link pauses
    its reading until the next turn (Leafnodes.read_done) and goes on, every message delivered."""
    broker = start_broker(workers=1, config=leaf_config(remote(nats_hub)))
    nats_hub.wait_leafs(1)
    count = 60_000

    async def run():
        bn = await connect(nats_url(broker))
        hn = await connect(nats_hub.url)
        got = 0
        done = asyncio.Event()

        async def cb(msg):
            nonlocal got
            got += 1
            if got >= count:
                done.set()

        probe = await bn.subscribe("burst.probe")
        await bn.subscribe("burst.x", cb=cb, pending_msgs_limit=1 << 22, pending_bytes_limit=1 << 30)
        await bn.flush()
        wait_hub_interest(nats_hub, "burst.x")
        await until_received(hn, "burst.probe", probe)
        for _ in range(count):
            await hn.publish("burst.x", b"m")
        await hn.flush()
        try:
            await asyncio.wait_for(done.wait(), 10)
        except TimeoutError:
            pass
        await bn.close()
        await hn.close()
        return got

    got = asyncio.run(run())
    assert_no_crash(broker)
    assert connects(broker) == ["sb-w0"] and not redials(broker), broker.log()[-3000:]
    assert got == count
