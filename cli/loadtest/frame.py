"""The header every load-test message starts with: publisher id, sequence number, intended and actual send time.

Binary protocols (NATS, Redis) carry it as 28 packed bytes; NDJSON's ``data`` must be JSON text, so there it is
56 hex digits.  Either way it is fixed-width at the start of the payload and padded to the message size, so
building and parsing cost a slice and a ``struct`` call, never a JSON decode of the payload.
"""

from __future__ import annotations

import struct

_BIN = struct.Struct("<IQqq")
BIN_SIZE = _BIN.size          # 28
HEX_SIZE = 56


def binary(pub_id: int, seq: int, t_intended: int, t_write: int, size: int) -> bytes:
    head = _BIN.pack(pub_id, seq, t_intended, t_write)
    return head + b"x" * (size - BIN_SIZE)


def parse_binary(payload) -> tuple[int, int, int, int]:
    return _BIN.unpack_from(payload)


def text(pub_id: int, seq: int, t_intended: int, t_write: int, size: int) -> str:
    return "%08x%016x%016x%016x" % (pub_id, seq, t_intended, t_write) + "x" * (size - HEX_SIZE)


def parse_text(data: str | bytes) -> tuple[int, int, int, int]:
    """Accepts the str from a JSON decode or the raw bytes of the string's contents."""
    return (int(data[0:8], 16), int(data[8:24], 16), int(data[24:40], 16), int(data[40:56], 16))
