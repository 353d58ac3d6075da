#!/usr/bin/env python3
"""One consumer draining a backlog, as ``brokerctl bench -s qdrain1`` does, but long enough to look at, with the
scheduler's own account of who ran: a fresh broker (2 workers, the bench's queue bounds), N messages pushed in
batches of 1000, then one consumer (receives of 100, each batch acked with the next receive) empties the queue.

    .venv/bin/python scripts/measure/queue_drain.py                      # 1,000,000 messages, the journal on
    .venv/bin/python scripts/measure/queue_drain.py --no-journal --runs 3

For each run: the drain's rate, and for the owner's threads and this process (the consumer) how much of the drain
they ran and waited for a CPU (``/proc/<pid>/task/<tid>/schedstat``), their context switches, and the CPU each
spent a message.  A round trip of one consumer is the owner and the consumer in turn: what either spends a message
is what the rate pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import psutil  # noqa: E402

from shardbroker.cli.bench import servers  # noqa: E402
from shardbroker.cli.bench.qload import QueueLoad, owner  # noqa: E402
from shardbroker.cli.bench.scenarios import QUEUE_BOUNDS  # noqa: E402
from shardbroker.cli.client import AsyncClient  # noqa: E402
from shardbroker.cluster.supervisor.launch import MARKER  # noqa: E402

QUEUE = "drain.q"


def schedstat(pid: int) -> dict[int, list[int]]:
    """Thread id -> [ns on a CPU, ns waiting for one, timeslices]."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                out[int(tid)] = [int(x) for x in fh.read().split()]
        except OSError:   # a thread that ended meanwhile
            pass
    return out


async def fill(port: int, messages: int) -> int:
    """Push ``messages`` in batches of 1000, eight requests at a time; -> how many were stored."""
    client = await AsyncClient.connect("127.0.0.1", port)
    data = "x" * 128   # the bench's payload (``wire.payload``), a string of 128 characters
    stored = 0
    try:
        while stored < messages:
            sizes = [min(1000, messages - stored - 1000 * i) for i in range(8)]
            done = await asyncio.gather(*(client.qpush_many(QUEUE, [data] * n) for n in sizes if n > 0))
            stored += sum(map(len, done))
    finally:
        await client.close()
    return stored


def one_run(messages: int, journal: bool) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"queues": dict(QUEUE_BOUNDS["queues"], journal=journal)}, fh)
    server = servers.start_broker(2, config=fh.name)
    os.unlink(fh.name)
    try:
        port = server.ports["ndjson"]
        own = owner(QUEUE, 2)
        pushed = asyncio.run(fill(port, messages))
        workers = {}   # pid -> its name, by the index its command line carries (``broker-worker <index> ...``)
        for proc in psutil.Process(server.proc.pid).children():
            args = proc.cmdline()
            if MARKER in args:
                index = int(args[args.index(MARKER) + 1])
                workers[proc.pid] = f"worker {index}" + (" (owner)" if index == own else "")
        drain = QueueLoad()   # the consumer lands off the owner, and moves there at its first receive
        drain.connect("127.0.0.1", port, "ndjson", 0, 1, owner=own, consumer_at="other")
        pids = workers | {os.getpid(): "consumer"}
        before = {pid: schedstat(pid) for pid in pids}
        start = time.monotonic()
        res = drain.run(QUEUE, 128, start, 0.0, drain=True)
        after = {pid: schedstat(pid) for pid in pids}
        drain.close()
        took = res["last_ack"] - start
        acked = res["acked"]
        print(f"journal {'on' if journal else 'off'}: {acked:,} of {pushed:,} acked in {took:.2f} s, "
              f"{acked / took:,.0f} msg/s")
        for pid, name in pids.items():
            for tid, (run0, wait0, n0) in before[pid].items():
                run1, wait1, n1 = after[pid].get(tid, (run0, wait0, n0))
                ran = (run1 - run0) / 1e9
                if ran / took < 0.02:   # idle threads (ZeroMQ's, the journal's syncer, the other worker)
                    continue
                print(f"  {name:17} thread {tid}: ran {ran / took:6.1%}, waited for a CPU "
                      f"{(wait1 - wait0) / 1e9 / took:5.1%}, {(n1 - n0) / took:,.0f} switches/s, "
                      f"{ran / acked * 1e6:.2f} µs a message")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--no-journal", action="store_true", help="queues.journal false")
    parser.add_argument("--runs", type=int, default=1)
    opts = parser.parse_args()
    for _ in range(opts.runs):
        one_run(opts.messages, not opts.no_journal)


if __name__ == "__main__":
    main()
