#!/usr/bin/env python3
"""Soak: hold 10,000 connections with steady traffic for a given time, and record whether the broker stays flat.

    .venv/bin/python scripts/stress/soak.py --duration 1200 --out docs/soak     # what docs/reliability.md records
    .venv/bin/python scripts/stress/soak.py --duration 60 --connections 2000    # a short look

Starts a broker (tests/support/harness.py: 2 workers, security on so that logins are real, cheap PBKDF2 so that they do
not dominate), then opens the connections from one asyncio process and keeps them busy:

- subscribers (all the connections not listed below), each on one of ``--subjects`` subjects;
- publishers, one per subject, each sending numbered messages at ``--rate`` per second; every subscriber checks
  that it gets every number of its subject, in order (a gap is a loss, a repeat a duplicate);
- work-queue producers pushing numbered jobs and consumers long-polling (``qrecv`` with ``wait_ms``) and acking
  them; at the end every job pushed must have been acked exactly once;
- login churn: connections that open, ``auth``, ``ping`` and close, ``--logins`` per second.

Every ``--every`` seconds it reads /varz: per process RSS and open fds, each worker's event-loop lag (the worst of
the last 10-20 s) and connection count, and its own CPU and loop lag (so a lagging generator would show, rather
than pass for a lagging broker).  It writes ``<out>.csv``, ``<out>.json`` (the summary) and ``<out>.png`` (the
curves).  Exit 1 if anything was lost, or a worker died.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import resource
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.harness import Broker  # noqa: E402

USER, PASSWORD = "soak", "soak-password"


def config(connections: int) -> dict:
    return {
        "limits": {"max_connections": connections + 1000},
        "security": {"enabled": True, "iterations": 10_000, "failures_per_address": 1_000_000,
                     "admin_user": {"username": "admin", "password": "admin-password", "permissions": ["admin"]},
                     "users": [{"username": USER, "password": PASSWORD, "permissions": ["publish:>", "subscribe:>"]}]},
        "queues": {"visibility_timeout": 120},
    }


class Stats:
    def __init__(self) -> None:
        self.sent: dict[str, int] = {}          # subject -> messages published
        self.subscribers: dict[str, int] = {}   # subject -> its subscribers (not the same for every subject)
        self.lost = 0
        self.duplicates = 0
        self.delivered = 0
        self.pushed: set[int] = set()
        self.acked: set[int] = set()
        self.double_acks = 0
        self.logins = 0
        self.login_failures = 0
        self.errors: list[str] = []
        self.running = True


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    for attempt in range(20):
        try:
            return await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        except OSError:
            await asyncio.sleep(0.05 * (attempt + 1))
    return await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)


async def request(reader, writer, obj: dict) -> dict:
    writer.write(orjson.dumps(obj) + b"\n")
    return orjson.loads(await reader.readline())


async def login(reader, writer) -> None:
    reply = await request(reader, writer, {"op": "auth", "user": USER, "pass": PASSWORD})
    if reply != {"ok": True}:
        raise RuntimeError(f"auth: {reply}")


async def subscriber(port: int, subject: str, st: Stats, ready: asyncio.Queue) -> None:
    reader, writer = await connect(port)
    await login(reader, writer)
    reply = await request(reader, writer, {"op": "sub", "topic": subject})
    if reply != {"ok": True}:
        raise RuntimeError(f"sub: {reply}")
    st.subscribers[subject] = st.subscribers.get(subject, 0) + 1
    await ready.put(1)
    expected = 0
    while True:
        line = await reader.readline()
        if not line:
            if st.running:
                st.errors.append(f"subscriber of {subject} closed by the broker")
            return
        msg = orjson.loads(line)
        n = msg.get("data")
        if type(n) is not int:
            continue
        st.delivered += 1
        if n > expected:
            st.lost += n - expected
        elif n < expected:
            st.duplicates += 1
            continue
        expected = n + 1


async def publisher(port: int, subject: str, rate: float, st: Stats) -> None:
    reader, writer = await connect(port)
    await login(reader, writer)
    st.sent[subject] = 0
    interval = 1.0 / rate
    due = time.monotonic() + random.random() * interval
    acks = asyncio.ensure_future(_drain_replies(reader, st, subject))
    while st.running:
        writer.write(b'{"op":"pub","topic":"%s","data":%d}\n' % (subject.encode(), st.sent[subject]))
        st.sent[subject] += 1
        due += interval
        await asyncio.sleep(max(0.0, due - time.monotonic()))
    writer.write(b'{"op":"ping"}\n')   # answered once all it published is delivered everywhere
    await writer.drain()
    await asyncio.sleep(0.5)
    acks.cancel()
    writer.close()


async def _drain_replies(reader, st: Stats, who: str) -> None:
    while True:
        line = await reader.readline()
        if not line:
            if st.running:
                st.errors.append(f"{who}: closed by the broker")
            return
        if b'"ok":false' in line:
            st.errors.append(f"{who}: {line.decode().strip()}")


async def producer(port: int, queue: str, rate: float, st: Stats, ids) -> None:
    reader, writer = await connect(port)
    await login(reader, writer)
    interval = 1.0 / rate
    while st.running:
        job = next(ids)
        reply = await request(reader, writer, {"op": "qpush", "queue": queue, "data": job})
        if reply.get("ok"):
            st.pushed.add(job)
        else:
            st.errors.append(f"qpush: {reply}")
        await asyncio.sleep(interval * (0.5 + random.random()))
    writer.close()


async def consumer(port: int, queue: str, st: Stats, stop_when_empty: asyncio.Event) -> None:
    reader, writer = await connect(port)
    await login(reader, writer)
    while True:
        reply = await request(reader, writer, {"op": "qrecv", "queue": queue, "wait_ms": 1000, "max": 10})
        messages = reply.get("messages") or []
        if not reply.get("ok"):
            st.errors.append(f"qrecv: {reply}")
        if not messages and stop_when_empty.is_set():
            break
        if messages:
            for m in messages:
                if m["data"] in st.acked:
                    st.double_acks += 1
                st.acked.add(m["data"])
            ack = await request(reader, writer, {"op": "qack", "queue": queue,
                                                 "receipts": [m["receipt"] for m in messages]})
            if not ack.get("ok"):
                st.errors.append(f"qack: {ack}")
    writer.close()


async def churn(port: int, per_second: float, st: Stats) -> None:
    """Connections that log in and leave: the per-connection state that must not leak."""
    interval = 1.0 / per_second
    while st.running:
        t0 = time.monotonic()
        try:
            reader, writer = await connect(port)
            await login(reader, writer)
            if await request(reader, writer, {"op": "ping"}) == {"ok": True}:
                st.logins += 1
            writer.close()
        except (OSError, RuntimeError, ValueError) as exc:
            st.login_failures += 1
            st.errors.append(f"login: {exc}")
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))


def varz(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=30) as resp:
        return json.loads(resp.read())


async def sampler(b: Broker, every: float, rows: list[dict], st: Stats, t0: float) -> None:
    me = psutil.Process()
    me.cpu_percent()
    lag_max = 0.0
    while st.running:
        asked = time.monotonic()
        await asyncio.sleep(every)
        lag_max = max(0.0, time.monotonic() - asked - every)   # our own loop's lag: is the generator the limit?
        v = await asyncio.to_thread(varz, b.ports["monitoring"])
        now = round(time.monotonic() - t0, 1)
        sup_rss = v["mem"] - sum(w.get("rss", 0) for w in v["workers"])
        rows.append({"t": now, "process": "supervisor", "rss": sup_rss, "fds": "", "lag_max_ms": "",
                     "connections": v["connections"], "in_msgs": v["in_msgs"], "out_msgs": v["out_msgs"]})
        for w in v["workers"]:
            rows.append({"t": now, "process": f"worker {w['worker']}", "rss": w.get("rss", 0), "fds": w.get("fds", 0),
                         "lag_max_ms": round(1000 * w.get("loop_lag_max_seconds", 0), 2),
                         "connections": w.get("connections", 0), "in_msgs": w.get("in_msgs", 0),
                         "out_msgs": w.get("out_msgs", 0), "restarts": w.get("restarts", 0), "pid": w.get("pid")})
        rows.append({"t": now, "process": "generator", "rss": me.memory_info().rss, "fds": me.num_fds(),
                     "lag_max_ms": round(lag_max * 1000, 2), "cpu": me.cpu_percent()})


async def run(args: argparse.Namespace, b: Broker) -> tuple[Stats, list[dict], dict]:
    st = Stats()
    port = b.port
    pubs = args.subjects
    queue_clients = args.queue_clients
    subs = args.connections - pubs - 2 * queue_clients - args.churners
    subjects = [f"soak.s.{i}" for i in range(args.subjects)]
    ready: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Future] = []
    t_open = time.monotonic()
    for i in range(subs):   # at most ~400 being set up at once
        tasks.append(asyncio.ensure_future(subscriber(port, subjects[i % len(subjects)], st, ready)))
        if i % 200 == 199:
            while ready.qsize() < i - 400:
                await asyncio.sleep(0.01)
    for _ in range(subs):
        await asyncio.wait_for(ready.get(), 120)
    opened_s = time.monotonic() - t_open
    print(f"{subs} subscribers ready in {opened_s:.1f}s", flush=True)
    rows: list[dict] = []
    t0 = time.monotonic()
    samples = asyncio.ensure_future(sampler(b, args.every, rows, st, t0))
    ids = iter(range(10 ** 12))
    stop_when_empty = asyncio.Event()
    work = [asyncio.ensure_future(publisher(port, s, args.rate, st)) for s in subjects]
    queues = [f"soak.q.{i}" for i in range(10)]
    work += [asyncio.ensure_future(producer(port, queues[i % 10], args.push_rate / queue_clients, st, ids))
             for i in range(queue_clients)]
    consumers = [asyncio.ensure_future(consumer(port, queues[i % 10], st, stop_when_empty))
                 for i in range(queue_clients)]
    work += [asyncio.ensure_future(churn(port, args.logins / args.churners, st)) for _ in range(args.churners)]
    await asyncio.sleep(args.duration)
    st.running = False
    await asyncio.gather(*work, return_exceptions=True)
    stop_when_empty.set()
    await asyncio.wait(consumers, timeout=60)
    await asyncio.sleep(2)   # the last deliveries
    samples.cancel()
    final = await asyncio.to_thread(varz, b.ports["monitoring"])
    for t in tasks:
        t.cancel()
    return st, rows, {"opened_s": round(opened_s, 1), "final_varz": final}


def chart(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = sorted({r["process"] for r in rows})
    colors = {proc: f"C{i}" for i, proc in enumerate(procs)}
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for proc in procs:
        pts = [r for r in rows if r["process"] == proc]
        ts = [r["t"] / 60 for r in pts]
        axes[0].plot(ts, [r["rss"] / 2**20 for r in pts], label=proc, color=colors[proc])
        if proc != "supervisor":
            axes[1].plot(ts, [r["fds"] for r in pts], label=proc, color=colors[proc])
            axes[2].plot(ts, [r["lag_max_ms"] for r in pts], label=proc, color=colors[proc])
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("open fds")
    axes[2].set_ylabel("loop lag, worst of 10-20 s (ms)")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(loc="upper right", fontsize=8, ncol=4)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--subjects", type=int, default=100, help="subjects, each with one publisher")
    ap.add_argument("--rate", type=float, default=2.0, help="messages/s per publisher")
    ap.add_argument("--queue-clients", type=int, default=50, help="work-queue producers (and as many consumers)")
    ap.add_argument("--push-rate", type=float, default=100.0, help="jobs pushed per second in all")
    ap.add_argument("--churners", type=int, default=10, help="connections that log in and leave, in turn")
    ap.add_argument("--logins", type=float, default=5.0, help="logins per second in all")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--out", default="soak", help="path prefix of the .csv, .json and .png written")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        b = Broker(Path(tmp), workers=args.workers, config=config(args.connections)).start()
        try:
            st, rows, extra = asyncio.run(run(args, b))
        finally:
            b.close()
    final = extra.pop("final_varz")
    restarts = sum(w.get("restarts", 0) for w in final["workers"])
    sent = sum(st.sent.values())
    # Each subject's messages times its own subscribers: the subscribers are dealt round-robin, so some subjects
    # have one more than others, and the mean times all messages published was off by a few (4 of 23,492,574).
    expected = sum(n * st.subscribers.get(subject, 0) for subject, n in st.sent.items())
    first = {r["process"]: r for r in rows if r["t"] == rows[0]["t"]} if rows else {}
    last = {r["process"]: r for r in rows if r["t"] == rows[-1]["t"]} if rows else {}
    summary = {
        "command": "python scripts/stress/soak.py " + " ".join(sys.argv[1:]),
        "duration_s": args.duration, "connections": args.connections, "workers": args.workers, **extra,
        "published": sent, "expected_deliveries": expected, "delivered": st.delivered,
        "lost": st.lost, "duplicates": st.duplicates,
        "jobs_pushed": len(st.pushed), "jobs_acked": len(st.acked & st.pushed),
        "jobs_missing": len(st.pushed - st.acked), "jobs_acked_twice": st.double_acks,
        "logins": st.logins, "login_failures": st.login_failures, "worker_restarts": restarts,
        "errors": st.errors[:20], "error_count": len(st.errors),
        "first_sample": first, "last_sample": last,
        "max_worker_lag_ms": max((r["lag_max_ms"] for r in rows if r["process"].startswith("worker")), default=0),
        "max_generator_lag_ms": max((r["lag_max_ms"] for r in rows if r["process"] == "generator"), default=0),
        "generator_cpu_percent_max": max((r.get("cpu", 0) for r in rows if r["process"] == "generator"), default=0),
    }
    keys = ["t", "process", "rss", "fds", "lag_max_ms", "connections", "in_msgs", "out_msgs", "restarts", "pid", "cpu"]
    with open(args.out + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".json", "w") as fh:
        json.dump(summary, fh, indent=1)
    if rows:
        chart(rows, args.out + ".png", f"soak: {args.connections:,} connections, {args.workers} workers, "
                                       f"{args.duration / 60:.0f} min\n{summary['command']}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("first_sample", "last_sample")}, indent=1))
    ok = (not st.lost and not st.duplicates and not (st.pushed - st.acked) and not restarts and not st.errors)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
