"""The publishing side of a load-test task: publishers and queue producers, on their schedules.

``Publisher`` is mixed into ``TaskRun`` (cli/loadtest/task.py), which holds the state these methods read (the
spec, the connections, the recorder, the agreed start); it is apart from the task so that what a publisher does
(open loop on a schedule, closed loop on a window, reconnects, the late subscribers' first sequence numbers) reads
on its own, beside the subscriber side (cli/loadtest/subscriber.py).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from array import array

from shardbroker.cli.loadtest.accounting import Bitmap
from shardbroker.cli.loadtest.conns import Conn
from shardbroker.cli.loadtest.schedule import Schedule

_now = time.monotonic_ns
MAX_BATCH = 2000            # messages per connection per write; more stay due (late, so they show as lag)


class PubConn:
    __slots__ = ("spec", "conn", "pub_id", "subject", "seq", "schedule", "batch_t", "batch_seq", "confirmed")

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.conn: Conn | None = None
        self.pub_id = spec["pub_id"]
        self.subject = spec["subject"].encode()
        self.seq = 0
        self.schedule: Schedule | None = None
        self.batch_t = array("q")        # write time and first sequence number of every batch: where a late
        self.batch_seq = array("q")      # subscriber's expected messages begin is found by bisection
        self.confirmed = Bitmap()


class Publisher:
    """A ``TaskRun``'s publishing methods.  They read the task's state (``spec``, ``w``, ``pubs``, ``rec``, ``t0``,
    ``offsets``, ``stopping``) and call back into it (``connect``, ``error``)."""

    async def publish(self) -> None:
        stages = [tuple(s) for s in self.spec["stages"]]
        poisson = self.w["arrival"] == "poisson"
        for p in self.pubs:
            p.schedule = Schedule(self.t0, stages, p.spec["share"], poisson, self.spec["seed"] * 1_000_003 + p.pub_id)
        tick = self.spec["tick"]
        if self.closed_model:
            end = self.t0 + int((self.spec["warmup"] + self.spec["duration"]) * 1e9)
            for p in self.pubs:
                self._refill(p)
            while _now() < end:
                await asyncio.sleep(min(0.05, (end - _now()) / 1e9))
                for p in self.pubs:
                    if p.conn is None or p.conn.closed.done():
                        await self.reconnect_pub(p)
            self.stopping = True
            return
        size = self.w["size"]
        while True:
            now = _now()
            left = False
            for p in self.pubs:
                if p.schedule.next is None:
                    continue
                left = True
                conn = p.conn
                if conn is None or conn.closed.done():
                    await self.reconnect_pub(p)
                    continue
                if conn.paused:
                    continue      # the socket is full: the schedule runs on, and the lag will show
                due = p.schedule.due(now, MAX_BATCH)
                if due:
                    self._send(p, due, size)
            if not left:
                return
            await asyncio.sleep(tick)     # >= 1 ms (scenario.py): uvloop rounds a shorter sleep to 0, a spin

    def _send(self, p: PubConn, due: list[int], size: int) -> None:
        first = p.seq
        items = [(p.pub_id, first + i, t) for i, t in enumerate(due)]
        p.seq += len(due)
        t_w = _now()
        p.conn.publish(p.subject, items, size)
        p.batch_t.append(t_w)
        p.batch_seq.append(first)
        cur = self.rec.cur
        cur.sent += len(due)
        lag = cur.send_lag
        for t in due:
            lag.append((t_w - t) // 1000)

    def _refill(self, p: PubConn) -> None:
        """Closed model: top the connection up to its window; intended time = now (not coordinated-omission safe)."""
        if p.conn is None or p.conn.closed.done():
            return
        want = self.w["window"] - len(p.conn.pending)
        if want > 0:
            now = _now()
            self._send(p, [now] * want, self.w["size"])

    async def reconnect_pub(self, p: PubConn) -> None:
        if p.conn is not None:
            p.conn = None
            self.reconnects += 1
        try:
            p.conn = await self.connect(self.pubs.index(p), self.closed_model and self.protocol == "nats")
        except (TimeoutError, OSError, ConnectionError) as exc:
            self.error(f"reconnect failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.2)
            return
        if self.closed_model:
            self._refill(p)

    async def settle(self) -> None:
        """After the last send: wait (up to drain_timeout) for the replies still due, so acks are complete."""
        deadline = time.monotonic() + self.spec["drain_timeout"]
        while time.monotonic() < deadline:
            if all(p.conn is None or p.conn.closed.done() or not p.conn.pending for p in self.pubs):
                return
            await asyncio.sleep(0.01)

    def first_seqs(self, late: dict[str, int]) -> dict:
        """For each late subscription: the first sequence number of each of our publishers that it must get."""
        out = {}
        for key, t_conf in late.items():
            task = int(key.partition(":")[0])
            t_local = t_conf + self.offsets.get(task, 0)
            firsts = {}
            for p in self.pubs:
                i = bisect.bisect_left(p.batch_t, t_local)
                firsts[str(p.pub_id)] = p.batch_seq[i] if i < len(p.batch_seq) else p.seq
            out[key] = firsts
        return out
