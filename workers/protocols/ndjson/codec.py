"""Jolt's NDJSON protocol as bytes: framing, request parsing and replies.  No sockets here.  Deliveries are the
core's (``workers.delivery``), which the hub writes for fan-out.

Framing: one JSON object per line, ``\\n``-terminated (a ``\\r`` before it is JSON whitespace and ignored).  A line
longer than the limit is reported as ``None`` in the list of lines, and nothing after it is returned: the session
answers ``line_too_long`` and closes.

Depth: orjson reads JSON nested up to 1,024 levels but writes only 254 levels inside a reply.  A request whose
``id`` (echoed in every reply) could not be written back is not a request (``parse`` returns None: ``invalid_json``),
and ``data`` nested too deeply to be written raises ``TooDeep`` (the session answers ``invalid_json``), before
anything is done: a reply rendered later, in another worker's callback, can never fail on what a client sent.

Data pass-through: a ``data`` value is re-encoded by orjson, which is exact for every JSON value except integers
beyond 64 bits (orjson reads them as floats).  Those are detected cheaply (a float that large, or a run of 19+
digits in a line whose data is a container) and re-read with the standard library, which keeps them exact.
"""

from __future__ import annotations

import json

import orjson

OK = b'{"ok":true}\n'

_DIGITS = bytes.maketrans(b"0123456789", b"9999999999")
_LONG_DIGIT_RUN = b"9" * 19
_LOSSY_FLOAT = float(1 << 63)
_INT_MIN, _INT_END = -(1 << 63), 1 << 64   # what orjson writes of integers
_INF = float("inf")


class TooDeep(ValueError):
    """A request's ``data`` is nested more deeply than JSON can be written here."""


def split_lines(tail: bytes, data: bytes, max_line: int) -> tuple[list[bytes | None], bytes]:
    """(complete lines, new tail).  A ``None`` entry ends the list: that line exceeded ``max_line``.

    A line that arrives over many reads is kept in a ``bytearray`` that each read extends in place, and joined to
    its end once: copying the whole tail at every read made a 1 MiB line sent 128 bytes at a time cost 2 s of CPU."""
    lines: list[bytes | None] = data.split(b"\n")  # type: ignore[assignment]
    rest: bytes = lines.pop()   # after the last newline: the start of a line still coming (split copies once)
    if tail:   # joined to the line it starts, not to the whole read (a read is up to 256 KiB, a tail a few bytes)
        if lines:
            lines[0] = b"".join((tail, lines[0]))  # type: ignore[arg-type]
        else:
            if type(tail) is not bytearray:
                tail = bytearray(tail)
            tail += rest
            rest = tail  # type: ignore[assignment]
    if not lines:
        if len(rest) > max_line:
            return [None], b""
        return [], rest
    if len(tail) + len(data) > max_line:
        for i, line in enumerate(lines):
            if len(line) > max_line:  # type: ignore[arg-type]
                return lines[:i] + [None], b""
        if len(rest) > max_line:
            return lines + [None], b""
    return lines, rest


def parse(line: bytes) -> dict | None:
    """The request on ``line``, or None if it is not a JSON object (bad JSON, bad UTF-8, another JSON type)."""
    try:
        req = orjson.loads(line)
    except orjson.JSONDecodeError:
        req = _exact_request(line)
    if type(req) is not dict:
        return None
    rid = req.get("id")
    if (type(rid) is list or type(rid) is dict) and not _writable({"id": rid}):
        return None
    return req


def _exact_request(line: bytes) -> dict | None:
    """A line orjson refuses because an integer in it has more digits than a double's range (309 and more) read
    with the standard library, which keeps integers exact (up to ``sys.get_int_max_str_digits()`` digits, 4,300 by
    default); a number that is infinite as a float is no JSON value anyone can be sent, and is refused."""
    if _LONG_DIGIT_RUN not in line.translate(_DIGITS):
        return None   # nothing a big integer could explain: the line is not JSON
    try:
        req = json.loads(line, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError):   # JSONDecodeError is a ValueError, and so is an over-long integer
        return None
    return req if type(req) is dict else None


def _finite(text: str) -> float:
    value = float(text)
    if value in (_INF, -_INF):
        raise ValueError(f"{text} is infinite as a number")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not JSON")


def _writable(value: object) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


def is_blank(line: bytes) -> bool:
    return not line.strip()


def encode_data(line: bytes, data: object) -> bytes:
    """The JSON encoding of a request's ``data`` value, exactly as the client wrote it (bar insignificant spaces)."""
    try:
        return _encode_data(line, data)
    except (orjson.JSONEncodeError, RecursionError):
        raise TooDeep("data nested too deeply") from None


def _encode_data(line: bytes, data: object) -> bytes:
    t = type(data)
    if t is int:
        if not _INT_MIN <= data < _INT_END:  # read exact by _exact_request: written so too
            return _exact_data(line)
    elif t is float:
        if data >= _LOSSY_FLOAT or data <= -_LOSSY_FLOAT:  # type: ignore[operator]
            return _exact_data(line)
    elif (t is dict or t is list) and _LONG_DIGIT_RUN in line.translate(_DIGITS):
        return _exact_data(line)
    # Copied out: orjson writes into a 4 KiB buffer and shrinks it in place, and a payload held until the end of
    # the turn (queued for the fabric) pins the rest of that block, which the next message's buffer cannot
    # reuse.  Kept, that cost 4 KiB of heap per message, a page fault each, and half the 1→1 throughput.
    return b"%s" % orjson.dumps(data)


def _exact_data(line: bytes) -> bytes:
    value = json.loads(line.decode()).get("data")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def reply(req: dict, error: str | None = None) -> bytes:
    """``{"ok":true}`` or ``{"ok":false,"error":...}``, echoing the request's ``id`` if it has one."""
    rid = req.get("id")
    if error is None:
        return OK if rid is None else orjson.dumps({"ok": True, "id": rid}) + b"\n"
    body: dict = {"ok": False, "error": error}
    if rid is not None:
        body["id"] = rid
    return orjson.dumps(body) + b"\n"


def error(reason: str) -> bytes:
    return orjson.dumps({"ok": False, "error": reason}) + b"\n"


def reply_with(req: dict, fields: dict) -> bytes:
    body = {"ok": True, **fields}
    rid = req.get("id")
    if rid is not None:
        body["id"] = rid
    return orjson.dumps(body) + b"\n"
