#!/usr/bin/env python3
"""Cost of the work-queue journal (``workers/workqueues/journal.py``), in-process, on a temporary file:

    .venv/bin/python scripts/measure/journal_bench.py                      # 1,000,000 push records, a commit every 64
    .venv/bin/python scripts/measure/journal_bench.py --fsync everysec --batch 16 --data 1024

Appends push-like records (``('push', seq, id, data, 4, time_ns, 0, 0, '', '', 0)``, the data ``--data`` random
bytes), committing every ``--batch`` records as the shard does once per event-loop turn, then replays the file.
Reports records/s for append+commit, the file's size, and records/s for replay.  A profiling aid, not a benchmark
of the broker.
"""

from __future__ import annotations

import argparse
import base64
import os
import tempfile
import time

from shardbroker.workers.workqueues.journal import FSYNC_MODES, Journal  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1_000_000, help="records (default 1,000,000)")
    ap.add_argument("--batch", type=int, default=64, help="records per commit (default 64)")
    ap.add_argument("--data", type=int, default=128, help="bytes of message data per record (default 128)")
    ap.add_argument("--fsync", choices=FSYNC_MODES, default="no")
    ap.add_argument("--dir", default=None, help="where to put the journal (default: a temporary directory)")
    args = ap.parse_args()

    n, batch = args.n, args.batch
    data = os.urandom(args.data)
    ids = [base64.urlsafe_b64encode(os.urandom(12)).decode() for _ in range(1024)]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "shard-0.journal")
        journal = Journal(path, fsync=args.fsync)
        append, commit = journal.append, journal.commit
        wall = time.time_ns()
        t0 = time.perf_counter()
        for seq in range(1, n + 1):
            append("jobs", ("push", seq, ids[seq & 1023], data, 4, wall + seq, 0, 0, "", "", 0))
            if seq % batch == 0:
                commit()
        commit()
        t1 = time.perf_counter()
        journal.close()
        size = os.path.getsize(path)

        journal = Journal(path, fsync=args.fsync)
        t2 = time.perf_counter()
        count = 0
        for _ in journal.replay():
            count += 1
        t3 = time.perf_counter()
        journal.close()
    assert count == n, (count, n)

    print(f"records            {n:,} ({args.data}-byte data, a commit every {batch}, fsync={args.fsync})")
    print(f"append+commit      {n / (t1 - t0):,.0f} records/s  ({(t1 - t0) / n * 1e9:,.0f} ns/record, "
          f"{t1 - t0:.2f} s)")
    print(f"file size          {size:,} bytes ({size / n:.1f} bytes/record)")
    print(f"replay             {count / (t3 - t2):,.0f} records/s  ({(t3 - t2) / count * 1e9:,.0f} ns/record, "
          f"{t3 - t2:.2f} s)")


if __name__ == "__main__":
    main()
