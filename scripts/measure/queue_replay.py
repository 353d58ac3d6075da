#!/usr/bin/env python3
"""How long a worker takes to rebuild its work queues from the journal: replay time per million messages.

    .venv/bin/python scripts/measure/queue_replay.py                   # 1,000,000 pushes of 128-byte data, 3 replays
    .venv/bin/python scripts/measure/queue_replay.py -n 200000 --consumed 0.5 --runs 1
    .venv/bin/python scripts/measure/queue_replay.py --together 50     # pipelined pushes: 50 arrive in each turn

Builds a journal the way a worker does (``workers.workqueues``: a ``Shard`` with a ``Journal`` on a temporary file,
inside an asyncio loop): ``-n`` pushes to one queue (``--data`` bytes of JSON data each, the default 128),
one by one or ``--together`` at a time (a client's pipelined pushes, as they come in one read), committed every
``--batch`` pushes as the shard commits once per event-loop turn; with ``--consumed F``, that
fraction of them is then leased and acked (100 a request), so the journal also holds lease and ack records.  Then,
``--runs`` times, a fresh ``Shard`` on a copy of that file runs ``Shard.replay()``, as a replacement worker does at
start-up, and is timed:

- ``read``: ``Journal.replay()`` alone (read, check each record's CRC, unmarshal), the file's records counted;
- ``replay``: all of ``Shard.replay()``: the records read and applied to the queues, due leases expired, and the
  journal's rewrite as the live state started (it does one after any replay, a batch per event-loop turn while
  the worker serves: ``Journal.start_rewrite``);
- ``compaction``: those batches' writing, here all at once, until the rewritten journal is in place (the worker
  spreads it over its turns: not part of the time a replacement worker keeps requests waiting);
- ``replaying what it wrote``: ``Shard.replay()`` of the compacted journal, what a worker that dies after that
  compaction leaves its replacement.

Reports records/s and seconds per million messages pushed (median of the runs).  In-process, no broker, no
sockets: what a worker's start-up after a crash adds per message it held.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time

from shardbroker.workers.message import KIND_JSON  # noqa: E402
from shardbroker.workers.workqueues.journal import Journal  # noqa: E402
from shardbroker.workers.workqueues.messages import D_RECEIPT  # noqa: E402
from shardbroker.workers.workqueues.rules import Settings  # noqa: E402
from shardbroker.workers.workqueues.shard import Shard  # noqa: E402

QUEUE = "jobs"
HOLDER = (0, 1)


def _shard(path: str, n: int) -> Shard:
    settings = Settings(max_messages=max(n, 1_000_000), max_bytes=1 << 40, visibility_ms=600_000)
    return Shard(0, settings, Journal(path, "no"), lambda: None, 256)


async def build(path: str, n: int, size: int, batch: int, consumed: float, together: int = 1) -> dict:
    """The journal: ``n`` pushes (``together`` at a time), then ``consumed`` of them leased and acked.  -> timings
    and counts."""
    shard = _shard(path, n)
    # a JSON string of ``size`` bytes, as NDJSON stores it; each message its own (as real ones are: the journal's
    # encoding would write one shared bytes object only once per turn)
    digits = max(1, size - 2)
    replies: list = []
    reply = replies.append
    handle = shard.handle
    t0 = time.perf_counter()
    run: list[bytes] = []
    for i in range(1, n + 1):
        # a run of pipelined pushes, as NDJSON hands it over (protocols.ndjson.queue_verbs.push_run): one clock
        if together > 1:
            run.append(b'"%0*d"' % (digits, i))
            if len(run) == together or i == n:
                handle("pushes", {"queue": QUEUE, "pushes": run}, HOLDER, reply)
                run = []
        else:
            handle("push", {"queue": QUEUE, "data": b'"%0*d"' % (digits, i), "kind": KIND_JSON}, HOLDER, reply)
        if i % batch == 0:
            shard.commit()
            replies.clear()
    shard.commit()
    t1 = time.perf_counter()
    acked = 0
    todo = int(n * consumed)
    while acked < todo:
        handle("recv", {"queue": QUEUE, "max": min(100, todo - acked)}, HOLDER, reply)
        shard.commit()
        got = replies.pop()["messages"]
        handle("ack", {"queue": QUEUE, "receipts": [m[D_RECEIPT] for m in got]}, HOLDER, reply)
        shard.commit()
        replies.clear()
        acked += len(got)
    t2 = time.perf_counter()
    shard.journal.close()
    return {"push_s": t1 - t0, "consume_s": t2 - t1, "acked": acked, "size": os.path.getsize(path)}


async def replay(path: str, no_gc: bool = False) -> dict:
    journal = Journal(path, "no")
    t0 = time.perf_counter()
    records = sum(1 for _ in journal.replay())
    read_s = time.perf_counter() - t0
    journal.close()

    shard = _shard(path, 0)
    if no_gc:
        gc.disable()
    try:
        t0 = time.perf_counter()
        applied = shard.replay()
        replay_s = time.perf_counter() - t0
    finally:
        gc.enable()
    # the compaction that follows a replay, a batch a turn while the worker serves (Shard._rewrite_step): here
    # every step at once
    t0 = time.perf_counter()
    shard.journal.complete_rewrite()
    compaction_s = time.perf_counter() - t0
    messages = sum(len(q.messages) for q in shard.queues.values())
    shard.journal.close()
    size_after = os.path.getsize(path)
    # a worker that dies after that compaction: its replacement replays the live state as the rewrite wrote it
    shard = _shard(path, 0)
    t0 = time.perf_counter()
    shard.replay()
    compacted_s = time.perf_counter() - t0
    shard.journal.close()     # (its own compaction, started by the replay, is not wanted here)
    return {"records": records, "applied": applied, "messages": messages, "read_s": read_s, "replay_s": replay_s,
            "compaction_s": compaction_s, "size_after": size_after, "compacted_s": compacted_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1_000_000, help="messages pushed (default 1,000,000)")
    ap.add_argument("--data", type=int, default=128, help="bytes of data per message (default 128)")
    ap.add_argument("--batch", type=int, default=100, help="pushes per commit (default 100)")
    ap.add_argument("--together", type=int, default=1,
                    help="pushes arriving together, as a client's pipelined pushes do (default 1: one by one)")
    ap.add_argument("--consumed", type=float, default=0.0, help="fraction of the messages then leased and acked")
    ap.add_argument("--runs", type=int, default=3, help="replays, each of a fresh copy of the journal")
    ap.add_argument("--no-gc", action="store_true",
                    help="replay with the garbage collector off (what the collector's passes over the growing "
                         "heap cost; the broker does not do this)")
    ap.add_argument("--dir", default=None, help="where to put the journal (default: a temporary directory)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        built = os.path.join(tmp, "built.journal")
        b = asyncio.run(build(built, args.n, args.data, args.batch, args.consumed, args.together))
        gc.collect()
        runs = []
        for _ in range(args.runs):
            path = os.path.join(tmp, "queues-0.journal")
            shutil.copyfile(built, path)
            runs.append(asyncio.run(replay(path, args.no_gc)))
            gc.collect()
    r = runs[-1]
    med = {k: statistics.median(x[k] for x in runs) for k in ("read_s", "replay_s", "compaction_s", "compacted_s")}
    per_million = 1e6 / max(1, args.n)
    print(f"journal            {b['size']:,} bytes, {r['records']:,} records: {args.n:,} pushes of {args.data}-byte "
          f"data (a commit every {args.batch})" + (f", {b['acked']:,} leased and acked" if b["acked"] else ""))
    print(f"building it        {args.n / b['push_s']:,.0f} pushes/s in-process ({b['push_s'] / args.n * 1e6:.2f} µs "
          f"a push, journal included)" + (f"; {b['acked'] / b['consume_s']:,.0f} recv+ack/s" if b["acked"] else ""))
    print(f"read               {r['records'] / med['read_s']:,.0f} records/s ({med['read_s']:.2f} s)")
    label = "replay (no gc)" if args.no_gc else "replay"
    print(f"{label:19}{r['records'] / med['replay_s']:,.0f} records/s ({med['replay_s']:.2f} s; then compaction "
          f"while serving {med['compaction_s']:.2f} s; {r['messages']:,} messages live, journal "
          f"{r['size_after']:,} bytes after)")
    print(f"per million pushed {med['replay_s'] * per_million:.2f} s (reading alone "
          f"{med['read_s'] * per_million:.2f} s; the compaction while serving after it "
          f"{med['compaction_s'] * per_million:.2f} s; replaying what it wrote "
          f"{med['compacted_s'] * per_million:.2f} s)")
    times = ", ".join(f"{x['replay_s']:.2f}" for x in runs)
    print(f"runs               replay {times} s")


if __name__ == "__main__":
    main()
