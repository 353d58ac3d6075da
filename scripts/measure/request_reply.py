#!/usr/bin/env python3
"""What a NATS request/reply costs the server: a requester publishes requests to ``svc``, each with a reply
subject of its own (``_INBOX.<run>.<n>``, as nats-py's requests have, under one wildcard subscription), and a
responder subscribed to ``svc`` answers each on its reply subject.  Both are raw sockets in this process, at most
``--window`` requests unanswered.  Reported: requests a second, and the server's CPU (all its processes) per
request, for this broker and, where installed, nats-server, alternately.

    .venv/bin/python scripts/measure/request_reply.py                   # 200,000 requests, three rounds, one worker
    .venv/bin/python scripts/measure/request_reply.py --workers 2 --requests 100000
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from shardbroker.cli.bench import servers  # noqa: E402

from support.harness import nats_ready  # noqa: E402


def _respond(sock: socket.socket) -> None:
    """Answer every ``MSG svc <sid> <reply> <size>`` with ``ok`` on its reply subject, until the socket closes."""
    buf = b""
    while True:
        try:
            data = sock.recv(1 << 20)
        except OSError:
            return
        if not data:
            return
        buf += data
        out = []
        while True:
            end = buf.find(b"\r\n")
            if end < 0:
                break
            head = buf[:end].split()
            if head[0] != b"MSG":   # PING, +OK
                if head[0] == b"PING":
                    out.append(b"PONG\r\n")
                buf = buf[end + 2:]
                continue
            size = int(head[-1])
            if len(buf) < end + 2 + size + 2:
                break
            out.append(b"PUB %s 2\r\nok\r\n" % head[3])
            buf = buf[end + 2 + size + 2:]
        if out:
            try:
                sock.sendall(b"".join(out))
            except OSError:
                return


def run(server: servers.Server, requests: int, window: int, tag: int) -> tuple[float, float]:
    """-> (requests a second, µs of the server's CPU a request)."""
    port = server.ports["nats"]
    requester = nats_ready(port, b"SUB _INBOX.%d.* 1\r\n" % tag, timeout=None)
    responder = nats_ready(port, b"SUB svc 1\r\n", timeout=None)
    answering = threading.Thread(target=_respond, args=(responder,), daemon=True)
    answering.start()
    try:
        c0, t0 = server.cpu_seconds(), time.perf_counter()
        got = 0
        for start in range(0, requests, window):
            stop = min(start + window, requests)
            requester.sendall(b"".join([b"PUB svc _INBOX.%d.%d 2\r\nhi\r\n" % (tag, i) for i in range(start, stop)]))
            while got < stop:
                chunk = requester.recv(1 << 20)
                if not chunk:
                    raise RuntimeError(f"{server.name} closed the connection")
                got += chunk.count(b"MSG ")   # a payload of "ok" cannot hold it
        elapsed, used = time.perf_counter() - t0, server.cpu_seconds() - c0
    finally:
        requester.close()
        responder.shutdown(socket.SHUT_RDWR)
        responder.close()
        answering.join(5)
    return requests / elapsed, used / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=500, help="requests unanswered at most")
    parser.add_argument("--workers", type=int, default=1, help="this broker's workers")
    opts = parser.parse_args()
    targets = [servers.start_broker(opts.workers)]
    nats = servers.start_nats()
    if nats is not None:
        targets.append(nats)
    try:
        for rnd in range(opts.rounds):
            for server in targets:
                rate, us = run(server, opts.requests, opts.window, rnd)
                print(f"{server.name:>12}: {rate:>9,.0f} requests/s, {us:6.2f} µs of the server's CPU a request")
    finally:
        for server in targets:
            server.stop()


if __name__ == "__main__":
    main()
