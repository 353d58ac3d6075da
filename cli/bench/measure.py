"""One bench run: a scenario on a target (pub/sub, work queue, or connection scale) with the load generators, and
what it measured: the rate, the loss and duplicates, the latency, the CPU it cost; and the generator check, the
ceiling of what a generator process can measure.

``OneRun`` is mixed into ``Bench`` (cli/bench/runner.py), which holds the options, the servers and the generator
pool these methods use; apart from it so that how one run is planned, driven and counted reads on its own, away
from the rounds and the summary.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import urllib.request

from shardbroker.cli.bench import leaf, loadgen, qload, scale, servers
from shardbroker.cli.bench.scenarios import Scenario, Target


class OneRun:
    """``Bench``'s runs of one scenario on one target.  They read the bench's state (``opts``, ``servers``,
    ``results``, ``log``, the TLS files ``_pem`` and the generators' ``_gen_pids``)."""

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

    def _run_one(self, sc: Scenario, target: Target, gens: list) -> dict:
        server = self.servers[target.server]
        port = server.ports[target.wire]
        if sc.kind == "connections":
            return self._connections(sc, target, server, port, gens)
        if sc.queue:
            return self._queue_run(sc, target, server, port, gens)
        if sc.leaf:
            return self._leaf_run(sc, target, server, gens)
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
        first = dict(zip(plan, _firsts([p + s for _, p, s in plan.values()])))
        ids = _ask(plan, lambda gid, p, s: {"op": "connect", "host": "127.0.0.1", "port": port, "wire": target.wire,
                                           "pubs": p, "subs": s, "ids": ours and sc.distinct, "tls": tls,
                                           "first": first[gid]})
        pub_subjects, sub_subjects = self._subjects(sc, server, plan, ids)
        _ask(plan, lambda gid, p, s: {"op": "subscribe", "subjects": [[x] for x in sub_subjects[gid]]})
        start = time.monotonic() + 0.3
        cpu, gen_cpu = server.cpu_seconds(), self._gen_cpu()
        replies = _ask(plan, lambda gid, p, s: {
            "op": "run", "subjects": pub_subjects[gid], "size": self.opts.payload, "start": start,
            "duration": self.opts.duration, "rate": sc.rate, "latency": sc.kind == "latency", "count": sc.count,
            "quiet": sc.quiet, "expect": sc.count * sc.pubs if sc.count and not sc.distinct else None})
        cpu, gen_cpu = server.cpu_seconds() - cpu, self._gen_cpu() - gen_cpu
        _ask(plan, lambda gid, p, s: {"op": "close"})
        res = self._measure(sc, plan, replies, pub_subjects, sub_subjects, start)
        res.update(_cpu(cpu, res["delivered"], gen_cpu))
        return res

    def _leaf_run(self, sc: Scenario, target: Target, server: servers.Server, gens: list) -> dict:
        """A leaf scenario: the same generators as the fan-outs, the publishers connected to one side (``in``: the
        hub; ``out``: the leaf, ``server``) and the subscribers to the other, on a subject of the run's own (the
        interest of an earlier run's subscribers may still be leaving the hub); publishing begins once their
        interest has reached the publisher's side (cli/bench/leaf.py).  The CPU counted is the leaf's; the hub's
        is in the run's ``hub_cpu_seconds``."""
        hub = self.servers["nats-hub"]
        ours = target.server == "shardbroker-leaf"
        pub_port, sub_port = ((hub.ports["nats"], server.ports["nats"]) if sc.leaf == "in"
                              else (server.ports["nats"], hub.ports["nats"]))
        sub_gens, pub_gens = gens[1:] or gens, gens[:1]
        plan: dict[int, list] = {}
        for g, n in zip(pub_gens, _spread(sc.pubs, len(pub_gens))):
            plan.setdefault(id(g), [g, 0, 0])[1] = n
        for g, n in zip(sub_gens, _spread(sc.subs, len(sub_gens))):
            plan.setdefault(id(g), [g, 0, 0])[2] = n
        ids = _ask(plan, lambda gid, p, s: {"op": "connect", "host": "127.0.0.1", "port": pub_port,
                                           "sub_port": sub_port, "wire": "nats", "pubs": p, "subs": s,
                                           "ids": ours and sc.leaf == "out"})
        subject = f"bench.{sc.name}.{len(self.results)}"
        pub_subjects = {gid: [subject] * p for gid, (_, p, _) in plan.items()}
        sub_subjects = {gid: [subject] * s for gid, (_, _, s) in plan.items()}
        _ask(plan, lambda gid, p, s: {"op": "subscribe", "subjects": [[x] for x in sub_subjects[gid]]})
        if sc.leaf == "in":
            waited = leaf.wait_hub_interest(hub, server, subject, ours)
        else:
            waited = leaf.probe_leaf_interest(hub.ports["nats"], server, subject, ours,
                                              [cid for reply in ids.values() for cid in reply["pubs"]])
        links, slow = leaf.link_state(hub, ours)
        start = time.monotonic() + 0.3
        cpu, hub_cpu, gen_cpu = server.cpu_seconds(), hub.cpu_seconds(), self._gen_cpu()
        replies = _ask(plan, lambda gid, p, s: {
            "op": "run", "subjects": pub_subjects[gid], "size": self.opts.payload, "start": start,
            "duration": self.opts.duration, "count": sc.count})
        cpu, hub_cpu, gen_cpu = server.cpu_seconds() - cpu, hub.cpu_seconds() - hub_cpu, self._gen_cpu() - gen_cpu
        links_after, slow_after = leaf.link_state(hub, ours)
        _ask(plan, lambda gid, p, s: {"op": "close"})
        res = self._measure(sc, plan, replies, pub_subjects, sub_subjects, start)
        res.update(_cpu(cpu, res["delivered"], gen_cpu))
        # links_cut: the leaf's connections to the hub that were gone at the end of the run (cut, or redialled);
        # hub_slow_consumers: the times the hub found a leaf connection too slow meanwhile
        res.update(hub_cpu_seconds=round(hub_cpu, 3), interest_wait_s=round(waited, 3),
                   links_cut=len(links - links_after), hub_slow_consumers=slow_after - slow)
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
        room = sc.connections + scale.FD_HEADROOM
        fresh = {"shardbroker": lambda: self._broker({}, sc.connections),
                 "nats-server": lambda: servers.start_nats(max_connections=room),
                 "redis": lambda: servers.start_redis(maxclients=room)}[target.server]()
        try:
            time.sleep(0.5)
            return self._measure_connections(sc, target, fresh, fresh.ports[target.wire], gens)
        finally:
            fresh.stop()

    def _measure_connections(self, sc: Scenario, target: Target, server: servers.Server, port: int,
                             gens: list) -> dict:
        before = server.rss()
        shares = _spread(sc.connections, len(gens))
        for g, n, first in zip(gens, shares, _firsts(shares)):
            g.send({"op": "scale", "host": "127.0.0.1", "port": port, "wire": target.wire, "n": n,
                    "prefix": f"bench.conn.{target.wire}", "first": first})
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


def _firsts(counts: list[int]) -> list[int]:
    """The run's number of each generator's first connection, given how many each opens: the source addresses
    are picked over the whole run's connections (cli/bench/scale.py)."""
    return [sum(counts[:i]) for i in range(len(counts))]


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
