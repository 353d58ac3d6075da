"""What the load generator writes and looks for, per protocol: pre-encoded frames and byte markers.

Publishers send frames built once; subscribers count deliveries by counting a marker that starts every delivery
(``bytes.count`` on whole reads, never decoding a message), carrying the last bytes of a read over to the next so a
marker split between reads is still counted once.  Latency runs embed ``T`` and 19 digits of the send time
(``time.monotonic_ns()``, one clock for every process of the machine) at the start of the payload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

STAMP = re.compile(rb"T(\d{19})")


def payload(size: int, stamp_ns: int | None = None) -> bytes:
    if stamp_ns is None:
        return b"x" * size
    head = b"T%019d" % stamp_ns
    return head + b"x" * max(0, size - len(head))


@dataclass(frozen=True)
class Wire:
    name: str
    delivery_marker: bytes      # one per delivered message
    reply_marker: bytes         # one per reply a publisher gets (b"" when publishers get none)
    greeting: bytes             # what the server sends first (b"" for none)

    def hello(self) -> bytes:
        return b""

    def subscribe(self, subject: str, sid: int) -> bytes:
        raise NotImplementedError

    def confirm(self) -> tuple[bytes, bytes]:
        """(what to send after subscribing, what comes back once the subscriptions are in force)."""
        raise NotImplementedError

    def publish(self, subject: str, data: bytes) -> bytes:
        raise NotImplementedError


class Ndjson(Wire):
    def __init__(self) -> None:
        super().__init__("ndjson", b'{"topic"', b'{"ok"', b"")

    def subscribe(self, subject: str, sid: int) -> bytes:
        return orjson.dumps({"op": "sub", "topic": subject}) + b"\n"

    def confirm(self) -> tuple[bytes, bytes]:
        return b'{"op":"ping","id":"ready"}\n', b'"id":"ready"'

    def publish(self, subject: str, data: bytes) -> bytes:
        return orjson.dumps({"op": "pub", "topic": subject, "data": data.decode()}) + b"\n"


class Nats(Wire):
    def __init__(self) -> None:
        super().__init__("nats", b"MSG ", b"", b"INFO ")

    def hello(self) -> bytes:
        return b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\n'

    def subscribe(self, subject: str, sid: int) -> bytes:
        return b"SUB %s %d\r\n" % (subject.encode(), sid)

    def confirm(self) -> tuple[bytes, bytes]:
        return b"PING\r\n", b"PONG\r\n"

    def publish(self, subject: str, data: bytes) -> bytes:
        return b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(data), data)


class Resp(Wire):
    """Redis pub/sub in RESP."""

    def __init__(self) -> None:
        super().__init__("redis", b"$7\r\nmessage\r\n", b":", b"")

    @staticmethod
    def _command(*parts: bytes) -> bytes:
        return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)

    def subscribe(self, subject: str, sid: int) -> bytes:
        return self._command(b"SUBSCRIBE", subject.encode())

    def confirm(self) -> tuple[bytes, bytes]:
        # A subscribed connection may only PING; RESP2 answers with a ["pong", ""] array.
        return self._command(b"PING"), b"$4\r\npong\r\n"

    def publish(self, subject: str, data: bytes) -> bytes:
        return self._command(b"PUBLISH", subject.encode(), data)


WIRES = {"ndjson": Ndjson(), "nats": Nats(), "redis": Resp()}


class Counter:
    """Occurrences of a marker in a byte stream that arrives in pieces."""

    __slots__ = ("marker", "count", "_tail")

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.count = 0
        self._tail = b""

    def feed(self, data: bytes) -> int:
        if not self.marker:
            return 0
        chunk = self._tail + data
        n = chunk.count(self.marker)
        self.count += n
        keep = len(self.marker) - 1
        self._tail = chunk[-keep:] if keep else b""
        return n
