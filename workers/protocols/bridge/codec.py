"""Bridge's small binary protocol as bytes (see docs/bridge.md).  No sockets here.

Client commands: one command byte (``S`` subscribe, ``U`` unsubscribe, ``P`` publish) and a 7-byte topic; after
``P`` the rest of the stream, up to the client's half-close, is the data.  Replies are one byte: ``O`` (done, and
one per 128-byte chunk of published data) or ``F`` (refused).  Deliveries are chunks of at most 128 bytes, each
after its 2-byte little-endian length, then the end marker: a chunk of length 4 holding CRLFCRLF.

Topics are normalised as the original does: every byte other than an ASCII letter, digit or space is removed, and
the result is padded with spaces to 7 (so ``c-h.a_t`` and ``chat`` are the same topic).  In the broker's shared
subject space a topic is ``bridge.<topic>``, trailing spaces dropped and inner spaces written ``_`` (which the
normalisation never leaves in a topic): ``chat`` is ``bridge.chat``, ``a b`` is ``bridge.a_b``, an empty topic is
``bridge._``.
"""

from __future__ import annotations

import re

CMD_SUBSCRIBE, CMD_UNSUBSCRIBE, CMD_PUBLISH = ord("S"), ord("U"), ord("P")
DATA, UNKNOWN = -1, -2   # Parser items besides the commands: a piece of a publish stream, a command byte unknown
COMMAND_SIZE = 8
CHUNK = 128
OK, FAIL = b"O", b"F"
END = b"\x04\x00\r\n\r\n"
PREFIX = "bridge."

_NOT_TOPIC = re.compile(rb"[^A-Za-z0-9 ]")


def normalise(topic: bytes) -> str:
    return _NOT_TOPIC.sub(b"", topic).decode("ascii").ljust(7)


def subject(topic: bytes) -> str:
    name = normalise(topic).rstrip(" ").replace(" ", "_")
    return PREFIX + (name or "_")


def chunks(data: bytes) -> list[bytes]:
    """A delivery: ≤128-byte chunks with their little-endian lengths, then the end marker."""
    out = []
    for i in range(0, len(data), CHUNK):
        part = data[i:i + CHUNK]
        out.append(len(part).to_bytes(2, "little") + part)
    out.append(END)
    return out


class Parser:
    """What a client sends, as items, however the bytes were split: ``(CMD_SUBSCRIBE, subject)``,
    ``(CMD_UNSUBSCRIBE, subject)``, ``(CMD_PUBLISH, subject)``, then ``(DATA, bytes)`` for every piece of the
    stream after a publish (to the client's half-close), or ``(UNKNOWN, byte)`` for a command byte that is none
    of these: nothing after it is parsed."""

    __slots__ = ("_buf", "_streaming", "_dead")

    def __init__(self) -> None:
        self._buf = b""
        self._streaming = False
        self._dead = False

    @property
    def partial(self) -> bool:
        """Whether part of a command is buffered."""
        return bool(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, object]]:
        if self._dead or not data:
            return []
        if self._streaming:
            return [(DATA, data)]
        buf = self._buf + data if self._buf else data
        out: list[tuple[int, object]] = []
        pos, n = 0, len(buf)
        while n - pos >= COMMAND_SIZE:
            cmd = buf[pos]
            topic = buf[pos + 1:pos + COMMAND_SIZE]
            pos += COMMAND_SIZE
            if cmd not in (CMD_SUBSCRIBE, CMD_UNSUBSCRIBE, CMD_PUBLISH):
                out.append((UNKNOWN, cmd))
                self._dead = True
                self._buf = b""
                return out
            out.append((cmd, subject(topic)))
            if cmd == CMD_PUBLISH:
                self._streaming = True
                self._buf = b""
                if pos < n:
                    out.append((DATA, buf[pos:]))
                return out
        self._buf = buf[pos:]
        return out
