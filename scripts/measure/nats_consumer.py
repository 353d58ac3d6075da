#!/usr/bin/env python3
"""What a work-queue consumer over NATS costs the broker: a queue is filled over NDJSON (batches of 100, not
measured), then one NATS connection receives it (``$Q.RECV.<queue>`` with ``{"batch": 100}``) and acks every
message it got (``$Q.ACK.<queue>.<receipt>``, no reply subject, as nats-py's ``msg.ack()``) before the next
receive.  Reported: messages a second, and the broker's CPU (all its processes) per message received and acked,
on a one-worker broker (docs/queues.md, NATS).

    .venv/bin/python scripts/measure/nats_consumer.py                   # 100,000 messages, three rounds
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.harness import Broker, NatsFrames, measured_broker, nats_ready  # noqa: E402


def _fill(port: int, queue: bytes, n: int) -> None:
    item = b'{"data":"' + b"x" * 118 + b'"}'
    line = b'{"op":"qpush","queue":"%s","messages":[%s]}\n' % (queue, b",".join([item] * 100))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(line * (n // 100))
        answered = 0
        while answered < n // 100:
            answered += s.recv(1 << 20).count(b"\n")


def run(broker: Broker, cpu: Callable[[], float], queue: bytes, n: int) -> tuple[float, float]:
    """-> (messages a second, µs of the broker's CPU a message)."""
    _fill(broker.ports["ndjson"], queue, n)
    with nats_ready(broker.ports["nats"], b"SUB _INBOX.consumer.* 1\r\n", timeout=None) as s:
        frames = NatsFrames(s)
        c0, t0 = cpu(), time.perf_counter()
        done = 0
        pull = b'{"batch":100}'
        while done < n:
            s.sendall(b"PUB $Q.RECV.%s _INBOX.consumer.%d %d\r\n%s\r\n" % (queue, done, len(pull), pull))
            got = frames.take(min(100, n - done))
            receipts = [re.search(rb"Q-Receipt: (\S+)", headers).group(1) for _, headers, _ in got]
            s.sendall(b"".join([b"PUB $Q.ACK.%s.%s 0\r\n\r\n" % (queue, r) for r in receipts]))
            done += len(got)
        s.sendall(b"PUB $Q.STAT.%s _INBOX.consumer.stat 0\r\n\r\n" % queue)   # after the acks: they are done
        stat = orjson.loads(frames.take(1)[0][2])["stat"]
        elapsed, used = time.perf_counter() - t0, cpu() - c0
    if stat["acked"] != n or stat["messages"]:
        raise RuntimeError(f"not every message was acked: {stat}")
    return n / elapsed, used / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="a multiple of 100")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    with measured_broker("nats-consumer-") as (broker, cpu):
        for rnd in range(opts.rounds):
            rate, us = run(broker, cpu, b"consumer.%d" % rnd, opts.messages)
            print(f"round {rnd}: {rate:>9,.0f} msg/s, {us:5.2f} µs of the broker's CPU a message received and acked")


if __name__ == "__main__":
    main()
