"""The fabric between workers under pressure: flow control, and a worker that stops answering."""

import asyncio
import os
import signal

from test_cluster import spread

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
