#!/usr/bin/env python3
"""What a journal compaction does to the latency of requests served meanwhile: one worker's queue gets a backlog
(``--messages`` pushed, ``--acked`` of them received and acked, so that the journal is mostly what is gone and the
next second's tick compacts it, a batch per turn while serving), and a client asks for another queue's ``qstat``
one request at a time throughout.  Prints the round trips' p50/p99/max while the rewrite's file exists and while
it does not.

    .venv/bin/python scripts/compaction_latency.py
    .venv/bin/python scripts/compaction_latency.py --messages 1200000 --acked 800000
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import Broker, Raw  # noqa: E402


def quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    values = sorted(values)
    p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
    return (f"{len(values):6,} round trips: p50 {statistics.median(values) * 1e6:4.0f} µs, p99 {p99 * 1e6:5.0f} µs, "
            f"max {values[-1] * 1e6:5.0f} µs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=1_200_000)
    ap.add_argument("--acked", type=int, default=800_000)
    ap.add_argument("--seconds", type=float, default=4.0, help="how long the client asks after the acks")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="compaction-latency-"))
    b = Broker(tmp, workers=1).start()
    try:
        journals = glob.glob(os.path.join(b.runtime_dir(), "**", "queues-0.journal"), recursive=True)
        rewriting = journals[0] + ".rewrite-*" if journals else None
        c = Raw(b.port, timeout=30)
        line = b'{"op":"qpush","queue":"backlog","data":"%0120d"}\n'
        for start in range(0, args.messages, 1000):
            c.send(b"".join(line % i for i in range(start, start + 1000)))
            for _ in range(1000):
                c.line()
        acked = 0
        while acked < args.acked:
            got = c.request({"op": "qrecv", "queue": "backlog", "max": 1000})["messages"]
            c.request({"op": "qack", "queue": "backlog", "receipts": [m["receipt"] for m in got]})
            acked += len(got)
        if rewriting is None:
            journals = glob.glob(os.path.join(b.runtime_dir(), "**", "queues-0.journal"), recursive=True)
            rewriting = journals[0] + ".rewrite-*"
        ping = b'{"op":"qstat","queue":"other"}\n'
        during: list[float] = []
        outside: list[float] = []
        compacting = False
        end = time.monotonic() + args.seconds
        n = 0
        while time.monotonic() < end:
            if n % 16 == 0:
                compacting = bool(glob.glob(rewriting))
            t = time.perf_counter()
            c.send(ping)
            c.line()
            (during if compacting else outside).append(time.perf_counter() - t)
            n += 1
        print(f"compacting: {quantiles(during)}")
        print(f"otherwise:  {quantiles(outside)}")
        c.close()
    finally:
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
