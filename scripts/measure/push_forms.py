#!/usr/bin/env python3
"""What each spelling of a push costs the broker: the CPU of its processes per message stored, for pipelined
pushes of 120-byte strings over one NDJSON connection to a one-worker broker (docs/queues.md, qpush).

    .venv/bin/python scripts/measure/push_forms.py                      # every form, twice, alternately
    .venv/bin/python scripts/measure/push_forms.py --forms single,dedup --messages 400000

Forms: ``single`` (the canonical ``{"op":"qpush","queue":Q,"data":D}``, taken a run at a time), ``priority`` (the
same with ``,"priority":4`` after the data, also a run at a time), ``delay`` (``,"delay_ms":60000``, likewise),
``spaced`` (the priority push as ``json.dumps`` writes it, with spaces: each line parsed on its own), ``dedup``
(with a ``dedup_id``: each line on its own), ``batch`` (100 messages of nothing but data a request) and
``batchdedup`` (the same with the request's ``dedup_id`` after its messages); over NATS, ``nats`` (``PUB
$Q.PUSH.<queue>`` with a reply subject of its own, as nats-py's requests have) and ``natsid`` (the same as HPUB
with a ``Nats-Msg-Id``).  At most 1,000 requests are unanswered at a time, under the connection's pipelining
bound.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.harness import measured_broker, nats_ready  # noqa: E402

DATA = b'"' + b"x" * 118 + b'"'
FORMS = ("single", "priority", "delay", "spaced", "dedup", "batch", "batchdedup", "nats", "natsid")


def lines(form: str, queue: bytes, n: int) -> list[bytes]:
    if form == "nats":   # each with its own reply subject, as nats-py's requests have
        return [b"PUB $Q.PUSH.%s _INBOX.forms.%d %d\r\n%s\r\n" % (queue, i, len(DATA), DATA) for i in range(n)]
    if form == "natsid":
        headers = [b"NATS/1.0\r\nNats-Msg-Id: m-%d\r\n\r\n" % i for i in range(n)]
        return [b"HPUB $Q.PUSH.%s _INBOX.forms.%d %d %d\r\n%s%s\r\n" % (queue, i, len(h), len(h) + len(DATA), h, DATA)
                for i, h in enumerate(headers)]
    head = b'{"op":"qpush","queue":"%s",' % queue
    if form == "single":
        return [head + b'"data":%s}\n' % DATA] * n
    if form == "priority":
        return [head + b'"data":%s,"priority":4}\n' % DATA] * n
    if form == "delay":
        return [head + b'"data":%s,"delay_ms":60000}\n' % DATA] * n
    if form == "spaced":   # json.dumps's default separators: not canonical
        return [head.replace(b",", b", ").replace(b":", b": ") + b'"data": %s, "priority": 4}\n' % DATA] * n
    if form == "dedup":
        return [head + b'"data":%s,"dedup_id":"m-%d"}\n' % (DATA, i) for i in range(n)]
    items = b",".join([b'{"data":%s}' % DATA] * 100)
    tail = [b"" if form == "batch" else b',"dedup_id":"b-%d"' % i for i in range(n // 100)]
    return [head + b'"messages":[%s]%s}\n' % (items, t) for t in tail]


def run(ports: dict, cpu: Callable[[], float], form: str, n: int) -> tuple[float, float]:
    """-> (messages a second, µs of the broker's CPU a message)."""
    queue = b"forms.%s.%d" % (form.encode(), time.time_ns())
    batch = lines(form, queue, n)
    s = nats_ready(ports["nats"], b"SUB _INBOX.forms.* 1\r\n", timeout=None) if form.startswith("nats") \
        else socket.create_connection(("127.0.0.1", ports["ndjson"]))
    with s:
        c0, t0 = cpu(), time.perf_counter()
        got, seen = 0, b""   # replies: each has its "ok" (a request's, a batch's one)
        for i in range(0, len(batch), 1000):
            s.sendall(b"".join(batch[i:i + 1000]))
            while got < min(i + 1000, len(batch)):
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise RuntimeError("the broker closed the connection")
                if b'"ok":false' in seen[-9:] + chunk:
                    raise RuntimeError(f"{form}: refused: {chunk[:300]!r}")
                got += (seen[-4:] + chunk).count(b'"ok":')
                seen = chunk
        elapsed, used = time.perf_counter() - t0, cpu() - c0
    # emptied, so that the forms after it are not measured against a broker holding millions of messages
    with socket.create_connection(("127.0.0.1", ports["ndjson"])) as s:
        s.sendall(b'{"op":"qpurge","queue":"%s"}\n' % queue)
        while not s.recv(1 << 16).endswith(b"\n"):
            pass
    return n / elapsed, used / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    with measured_broker("push-forms-") as (broker, cpu):
        for _ in range(opts.rounds):
            for form in opts.forms.split(","):
                rate, us = run(broker.ports, cpu, form, opts.messages)
                print(f"{form:>10}: {rate:>9,.0f} msg/s, {us:5.2f} µs of the broker's CPU a message")


if __name__ == "__main__":
    main()
