"""Redis' RESP2 as a client speaks it, sans I/O: commands out, replies in (the bench and the load test compare this
broker with Redis: its pub/sub and its streams).

``replies(buf)`` reads the complete replies at the start of a buffer and says where they end (the caller keeps the
rest for the next read); ``parse(buf, pos)`` reads one, or None while it is not all there.  Simple strings and bulk
strings come as bytes, integers as int, a null bulk string or array as None, arrays as lists, and an error reply as
an ``Error`` (a value, not raised: the caller decides).  Bytes that are no RESP2 reply raise ``ProtocolError``.
"""

from __future__ import annotations

from typing import Any


class Error(Exception):
    """An error reply (``-ERR ...``): ``str()`` is its text."""


class ProtocolError(ValueError):
    """Not a RESP2 reply: ``line`` is the offending line, without its CRLF."""

    def __init__(self, line: bytes) -> None:
        super().__init__(f"unexpected reply {line[:200]!r}")
        self.line = line


def command(*parts: bytes) -> bytes:
    """A command as an array of bulk strings."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def replies(buf: bytes, pos: int = 0) -> tuple[list, int]:
    """The complete replies from ``pos`` -> (their values, where they end): keep the rest for the next read."""
    return _read(buf, pos, -1)


def parse(buf: bytes, pos: int = 0) -> tuple[Any, int] | None:
    """One complete reply at ``pos`` -> (its value, where it ends), or None while it is not all there."""
    values, end = _read(buf, pos, 1)
    return (values[0], end) if values else None


def _read(buf: bytes, pos: int, limit: int) -> tuple[list, int]:
    """Up to ``limit`` replies (-1: all there are) from ``pos``: one loop, arrays of bulk strings and integers
    inline (pub/sub's messages, a command's replies), anything else in them by recursion."""
    out: list = []
    n = len(buf)
    while pos < n and len(out) != limit:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            break
        kind = buf[pos:pos + 1]
        if kind == b"*":
            count = int(buf[pos + 1:eol])
            if count < 0:
                out.append(None)
                pos = eol + 2
                continue
            items: list = []
            at = eol + 2
            for _ in range(count):
                e = buf.find(b"\r\n", at)
                if e < 0:
                    return out, pos
                k = buf[at:at + 1]
                if k == b"$":
                    size = int(buf[at + 1:e])
                    if size < 0:
                        items.append(None)
                        at = e + 2
                        continue
                    if e + 2 + size + 2 > n:
                        return out, pos
                    items.append(buf[e + 2:e + 2 + size])
                    at = e + 2 + size + 2
                elif k == b":":
                    items.append(int(buf[at + 1:e]))
                    at = e + 2
                else:
                    value, end = _read(buf, at, 1)
                    if not value:
                        return out, pos
                    items.append(value[0])
                    at = end
            out.append(items)
            pos = at
        elif kind == b":":
            out.append(int(buf[pos + 1:eol]))
            pos = eol + 2
        elif kind == b"$":
            size = int(buf[pos + 1:eol])
            if size < 0:
                out.append(None)
                pos = eol + 2
                continue
            end = eol + 2 + size
            if end + 2 > n:
                break
            out.append(buf[eol + 2:end])
            pos = end + 2
        elif kind == b"+":
            out.append(buf[pos + 1:eol])
            pos = eol + 2
        elif kind == b"-":
            out.append(Error(buf[pos + 1:eol].decode(errors="replace")))
            pos = eol + 2
        else:
            raise ProtocolError(buf[pos:eol])
    return out, pos
