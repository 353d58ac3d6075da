#!/usr/bin/env python3
"""What one hop between two worker processes costs, ZeroMQ (the fabric's PUB/SUB over ipc://, each side an event
loop watching the socket's FD, as router/fabric.py does) against a plain Unix socket between the same two loops.

    .venv/bin/python scripts/measure/fabric_hop.py                 # 20,000 round trips a second for 5 s, each way
    .venv/bin/python scripts/measure/fabric_hop.py --rate 5000 --seconds 10

Each message goes there and back (a ping-pong at a fixed rate, like the bench's latency scenario); half the round
trip is the one-way hop.  The difference between the two lines is what ZeroMQ's I/O threads add: a ZeroMQ message
from one process to another passes the sender's I/O thread and the receiver's, besides the two event loops.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import tempfile
import time

import zmq

try:
    import uvloop
except ImportError:
    uvloop = None


def _run(coro):
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


class ZmqEnd:
    """One end: a PUB it sends on, a SUB it reads from; edge-triggered FD, drained on each wake (as the fabric)."""

    def __init__(self, ctx: zmq.Context, mine: str, theirs: str) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(mine)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(theirs)

    def watch(self, loop, on_message) -> None:
        fd = self.sub.getsockopt(zmq.FD)

        def readable() -> None:
            while True:
                try:
                    msg = self.sub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                on_message(msg)
        loop.add_reader(fd, readable)
        loop.call_soon(readable)

    def send(self, data: bytes) -> None:
        self.pub.send(data, zmq.NOBLOCK)


def echo_zmq(a: str, b: str) -> None:
    async def main():
        ctx = zmq.Context(io_threads=1)
        end = ZmqEnd(ctx, b, a)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on(msg: bytes) -> None:
            if msg == b"stop":
                done.set_result(None)
            else:
                end.send(msg)
        end.watch(loop, on)
        await done
    _run(main())


def echo_unix(path: str) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        class Echo(asyncio.Protocol):
            def connection_made(self, transport):
                self.t = transport

            def data_received(self, data):
                if data.endswith(b"stop"):
                    done.set_result(None)
                else:
                    self.t.write(data)
        server = await loop.create_unix_server(Echo, path)
        await done
        server.close()
    _run(main())


async def pinger(send, rate: float, seconds: float, got: asyncio.Queue) -> list[float]:
    """One message every 1/rate s; -> one-way times (half of each round trip), µs."""
    gap = 1.0 / rate
    out = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        due = start + i * gap
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.perf_counter()
        send(b"%.9f" % t0)
        await got.get()
        out.append((time.perf_counter() - t0) / 2 * 1e6)
    return out


def _measure(peer_target, peer_args: tuple, connect, rate: float, seconds: float) -> list[float]:
    """Start the echoing peer, ``connect()`` -> (send, queue of what comes back), ping-pong, stop the peer."""
    peer = multiprocessing.Process(target=peer_target, args=peer_args)
    peer.start()

    async def main():
        send, got = await connect()
        times = await pinger(send, rate, seconds, got)
        send(b"stop")
        await asyncio.sleep(0.1)
        return times
    try:
        return _run(main())
    finally:
        peer.join(5)


def measure_zmq(rate: float, seconds: float) -> list[float]:
    d = tempfile.mkdtemp()
    a, b = f"ipc://{d}/a", f"ipc://{d}/b"

    async def connect():
        end = ZmqEnd(zmq.Context(io_threads=1), a, b)
        got: asyncio.Queue = asyncio.Queue()
        end.watch(asyncio.get_running_loop(), got.put_nowait)
        while True:   # ZeroMQ's slow joiner: wait until a message makes it through
            end.send(b"hello")
            try:
                await asyncio.wait_for(got.get(), 0.1)
                return end.send, got
            except TimeoutError:
                pass
    try:
        return _measure(echo_zmq, (a, b), connect, rate, seconds)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def measure_unix(rate: float, seconds: float) -> list[float]:
    d = tempfile.mkdtemp()
    path = os.path.join(d, "s")

    async def connect():
        for _ in range(100):
            if os.path.exists(path):
                break
            await asyncio.sleep(0.02)
        got: asyncio.Queue = asyncio.Queue()

        class P(asyncio.Protocol):
            def data_received(self, data):
                got.put_nowait(data)
        transport, _ = await asyncio.get_running_loop().create_unix_connection(P, path)
        return transport.write, got
    try:
        return _measure(echo_unix, (path,), connect, rate, seconds)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def summary(name: str, times: list[float]) -> str:
    s = sorted(times)
    pct = lambda p: s[min(len(s) - 1, int(p / 100 * len(s)))]  # noqa: E731
    return (f"{name:28s} one way: p50 {pct(50):6.1f}  p99 {pct(99):6.1f}  p99.9 {pct(99.9):7.1f} µs  "
            f"({len(s):,} messages)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=20_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    print(summary("ZeroMQ PUB/SUB over ipc://", measure_zmq(args.rate, args.seconds)))
    print(summary("Unix socket, asyncio", measure_unix(args.rate, args.seconds)))


if __name__ == "__main__":
    main()
