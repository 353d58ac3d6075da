#!/usr/bin/env python3
"""Per-message cost of the broker's hot path, in-process: no sockets, no other processes, nothing but the code.

    .venv/bin/python scripts/measure/hotpath.py nats 1          # a NATS publisher and one NATS subscriber on one worker
    .venv/bin/python scripts/measure/hotpath.py ndjson 10       # an NDJSON publisher and ten subscribers
    .venv/bin/python scripts/measure/hotpath.py nats 1 --profile

A profiling aid for changes to the hot path (docs/performance-notes.md), not a benchmark of the broker: throughput on
real sockets is measured by ``brokerctl bench``.  The sessions and the hub are the real ones; the transport is a
stand-in that accepts every write.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time

from shardbroker.cluster.config import load  # noqa: E402
from shardbroker.workers import speedups  # noqa: E402
from shardbroker.workers.auth import Authenticator  # noqa: E402
from shardbroker.workers.hub import Hub  # noqa: E402
from shardbroker.workers.protocols.nats.session import NatsSession  # noqa: E402
from shardbroker.workers.protocols.ndjson.session import NdjsonSession  # noqa: E402


class NullTransport:
    """Takes every write at once: what is measured is the broker's own work (scripts/measure/stages.py counts the
    writes it takes)."""

    def __init__(self) -> None:
        self.writes = self.written = 0

    def writelines(self, chunks: list) -> None:
        self.writes += 1
        self.written += sum(map(len, chunks))

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.written += len(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, key: str, default=None):
        return ("127.0.0.1", 1) if key == "peername" else default

    def set_write_buffer_limits(self, **limits) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return True


async def run(protocol: str, subscribers: int, messages: int, size: int, profile: bool) -> None:
    cfg = load(None)
    hub = Hub(0, 1, cfg, Authenticator(cfg.security, []))
    hub.server_info = {"server_id": "hotpath"}
    session = NatsSession if protocol == "nats" else NdjsonSession
    sessions = []
    for cid in range(1, subscribers + 2):
        s = session(hub, cid)
        s.connection_made(NullTransport())
        sessions.append(s)
    publisher, subs = sessions[0], sessions[1:]
    data = b"x" * size
    if protocol == "nats":
        for s in sessions:
            s.data_received(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        for sid, s in enumerate(subs, 1):
            s.data_received(b"SUB hot.path %d\r\n" % sid)
        frame = b"PUB hot.path %d\r\n%s\r\n" % (size, data)
    else:
        for s in subs:
            s.data_received(b'{"op":"sub","topic":"hot.path"}\n')
        frame = b'{"op":"pub","topic":"hot.path","data":"%s"}\n' % data
    per_read = max(1, 65536 // len(frame))
    chunk = frame * per_read
    reads = max(1, messages // per_read)
    await asyncio.sleep(0)
    hub.flush_now()
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    before = hub.msgs_in
    for _ in range(reads):
        publisher.data_received(chunk)
        while publisher._held is not None:  # a turn's budget was spent: the rest of the read comes next turn
            await asyncio.sleep(0)
        hub.flush_now()
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - started
    n = hub.msgs_in - before
    print(f"{protocol} 1→{subscribers}, {size} B, {speedups.IMPLEMENTATION} path: "
          f"{elapsed / n * 1e6:.2f} µs per published message, "
          f"{n * subscribers / elapsed:,.0f} deliveries/s")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("protocol", choices=["nats", "ndjson"])
    parser.add_argument("subscribers", type=int)
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="cProfile the run (slower; look at the ratios)")
    args = parser.parse_args()
    asyncio.run(run(args.protocol, args.subscribers, args.messages, args.size, args.profile))


if __name__ == "__main__":
    main()
