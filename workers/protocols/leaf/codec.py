"""nats-server's leafnode protocol as bytes (../shared/reference/leafnodes.md §2-3): an incremental parser of what a
hub sends, and what a spoke sends.  No sockets here.

The parser follows nats-server's (server/parser.go) as a hub speaks it:
- operators are case-insensitive, arguments separated by any run of spaces and tabs, control lines may end in LF;
- ``LS+ <subject> [<queue> <weight>]`` and ``LS- <subject> [<queue>]`` (no account: a leaf connection is bound to
  one account on each side);
- ``LMSG <subject> [<reply> | "|" q… | "+" <reply> q…] <size>`` and ``HMSG`` with ``<header size> <total size>``;
- a control line longer than ``max_control_line`` (nats-server allows a leaf 64 KB) is an error while it is still
  arriving, and a message over ``max_payload`` on its control line: a hub cannot make a worker buffer more.
A payload is sliced out by its declared size, never scanned (``Framing``: nats-server's framing, which the client
protocol's parser shares).

``feed`` returns events as tuples, in order; after an ``ERR`` event nothing more is parsed (the link logs it and
redials).  Messages come as ``(MSG, subject, reply, queues, headers, payload)`` with bytes throughout and
``queues`` a tuple of group names (empty for plain interest only).
"""

from __future__ import annotations

import orjson

from shardbroker.workers.protocols.nats.codec import Framing

INFO, LS_ADD, LS_DEL, MSG, PING, PONG, OK, ERR, REMOTE_ERR = range(9)

CRLF = b"\r\n"
PING_LINE = b"PING\r\n"
PONG_LINE = b"PONG\r\n"
CONTROL_LINE_MAX = 64 * 1024   # nats-server's leaf limit: 16 × max_control_line


class Parser(Framing):
    """What a hub sends, as events; the framing is nats-server's, shared with its client protocol."""

    __slots__ = ()
    _ERR = ERR
    _LONG_LINE = (ERR, "a control line over the limit")
    _BAD_END = (ERR, "a message's payload is not followed by CRLF")

    def __init__(self, max_payload: int, max_control_line: int = CONTROL_LINE_MAX) -> None:
        super().__init__(max_control_line, max_payload)

    def _control(self, line: bytes) -> tuple | None:
        args = line.split()
        if not args:
            return (ERR, "an empty control line")
        op = args[0].upper()
        if op == b"LMSG" or op == b"HMSG":
            return self._message(args, op == b"HMSG")
        if op == b"LS+":
            if len(args) == 2:
                return (LS_ADD, args[1], None, 0)
            if len(args) == 4:
                weight = _size(args[3])
                if weight >= 0:
                    return (LS_ADD, args[1], args[2], weight)
            elif len(args) == 3:   # a queue without a weight: nats-server counts it as one
                return (LS_ADD, args[1], args[2], 1)
            return (ERR, f"malformed LS+: {_shown(line)}")
        if op == b"LS-":
            if len(args) in (2, 3):
                return (LS_DEL, args[1], args[2] if len(args) == 3 else None)
            return (ERR, f"malformed LS-: {_shown(line)}")
        if op == b"PING":
            return (PING,)
        if op == b"PONG":
            return (PONG,)
        if op == b"+OK":
            return (OK,)
        if op == b"-ERR":
            text = line[4:].strip()
            if text[:1] == b"'" and text[-1:] == b"'" and len(text) >= 2:
                text = text[1:-1]
            return (REMOTE_ERR, text.decode("utf-8", "replace"))
        if op == b"INFO":
            try:
                info = orjson.loads(line[4:])
            except orjson.JSONDecodeError:
                return (ERR, "an INFO that is not JSON")
            if not isinstance(info, dict):
                return (ERR, "an INFO that is not a JSON object")
            return (INFO, info)
        return (ERR, f"unknown operation {_shown(args[0])}")

    def _message(self, args: list[bytes], headers: bool) -> tuple | None:
        sizes = 2 if headers else 1
        if len(args) < 2 + sizes:
            return (ERR, f"malformed {args[0].decode('ascii', 'replace').upper()}")
        subject = args[1]
        middle = args[2:-sizes]
        reply = None
        queues: tuple = ()
        if middle:
            mark = middle[0]
            if mark == b"|":
                queues = tuple(middle[1:])
            elif mark == b"+":
                if len(middle) < 2:
                    return (ERR, "an LMSG with '+' and no reply")
                reply, queues = middle[1], tuple(middle[2:])
            elif len(middle) == 1:
                reply = mark
            else:
                return (ERR, "malformed LMSG arguments")
        if headers:
            hdr, total = _size(args[-2]), _size(args[-1])
            if hdr < 0 or total < 0 or hdr > total:
                return (ERR, "malformed HMSG sizes")
        else:
            hdr, total = -1, _size(args[-1])
            if total < 0:
                return (ERR, "malformed LMSG size")
        if total > self.max_payload:
            return (ERR, f"a message of {total} bytes, over max_payload {self.max_payload}")
        self._pending = ((MSG, subject, reply, queues), hdr)
        self._want = total + 2
        return None


def _size(token: bytes) -> int:
    return int(token) if token.isdigit() and len(token) <= 12 else -1


def _shown(data: bytes) -> str:
    text = data[:80].decode("utf-8", "replace")
    return repr(text + ("…" if len(data) > 80 else ""))


# -- spoke to hub -------------------------------------------------------------------------------------------------

def err(text: str) -> bytes:
    return b"-ERR '" + text.encode() + b"'\r\n"


def connect(fields: dict) -> bytes:
    return b"CONNECT " + orjson.dumps(fields) + CRLF


def ls_add(subject: bytes, queue: bytes | None = None, weight: int = 0) -> bytes:
    if queue is None:
        return b"LS+ " + subject + CRLF
    return b"LS+ %s %s %d\r\n" % (subject, queue, weight)


def ls_del(subject: bytes, queue: bytes | None = None) -> bytes:
    if queue is None:
        return b"LS- " + subject + CRLF
    return b"LS- " + subject + b" " + queue + CRLF


def message_head(subject: bytes, reply: bytes | None, queues: bytes | None) -> bytes:
    """What follows the operator and precedes the sizes: `` <subject>[ <reply> | | q… | + <reply> q…] ``."""
    if queues:
        if reply:
            return b" " + subject + b" + " + reply + b" " + queues + b" "
        return b" " + subject + b" | " + queues + b" "
    if reply:
        return b" " + subject + b" " + reply + b" "
    return b" " + subject + b" "


def lmsg(head: bytes, headers: bytes | None, payload: bytes) -> bytes:
    """One message; ``head`` from ``message_head`` (one per route, shared by its messages)."""
    if headers is None:
        return b"LMSG%s%d\r\n%s\r\n" % (head, len(payload), payload)
    return b"HMSG%s%d %d\r\n%s%s\r\n" % (head, len(headers), len(headers) + len(payload), headers, payload)
