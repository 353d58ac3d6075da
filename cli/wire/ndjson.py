"""Jolt's NDJSON as a client speaks it, sans I/O (docs/protocol.md; the server's end is
workers/protocols/ndjson/codec.py).

Framing: one JSON object per line, ``\\n``-terminated, both ways.  A request is ``{"op": ..., fields...}``; the
server answers every request, in order, with a reply whose first key is ``ok``, and sends deliveries, between the
replies, with ``topic`` first.  A client that must not decode every line (a load generator) tells them apart by
their first bytes: ``DELIVERY``, ``REPLY``, and ``OK`` for a successful reply.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

DELIVERY = b'{"topic"'      # how every delivery starts
REPLY = b'{"ok"'            # how every reply starts
OK = b'{"ok":true'          # how a successful reply starts


def encode(obj: Any) -> bytes:
    """One object as a line."""
    return orjson.dumps(obj) + b"\n"


def request(op: str, **fields: Any) -> bytes:
    """A request line: ``{"op": op, **fields}`` (``op`` first, then the fields in the order given)."""
    return orjson.dumps({"op": op, **fields}) + b"\n"


# -- framing ----------------------------------------------------------------------------------------------------

def lines(buf: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines in ``buf``, without their newlines, and the start of the line still arriving (b"" when
    ``buf`` ends with a newline): keep it, and put it before the next read."""
    parts = buf.split(b"\n")
    rest = parts.pop()
    return parts, rest


def first_line(buf: bytes) -> tuple[bytes, bytes] | None:
    """The first complete line of ``buf``, with its newline, and what follows it; None while there is none."""
    line, nl, rest = buf.partition(b"\n")
    return (line + nl, rest) if nl else None


class Decoder:
    """What the server sends, decoded however its bytes were split: ``feed(data)`` -> the objects of the lines it
    completes, in order (blank lines skipped).  A line that is not JSON raises ``orjson.JSONDecodeError``."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[Any]:
        done, self._tail = lines(self._tail + data)
        return [orjson.loads(line) for line in done if line.strip()]


# -- what the server sends --------------------------------------------------------------------------------------

class Delivery(NamedTuple):
    topic: str
    data: Any
    extra: dict          # any other fields of the delivery (reply, headers, encoding)


def is_reply(obj: dict) -> bool:
    """Whether a decoded line is a reply (to the oldest request not yet answered), not a delivery."""
    return "ok" in obj


def delivery(obj: dict) -> Delivery:
    extra = {k: v for k, v in obj.items() if k not in ("topic", "data")}
    return Delivery(obj.get("topic", ""), obj.get("data"), extra)


def error_of(line: bytes) -> Any:
    """What a failed reply's line says: its ``error``; the whole object where it has none; the line as text where
    it is no JSON."""
    try:
        reply = orjson.loads(line)
    except orjson.JSONDecodeError:
        return line.decode(errors="replace")
    return reply.get("error", reply) if isinstance(reply, dict) else reply
