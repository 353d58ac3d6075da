"""What a monitoring request costs with many connections: /metrics, /varz and /connz (sorted, one page, as nats-top
and brokerctl top ask, and the whole list).  docs/operations.md quotes its output.

    python scripts/measure/scrape_cost.py --workers 2 --connections 10000

Starts a broker (tests/support/harness.py), opens the connections (a tenth of them subscribed), then times each request
from the client's side; the broker is otherwise idle.
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.harness import Broker  # noqa: E402


def timed(url: str, n: int) -> tuple[float, float, int]:
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as resp:
            size = len(resp.read())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times), size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as tmp:
        limits = {"max_connections": args.connections + 100, "handshake_timeout": 3600}   # most send nothing
        b = Broker(Path(tmp), workers=args.workers, config={"limits": limits})
        b.start()
        socks = []
        try:
            for i in range(args.connections):
                s = socket.create_connection(("127.0.0.1", b.port))
                if i % 10 == 0:
                    s.sendall(b'{"op":"sub","topic":"cost.%d"}\n' % i)
                socks.append(s)
            deadline = time.monotonic() + 120
            while b.varz()["connections"] < args.connections and time.monotonic() < deadline:
                time.sleep(0.2)
            base = f"http://127.0.0.1:{b.ports['monitoring']}"
            print(f"{args.connections} connections, {args.workers} workers, {args.repeat} requests each "
                  f"(median / max ms, bytes)")
            for path in ("/metrics", "/varz", "/healthz", "/connz?sort=msgs_to&limit=50", "/connz?limit=100000"):
                median, worst, size = timed(base + path, args.repeat)
                print(f"  {path:32s} {median * 1000:8.1f} {worst * 1000:8.1f} {size:10d}")
        finally:
            for s in socks:
                s.close()
            b.close()


if __name__ == "__main__":
    main()
