"""Two fabric ends in one event loop, with handlers of the test's own: what a failing callback does to the reader,
and how a peer that stops reading shows in the other's stats (what /healthz reads)."""

import asyncio

from shardbroker.router import guard
from shardbroker.router.fabric import Fabric


class Handler:
    """Records what arrives; ``fail`` makes the next deliveries raise, as a reply that cannot be rendered did."""

    def __init__(self) -> None:
        self.fabric: Fabric | None = None
        self.got: list = []
        self.fail = 0
        self._scheduled = False

    def on_messages(self, src, messages, token):
        if self.fail:
            self.fail -= 1
            raise TypeError("Recursion limit reached")
        self.got.extend(m[2] for m in messages)
        if token is not None:
            self.fabric.finish(src, token)

    def on_control(self, src, item):
        if item[0] == "boom":
            raise TypeError("a control item's handler failed")

    def on_peer_hello(self, src):
        pass

    def on_peer_reset(self, src):
        pass

    def on_congestion(self, congested):
        pass

    def schedule_flush(self):
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self):
        self._scheduled = False
        self.fabric.flush()


async def _pair(tmp_path):
    handlers = [Handler(), Handler()]
    fabrics = []
    for i, h in enumerate(handlers):
        h.fabric = Fabric(i, 2, 1, str(tmp_path), h, hwm=1000, window_bytes=1 << 20, stall_timeout=0.5)
        fabrics.append(h.fabric)
    await asyncio.gather(*(f.join(5) for f in fabrics))
    return fabrics, handlers


async def _until(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_delivery_or_control_item_that_raises_does_not_stop_the_reader(tmp_path):
    async def run():
        (a, b), (ha, hb) = await _pair(tmp_path)
        before = guard.errors
        hb.fail = 1
        a.send(1, ("s", 0, b"lost", None, None, None), 4)
        a.control(1, ("boom",))
        ha.schedule_flush()
        await asyncio.sleep(0.1)
        synced = asyncio.get_running_loop().create_future()
        for i in range(3):
            a.send(1, ("s", 0, b"m%d" % i, None, None, None), 2)
        a.when_processed(lambda: synced.set_result(True))
        ha.schedule_flush()
        await asyncio.wait_for(synced, 5)   # acknowledged: the failed frame did not hold the window either
        assert hb.got == [b"m0", b"m1", b"m2"]
        assert guard.errors == before + 2
        for f in (a, b):
            f.close()

    asyncio.run(run())


def test_a_sync_point_callback_that_raises_does_not_stop_the_others(tmp_path):
    async def run():
        (a, b), (ha, hb) = await _pair(tmp_path)
        called = []

        def bad():
            raise TypeError("a reply that cannot be rendered")

        a.send(1, ("s", 0, b"x", None, None, None), 1)
        a.when_processed(bad)
        a.when_processed(lambda: called.append(1))
        ha.schedule_flush()
        await _until(lambda: called)
        for f in (a, b):
            f.close()

    asyncio.run(run())


def test_a_peer_that_stops_reading_shows_as_unacknowledged_time(tmp_path):
    async def run():
        (a, b), (ha, hb) = await _pair(tmp_path)
        b.pause_input("test", True)   # reads nothing more, and so acknowledges nothing
        a.send(1, ("s", 0, b"x", None, None, None), 1)
        ha.schedule_flush()
        await asyncio.sleep(1.2)
        a.tick()
        assert a.stats()["links"]["1"]["unacked_seconds"] >= 1.0
        b.pause_input("test", False)
        await _until(lambda: hb.got == [b"x"])
        b.tick()   # its acknowledgement, as once a second
        await _until(lambda: a.stats()["links"]["1"]["unacked_seconds"] == 0.0)
        for f in (a, b):
            f.close()

    asyncio.run(run())


def test_a_turns_batch_leaves_in_frames_of_about_64_kib_in_order(tmp_path):
    """What one turn queued for a worker is cut into frames of about 64 KiB of payloads (a frame of megabytes cost
    page faults at every copy), shared out evenly, and arrives whole and in order; sync points added in one flush
    are released together by the acks."""
    async def run():
        (a, b), (ha, hb) = await _pair(tmp_path)
        payloads = [b"%06d" % i + b"x" * 994 for i in range(1000)]   # 1 MB in all
        for p in payloads:
            a.send(1, ("s", 0, p, None, None, None), len(p))
        released = []
        for i in range(3):
            a.when_processed(lambda i=i: released.append(i))
        frames_before = a.stats()["links"]["1"]["frames_out"]
        ha.schedule_flush()
        await _until(lambda: len(released) == 3)
        frames = a.stats()["links"]["1"]["frames_out"] - frames_before
        assert hb.got == payloads and released == [0, 1, 2]
        assert 1000 * 1000 // (64 * 1024) <= frames <= 1000 * 1000 // (64 * 1024) + 1
        for f in (a, b):
            f.close()

    asyncio.run(run())
