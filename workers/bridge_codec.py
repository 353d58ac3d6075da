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
