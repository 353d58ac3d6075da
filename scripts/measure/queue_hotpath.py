#!/usr/bin/env python3
"""Per-message cost of the work queues' hot path, in-process: the real NDJSON sessions, hubs, queue service, shard
and journal of two workers, with the fabric between them replaced by a stand-in that marshals each turn's control
items as the real one does (``router.frames``), and transports that accept every write.

    .venv/bin/python scripts/measure/queue_hotpath.py                 # push, then receive+ack across workers
    .venv/bin/python scripts/measure/queue_hotpath.py --batch 100     # pushes as batch requests of 100 messages
    .venv/bin/python scripts/measure/queue_hotpath.py --extra ',"priority":4'   # single pushes not in canonical form
    .venv/bin/python scripts/measure/queue_hotpath.py --profile       # cProfile of each phase (slower; look at ratios)
    .venv/bin/python scripts/measure/queue_hotpath.py --no-journal    # queues.journal false
    .venv/bin/python scripts/measure/queue_hotpath.py --local         # the consumer on the owner, as the bench has it
    .venv/bin/python scripts/measure/queue_hotpath.py --gc off        # the collector off (or: freeze)
    .venv/bin/python scripts/measure/queue_hotpath.py --gc-threshold 700   # the collector's first threshold

Phases, as in ``brokerctl bench``: the producer's connection is on the queue's owner (worker 0), the consumer's on
the other worker (1).  ``push``: pipelined pushes, a read of 64 KiB at a time, then the end of the turn (journal
commit, replies); µs per push on the owner.  ``recv+ack``: the consumer receives up to ``--max`` and acks each
batch with one request sent together with the next receive; µs per message on the owner and on the consumer's
worker separately (``--local``: both are the owner, and the split is the requests' handling, from parsing to
rendering, against the end of the turn: the journal's write and the replies).  A profiling aid (what a change
to the queues' hot path should move), not a benchmark of the broker: throughput on real sockets is ``brokerctl
bench -s qpush,qwork1,qdrain1``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import marshal
import os
import pstats
import shutil
import tempfile
import time
import zlib

import orjson  # noqa: E402
from hotpath import NullTransport  # noqa: E402  (scripts/measure/hotpath.py, beside this file)

from shardbroker.cluster.config import load  # noqa: E402
from shardbroker.workers import workqueues  # noqa: E402
from shardbroker.workers.auth import Authenticator  # noqa: E402
from shardbroker.workers.hub import Hub  # noqa: E402
from shardbroker.workers.protocols.ndjson.session import NdjsonSession  # noqa: E402


class Transport(NullTransport):
    """Takes every write at once, and keeps it for the harness to read."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def writelines(self, chunks: list) -> None:
        self.chunks.extend(chunks)

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


class Fabric:
    """The link between the two hubs: each turn's control items leave as one marshalled frame (what
    ``router.frames`` costs), and are handed to the other hub when the harness pumps them."""

    def __init__(self, hub: Hub, peer: int) -> None:
        self.hub = hub
        self.peer = peer
        self.epoch = 1
        self.links = {peer: None}
        self.out: list = []
        self.frames: list[bytes] = []

    def up_peers(self):
        return (self.peer,)

    def control(self, dst: int, item: tuple) -> None:
        self.out.append(item)

    def flush(self) -> None:
        if self.out:
            self.frames.append(marshal.dumps(([], self.out)))
            self.out = []

    def deliver_to(self, other: Hub) -> bool:
        frames, self.frames = self.frames, []
        for frame in frames:
            _, control = marshal.loads(frame)
            for item in control:
                other.on_control(self.hub.index, item)
        return bool(frames)


def queue_owned_by(index: int, workers: int) -> str:
    n = 0
    while True:
        name = f"hot.q{n}"
        if zlib.crc32(name.encode()) % workers == index:
            return name
        n += 1


class Clock:
    def __init__(self) -> None:
        self.total = 0.0
        self.profiler = None

    def __enter__(self):
        if self.profiler:
            self.profiler.enable()
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.total += time.perf_counter() - self.t
        if self.profiler:
            self.profiler.disable()


async def run(opts, tmp: str) -> None:
    # the consumer stays a worker away, not moved to the owner (workers/protocols/ndjson/moves.py), unless --local puts
    # it there
    raw = {"queues": {"journal": not opts.no_journal, "move_connections": False}}
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as fh:
        fh.write(orjson.dumps(raw).decode())
    cfg = load(cfg_path)
    auth = Authenticator(cfg.security, [])
    hubs = [Hub(i, 2, cfg, auth) for i in range(2)]
    for hub in hubs:
        hub.server_info = {"server_id": "queue-hotpath"}
        hub.fabric = Fabric(hub, 1 - hub.index)
        hub.queue_service = workqueues.start(hub.index, cfg, tmp, hub)
    owner, other = hubs
    queue = queue_owned_by(0, 2)
    producer = NdjsonSession(owner, 1)
    producer.connection_made(Transport())
    consumer = NdjsonSession(owner if opts.local else other, 2)
    consumer.connection_made(Transport())

    def pump() -> None:
        """Run both hubs' end of turn and carry the frames until nothing moves."""
        moved = True
        while moved:
            owner.flush_now()
            other.flush_now()
            moved = owner.fabric.deliver_to(other) | other.fabric.deliver_to(owner)

    if opts.gc_threshold:
        gc.set_threshold(opts.gc_threshold, *gc.get_threshold()[1:])
    if opts.gc == "off":
        gc.disable()
    elif opts.gc == "freeze":
        gc.collect()
        gc.freeze()
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    gc.callbacks.append(timed)

    data = b'"' + b"x" * (opts.size - 2) + b'"'
    if opts.batch > 1:
        items = b",".join([b'{"data":%s}' % data] * opts.batch)
        frame = b'{"op":"qpush","queue":"%s","messages":[%s]}\n' % (queue.encode(), items)
        per_frame = opts.batch
    else:
        frame = b'{"op":"qpush","queue":"%s","data":%s%s}\n' % (queue.encode(), data, opts.extra.encode())
        per_frame = 1
    per_read = max(1, 65536 // len(frame))
    chunk = frame * per_read
    reads = max(1, opts.messages // (per_read * per_frame))
    push_clock = Clock()
    prof = cProfile.Profile() if opts.profile else None
    push_clock.profiler = prof
    for _ in range(reads):
        with push_clock:
            producer.data_received(chunk)
            while producer._held is not None:
                await asyncio.sleep(0)
            owner.flush_now()
        producer.transport.take()
    pushed = reads * per_read * per_frame
    print(f"push ({'batches of %d' % opts.batch if opts.batch > 1 else 'one per request'}): "
          f"{push_clock.total / pushed * 1e6:.2f} µs per message on the owner, "
          f"{pushed / push_clock.total:,.0f}/s")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)

    # receive+ack across workers: the consumer's worker parses, forwards and renders; the owner leases and acks
    recv = b'{"op":"qrecv","queue":"%s","max":%d}\n' % (queue.encode(), opts.max)
    own_clock, cons_clock = Clock(), Clock()
    prof = cProfile.Profile() if opts.profile else None
    own_clock.profiler = cons_clock.profiler = prof
    done = 0
    ack = b""
    while True:
        with cons_clock:
            consumer.data_received(ack + recv)
            other.flush_now()
        with own_clock:
            other.fabric.deliver_to(owner)
            owner.flush_now()
        with cons_clock:
            owner.fabric.deliver_to(other)
            other.flush_now()
        out = consumer.transport.take()
        lines = out.splitlines()
        reply = orjson.loads(lines[-1])
        if not reply.get("ok"):
            raise SystemExit(f"recv failed: {reply}")
        for line in lines[:-1]:
            if not orjson.loads(line).get("ok"):
                raise SystemExit(f"ack failed: {line!r}")
        msgs = reply["messages"]
        if not msgs:
            break
        done += len(msgs)
        ack = orjson.dumps({"op": "qack", "queue": queue, "receipts": [m["receipt"] for m in msgs]}) + b"\n"
    pump()
    if done != pushed:
        raise SystemExit(f"received {done} of {pushed}")
    total = own_clock.total + cons_clock.total
    print(f"recv+ack (max {opts.max}): {own_clock.total / done * 1e6:.2f} µs per message on the owner, "
          f"{cons_clock.total / done * 1e6:.2f} µs on the consumer's worker ({done / total:,.0f}/s both together)")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    gc.callbacks.remove(timed)
    print(f"garbage collections (threshold {gc.get_threshold()[0]}): "
          f"{sum(map(sum, pauses.values())) * 1e3:.0f} ms in all;", ", ".join(
              f"gen{g} {len(p)} (median {sorted(p)[len(p) // 2] * 1e3:.2f} ms, max {max(p) * 1e3:.2f} ms)"
              for g, p in pauses.items() if p))
    for hub in hubs:
        hub.queue_service.close(graceful=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=128, help="bytes of each message's data (a JSON string)")
    parser.add_argument("--batch", type=int, default=1, help="messages per push request (1: single pushes)")
    parser.add_argument("--max", type=int, default=100, help="messages per receive")
    parser.add_argument("--extra", default="", help='fields after a single push\'s data, e.g. \',"priority":4\' '
                        "(no longer the canonical form: each line on its own)")
    parser.add_argument("--no-journal", action="store_true")
    parser.add_argument("--local", action="store_true", help="the consumer's connection on the owner, as the bench "
                        "has it once the connection has moved there (workers/protocols/ndjson/moves.py)")
    parser.add_argument("--gc", choices=["on", "off", "freeze"], default="on")
    parser.add_argument("--gc-threshold", type=int, default=0, help="the collector's first threshold (default: "
                        "what the broker's workers set)")
    parser.add_argument("--profile", action="store_true", help="cProfile the phases (slower; look at the ratios)")
    opts = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="queue-hotpath-")   # its journals: hundreds of MB a run
    try:
        asyncio.run(run(opts, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
