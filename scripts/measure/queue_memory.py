#!/usr/bin/env python3
"""The memory a work queue keeps per message, measured: push and ack ``--messages`` messages through one queue and
sample the RSS of both workers (docs/reliability.md, Soak).

    .venv/bin/python scripts/measure/queue_memory.py --messages 300000
    .venv/bin/python scripts/measure/queue_memory.py --messages 300000 --config '{"queues": {"visibility_timeout": 1}}'

The producer and the consumer connect to the worker that does NOT own the queue, as the soak's clients mostly do,
so every push carries a token (kept in ``workers/workqueues/history.py``) and every reply crosses the fabric.  Each
round pushes 100
single messages (pipelined), receives them (``qrecv`` max 100) and acks them in one batch ``qack``.  Prints one
JSON line per sample (messages so far, RSS of the owner and of the other worker, MiB) and a summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.harness import Broker, on_worker  # noqa: E402


def rss_mib(pid: int) -> float:
    return round(psutil.Process(pid).memory_info().rss / 2**20, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--every", type=int, default=20_000, help="sample every this many messages")
    ap.add_argument("--config", default=None, help="JSON for the broker's configuration (e.g. a queues section)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="qmem-"))
    b = Broker(tmp, workers=2, config=json.loads(args.config) if args.config else None).start()
    samples = []
    try:
        queue = "memq"
        with on_worker(b.port, 0) as probe:
            owner = probe.request({"op": "qstat", "queue": queue})["stat"]["owner"]
        other = 1 - owner
        pids = b.worker_pids()
        by_index = {}
        for index in (0, 1):
            with on_worker(b.port, index) as c:
                by_index[index] = c.request({"op": "info"})["info"].get("pid")
        owner_pid = by_index.get(owner) or pids[owner]
        other_pid = by_index.get(other) or pids[other]
        c = on_worker(b.port, other)
        done = 0
        t0 = time.monotonic()
        line = b'{"op":"qpush","queue":"memq","data":{"n":%d,"pad":"0123456789012345678901234567890123456789"}}\n'

        def sample() -> None:
            s = {"messages": done, "s": round(time.monotonic() - t0, 1), "owner_mib": rss_mib(owner_pid),
                 "other_mib": rss_mib(other_pid)}
            samples.append(s)
            print(json.dumps(s), flush=True)

        sample()
        while done < args.messages:
            c.send(b"".join(line % (done + i) for i in range(100)))
            for _ in range(100):
                assert c.json(timeout=30).get("ok")
            got = c.request({"op": "qrecv", "queue": queue, "max": 100})["messages"]
            assert len(got) == 100, len(got)
            acked = c.request({"op": "qack", "queue": queue, "receipts": [m["receipt"] for m in got]})
            assert all(r.get("ok") and not r.get("already_acked") for r in acked["results"]), acked
            done += 100
            if done % args.every == 0:
                sample()
        stat = c.request({"op": "qstat", "queue": queue})["stat"]
        c.close()
    finally:
        b.close()
        shutil.rmtree(tmp, ignore_errors=True)
    first, last = samples[0], samples[-1]
    summary = {"messages": last["messages"], "seconds": last["s"], "owner_mib": [first["owner_mib"],
               last["owner_mib"]], "other_mib": [first["other_mib"], last["other_mib"]],
               "pushed": stat["pushed"], "acked": stat["acked"], "left": stat["messages"]}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
