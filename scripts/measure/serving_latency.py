#!/usr/bin/env python3
"""What a worker's background work on its work-queue journal does to the latency of the requests it serves
meanwhile: a client asks for a queue's ``qstat``, one request at a time, while one worker

- ``--during compaction``: compacts its journal.  The queue ``backlog`` gets ``--messages`` pushed and
  ``--acked`` of them received and acked, so that the journal is mostly what is gone and the next second's tick
  compacts it, a batch per turn while serving.  Round trips while the rewrite's file exists, and otherwise.
- ``--during fsync``: syncs its journal once a second (``queues.data_dir`` in a temporary directory, ``fsync``
  ``everysec``, or ``--fsync``), while another client pushes as fast as it can (and drains what it pushed now
  and then).  Round trips over ``--seconds``.

    .venv/bin/python scripts/measure/serving_latency.py --during compaction
    .venv/bin/python scripts/measure/serving_latency.py --during fsync
    .venv/bin/python scripts/measure/serving_latency.py --during fsync --fsync no
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.harness import Broker, Raw  # noqa: E402

PUSH = b'{"op":"qpush","queue":"%s","data":"%%0120d"}\n'


def quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    values = sorted(values)

    def at(q: float) -> float:
        return values[min(len(values) - 1, int(len(values) * q))] * 1e6

    return (f"{len(values):6,} round trips: p50 {statistics.median(values) * 1e6:5.0f} µs, p99 {at(0.99):6.0f} µs, "
            f"p99.9 {at(0.999):6.0f} µs, max {values[-1] * 1e6:6.0f} µs; over 20 ms: "
            f"{sum(1 for v in values if v > 0.02)}")


def push(c: Raw, queue: str, start: int, n: int) -> None:
    line = PUSH % queue.encode()
    c.send(b"".join(line % i for i in range(start, start + n)))
    for _ in range(n):
        c.line()


def drain(c: Raw, queue: str, most: int) -> int:
    """Receive and ack up to ``most`` messages of ``queue``, 1,000 at a time."""
    done = 0
    while done < most:
        got = c.request({"op": "qrecv", "queue": queue, "max": min(1000, most - done)})["messages"]
        if not got:
            break
        c.request({"op": "qack", "queue": queue, "receipts": [m["receipt"] for m in got]})
        done += len(got)
    return done


def ping(c: Raw, seconds: float, phase=lambda: False, pause: float = 0.0) -> tuple[list[float], list[float]]:
    """``qstat`` round trips for ``seconds``, split by what ``phase`` says (looked at every 16)."""
    yes: list[float] = []
    no: list[float] = []
    now = False
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        if n % 16 == 0:
            now = phase()
        t = time.perf_counter()
        c.send(b'{"op":"qstat","queue":"other"}\n')
        c.line()
        (yes if now else no).append(time.perf_counter() - t)
        n += 1
        if pause:
            time.sleep(pause)
    return yes, no


def during_compaction(b: Broker, args) -> None:
    c = Raw(b.port, timeout=30)
    for start in range(0, args.messages, 1000):
        push(c, "backlog", start, 1000)
    drain(c, "backlog", args.acked)
    journal = glob.glob(os.path.join(b.runtime_dir(), "**", "queues-0.journal"), recursive=True)[0]
    compacting, otherwise = ping(c, args.seconds, lambda: bool(glob.glob(journal + ".rewrite-*")))
    print(f"compacting: {quantiles(compacting)}")
    print(f"otherwise:  {quantiles(otherwise)}")
    c.close()


def during_fsync(b: Broker, args) -> None:
    stop = threading.Event()

    def produce() -> None:
        c = Raw(b.port, timeout=30)
        n = 0
        while not stop.is_set():
            push(c, "load", n, 200)
            n += 200
            if n % 20_000 == 0:   # the queue does not grow without end
                drain(c, "load", 20_000)
        c.close()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        c = Raw(b.port, timeout=30)
        _, rtts = ping(c, args.seconds, pause=0.001)
        c.close()
    finally:
        stop.set()
        producer.join()
    print(f"fsync {args.fsync}, a producer pushing: {quantiles(rtts)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--during", choices=("compaction", "fsync"), required=True)
    ap.add_argument("--messages", type=int, default=1_200_000, help="compaction: messages pushed")
    ap.add_argument("--acked", type=int, default=800_000, help="compaction: of which acked")
    ap.add_argument("--fsync", default="everysec", choices=("no", "everysec", "always"), help="fsync: the policy")
    ap.add_argument("--seconds", type=float, default=None, help="how long the client asks (4 s; fsync: 8 s)")
    args = ap.parse_args()
    args.seconds = args.seconds or (4.0 if args.during == "compaction" else 8.0)
    tmp = Path(tempfile.mkdtemp(prefix="serving-latency-", dir=None if args.during == "compaction" else "/var/tmp"))
    config = None
    if args.during == "fsync":   # on a disk, not a tmpfs: what a sync costs is the point
        config = {"queues": {"data_dir": str(tmp / "data"), "fsync": args.fsync}}
    b = Broker(tmp, workers=1, config=config).start()
    try:
        (during_compaction if args.during == "compaction" else during_fsync)(b, args)
    finally:
        b.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
