"""The receiving side of a load-test task: subscribers (ordered or in a queue group) and work-queue consumers.

``Subscriber`` is mixed into ``TaskRun`` (cli/loadtest/task.py), which holds the state these methods read and
counts plain deliveries as its connections' sink; it is apart from the task so that what a receiver does (late
joins, reconnects, queue receives and acks, the drain after the publishers stop) reads on its own, beside the
publisher side (cli/loadtest/publisher.py).
"""

from __future__ import annotations

import asyncio
import time

from shardbroker.cli.loadtest import frame
from shardbroker.cli.loadtest.accounting import GroupMember
from shardbroker.cli.loadtest.conns import Conn, QueueConn

_now = time.monotonic_ns
QUIET_S = 0.5               # a queue group's member is drained after this long without a delivery


class SubConn:
    __slots__ = ("spec", "conn", "index", "t_conf", "first", "last_delivery")

    def __init__(self, spec: dict, index: int) -> None:
        self.spec = spec
        self.conn: Conn | None = None
        self.index = index
        self.t_conf = 0          # when the subscription was confirmed (late subscribers)
        self.first: dict[int, int] = {}
        self.last_delivery = 0


class Subscriber:
    """A ``TaskRun``'s receiving methods.  They read the task's state (``spec``, ``w``, ``subs``, ``rec``, ``t0``,
    ``trackers``, ``members``, ``control``, ``stopping``) and call back into it (``connect``, ``error``,
    ``_latency``)."""

    async def receive(self) -> None:
        tasks = []
        if any(s.spec["late"] for s in self.subs):
            tasks.append(asyncio.create_task(self.join_late()))
        if self.protocol == "queue":
            tasks += [asyncio.create_task(self.consume(s)) for s in self.subs]
        tasks.append(asyncio.create_task(self.watch()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def join_late(self) -> None:
        at = self.t0 + int((self.spec["warmup"] + self.w["late_after"]) * 1e9)
        await asyncio.sleep(max(0.0, (at - _now()) / 1e9))
        for s in self.subs:
            if s.spec["late"]:
                await s.conn.subscribe(s.spec["subject"], s.spec["group"], self.spec["setup_timeout"])
                s.t_conf = _now()

    async def watch(self) -> None:
        """Reconnects subscribers whose connection dropped (a broker worker killed, say) and subscribes again."""
        while not self.stopping:
            await asyncio.sleep(0.05)
            for s in self.subs:
                if s.conn is not None and s.conn.closed.done() and not self.stopping:
                    self.reconnects += 1
                    try:
                        s.conn = await self.connect(s.index, False)
                        if not s.spec["late"] or s.t_conf:
                            await s.conn.subscribe(s.spec["subject"], s.spec["group"], self.spec["setup_timeout"])
                    except (TimeoutError, OSError, ConnectionError) as exc:
                        self.error(f"reconnect failed: {type(exc).__name__}: {exc}")

    async def consume(self, s: SubConn) -> None:
        q = self.w["queue"]
        recv = {"op": "qrecv", "queue": s.spec["subject"], "max": q["batch"], "wait_ms": int(q["wait"] * 1000),
                "visibility_ms": int(q["visibility"] * 1000)}
        timeout = q["wait"] + self.spec["setup_timeout"]
        abandon = int(q["abandon"] * 1_000_000)
        acks: set[asyncio.Task] = set()
        while not self.stopping:
            conn = s.conn
            if not isinstance(conn, QueueConn) or conn.closed.done():
                await asyncio.sleep(0.05)     # watch() reconnects it
                continue
            try:
                reply, t_recv = await conn.call(recv, timeout)
            except (TimeoutError, ConnectionError) as exc:
                self.error(f"qrecv: {type(exc).__name__}")
                continue
            if not reply.get("ok"):
                self.error(f"qrecv: {reply.get('error')}")
                await asyncio.sleep(0.05)
                continue
            receipts, owners = [], []
            cur = self.rec.cur
            for m in reply["messages"]:
                pub_id, seq, t_int, t_w = frame.parse_text(m["data"])
                key = (s.index, pub_id)
                member = self.members.get(key)
                if member is None:
                    member = self.members[key] = GroupMember()
                member.deliveries += 1
                member.seen.set(seq)
                cur.received += 1
                if m["deliveries"] > 1:
                    member.redelivered_reported += 1
                    cur.redelivered += 1
                else:
                    # Latency of first deliveries only: a redelivery's lateness is the lease, by design.
                    self._latency(cur, pub_id, t_int, t_w, t_recv)
                    if abandon and (pub_id * 1_000_003 + seq * 7919) % 1_000_000 < abandon:
                        continue      # let this lease expire: the broker must deliver it again
                receipts.append(m["receipt"])
                owners.append((member, seq))
            s.last_delivery = t_recv
            if receipts:
                ack = asyncio.create_task(self._ack(conn, s.spec["subject"], receipts, owners))
                acks.add(ack)
                ack.add_done_callback(acks.discard)
        if acks:
            await asyncio.gather(*acks, return_exceptions=True)

    async def _ack(self, conn: QueueConn, queue: str, receipts: list[str], owners: list) -> None:
        try:
            reply, _ = await conn.call({"op": "qack", "queue": queue, "receipts": receipts},
                                       self.spec["setup_timeout"])
        except (TimeoutError, ConnectionError):
            self.error("qack: no reply (connection lost)")
            return
        results = reply.get("results")
        if not reply.get("ok") or results is None:
            self.error(f"qack: {reply.get('error')}")
            return
        for (member, seq), r in zip(owners, results):
            if r.get("ok") and not r.get("purged"):
                # already_acked: this very ack was journaled, and its reply lost with the queue's owner (killed);
                # the consumer's worker sent it again to the replacement.  Acked, and not a second success.
                member.acked.set(seq)
                if not r.get("already_acked"):
                    member.acks_ok += 1
            elif not r.get("ok"):
                self.error(f"qack: {r.get('error')}")

    async def drain(self, finals: dict[int, list]) -> None:
        """Until every expected message arrived (ordered), the group went quiet, or the queue is empty."""
        deadline = _now() + int(self.spec["drain_timeout"] * 1e9)
        expected = {}
        for s in self.subs:
            for pub_id, (subj, final) in finals.items():
                if subj == s.spec["subject"]:
                    expected[(s.index, pub_id)] = final
        while _now() < deadline:
            if self.protocol == "queue":
                if await self.queues_empty():
                    return
                await asyncio.sleep(0.1)
                continue
            if self.grouped:
                last = max((s.last_delivery for s in self.subs), default=0)
                if _now() - max(last, self.t_end()) > QUIET_S * 1e9:
                    return
            elif all(self.trackers.get(k) is not None and self.trackers[k].complete(f) for k, f in expected.items()):
                return
            await asyncio.sleep(0.02)

    async def queues_empty(self) -> bool:
        """Every queue this task consumes holds nothing: no visible, leased or delayed message."""
        for queue in sorted({s.spec["subject"] for s in self.subs}):
            try:
                if self.control.closed.done():
                    self.control = await self.connect(len(self.subs), False)
                reply, _ = await self.control.call({"op": "qstat", "queue": queue}, 5)
            except (TimeoutError, OSError):
                return False
            if reply.get("ok") and (reply.get("stat") or {}).get("messages", 1) != 0:
                return False
        return True

    def t_end(self) -> int:
        return self.t0 + int((self.spec["warmup"] + self.spec["duration"]) * 1e9)
