#!/usr/bin/env python3
"""Delivery latency to connected subscribers while many clients authenticate at once.

    .venv/bin/python scripts/auth_storm.py                       # 50 clients, 600,000 PBKDF2 iterations, 1 worker
    .venv/bin/python scripts/auth_storm.py --clients 200 --iterations 100000

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
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli.client import AsyncClient  # noqa: E402

USER, PASSWORD = "chatuser", "secret3"


def start_broker(config_path: str) -> tuple[subprocess.Popen, int]:
    brokerctl = os.path.join(os.path.dirname(sys.executable), "brokerctl")
    proc = subprocess.Popen([brokerctl, "start", "--config", config_path, "--workers", "1", "--port", "0",
                             "--nats-port", "0", "--monitor-port", "0"], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"ready: ndjson=[^ ]*:(\d+)", line)
        if m:
            # Keep reading the log, or the broker would block once the pipe is full.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    raise RuntimeError("the broker did not start")


def summary(samples: list[float]) -> str:
    s = sorted(samples)
    if not s:
        return "no samples"
    p99 = s[min(len(s) - 1, int(len(s) * 0.99))]
    return (f"{len(s):6d} deliveries  p50 {statistics.median(s) * 1e6:7.0f} µs  p99 {p99 * 1e6:7.0f} µs  "
            f"max {s[-1] * 1e6:7.0f} µs")


async def measure(port: int, clients: int, rate: float, quiet: float) -> None:
    sub = await AsyncClient.connect("127.0.0.1", port, user=USER, password=PASSWORD)
    pub = await AsyncClient.connect("127.0.0.1", port, user=USER, password=PASSWORD)
    await sub.sub("chat.storm")
    phase = {"name": "quiet"}
    latencies: dict[str, list[float]] = {"quiet": [], "storm": []}
    running = True

    async def publish() -> None:
        started, sent = time.monotonic(), 0
        while running:
            due = int((time.monotonic() - started) * rate)
            for _ in range(due - sent):
                await pub.pub("chat.storm", time.monotonic(), wait=False)
            sent = due
            await asyncio.sleep(0.001)

    async def receive() -> None:
        while running:
            try:
                m = await sub.next_message(timeout=0.5)
            except TimeoutError:
                continue
            latencies[phase["name"]].append(time.monotonic() - m.data)

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
        proc, port = start_broker(path)
        try:
            asyncio.run(measure(port, args.clients, args.rate, args.quiet))
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
