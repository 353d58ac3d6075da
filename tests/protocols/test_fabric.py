"""The fabric between workers under pressure: flow control, and a worker that stops answering."""

import asyncio
import os
import signal
import time

import pytest
from test_cluster import close_spread, spread

BIG = 1 << 30  # a pending bound no reader in these tests can reach: they are about the fabric, not slow readers


def test_small_window_stalls_publishers_and_loses_nothing(start_broker):
    b = start_broker(workers=2, config={"fabric": {"window_bytes": 65536},
                                        "limits": {"max_pending_bytes": BIG}})
    n = 50_000

    async def run():
        clients = await spread(b.port, 2, 1)
        pub, sub = clients[0][0], clients[1][0]
        await sub.sub("fc.t")
        for i in range(n):
            await pub.pub("fc.t", {"i": i, "pad": "x" * 200}, wait=False)
        await pub.ping()
        got = [(await sub.next_message(timeout=30)).data["i"] for _ in range(n)]
        assert got == list(range(n))
        await pub.close()
        await sub.close()

    asyncio.run(run())
    varz = b.varz()
    assert varz["fabric_stalls"] > 0, "the window never filled: this test tested nothing"
    assert varz["fabric_lost_messages"] == 0 and varz["fabric_dropped_messages"] == 0


@pytest.mark.exclusive   # a worker stopped for less than its heartbeat timeout, which a loaded machine stretches
def test_frozen_worker_does_not_hold_up_the_others_and_its_losses_are_counted(start_broker):
    b = start_broker(workers=2, config={"fabric": {"window_bytes": 65536, "stall_timeout": 0.5},
                                        "limits": {"max_pending_bytes": BIG}})
    n = 20_000

    async def run():
        clients = await spread(b.port, 2, 2)
        pub, local_sub = clients[0]
        frozen_sub = clients[1][0]
        frozen_pid = (await frozen_sub.info())["pid"]
        for s in (local_sub, frozen_sub):
            await s.sub("frozen.t")
        os.kill(frozen_pid, signal.SIGSTOP)
        try:
            for i in range(n):
                await pub.pub("frozen.t", {"i": i, "pad": "x" * 200}, wait=False)
                if i % 1000 == 999:
                    await pub.request("ping", timeout=10)   # the publisher keeps going after at most the stall timeout
            await pub.ping()
            got = [(await local_sub.next_message(timeout=10)).data["i"] for _ in range(n)]
            assert got == list(range(n))
        finally:
            os.kill(frozen_pid, signal.SIGCONT)
        received = []
        while True:
            try:
                received.append((await frozen_sub.next_message(timeout=2)).data["i"])
            except TimeoutError:
                break
        assert received == sorted(received) and len(set(received)) == len(received)
        for c in (pub, local_sub, frozen_sub):
            await c.close()
        return received

    received = asyncio.run(run())
    varz = b.varz()
    link = varz["workers"][0]["fabric"]["links"]["1"]
    assert link["dropped_messages"] > 0, "the frozen worker was never declared lagging"
    assert len(received) + link["dropped_messages"] + varz["fabric_lost_messages"] == n


def test_frames_at_a_low_rate_get_no_ack_frame_each_but_a_ping_is_still_answered_after_delivery(start_broker):
    """At a low rate each publish that crosses workers is a frame of its own.  Its receiver acknowledges it on its
    own frames, or about once a second, not with an ack-only frame each (at a low rate that frame cost each side as
    much as the one it acknowledged: two thread wake-ups, ZeroMQ's and the event loop's).  A sender that waits on
    an ack asks for it (WANT_ACK): a PING's PONG still comes once every message published before it is delivered."""
    b = start_broker(workers=2)
    n = 100

    def link(worker: int) -> dict:
        return b.varz()["workers"][worker]["fabric"]["links"][str(1 - worker)]

    async def run():
        clients = await spread(b.port, 2, 1)
        pub, sub = clients[0][0], clients[1][0]
        await sub.sub("lazy.acks")
        await pub.ping()
        before = link(1)
        for i in range(n):
            await pub.pub("lazy.acks", i, wait=False)
            await asyncio.sleep(0.003)                  # each in a frame of its own
        assert [(await sub.next_message(timeout=10)).data for _ in range(n)] == list(range(n))
        after = link(1)
        started = time.monotonic()
        for i in range(5):                              # each ping waits for worker 1's ack of its message
            await pub.pub("lazy.acks", f"then {i}", wait=False)
            await asyncio.wait_for(pub.ping(), 10)
            assert (await sub.next_message(timeout=10)).data == f"then {i}"
        pinged = time.monotonic() - started
        await close_spread(clients)
        return before, after, pinged

    before, after, pinged = asyncio.run(run())
    # asked for, an ack comes at once; had the pings waited for the once-a-second one, five would take five seconds
    assert pinged < 2.5, f"five pings took {pinged:.1f} s"

    frames_in = after["frames_in"] - before["frames_in"]
    assert frames_in >= n // 2, f"the publishes did not go in frames of their own: {frames_in} frames"
    assert after["acks_out"] - before["acks_out"] <= frames_in // 4, (before, after)
