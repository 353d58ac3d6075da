"""Benchmark scenarios and the run that alternates servers through them.

Every scenario runs against every target in each round, the targets in a rotated order each round, so that drift
of the machine (thermal, other load) falls on all of them alike; the report takes the median over rounds and the
ratio to nats-server measured in the same run.  The load comes from a pool of generator processes
(``loadgen``), reused across runs.

The work-queue scenarios (``qpush``, ``qwork1``, ``qwork8``, ``qdrain1``, ``qdrain8``, ``qlatency``, and with batch
producers ``qpushb``, ``qwork1b``, ``qwork8b``; ``qload``) run on the targets that have queues: this broker over
NDJSON, the same broker with its queue journal off (a second instance, started only for them), Redis Streams
with a consumer group (with nothing on disk, and as ``redis-aof`` with its append-only file), and nats-server
JetStream (a work-queue stream in memory and a durable pull consumer, on a
server started with ``-js`` for them).  Each run uses a fresh queue, checks afterwards that every acknowledged
push was stored (``qpush``) or acked exactly once (the others), and removes the queue.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from shardbroker.cli.bench import loadgen, qload, servers


@dataclass(frozen=True)
class Target:
    label: str
    server: str     # which Server
    wire: str       # which protocol
    pubsub: bool = True     # runs the pub/sub scenarios
    queues: bool = False    # runs the work-queue scenarios
    tls: bool = False       # clients connect with TLS (--tls); not in the connection-scale scenario


ALL_TARGETS = [
    Target("shardbroker/nats", "shardbroker", "nats"),
    Target("shardbroker/ndjson", "shardbroker", "ndjson", queues=True),
    Target("shardbroker/ndjson-nojournal", "shardbroker-nojournal", "ndjson", pubsub=False, queues=True),
    Target("nats-server", "nats-server", "nats"),
    Target("redis", "redis", "redis", queues=True),
    # Redis with its append-only file (fsync every second), for the queue scenarios: durable against durable
    Target("redis-aof", "redis-aof", "redis", pubsub=False, queues=True),
    Target("nats-server/jetstream", "nats-server-jetstream", "jetstream", pubsub=False, queues=True),
    # --tls: the same broker with TLS on its NATS and NDJSON ports, and nats-server with TLS (the cost of TLS)
    Target("shardbroker/nats-tls", "shardbroker-tls", "nats", tls=True),
    Target("shardbroker/ndjson-tls", "shardbroker-tls", "ndjson", tls=True),
    Target("nats-server-tls", "nats-server-tls", "nats", tls=True),
]
OURS = ("shardbroker", "shardbroker-nojournal", "shardbroker-tls")
QUEUE_RATE = 2000.0     # pushes per second in ``qlatency`` (Options.qrate)
# The receive+ack scenarios' goal (at or above Redis Streams), like for like: the journal, written before every
# reply, against Redis with its append-only file, which Redis also writes before every reply; and the broker with
# its journal off against Redis with nothing on disk.  Every row still shows its ratio to Redis with nothing on
# disk (``vs redis``): docs/performance.md, "Which Redis is the yardstick".
QUEUE_GOALS = (("shardbroker/ndjson", "redis-aof", 1.0), ("shardbroker/ndjson-nojournal", "redis", 1.0))


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    kind: str                       # "throughput", "latency" or "connections"
    pubs: int = 1
    subs: int = 1
    distinct: bool = False          # N→N: publisher i publishes to subject i, which subscriber i alone receives
    rate: float | None = None       # messages per second per publisher (latency)
    count: int | None = None        # messages per publisher, instead of publishing for the duration
    connections: int = 0
    # (target, compared with, the ratio it must reach); for latency: at most that ratio of p99
    goals: tuple = ()
    # work queues: pubs producers and subs consumers of one queue.  On this broker with more than one worker,
    # where the producers and consumers are, relative to the queue's owner: "owner", "other" or "" (anywhere).
    queue: bool = False
    producer_at: str = ""
    consumer_at: str = ""
    window: int = 1000      # pushes a producer has unanswered at most (full speed)
    batch: int = 100        # messages per receive at most (each batch is acked with one request)
    wait_ms: int = 1000     # a receive's long poll
    drain: bool = False     # consumers start once the producer is done (count: pushes at most): receive+ack alone
    push_batch: int = 1     # messages per push request (this broker's batch qpush; Redis: that many XADDs)


def scenarios(nn: int, wide: int, rate: float, connections: int, qrate: float = QUEUE_RATE) -> dict[str, Scenario]:
    return {s.name: s for s in [
        Scenario("fanout1", "fan-out 1→1", "throughput", 1, 1,
                 goals=(("shardbroker/nats", "nats-server", 0.75), ("shardbroker/ndjson", "redis", 1.0))),
        Scenario("fanout10", "fan-out 1→10", "throughput", 1, 10,
                 goals=(("shardbroker/nats", "nats-server", 1.0), ("shardbroker/ndjson", "redis", 1.0))),
        Scenario("fanout100", "fan-out 1→100", "throughput", 1, 100,
                 goals=(("shardbroker/nats", "nats-server", 1.0),)),
        Scenario("nn", f"N→N, N={nn}, across workers", "throughput", nn, nn, distinct=True,
                 goals=(("shardbroker/nats", "nats-server", 0.75),)),
        Scenario("wide", f"fan-out to {wide:,} connections", "throughput", 1, wide, count=200),
        Scenario("latency", f"latency at {rate:,.0f} msg/s", "latency", 1, 1, rate=rate,
                 goals=(("shardbroker/nats", "nats-server", 1.5),)),
        Scenario("connections", f"{connections:,} connections", "connections", connections=connections),
        # Work queues.  The producer is on the queue's owner, the consumers on the other workers, so receives and
        # acks cross workers and pushes do not (a push from another worker costs a round trip between workers
        # per push: see docs/performance-notes.md).
        Scenario("qpush", "queue push, 1 producer", "throughput", 1, 0, queue=True, producer_at="owner"),
        Scenario("qwork1", "queue push→recv+ack 1→1", "throughput", 1, 1, queue=True, producer_at="owner",
                 consumer_at="other", goals=QUEUE_GOALS),
        Scenario("qwork8", "queue push→recv+ack 1→8", "throughput", 1, 8, queue=True, producer_at="owner",
                 consumer_at="other", goals=QUEUE_GOALS),
        Scenario("qdrain1", "queue recv+ack of a backlog, 1", "throughput", 1, 1, count=300_000, queue=True,
                 producer_at="owner", consumer_at="other", drain=True, goals=QUEUE_GOALS),
        Scenario("qdrain8", "queue recv+ack of a backlog, 8", "throughput", 1, 8, count=300_000, queue=True,
                 producer_at="owner", consumer_at="other", drain=True, goals=QUEUE_GOALS),
        Scenario("qlatency", f"queue latency at {qrate:,.0f} msg/s", "latency", 1, 1, rate=qrate, queue=True,
                 producer_at="owner", consumer_at="other"),
        # Batch producers: each push request carries 100 messages (Redis has no batch XADD: its producer
        # pipelines XADDs as in the others, which is how Redis batches).
        Scenario("qpushb", "queue push, 1 producer, batches of 100", "throughput", 1, 0, queue=True,
                 producer_at="owner", push_batch=100),
        Scenario("qwork1b", "queue batch push→recv+ack 1→1", "throughput", 1, 1, queue=True, producer_at="owner",
                 consumer_at="other", push_batch=100, goals=QUEUE_GOALS),
        Scenario("qwork8b", "queue batch push→recv+ack 1→8", "throughput", 1, 8, queue=True, producer_at="owner",
                 consumer_at="other", push_batch=100, goals=QUEUE_GOALS),
    ]}


# This broker's queues in the bench hold more than the defaults (1,000,000 messages, 256 MiB a queue), so that a
# push scenario measures pushing rather than the bound: a producer at 500k msg/s fills a default queue in 2 s, and
# its pushes are refused (queue_full) from then on.  Redis Streams and JetStream are not bounded here either.
QUEUE_BOUNDS = {"queues": {"max_messages": 200_000_000, "max_bytes": 1 << 40}}


@dataclass
class Options:
    scenarios: list[str]
    peers: list[str]
    protocols: list[str]
    payload: int = 128
    duration: float = 3.0
    rounds: int = 3
    workers: int | None = None
    procs: int = 2
    nn: int = 8
    wide: int = 5000
    rate: float = 20000.0
    connections: int = 10000
    qrate: float = QUEUE_RATE
    tls: bool = False       # also the TLS targets


@dataclass
class Bench:
    opts: Options
    results: list[dict] = field(default_factory=list)
    servers: dict[str, servers.Server] = field(default_factory=dict)
    log: callable = print

    def run(self) -> dict:
        catalog = scenarios(self.opts.nn, self.opts.wide, self.opts.rate, self.opts.connections, self.opts.qrate)
        chosen = [catalog[name] for name in self.opts.scenarios]
        self._start_servers(chosen)
        targets = [t for t in ALL_TARGETS if t.server in self.servers
                   and (t.server not in OURS or t.wire in self.opts.protocols)
                   and any(t.queues if sc.queue else t.pubsub for sc in chosen)]
        ctx = multiprocessing.get_context("spawn")
        pool = []
        for _ in range(self.opts.procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=loadgen.main, args=(child,), daemon=True)
            proc.start()
            pool.append((proc, parent))
        self._gen_pids = [proc.pid for proc, _ in pool]
        try:
            for rnd in range(self.opts.rounds):
                order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                for sc in chosen:
                    for target in order:
                        if not (target.queues if sc.queue else target.pubsub) or \
                                (target.tls and sc.kind == "connections"):
                            continue
                        self.log(f"round {rnd + 1}/{self.opts.rounds}: {sc.title} on {target.label}")
                        res = self._run_one(sc, target, [p for _, p in pool])
                        res.update(scenario=sc.name, target=target.label, round=rnd + 1)
                        self.results.append(res)
        except Exception:
            for server in self.servers.values():   # what the brokers logged may say why the run failed
                server.keep_log = True
            raise
        finally:
            for proc, pipe in pool:
                try:
                    pipe.send({"op": "exit"})
                except OSError:
                    pass
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
            for server in self.servers.values():
                server.stop()
            if self.opts.tls and hasattr(self, "_pem"):
                shutil.rmtree(os.path.dirname(self._pem["cert"]), ignore_errors=True)
        return self.report(chosen, targets)

    def generator_check(self) -> list[dict]:
        """What one generator process reaches against a server that only discards (publishing) or only streams
        (subscribing): the ceiling of what the benchmark can measure."""
        from shardbroker.cli.bench.nullserver import NullServer

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=loadgen.main, args=(child,), daemon=True)
        proc.start()
        plan = {0: [parent, 0, 0]}
        rows = []
        try:
            for wire in ("nats", "ndjson", "redis"):
                server = NullServer(wire, self.opts.payload)
                try:
                    for role, pubs, subs in (("publish", 1, 0), ("subscribe", 0, 1)):
                        plan[0][1:] = [pubs, subs]
                        _ask(plan, lambda gid, p, s: {"op": "connect", "host": "127.0.0.1", "port": server.port,
                                                      "wire": wire, "pubs": p, "subs": s, "ids": False})
                        if subs:
                            _ask(plan, lambda gid, p, s: {"op": "subscribe", "subjects": [["bench.null"]]})
                        start = time.monotonic() + 0.2
                        rep = _ask(plan, lambda gid, p, s: {
                            "op": "run", "subjects": ["bench.null"] * p, "size": self.opts.payload, "start": start,
                            "duration": self.opts.duration, "drain": False})[0]
                        _ask(plan, lambda gid, p, s: {"op": "close"})
                        n = sum(rep["sent"]) if pubs else sum(rep["received"])
                        seconds = self.opts.duration if pubs else max(1e-9, rep["last_recv"] - start)
                        rows.append({"wire": wire, "role": role, "msgs_per_sec": round(n / seconds)})
                        self.log(f"generator check: {wire} {role}: {n / seconds:,.0f} msg/s")
                finally:
                    server.stop()
        finally:
            parent.send({"op": "exit"})
            proc.join(5)
        return rows

    def _gen_cpu(self) -> float:
        """CPU time the generator processes have used so far."""
        return sum(servers.process_cpu(pid) for pid in self._gen_pids)

    def _start_servers(self, chosen: list[Scenario]) -> None:
        self.servers["shardbroker"] = self._broker(QUEUE_BOUNDS)
        if any(sc.queue for sc in chosen) and "ndjson" in self.opts.protocols:
            # The same broker with queues.journal false: what the journal costs.
            self.servers["shardbroker-nojournal"] = self._broker({"queues": dict(QUEUE_BOUNDS["queues"],
                                                                                journal=False)})
            self.servers["shardbroker-nojournal"].writes = ""
        if self.opts.tls:
            self._pem = servers.make_certificate(tempfile.mkdtemp(prefix="bench-tls-"))
            self.servers["shardbroker-tls"] = self._broker({
                "tls": {"cert": self._pem["cert"], "key": self._pem["key"]}, "network": {"tls": True},
                "nats": {"tls": True}})
            if "nats" in self.opts.peers:
                server = servers.start_nats_tls(self._pem)
                if server is not None:
                    self.servers[server.name] = server
        starters = {"nats": [servers.start_nats], "redis": [servers.start_redis]}
        if any(sc.queue for sc in chosen):
            starters["nats"].append(servers.start_nats_jetstream)   # the work queues' peer on nats-server
            starters["redis"].append(lambda: servers.start_redis(aof=True))
        for peer in self.opts.peers:
            for start in starters[peer]:
                server = start()
                if server is None:
                    package = "nats-server" if peer == "nats" else "redis-server"
                    self.log(f"{peer}: not installed, skipped (Debian package {package})")
                    break
                self.servers[server.name] = server

    def _broker(self, config: dict) -> servers.Server:
        with tempfile.NamedTemporaryFile("w", prefix="bench-broker-", suffix=".json", delete=False) as fh:
            json.dump(config, fh)
        try:
            return servers.start_broker(self.opts.workers, config=fh.name)
        finally:
            os.unlink(fh.name)

    # -- one run --------------------------------------------------------------------------------------------
    def _run_one(self, sc: Scenario, target: Target, gens: list) -> dict:
        server = self.servers[target.server]
        port = server.ports[target.wire]
        if sc.kind == "connections":
            return self._connections(sc, target, server, port, gens)
        if sc.queue:
            return self._queue_run(sc, target, server, port, gens)
        # Publishers on the first generator, subscribers spread over the others (all of them when alone);
        # N→N spreads both over every generator.
        sub_gens = gens if sc.distinct else (gens[1:] or gens)
        pub_gens = gens if sc.distinct else gens[:1]
        plan: dict[int, list] = {}
        for g, n in zip(pub_gens, _spread(sc.pubs, len(pub_gens))):
            plan.setdefault(id(g), [g, 0, 0])[1] = n
        for g, n in zip(sub_gens, _spread(sc.subs, len(sub_gens))):
            plan.setdefault(id(g), [g, 0, 0])[2] = n
        ours = target.server == "shardbroker"
        tls = {"ca": self._pem["ca"]} if target.tls else None
        ids = _ask(plan, lambda gid, p, s: {"op": "connect", "host": "127.0.0.1", "port": port, "wire": target.wire,
                                           "pubs": p, "subs": s, "ids": ours and sc.distinct, "tls": tls})
        pub_subjects, sub_subjects = self._subjects(sc, server, plan, ids)
        _ask(plan, lambda gid, p, s: {"op": "subscribe", "subjects": [[x] for x in sub_subjects[gid]]})
        start = time.monotonic() + 0.3
        cpu, gen_cpu = server.cpu_seconds(), self._gen_cpu()
        replies = _ask(plan, lambda gid, p, s: {
            "op": "run", "subjects": pub_subjects[gid], "size": self.opts.payload, "start": start,
            "duration": self.opts.duration, "rate": sc.rate, "latency": sc.kind == "latency", "count": sc.count})
        cpu, gen_cpu = server.cpu_seconds() - cpu, self._gen_cpu() - gen_cpu
        _ask(plan, lambda gid, p, s: {"op": "close"})
        res = self._measure(sc, plan, replies, pub_subjects, sub_subjects, start)
        res.update(_cpu(cpu, res["delivered"], gen_cpu))
        return res

    def _subjects(self, sc: Scenario, server: servers.Server, plan: dict, ids: dict) -> tuple[dict, dict]:
        """Which subject each publisher and subscriber uses.  N→N on this broker: pair each publisher with a
        subscriber on another worker, so that the traffic crosses workers."""
        base = f"bench.{sc.name}"
        if not sc.distinct:
            return ({gid: [base] * p for gid, (_, p, _) in plan.items()},
                    {gid: [base] * s for gid, (_, _, s) in plan.items()})
        subs = [(gid, i) for gid, (_, _, s) in plan.items() for i in range(s)]
        pubs = [(gid, i) for gid, (_, p, _) in plan.items() for i in range(p)]
        sub_subject = {key: f"{base}.{n}" for n, key in enumerate(subs)}
        pairing = {key: subs[n] for n, key in enumerate(pubs)}
        if ids and server.monitor_port:
            worker_of = _workers(server.monitor_port)
            wk = lambda kind, key: worker_of.get(ids[key[0]][kind][key[1]])  # noqa: E731
            free = list(subs)
            for key in pubs:
                pick = next((s for s in free if wk("subs", s) != wk("pubs", key)), free[0])
                free.remove(pick)
                pairing[key] = pick
        pub_subjects = {gid: [] for gid in plan}
        for key in pubs:
            pub_subjects[key[0]].append(sub_subject[pairing[key]])
        sub_subjects = {gid: [] for gid in plan}
        for key in subs:
            sub_subjects[key[0]].append(sub_subject[key])
        return pub_subjects, sub_subjects

    def _measure(self, sc, plan, replies, pub_subjects, sub_subjects, start) -> dict:
        sent_by_subject: dict[str, int] = {}
        for gid, rep in replies.items():
            for subject, n in zip(pub_subjects[gid], rep["sent"]):
                sent_by_subject[subject] = sent_by_subject.get(subject, 0) + n
        expected = sum(sent_by_subject.get(subject, 0) for gid in plan for subject in sub_subjects[gid])
        delivered = sum(sum(rep["received"]) for rep in replies.values())
        last = max((rep["last_recv"] for rep in replies.values()), default=0.0)
        seconds = max(1e-9, last - start) if last else 0.0
        res = {"sent": sum(sent_by_subject.values()), "expected": expected, "delivered": delivered,
               "loss": expected - delivered, "seconds": round(seconds, 4),
               "msgs_per_sec": round(delivered / seconds) if seconds else 0, "payload": self.opts.payload}
        if sc.kind == "latency":
            res["latency_us"] = percentiles([x for rep in replies.values() for x in rep["latencies"]])
        return res

    def _queue_run(self, sc: Scenario, target: Target, server: servers.Server, port: int, gens: list) -> dict:
        """One queue scenario: the producer on the first generator, the consumers spread over the others."""
        ctl = qload.Control("127.0.0.1", port, target.wire)
        try:
            workers = ctl.workers()
            queue = f"bench.q.{sc.name}.{os.getpid()}.{len(self.results)}"
            owner = qload.owner(queue, workers) if workers > 1 else None
            ctl.prepare(queue)
            cons_gens = gens[1:] or gens
            plan: dict[int, list] = {id(gens[0]): [gens[0], sc.pubs, 0]}
            for g, n in zip(cons_gens, _spread(sc.subs, len(cons_gens))):
                plan.setdefault(id(g), [g, 0, 0])[2] = n
            prefixes = {gid: f"c{i}." for i, gid in enumerate(plan)}
            placed = _ask(plan, lambda gid, p, s: {
                "op": "qconnect", "host": "127.0.0.1", "port": port, "wire": target.wire, "producers": p,
                "consumers": s, "owner": owner, "producer_at": sc.producer_at, "consumer_at": sc.consumer_at,
                "prefix": prefixes[gid]})
            start = time.monotonic() + 0.3
            cpu, gen_cpu = server.cpu_seconds(), self._gen_cpu()
            replies = _ask(plan, lambda gid, p, s: {
                "op": "qrun", "queue": queue, "size": self.opts.payload, "start": start,
                "duration": self.opts.duration, "rate": sc.rate, "window": sc.window, "batch": sc.batch,
                "wait_ms": sc.wait_ms, "count": sc.count, "drain": sc.drain, "push_batch": sc.push_batch})
            cpu, gen_cpu = server.cpu_seconds() - cpu, self._gen_cpu() - gen_cpu
            _ask(plan, lambda gid, p, s: {"op": "close"})
            left = ctl.remaining(queue)
            ctl.cleanup(queue)
        finally:
            ctl.close()
        res = _queue_measure(sc, replies.values(), start, self.opts.duration, left)
        res.update(_cpu(cpu, res["delivered"], gen_cpu))
        res.update(payload=self.opts.payload, owner=owner,
                   producer_workers=[w for r in placed.values() for w in r["producers"]],
                   consumer_workers=[w for r in placed.values() for w in r["consumers"]])
        return res

    def _connections(self, sc: Scenario, target: Target, server: servers.Server, port: int, gens: list) -> dict:
        # On a server started for this alone: memory left over from earlier runs (and a garbage collector
        # giving it back meanwhile) would swamp what the connections cost.
        fresh = {"shardbroker": lambda: servers.start_broker(self.opts.workers), "nats-server": servers.start_nats,
                 "redis": servers.start_redis}[target.server]()
        try:
            time.sleep(0.5)
            return self._measure_connections(sc, target, fresh, fresh.ports[target.wire], gens)
        finally:
            fresh.stop()

    def _measure_connections(self, sc: Scenario, target: Target, server: servers.Server, port: int,
                             gens: list) -> dict:
        before = server.rss()
        shares = _spread(sc.connections, len(gens))
        for g, n in zip(gens, shares):
            g.send({"op": "scale", "host": "127.0.0.1", "port": port, "wire": target.wire, "n": n,
                    "prefix": f"bench.conn.{target.wire}"})
        replies = _collect(gens)
        time.sleep(0.5)  # let the servers settle their buffers
        after = server.rss()
        for g in gens:
            g.send({"op": "close"})
        _collect(gens)
        seconds = max(r["seconds"] for r in replies)
        return {"connections": sc.connections, "seconds": round(seconds, 3),
                "rss_before": before, "rss_after": after,
                "rss_per_conn": round((after - before) / sc.connections) if sc.connections else 0}

    # -- summary --------------------------------------------------------------------------------------------
    def report(self, chosen: list[Scenario], targets: list[Target]) -> dict:
        summary = []
        ran = {r["target"] for r in self.results if r.get("scenario") in {sc.name for sc in chosen if sc.queue}}
        queue_servers = {t.server for t in targets if t.queues and t.label in ran}
        for sc in chosen:
            rows = {}
            for t in targets:
                runs = [r for r in self.results if r["scenario"] == sc.name and r["target"] == t.label]
                if not runs:
                    continue
                row = {"scenario": sc.name, "title": sc.title, "kind": sc.kind, "target": t.label,
                       "rounds": len(runs)}
                if sc.kind == "connections":
                    row["seconds"] = statistics.median(r["seconds"] for r in runs)
                    row["rss_per_conn"] = statistics.median(r["rss_per_conn"] for r in runs)
                else:
                    row["msgs_per_sec"] = statistics.median(r["msgs_per_sec"] for r in runs)
                    row["loss"] = sum(r["loss"] for r in runs)
                    row["expected"] = sum(r["expected"] for r in runs)
                    for key in ("cpu_us_per_msg", "gen_cpu_us_per_msg"):
                        cpu = [r[key] for r in runs if r.get(key) is not None]
                        row[key] = statistics.median(cpu) if cpu else None
                    if sc.queue:
                        row["queue"] = True
                        row["duplicates"] = sum(r["duplicates"] for r in runs)
                        row["refused"] = sum(r["refused"] for r in runs)
                        row["pushes_per_sec"] = statistics.median(r["pushes_per_sec"] for r in runs)
                    if sc.kind == "latency":
                        row["latency_us"] = {k: statistics.median(r["latency_us"][k] for r in runs)
                                             for k in runs[0]["latency_us"]}
                rows[t.label] = row
            base = rows.get("nats-server/jetstream" if sc.queue else "nats-server")   # queues: JetStream's
            for row in rows.values():
                if base is not None:
                    row["vs_nats"] = _ratio(sc, row, base)
                if "redis" in rows:
                    row["vs_redis"] = _ratio(sc, row, rows["redis"])
                for label, other, goal in sc.goals:
                    if row["target"] == label and other in rows:
                        ratio = _ratio(sc, row, rows[other])
                        met = ratio is not None and (ratio <= goal if sc.kind == "latency" else ratio >= goal)
                        row["goal"] = {"vs": other, "ratio": ratio, "target": goal, "met": met}
            summary.extend(rows.values())
        return {
            "machine": _machine(),
            "servers": {name: s.version for name, s in self.servers.items()},
            # where the queues' journal and Redis's append-only file went, and on what: a disk's filesystem costs
            # more a write than a tmpfs
            "writes": {name: {"dir": s.writes, "filesystem": servers.filesystem(s.writes)}
                       for name, s in self.servers.items() if s.writes and name in queue_servers},
            "options": asdict(self.opts),
            "summary": summary,
            "runs": self.results,
        }


def _queue_measure(sc: Scenario, replies, start: float, duration: float, left: dict) -> dict:
    """A queue run's rates, and its accounting: every acknowledged push stored (``qpush``), or received and acked
    exactly once (consumers).  ``expected``: pushes acknowledged; ``delivered``: pushes stored (``qpush``) or
    messages acked; ``loss``: acknowledged pushes not stored, or not acked; ``duplicates``: deliveries of a
    message after its first."""
    replies = list(replies)
    pushed = [i for r in replies for i in r["push_ids"].split(b"\n") if i]
    received = [i for r in replies for i in r["recv_ids"].split(b"\n") if i]
    failed = [i for r in replies for i in r["failed_ids"].split(b"\n") if i]
    acked = sum(r["acked"] for r in replies)
    last_push = max(r["last_push"] for r in replies)
    last_ack = max(r["last_ack"] for r in replies)
    push_seconds = max(1e-9, last_push - start) if last_push else 0.0
    res = {"sent": sum(r["sent"] for r in replies), "expected": len(pushed),
           "refused": sum(r["refused"] for r in replies),
           "pushes_per_sec": round(len(pushed) / push_seconds) if push_seconds else 0,
           "left": left}
    first_refusal = next((r["first_refusal"] for r in replies if r["first_refusal"]), "")
    if first_refusal:
        res["first_refusal"] = first_refusal
    if not sc.subs:
        res.update(delivered=left["stored"], loss=len(pushed) - left["stored"], duplicates=0,
                   seconds=round(push_seconds, 4), msgs_per_sec=res["pushes_per_sec"])
        return res
    pushed_set = set(pushed)
    received_set = set(received)
    acked_set = received_set.difference(failed) if failed else received_set
    began = start + duration if sc.drain else start
    seconds = max(1e-9, last_ack - began) if last_ack else 0.0
    res.update(received=len(received), delivered=acked, duplicates=len(received) - len(received_set),
               loss=len(pushed_set - acked_set), unexpected=len(received_set - pushed_set), ack_failed=len(failed),
               seconds=round(seconds, 4), msgs_per_sec=round(acked / seconds) if seconds else 0)
    if sc.kind == "latency":
        res["latency_us"] = percentiles([x for r in replies for x in r["latencies"]])
    return res


def _cpu(seconds: float, delivered: int, generators: float) -> dict:
    """What a run cost the server: its CPU seconds (every process and thread of it, ``Server.cpu_seconds``) from
    the run's start to its end, and those per message delivered (queues: acked; ``qpush``: stored).  Steadier
    than a rate on a machine the generators share, and comparable across servers whatever their threads.  The
    generators' CPU the same way: on a machine they share with the server, what a server's clients cost is CPU
    the server does not get (a protocol that is dear to parse slows its server down from the client's side)."""
    per = (lambda s: round(s / delivered * 1e6, 3) if delivered else None)
    return {"cpu_seconds": round(seconds, 3), "cpu_us_per_msg": per(seconds),
            "gen_cpu_seconds": round(generators, 3), "gen_cpu_us_per_msg": per(generators)}


def _ratio(sc: Scenario, row: dict, base: dict) -> float | None:
    if sc.kind == "latency":
        a, b = row["latency_us"]["p99"], base["latency_us"]["p99"]
    elif sc.kind == "connections":
        a, b = row["seconds"], base["seconds"]
    else:
        a, b = row["msgs_per_sec"], base["msgs_per_sec"]
    return round(a / b, 3) if b else None


def percentiles(latencies_ns: list[int]) -> dict:
    """p50, p99, p99.9 and max in microseconds, and the number of samples."""
    values = sorted(latencies_ns)
    if not values:
        return {"p50": 0, "p99": 0, "p99.9": 0, "max": 0, "samples": 0}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))] / 1000  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "p99.9": pick(0.999), "max": values[-1] / 1000,
            "samples": len(values)}


def _spread(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _ask(plan: dict, make) -> dict:
    """Send each generator of the plan its command, ``make(gid, pubs, subs)``; -> the answers by generator."""
    for gid, (g, p, s) in plan.items():
        g.send(make(gid, p, s))
    return dict(zip(plan, _collect([g for g, _, _ in plan.values()])))


def _collect(pipes: list) -> list[dict]:
    out = []
    for pipe in pipes:
        reply = pipe.recv()
        if isinstance(reply, dict) and reply.get("error"):
            raise RuntimeError(f"load generator: {reply['error']}")
        out.append(reply)
    return out


def _workers(monitor_port: int) -> dict[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?limit=100000", timeout=10) as resp:
        return {c["cid"]: c["worker"] for c in json.load(resp)["connections"]}


def _machine() -> dict:
    import os
    import platform

    import psutil

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "memory": psutil.virtual_memory().total}
