"""qlite's wire protocol, sans I/O: framing, the handshake's frames, requests and replies (docs/qlite.md).

Every frame, both ways, is a ``u32`` little-endian length and that many bytes.  The server greets with
``greetings;`` and a 16-byte challenge; the client answers with a role byte, ``<user>;`` and
bcrypt(secret ‖ challenge); after ``PASS;`` each frame is a request ``FN;data`` (``FN`` case-insensitive), answered
by one ``PASS;…`` or ``FAIL;<text>`` frame.  The texts are the original server's (govindansriram/qlite), byte for
byte, where it has one.

Fixed against the original: frames may be pipelined (several in one read) and fragmented (one byte at a time); a
declared length above 10 MiB is answered ``FAIL;error: message is longer than limit of 10 megabytes`` (the
session then closes: what follows cannot be resynchronised without reading up to 4 GiB).
"""

from __future__ import annotations

import os
import re
import struct

MAX_FRAME = 10 * 1024 * 1024        # the original's limit; a frame of exactly 10 MiB is accepted
HANDSHAKE_FRAME_MAX = 1024          # the client's auth frame: role, a user name, a 60-byte bcrypt hash
CHALLENGE_SIZE = 16
RECEIPT_SIZE = 16
GREETING = b"greetings;"
MIN_COST, MAX_COST = 4, 12          # bcrypt costs accepted from clients (the original accepts 4-31: a DoS)
BCRYPT_INPUT_MAX = 72               # bcrypt keys from the first 72 bytes; pyca bcrypt >= 5 refuses more
SECRET_MAX = BCRYPT_INPUT_MAX - CHALLENGE_SIZE   # 56: longer secrets would push challenge bytes out of the hash
U32_MAX = 0xFFFFFFFF

PUBLISHER, SUBSCRIBER = "publisher", "subscriber"

_LEN = struct.Struct("<I")
_STAT = struct.Struct("<IIIIQ")

# -- texts (FAIL;<text>) --------------------------------------------------------------------------------------
# The original server's, byte for byte.
TOO_LONG = "error: message is longer than limit of 10 megabytes"
NO_SEMICOLON = "no semicolon delimiter found"
BAD_REQUEST = "error: bad request"
AUTH_EMPTY = "error: message is empty"
AUTH_FORMAT = "error: authentication packet formatted incorrectly"
AUTH_INVALID = "error: password is invalid"
EMPTY_PUSH = "cannot push empty message"
TOO_LARGE = "message exceeds acceptable message size"
QUEUE_EMPTY = "queue is empty"
HIDDEN_TOO_LONG = "provided hidden duration is longer then the max viable time"
POLL_TIMEOUT = "error: no data could be dequeued in the specified time period"
NOT_CORRELATED = ("the key you provided does not correlate to any value being processed, "
                  "expiration time may have been exceeded")
SUBSCRIBER_PUSH = "subscribers cannot push to the queue"
PUBLISHER_HIDE = "publishers cannot hide messages on the queue"
PUBLISHER_POLL = "publishers cannot poll the queue"
PUBLISHER_DEL = "publishers cannot delete hidden messages"
# Ours, where the original has none: a crash there (HIDE/POLL with fewer than 4 bytes), or a verb it lacks.
HIDDEN_TIME_FORMAT = "hidden time must be a 4 byte little endian uint32"
PUBLISHER_EXT = "publishers cannot extend hidden messages"
PUBLISHER_NACK = "publishers cannot return hidden messages"
PUBLISHER_STAT = "publishers cannot read the queue's statistics"
EXT_FORMAT = "error: EXT needs a 16 byte id followed by a 4 byte little endian uint32"
NACK_FORMAT = "error: NACK needs a 16 byte id followed by a 4 byte little endian uint32"
DELAY_TOO_LONG = "error: the delay is longer than the max of 43200 seconds"
QUEUE_FULL = "error: the queue is full, try again later"
QUEUE_UNAVAILABLE = "error: the queue is unavailable, try again later"
JOURNAL_UNAVAILABLE = "error: the queue cannot store this now (its journal cannot be written), try again later"
TOO_MANY_WAITERS = "error: too many polls are waiting on the queue, try again later"


def no_role(role: str) -> str:
    """A user that may not take ``role`` (the original's text)."""
    return f"error: user does not have the {role} role"


def role_full(role: str) -> str:
    """Every seat of ``role`` is taken (the original's text)."""
    return f"error: the max amount of {role}s have already been connected"


def unknown_function(fn: bytes) -> str:
    """The original's answer to a verb it does not know (it lists only its own five)."""
    return (f"error: error can not handle function {fn.decode('utf-8', 'replace')}, "
            f"options are PUSH, HIDE, POLL, DEL and LEN")


def bad_id(n: int) -> str:
    """A DEL whose id is not 16 bytes (the original's text, from its UUID library)."""
    return f"invalid UUID (got {n} bytes)"


CONNECTIONS_FULL = role_full("connection")


class QliteError(Exception):
    """A frame the protocol refuses; ``str(exc)`` is the text to answer ``FAIL;`` with."""


# -- framing --------------------------------------------------------------------------------------------------
def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def ok(data: bytes = b"") -> bytes:
    """A ``PASS;`` reply frame."""
    return frame(b"PASS;" + data)


def fail(text: str) -> bytes:
    """A ``FAIL;`` reply frame."""
    return frame(b"FAIL;" + text.encode())


# What the acceptor writes to a qlite client over limits.max_connections, and a worker to one past its cap of
# connections in their handshake: a FAIL frame where the greeting would be.
REFUSAL = fail(CONNECTIONS_FULL)


def u32(n: int) -> bytes:
    """``n`` as a little-endian u32, saturated to 0..2³²-1."""
    return _LEN.pack(min(max(n, 0), U32_MAX))


def stat_payload(visible: int, in_flight: int, delayed: int, dlq: int, oldest_ms: int) -> bytes:
    """``STAT``'s reply data: four u32 counts and a u64 age in ms, little-endian, each saturated."""
    sat = lambda n: min(max(n, 0), U32_MAX)  # noqa: E731
    return _STAT.pack(sat(visible), sat(in_flight), sat(delayed), sat(dlq), min(max(oldest_ms, 0), (1 << 64) - 1))


class FrameTooLong:
    """What ``Deframer.feed`` yields for a frame whose declared length is over its limit (nothing follows it)."""

    __slots__ = ("length", "first")

    def __init__(self, length: int, first: bool) -> None:
        self.length = length
        self.first = first      # the connection's first frame (the handshake's, with its own, smaller limit)

    def __repr__(self) -> str:
        return f"FrameTooLong({self.length}, first={self.first})"


class Deframer:
    """Incoming bytes -> complete frame payloads, in order, however the bytes were split.

    ``feed`` returns every frame completed by the data (a pipelined read gives several); a frame declared longer
    than ``limit`` (the first frame: ``first_limit``) ends the stream with a ``FrameTooLong``, and later input is
    ignored.  Bytes are kept in one buffer and compacted once per ``feed``; a payload is sliced out once."""

    def __init__(self, limit: int = MAX_FRAME, first_limit: int | None = None) -> None:
        self.limit = limit
        self._first_limit = first_limit
        self._buf = bytearray()
        self._need = -1          # the declared length of the frame in progress, once its 4 bytes are in
        self.frames = 0          # frames completed so far
        self.broken = False      # a FrameTooLong was given: nothing more is read

    @property
    def partial(self) -> bool:
        """Whether part of a frame is buffered (its first byte has arrived, its last not yet)."""
        return (bool(self._buf) or self._need >= 0) and not self.broken

    def feed(self, data: bytes) -> list:
        if self.broken:
            return []
        buf = self._buf
        buf += data
        out: list = []
        pos = 0
        end = len(buf)
        while True:
            if self._need < 0:
                if end - pos < 4:
                    break
                self._need = _LEN.unpack_from(buf, pos)[0]
                pos += 4
                first = self.frames == 0
                limit = self._first_limit if first and self._first_limit is not None else self.limit
                if self._need > limit:
                    out.append(FrameTooLong(self._need, first))
                    self.broken = True
                    self._buf = bytearray()
                    return out
            if end - pos < self._need:
                break
            out.append(bytes(buf[pos:pos + self._need]))
            pos += self._need
            self._need = -1
            self.frames += 1
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


# -- the handshake --------------------------------------------------------------------------------------------
def new_challenge() -> bytes:
    """16 CSPRNG bytes without NUL (a C-string bcrypt would stop there; clients cannot tell it from a UUID)."""
    while True:
        challenge = os.urandom(CHALLENGE_SIZE)
        if b"\0" not in challenge:
            return challenge


def greeting(challenge: bytes) -> bytes:
    """The server's first frame: ``greetings;`` and the challenge (26 bytes)."""
    return frame(GREETING + challenge)


def parse_greeting(payload: bytes) -> bytes:
    """The challenge of a greeting frame's payload (for clients and tests)."""
    if len(payload) != len(GREETING) + CHALLENGE_SIZE or not payload.startswith(GREETING):
        raise QliteError("not a qlite greeting")
    return payload[len(GREETING):]


def parse_auth(payload: bytes) -> tuple[str, bytes, bytes]:
    """The client's answer -> (role, user name, bcrypt hash).  Role byte 0 is a publisher, any other a
    subscriber (as the original); the rest must hold exactly one ``;`` (the bcrypt alphabet has none)."""
    if not payload:
        raise QliteError(AUTH_EMPTY)
    role = PUBLISHER if payload[0] == 0 else SUBSCRIBER
    parts = payload[1:].split(b";")
    if len(parts) != 2:
        raise QliteError(AUTH_FORMAT)
    return role, parts[0], parts[1]


def auth_frame(role: str | int, user: bytes, hashed: bytes) -> bytes:
    """A client's answer frame (for clients and tests); ``role`` is a role name or the raw byte."""
    byte = role if isinstance(role, int) else (0 if role == PUBLISHER else 1)
    return frame(bytes([byte]) + user + b";" + hashed)


_HASH = re.compile(rb"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")


def bcrypt_cost(hashed: bytes) -> int | None:
    """The cost of a ``$2a$``, ``$2b$`` or ``$2y$`` bcrypt hash, or None if ``hashed`` is not one."""
    m = _HASH.fullmatch(hashed)
    return int(m.group(1)) if m else None


def acceptable_hash(hashed: bytes) -> bool:
    """Whether a client's hash may be verified: a bcrypt hash of cost 4-12 (a cost-31 hash would cost 2²¹
    cost-10 checks: refused without running bcrypt)."""
    cost = bcrypt_cost(hashed)
    return cost is not None and MIN_COST <= cost <= MAX_COST


def bcrypt_input(secret: bytes, challenge: bytes) -> bytes:
    """What the client hashes: secret ‖ challenge, cut at bcrypt's 72 bytes (as Go's bcrypt does)."""
    return (secret + challenge)[:BCRYPT_INPUT_MAX]


def normalized_hash(hashed: bytes) -> bytes:
    """``$2a$``/``$2y$`` as ``$2b$``: the same algorithm for inputs under 255 bytes (ours are at most 72)."""
    return b"$2b$" + hashed[4:]


# -- requests -------------------------------------------------------------------------------------------------
def parse_request(payload: bytes) -> tuple[bytes, bytes]:
    """``FN;data`` -> (FN in upper case, data).  The original's errors: no ``;``, or nothing before it."""
    fn, sep, data = payload.partition(b";")
    if not sep:
        raise QliteError(NO_SEMICOLON)
    if not fn:
        raise QliteError(BAD_REQUEST)
    return fn.upper(), data


def seconds(data: bytes) -> int | None:
    """The u32 at the start of ``data`` (more bytes are ignored, as the original does), or None if too short."""
    if len(data) < 4:
        return None
    return _LEN.unpack_from(data)[0]


def poll_args(data: bytes) -> tuple[int, int] | None:
    """``POLL``'s data -> (hidden seconds, wait seconds or 0 for the server's maximum); None if too short.  The
    optional second u32 is our extension (the original ignores bytes after the first four)."""
    hidden = seconds(data)
    if hidden is None:
        return None
    wait = _LEN.unpack_from(data, 4)[0] if len(data) >= 8 else 0
    return hidden, wait


def id_and_u32(data: bytes) -> tuple[bytes, int] | None:
    """``EXT``/``NACK``'s data: a 16-byte id then a u32; None if shorter (extra bytes are ignored)."""
    if len(data) < RECEIPT_SIZE + 4:
        return None
    return data[:RECEIPT_SIZE], _LEN.unpack_from(data, RECEIPT_SIZE)[0]


def request(fn: bytes | str, data: bytes = b"") -> bytes:
    """A request frame (for clients and tests)."""
    return frame((fn.encode() if isinstance(fn, str) else fn) + b";" + data)


def parse_reply(payload: bytes) -> tuple[bool, bytes]:
    """A reply frame's payload -> (passed, the rest) (for clients and tests)."""
    if payload.startswith(b"PASS;"):
        return True, payload[5:]
    if payload.startswith(b"FAIL;"):
        return False, payload[5:]
    raise QliteError("not a qlite reply")


def parse_message(data: bytes) -> tuple[bytes, bytes]:
    """``HIDE``/``POLL``'s PASS data -> (16-byte id, message) (for clients and tests): sliced, never split."""
    if len(data) < RECEIPT_SIZE + 1 or data[RECEIPT_SIZE:RECEIPT_SIZE + 1] != b";":
        raise QliteError("not a qlite message")
    return data[:RECEIPT_SIZE], data[RECEIPT_SIZE + 1:]


def parse_stat(data: bytes) -> dict:
    """``STAT``'s PASS data -> the counts (for clients and tests)."""
    visible, in_flight, delayed, dlq, oldest = _STAT.unpack(data)
    return {"visible": visible, "in_flight": in_flight, "delayed": delayed, "dlq": dlq, "oldest_age_ms": oldest}
