"""One Spark task of a load test: one asyncio loop holding the task's connections, from setup to its rows.

The four agreements of a run (see docs/loadtest.md):
  1. everyone is connected and subscribed → allGather #1 → an agreed start time on the monotonic clock;
  2. publishers send on their schedules while subscribers count, one row per interval;
  3. publishers stop → allGather #2 of final sequence numbers (and late subscriptions' confirmation times);
     with late subscribers, allGather #3 tells each where its expected messages begin;
  4. subscribers drain until complete or ``drain_timeout``, then everyone returns its rows.
``allGather`` blocks, so it runs in a thread while the loop keeps reading.

The task's roles and its interval rows are in their own modules (cli/loadtest/publisher.py,
cli/loadtest/subscriber.py, cli/loadtest/intervals.py), mixed into ``TaskRun``; this module keeps what every task
does (setup, the agreements, clock probes, the result rows) and the function Spark runs, ``run_partition``, which
Spark pickles by reference: it must stay importable here at module level.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import orjson

from shardbroker.cli.loadtest.accounting import GroupMember, OrderedTracker
from shardbroker.cli.loadtest.clock import Clock
from shardbroker.cli.loadtest.conns import Conn, Sink, open_conn
from shardbroker.cli.loadtest.intervals import Intervals
from shardbroker.cli.loadtest.plan import clock_subject, split_endpoint
from shardbroker.cli.loadtest.publisher import PubConn, Publisher
from shardbroker.cli.loadtest.recorder import Recorder
from shardbroker.cli.loadtest.subscriber import SubConn, Subscriber

_now = time.monotonic_ns
START_MARGIN_S = 1.5


def run_partition(iterator):
    """The barrier stage's function: one spec in, one result dict out."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    spec = next(iter(iterator))
    infos = ctx.getTaskInfos()
    where = infos[ctx.partitionId()].address if ctx.partitionId() < len(infos) else ""
    yield run(spec, ctx.allGather, attempt=ctx.attemptNumber(), executor=where)


def run(spec: dict, gather, attempt: int = 0, executor: str = "") -> dict:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(TaskRun(spec, gather, attempt, executor).main())
    return uvloop.run(TaskRun(spec, gather, attempt, executor).main())


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return socket.gethostname()


class TaskRun(Publisher, Subscriber, Intervals, Sink):
    def __init__(self, spec: dict, gather, attempt: int, executor: str) -> None:
        self.spec = spec
        self.gather_fn = gather
        self.attempt = attempt
        self.executor = executor
        self.w = spec["workload"]
        self.protocol = self.w["protocol"]
        self.role = spec["role"]
        self.publishing = self.role in ("publisher", "producer")
        self.grouped = self.protocol == "queue" or self.w["consumers_per_subscription"] > 1
        self.closed_model = self.w["model"] == "closed"
        self.host, self.port = split_endpoint(spec["endpoint"])
        self.password = os.environ.get(spec["password_env"]) if spec["user"] else None
        self.interval_ns = int(spec["interval"] * 1e9)
        self.rec = Recorder(spec["run_id"], self.w["name"], spec["task"], spec["interval"], spec["warmup"],
                            spec["duration"])
        self.pubs = [PubConn(c) for c in spec["conns"]] if self.publishing else []
        self.subs = [SubConn(c, i) for i, c in enumerate(spec["conns"])] if not self.publishing else []
        self.trackers: dict[tuple[int, int], OrderedTracker] = {}
        self.members: dict[tuple[int, int], GroupMember] = {}
        self.errors: dict[str, int] = {}
        self.reconnects = 0
        self.stopping = False
        self.t0 = 0
        self.offsets: dict[int, int] = {}     # task on another host -> ns from its monotonic clock to ours
        self.clock = Clock(spec["task"], lambda task: clock_subject(spec["run_id"], task))
        self.probe_targets: list[int] = []
        self.probed: dict[int, tuple[int, int, int, int]] = {}   # task -> (offset, bound, probes, when)
        self.clock_rows: list[dict] = []
        self.cpu_peak = 0.0
        self._rolling: asyncio.Future | None = None
        self.all_conns: list[Conn] = []     # every connection opened, for the byte counts
        self.bytes_counted = (0, 0)

    # ---- Sink ---------------------------------------------------------------------------------------------
    def deliver(self, conn, pub_id, seq, t_int, t_w, t_recv) -> None:
        if conn is self.clock.conn:
            self.clock.handle(pub_id, seq, t_int, t_w, t_recv)
            return
        cur = self.rec.cur
        cur.received += 1
        self._latency(cur, pub_id, t_int, t_w, t_recv)
        key = (conn.index, pub_id)
        if self.grouped:
            m = self.members.get(key)
            if m is None:
                m = self.members[key] = GroupMember()
            m.deliveries += 1
            m.seen.set(seq)
        else:
            t = self.trackers.get(key)
            if t is None:
                t = self.trackers[key] = OrderedTracker()
            t.add(seq)
        self.subs[conn.index].last_delivery = t_recv

    def _latency(self, cur, pub_id: int, t_int: int, t_w: int, t_recv: int) -> None:
        shift = self.offsets.get(pub_id >> 16) if self.offsets else None
        if shift is None:
            cur.e2e_corrected.append((t_recv - t_int) // 1000)
            cur.e2e_raw.append((t_recv - t_w) // 1000)
        else:
            cur.e2e_cross.append((t_recv - t_int - shift) // 1000)

    def acked(self, conn, entry, ok, t_recv, detail=None) -> None:
        if conn is self.clock.conn:
            return
        t_int, t_w, pub_id, seq = entry
        cur = self.rec.cur
        if ok:
            cur.acked += 1
            cur.ack_corrected.append((t_recv - t_int) // 1000)
            cur.ack_raw.append((t_recv - t_w) // 1000)
            if self.protocol == "queue":
                self.pubs[pub_id & 0xFFFF].confirmed.set(seq)
        else:
            cur.send_errors += 1
            self.error(f"publish refused: {detail}")
        if self.closed_model and not self.stopping and len(conn.pending) <= self.w["window"] // 2:
            self._refill(self.pubs[pub_id & 0xFFFF])

    def lost_connection(self, conn, why) -> None:
        if not self.stopping:
            self.error(f"connection lost: {why}")

    def error(self, text: str) -> None:
        if text in self.errors or len(self.errors) < 20:
            self.errors[text] = self.errors.get(text, 0) + 1

    # ---- setup --------------------------------------------------------------------------------------------
    async def connect(self, index: int, verbose: bool) -> Conn:
        conn = await open_conn(self.protocol, self.host, self.port, self, index, self.spec["user"], self.password,
                               self.spec["setup_timeout"], verbose)
        self.all_conns.append(conn)
        return conn

    async def setup(self) -> None:
        verbose = self.closed_model and self.protocol == "nats"
        for i, p in enumerate(self.pubs):
            p.conn = await self.connect(i, verbose)
        for s in self.subs:
            s.conn = await self.connect(s.index, False)
            if not s.spec["late"]:
                await s.conn.subscribe(s.spec["subject"], s.spec["group"], self.spec["setup_timeout"])
        if self.protocol == "queue" and self.subs:
            self.control = await self.connect(len(self.subs), False)
        if self.spec["clock_probes"] != "off":
            # Every task answers clock probes; only receivers on another host than a publisher ask (or all, with
            # clock_probes = "always").
            self.clock.conn = await open_conn("ndjson" if self.protocol == "queue" else self.protocol, self.host,
                                              self.port, self, -1, self.spec["user"], self.password,
                                              self.spec["setup_timeout"])
            await self.clock.conn.subscribe(clock_subject(self.spec["run_id"], self.spec["task"]), "",
                                            self.spec["setup_timeout"])

    async def gather(self, payload: dict) -> list[dict]:
        msg = orjson.dumps(payload).decode()
        replies = await asyncio.get_running_loop().run_in_executor(None, self.gather_fn, msg)
        return [orjson.loads(r) for r in replies]

    # ---- the run ------------------------------------------------------------------------------------------
    async def main(self) -> dict:
        import psutil

        self.proc = psutil.Process()
        cpu0 = self.proc.cpu_times()
        setup_error = ""
        try:
            await asyncio.wait_for(self.setup(), self.spec["setup_timeout"])
        except Exception as exc:  # reported to every task through the gather, so the whole run fails with it
            setup_error = f"task {self.spec['task']} ({self.role}, {self.spec['endpoint']}): " \
                          f"{type(exc).__name__}: {exc}".rstrip(": ")
        wall, mono = time.time_ns(), _now()
        infos = await self.gather({"task": self.spec["task"], "host": socket.gethostname(), "boot_id": _boot_id(),
                                   "wall_ns": wall, "mono_ns": mono, "error": setup_error,
                                   "workload": self.w["name"], "publishing": self.publishing})
        failed = [i["error"] for i in infos if i["error"]]
        if failed:
            self.close_all()
            raise RuntimeError("load test setup failed: " + "; ".join(failed))
        self.wall_minus_mono = wall - mono
        margin = START_MARGIN_S + 0.1 * (len(infos) // 100)
        t0_wall = max(i["wall_ns"] for i in infos) + int(margin * 1e9)
        self.t0 = t0_wall - self.wall_minus_mono
        # Tasks on another host stamp with their own monotonic clock: their stamps move onto ours through the
        # offset probed through the broker (or, without an answer, through wall time: as good as the hosts' clock
        # sync), and go into the e2e_cross histogram, never the exact one.
        mine = _boot_id()
        self.offsets = {i["task"]: (i["wall_ns"] - i["mono_ns"]) - self.wall_minus_mono
                        for i in infos if i["boot_id"] != mine}
        self.hosts = {i["task"]: i["host"] for i in infos}
        if not self.publishing and self.clock.conn is not None:
            self.probe_targets = [i["task"] for i in infos if i["publishing"] and i["workload"] == self.w["name"]
                                  and (i["boot_id"] != mine or self.spec["clock_probes"] == "always")]
            await self.probe_clocks(32, self.t0 - int(0.2e9), first=True)
        await asyncio.sleep(max(0.0, (self.t0 - _now()) / 1e9 - 0.002))
        while _now() < self.t0:
            pass   # the last 2 ms on the CPU: sleep granularity would otherwise be the start skew
        self.start_skew_us = (_now() - self.t0) // 1000
        self._cpu_last, self._t_last = sum(self.proc.cpu_times()[:2]), time.monotonic()
        ticker = asyncio.create_task(self.intervals())
        try:
            if self.publishing:
                await self.publish()
                finals = {str(p.pub_id): [p.spec["subject"], p.seq] for p in self.pubs}
                round2 = await self.gather({"task": self.spec["task"], "finals": finals, "late": {}})
            else:
                work = asyncio.create_task(self.receive())
                end = self.t0 + int((self.spec["warmup"] + self.spec["duration"]) * 1e9)
                await asyncio.sleep(max(0.0, (end - _now()) / 1e9))
                await self.probe_clocks(8, _now() + int(0.5e9), first=False)     # again, for the drift
                late = {f"{self.spec['task']}:{s.index}": s.t_conf for s in self.subs if s.spec["late"]}
                round2 = await self.gather({"task": self.spec["task"], "finals": {}, "late": late})
            finals = {int(k): v for r in round2 for k, v in r["finals"].items()}
            if self.spec["late_round"]:
                late = {k: v for r in round2 for k, v in r["late"].items()}
                round3 = await self.gather({"first": self.first_seqs(late)})
                for r in round3:
                    for key, firsts in r["first"].items():
                        task, _, conn = key.partition(":")
                        if int(task) == self.spec["task"]:
                            self.subs[int(conn)].first.update({int(k): v for k, v in firsts.items()})
            if self.publishing:
                await self.settle()
            else:
                await self.drain(finals)
                # Consumers finish their current receive and wait for their acks' replies, so every ack the
                # broker answered is counted; then anything left is cut.
                self.stopping = True
                done, _ = await asyncio.wait([work], timeout=self.w["queue"]["wait"] + 2)
                if not done:
                    work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        finally:
            self.stopping = True
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            if self._rolling is not None:
                await self._rolling
            self.close_all()
        self.roll()
        return self.result(finals if not self.publishing else {}, cpu0)

    async def probe_clocks(self, count: int, deadline: int, first: bool) -> None:
        """Measures each target's clock offset; the second time, also its drift since the first."""
        for target in self.probe_targets:
            got = await self.clock.probe(target, count, deadline)
            if got is None:
                if first:
                    self.error(f"clock probes to task {target} got no answer: cross-host latency uses wall clocks")
                continue
            offset, bound, probes = got
            if first:
                self.probed[target] = (offset, bound, probes, _now())
                if target in self.offsets:
                    self.offsets[target] = -offset
                continue
            first_offset, first_bound, first_probes, at = self.probed.pop(target, (offset, bound, 0, _now()))
            drift = (offset - first_offset) / max(1e-9, (_now() - at) / 1e9)
            self.clock_rows.append({"run_id": self.spec["run_id"], "pub_host": self.hosts.get(target, ""),
                                    "sub_host": socket.gethostname(), "offset_ns": first_offset,
                                    "bound_ns": max(first_bound, bound), "drift_ns_per_s": drift,
                                    "probes": first_probes + probes})
        if first:
            return
        for target, (offset, bound, probes, _) in self.probed.items():   # no second answer: no drift figure
            self.clock_rows.append({"run_id": self.spec["run_id"], "pub_host": self.hosts.get(target, ""),
                                    "sub_host": socket.gethostname(), "offset_ns": offset, "bound_ns": bound,
                                    "drift_ns_per_s": 0.0, "probes": probes})
        self.probed.clear()

    def close_all(self) -> None:
        self.stopping = True
        for c in [p.conn for p in self.pubs] + [s.conn for s in self.subs] + [getattr(self, "control", None),
                                                                                self.clock.conn]:
            if c is not None:
                c.close()

    # ---- rows ---------------------------------------------------------------------------------------------
    def result(self, finals: dict[int, list], cpu0) -> dict:
        spec, w = self.spec, self.w
        run_id, name = spec["run_id"], w["name"]
        cpu = self.proc.cpu_times()
        measured = [r for r in self.rec.rows if r["phase"] == "measure"]
        measure_s = max(1e-9, len(measured) * spec["interval"])
        lag_p99 = self.rec.measure_send_lag.get_value_at_percentile(99) if \
            self.rec.measure_send_lag.get_total_count() else 0
        busy = self.cpu_peak > 85.0
        lagging = lag_p99 > max(5 * spec["tick"] * 1e6, 2000)
        # The plan's mean rate over the measure phase (stages included), for the imbalance figures.
        warm, dur = spec["warmup"], spec["duration"]
        at, planned = 0.0, 0.0
        for length, rate in spec["stages"]:
            planned += rate * max(0.0, min(at + length, warm + dur) - max(at, warm))
            at += length
        mean_rate = planned / dur
        if self.publishing:
            achieved = sum(r["sent"] for r in measured) / measure_s
            target = 0.0 if self.closed_model else sum(p.spec["share"] for p in self.pubs) * mean_rate
        else:
            achieved = sum(r["received"] for r in measured) / measure_s
            per_conn = mean_rate / max(1, w["topics"]) / (w["consumers_per_subscription"] if self.grouped else 1)
            target = 0.0 if self.closed_model else len(self.subs) * per_conn
        task_row = {
            "run_id": run_id, "task": spec["task"], "attempt": self.attempt, "workload": name, "role": self.role,
            "model": w["model"],
            "host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(), "executor_id": self.executor,
            "conns": len(spec["conns"]), "pub_ids": [p.pub_id for p in self.pubs], "target_rate": target,
            "achieved_rate": achieved, "start_skew_us": self.start_skew_us,
            "wall_minus_mono_start_ns": self.wall_minus_mono,
            "wall_minus_mono_end_ns": time.time_ns() - _now(),
            "cpu_user_s": cpu.user - cpu0.user, "cpu_sys_s": cpu.system - cpu0.system,
            "max_rss_bytes": self.proc.memory_info().rss, "cpu_peak_pct": self.cpu_peak,
            "send_lag_p99_us": lag_p99,
            "generator_bound": bool(self.publishing and not self.closed_model and (busy or lagging)),
            "reconnects": self.reconnects,
            "errors": [f"{k} (x{n})" if n > 1 else k for k, n in self.errors.items()]}
        streams, members = [], []
        for s in self.subs:
            subj = s.spec["subject"]
            for pub_id, (psubj, final) in finals.items():
                if psubj != subj:
                    continue
                key = (s.index, pub_id)
                if self.grouped:
                    m = self.members.get(key) or GroupMember()
                    members.append(dict(m.row(), workload=name, subject=subj, group=s.spec["group"],
                                        pub_id=pub_id))
                else:
                    t = self.trackers.get(key) or OrderedTracker()
                    streams.append(dict(t.result(final, s.first.get(pub_id, 0)), run_id=run_id, workload=name,
                                        sub_task=spec["task"], sub_conn=s.index, subject=subj, group="",
                                        pub_id=pub_id, mode="ordered", redeliveries=0, unacked=0,
                                        unconfirmed=0))
        publishers = [{"workload": name, "pub_id": p.pub_id, "subject": p.spec["subject"], "final": p.seq,
                       "confirmed": p.confirmed.encode() if self.protocol == "queue" else None}
                      for p in self.pubs]
        return {"task": task_row, "intervals": self.rec.rows, "streams": streams, "members": members,
                "publishers": publishers, "clock": self.clock_rows, "t0_wall_ns": self.t0 + self.wall_minus_mono}
