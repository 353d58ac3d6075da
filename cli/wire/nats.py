"""NATS core as a client speaks it, sans I/O (docs/nats.md; the server's end is workers/protocols/nats/codec.py).

Out: ``connect``, ``sub``, ``pub`` (``pub_head`` for a caller that splices payloads onto one head), ``PING`` and
``PONG``.  Subjects, queue groups and reply subjects may be ``str`` or ``bytes``.

In: ``parse(buf)`` reads the complete frames at the start of a buffer and says how many bytes they took; the caller
keeps the rest for the next read.  A MSG or HMSG is ``(subject, reply, headers, payload)``, with ``reply`` and
``headers`` b"" where absent; the payload is sliced out by its declared size, never scanned.  The server's other
lines (INFO, PING, PONG, +OK, -ERR) are passed over, but for -ERR, which raises ``ServerError``; with
``controls=True`` they come instead among the messages, in order, as bytes (the line without its CRLF): a message
is a tuple, a control line is bytes.
"""

from __future__ import annotations

from typing import Any

import orjson

PING = b"PING\r\n"
PONG = b"PONG\r\n"
CRLF = b"\r\n"


class ServerError(Exception):
    """The server sent ``-ERR``: ``line`` is that line, without its CRLF."""

    def __init__(self, line: bytes) -> None:
        super().__init__(line.decode(errors="replace"))
        self.line = line


def _b(text: str | bytes) -> bytes:
    return text.encode() if isinstance(text, str) else text


# -- client to server -------------------------------------------------------------------------------------------

def connect(options: dict) -> bytes:
    """``CONNECT`` with ``options`` (verbose, pedantic, headers, user, pass, ...) as JSON, in the order given."""
    return b"CONNECT " + orjson.dumps(options) + CRLF


def sub(subject: str | bytes, sid: int, queue: str | bytes | None = None) -> bytes:
    """``SUB``: ``queue`` names a queue group (None or empty for none)."""
    if queue:
        return b"SUB %s %s %d\r\n" % (_b(subject), _b(queue), sid)
    return b"SUB %s %d\r\n" % (_b(subject), sid)


def pub_head(subject: str | bytes, size: int, reply: str | bytes | None = None) -> bytes:
    """A ``PUB`` line for a payload of ``size`` bytes: what goes before the payload and its CRLF."""
    if reply:
        return b"PUB %s %s %d\r\n" % (_b(subject), _b(reply), size)
    return b"PUB %s %d\r\n" % (_b(subject), size)


def pub(subject: str | bytes, payload: bytes, reply: str | bytes | None = None) -> bytes:
    return pub_head(subject, len(payload), reply) + payload + CRLF


def empty_pubs(subjects: list[bytes]) -> bytes:
    """A PUB without payload to each subject, in one piece (JetStream's acks: an empty message to each message's
    ack subject)."""
    return b"".join([b"PUB %s 0\r\n\r\n" % s for s in subjects])


# -- server to client -------------------------------------------------------------------------------------------

def parse(buf: bytes, controls: bool = False, peek: int = -1) -> tuple[list, int]:
    """The complete frames at the start of ``buf`` -> (messages, and with ``controls`` the control lines, in order;
    the bytes they took).  See the module's docstring.  ``peek`` >= 0: only the first ``peek`` bytes of each payload
    (for a load generator that reads a fixed-size header there: large payloads are not copied)."""
    frames: list = []
    pos, n = 0, len(buf)
    while pos < n:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            break
        head = buf[pos:eol]
        if head[:4] == b"MSG " or head[:5] == b"HMSG ":
            # MSG <subject> <sid> [reply] <size>; HMSG <subject> <sid> [reply] <header size> <total size>
            parts = head.split()
            headed = parts[0] == b"HMSG"
            total = int(parts[-1])
            hlen = int(parts[-2]) if headed else 0
            end = eol + 2 + total + 2
            if end > n:
                break
            reply = parts[3] if len(parts) == (6 if headed else 5) else b""
            body = eol + 2 + hlen
            stop = body + peek if 0 <= peek < total - hlen else eol + 2 + total
            frames.append((parts[1], reply, buf[eol + 2:body], buf[body:stop]))
            pos = end
        elif controls:
            frames.append(head)
            pos = eol + 2
        elif head[:4] == b"-ERR":
            raise ServerError(head)
        else:
            pos = eol + 2
    return frames, pos


def frame_size(buf: bytes, pos: int, item: tuple | bytes) -> int:
    """How many bytes, from ``pos``, the frame ``parse`` read there as ``item`` (without ``peek``) took: for a
    caller that keeps each frame's bytes as they came."""
    eol = buf.find(b"\r\n", pos)
    if type(item) is bytes:
        return eol + 2 - pos
    return eol + 2 + len(item[2]) + len(item[3]) + 2 - pos


def info(line: bytes) -> dict[str, Any]:
    """The fields of an ``INFO`` line (its CRLF may be there or not)."""
    return orjson.loads(line[5:])


def error_text(line: bytes) -> str:
    """The text of a ``-ERR '...'`` line, without its quotes."""
    return line[5:].decode(errors="replace").strip(" '")
