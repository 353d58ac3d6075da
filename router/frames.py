"""Frames exchanged between workers on the ZeroMQ fabric (bytes in, bytes out; no sockets here).

A frame is one ZeroMQ message:

    dst:u16 | src:u16 | epoch:u32 | seq:u64 | msgs_before:u64 | ack:u64 | ack_epoch:u32 | flags:u8 | body

- ``dst`` comes first because ZeroMQ SUB filters on a prefix: each worker subscribes to its own index only, so the
  PUB side sends a frame to the one worker it is addressed to.
- ``epoch`` is the sender's incarnation (the supervisor numbers every spawn), so a replaced worker starts a new link.
- ``seq`` numbers the frames of the link src->dst from 1; a gap means frames were lost.  ``msgs_before`` counts the
  messages sent on the link before this frame, so the receiver can say how many messages a gap lost.
- ``ack`` is the highest ``seq`` of the link dst->src that the sender has processed: it releases the receiver's flow
  control window and tells it that earlier interest changes are in force.  ``ack_epoch`` says which incarnation of
  dst those frames came from: a worker that has just replaced a dead one must not take acks meant for its
  predecessor as proof that its own frames arrive.  Ack-only frames carry seq 0 and no body; they are not part of
  the sequence (losing one is harmless, the next ack covers it).
- ``flags``: ``WANT_ACK`` asks the receiver to acknowledge as soon as it has processed what it received so far
  (the sender waits on it: a sync point, its flow-control window a quarter full, control items).  Without it
  the receiver's acks ride on its own frames, or on the ack-only frame it sends about once a second: an
  ack-only frame a frame cost as much again as the frame (two thread wake-ups on each side, ZeroMQ's and the
  event loop's), at a low rate.
- ``body`` is ``marshal`` of ``(messages, control)``: messages are ``(subject, kind, payload, reply, headers,
  extra)`` tuples, where ``payload`` may be a list of payloads (a run of messages to one subject, without
  headers); control is a list of small tuples (interest changes, hello, counters).  marshal is C-fast and only
  builds plain values; it is not safe for untrusted input, which is why the fabric lives in a private 0700 directory and
  only the broker's own workers ever write to it.
"""

from __future__ import annotations

import marshal
import struct

_HEADER = struct.Struct("!HHIQQQIB")
WANT_ACK = 1
HEADER_SIZE = _HEADER.size
_PREFIX = struct.Struct("!H")

Message = tuple  # (subject: str, kind: int, payload: bytes | list[bytes], reply: str | None, headers, extra)


def count(messages: list) -> int:
    """How many messages ``messages`` holds, a run counting as its payloads (what the link's counters count)."""
    return len(messages) + sum([len(m[2]) - 1 for m in messages if type(m[2]) is list])


def prefix(dst: int) -> bytes:
    """The ZeroMQ subscription prefix that selects frames addressed to ``dst``."""
    return _PREFIX.pack(dst)


def encode(dst: int, src: int, epoch: int, seq: int, msgs_before: int, ack: int, ack_epoch: int,
           messages: list, control: list, flags: int = 0) -> bytes:
    head = _HEADER.pack(dst, src, epoch, seq, msgs_before, ack, ack_epoch, flags)
    if not messages and not control:
        return head
    return head + marshal.dumps((messages, control))


def decode(frame: bytes) -> tuple[int, int, int, int, int, int, int, list, list]:
    """-> (src, epoch, seq, msgs_before, ack, ack_epoch, flags, messages, control).  ValueError on a malformed
    frame."""
    if len(frame) < HEADER_SIZE:
        raise ValueError("short fabric frame")
    _dst, src, epoch, seq, msgs_before, ack, ack_epoch, flags = _HEADER.unpack_from(frame)
    if len(frame) == HEADER_SIZE:
        return src, epoch, seq, msgs_before, ack, ack_epoch, flags, [], []
    try:
        messages, control = marshal.loads(memoryview(frame)[HEADER_SIZE:])
    except (EOFError, TypeError, ValueError) as exc:
        raise ValueError(f"bad fabric frame body: {exc}") from None
    return src, epoch, seq, msgs_before, ack, ack_epoch, flags, messages, control
