#!/usr/bin/env python3
"""Delivery latency to connected subscribers while many clients authenticate at once.

    .venv/bin/python scripts/measure/auth_storm.py                       # 50 clients, 600,000 PBKDF2 iterations, 1
    worker
    .venv/bin/python scripts/measure/auth_storm.py --clients 200 --iterations 100000

Starts a broker with security on (one worker, so that every connection shares its event loop), keeps a publisher
sending timestamped messages at a fixed rate to an authenticated subscriber, and reports the delivery latency
before and during a storm of concurrent ``auth`` requests.  Password hashing runs on a thread pool, off the event
loop; what the storm costs deliveries is CPU contention, which this shows.  A measurement (docs/security.md), not
a test: the test suite checks that the deliveries all arrive, not how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

from shardbroker.cli.bench.measure import percentiles  # noqa: E402
from shardbroker.cli.bench.servers import start_broker  # noqa: E402
from shardbroker.cli.client import AsyncClient  # noqa: E402

USER, PASSWORD = "chatuser", "secret3"


def summary(latencies_ns: list[int]) -> str:
    p = percentiles(latencies_ns)
    return f"{p['samples']:6d} deliveries  p50 {p['p50']:7.0f} µs  p99 {p['p99']:7.0f} µs  max {p['max']:7.0f} µs"


async def measure(port: int, clients: int, rate: float, quiet: float) -> None:
    sub = await AsyncClient.connect("127.0.0.1", port, user=USER, password=PASSWORD)
    pub = await AsyncClient.connect("127.0.0.1", port, user=USER, password=PASSWORD)
    await sub.sub("chat.storm")
    phase = {"name": "quiet"}
    latencies: dict[str, list[int]] = {"quiet": [], "storm": []}
    running = True

    async def publish() -> None:
        started, sent = time.monotonic(), 0
        while running:
            due = int((time.monotonic() - started) * rate)
            for _ in range(due - sent):
                await pub.pub("chat.storm", time.monotonic_ns(), wait=False)
            sent = due
            await asyncio.sleep(0.001)

    async def receive() -> None:
        while running:
            try:
                m = await sub.next_message(timeout=0.5)
            except TimeoutError:
                continue
            latencies[phase["name"]].append(time.monotonic_ns() - m.data)

    tasks = [asyncio.ensure_future(publish()), asyncio.ensure_future(receive())]
    await asyncio.sleep(quiet)
    phase["name"] = "storm"
    storm = [await AsyncClient.connect("127.0.0.1", port) for _ in range(clients)]
    began = time.monotonic()
    await asyncio.gather(*(c.auth(USER, PASSWORD) for c in storm))
    took = time.monotonic() - began
    running = False
    await asyncio.gather(*tasks)
    print(f"before the storm:            {summary(latencies['quiet'])}")
    print(f"while {clients} clients authenticate: {summary(latencies['storm'])}")
    print(f"the {clients} authentications took {took:.2f} s in all")
    for c in [sub, pub, *storm]:
        await c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--iterations", type=int, default=600_000, help="PBKDF2 iterations (the default's)")
    ap.add_argument("--rate", type=float, default=2000, help="messages per second to the subscriber")
    ap.add_argument("--quiet", type=float, default=3.0, help="seconds measured before the storm")
    args = ap.parse_args()
    config = {"network": {"bind": "127.0.0.1", "port": 8080},
              "security": {"enabled": True, "iterations": args.iterations, "failures_per_address": 1_000_000,
                           "admin_user": {"username": "admin", "password": "admin-password",
                                          "permissions": ["admin"]},
                           "users": [{"username": USER, "password": PASSWORD,
                                      "permissions": ["publish:chat.*", "subscribe:chat.*"]}]}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            json.dump(config, f)
        broker = start_broker(1, config=path)  # one worker: every connection shares its event loop
        try:
            asyncio.run(measure(broker.ports["ndjson"], args.clients, args.rate, args.quiet))
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
