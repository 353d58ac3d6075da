"""The NATS core client protocol as bytes: an incremental parser of what clients send, and what the server sends.
No sockets here.

The parser follows nats-server's (server/parser.go) where clients can tell the difference:
- verbs are case-insensitive, arguments are separated by any run of spaces and tabs;
- control lines may end in LF alone; a payload must be followed by exactly CRLF;
- a control line longer than ``max_control_line`` is an error (checked while it is still arriving, so a client
  cannot make the server buffer more); a PUB or HPUB larger than ``max_payload`` is refused on its control line,
  before the payload arrives;
- a malformed argument list closes the connection without ``-ERR``; an unknown verb gets
  ``-ERR 'Unknown Protocol Operation'``.
A payload is sliced out of the buffer by its declared size, never scanned.  Large payloads that span many reads are
gathered in a list and joined once, so no read copies what came before it.

``feed`` returns commands as tuples, in order.  Consecutive complete PUBs to one subject (and reply) in one read
come as one ``(OP_PUBS, subject, reply, payloads)``: the hot path routes and batches a run in one call
(``workers.speedups.scan_pubs`` reads it, compiled where built); a PUB whose payload spans reads, and HPUB, come
as ``(OP_PUB, subject, reply, headers, payload)``.  After an ``ERR`` command nothing more is parsed: the session
sends the text (if any) and closes.
"""

from __future__ import annotations

from shardbroker.workers.speedups import scan_pubs

OP_PUB, OP_SUB, OP_UNSUB, OP_PING, OP_PONG, OP_CONNECT, OP_INFO, OP_ERR, OP_PUBS = range(9)

ERR_UNKNOWN_OP = "Unknown Protocol Operation"
ERR_CONTROL_LINE = "maximum control line exceeded"
ERR_MAX_PAYLOAD = "Maximum Payload Violation"

CRLF = b"\r\n"
PING = b"PING\r\n"
PONG = b"PONG\r\n"
OK = b"+OK\r\n"

# (ERR, None): close without a word, as nats-server does for argument errors.
_PROTOCOL_VIOLATION = (OP_ERR, None)


def err(text: str) -> bytes:
    return b"-ERR '" + text.encode() + b"'\r\n"


class Framing:
    """nats-server's framing, which its client and leafnode protocols share: control lines, each message's payload
    (with its header block) sliced out by its declared size.  A protocol's parser gives ``_control`` (a line to an
    item, or None when it set ``_pending``/``_want`` for a payload) and the items its errors are, ``_LONG_LINE``
    and ``_BAD_END``; ``_scan``, where given, takes runs of messages ahead of the line-by-line path (NATS' PUBs)."""

    __slots__ = ("max_control_line", "max_payload", "_buf", "_chunks", "_have", "_want", "_pending", "_dead", "_scan")
    _ERR = OP_ERR          # the first field of an error item: the parser stops after one
    _LONG_LINE: tuple = (OP_ERR, ERR_CONTROL_LINE)
    _BAD_END: tuple = (OP_ERR, ERR_UNKNOWN_OP)   # a payload not followed by CRLF

    def __init__(self, max_control_line: int, max_payload: int, scan=None) -> None:
        self._scan = scan
        self.max_control_line = max_control_line
        self.max_payload = max_payload
        self._buf = b""
        self._chunks: list[bytes] = []      # a large payload still arriving
        self._have = 0
        self._want = 0                      # bytes needed (payload + CRLF) before _pending completes
        # (the message's item without headers and payload, header length or -1), waiting for its payload
        self._pending: tuple | None = None
        self._dead = False

    def _control(self, line: bytes) -> tuple | None:
        raise NotImplementedError

    def feed(self, data: bytes) -> list[tuple]:
        if self._dead:
            return []
        out: list[tuple] = []
        if self._pending is not None and self._chunks:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._want:
                return out
            data = b"".join(self._chunks)
            self._chunks = []
        buf = self._buf + data if self._buf else data
        pos, n = 0, len(buf)
        max_line, max_payload = self.max_control_line, self.max_payload
        scan = self._scan
        while pos < n:
            pending = self._pending
            if pending is not None:
                end = pos + self._want
                if end > n:
                    if self._want > 65536:  # gather the rest without re-copying the buffer per read
                        self._chunks = [buf[pos:]]
                        self._have = n - pos
                        self._buf = b""
                        return out
                    break
                if buf[end - 2:end] != CRLF:
                    return self._fail(out, self._BAD_END)
                head, hdr = pending
                if hdr < 0:
                    out.append((*head, None, buf[pos:end - 2]))
                else:
                    out.append((*head, buf[pos:pos + hdr], buf[pos + hdr:end - 2]))
                self._pending = None
                pos = end
                continue
            if scan is not None:
                subject, reply, payloads, after = scan(buf, pos, max_line, max_payload)
                if payloads:
                    out.append((OP_PUBS, subject, reply, payloads))
                    pos = after
                    continue
            nl = buf.find(b"\n", pos)
            if nl < 0:
                # a CR at the end may be the CRLF's: the line is too long only without it (split or not, the same)
                if n - pos - (buf[n - 1] == 13) > max_line:
                    return self._fail(out, self._LONG_LINE)
                break
            end = nl - 1 if nl > pos and buf[nl - 1] == 13 else nl
            if end - pos > max_line:
                return self._fail(out, self._LONG_LINE)
            line = buf[pos:end]
            pos = nl + 1
            cmd = self._control(line)
            if cmd is None:
                continue  # a message waiting for its payload
            if cmd[0] == self._ERR:
                return self._fail(out, cmd)
            out.append(cmd)
        self._buf = buf[pos:] if pos < n else b""
        return out

    def _fail(self, out: list[tuple], cmd: tuple) -> list[tuple]:
        out.append(cmd)
        self._dead = True
        self._buf = b""
        self._chunks = []
        self._pending = None
        return out


class Parser(Framing):
    __slots__ = ()

    def __init__(self, max_control_line: int, max_payload: int, scan=None) -> None:
        # tests pass each implementation of scan_pubs in turn (workers.speedups)
        super().__init__(max_control_line, max_payload, scan or scan_pubs)

    def _control(self, line: bytes) -> tuple | None:
        args = line.split()
        if not args:
            return (OP_ERR, ERR_UNKNOWN_OP)
        verb = args[0]
        if verb != b"PUB":
            verb = verb.upper()
        if verb == b"PUB":
            if len(args) == 3:
                subject, reply, size = args[1], None, args[2]
            elif len(args) == 4:
                subject, reply, size = args[1], args[2], args[3]
            else:
                return _PROTOCOL_VIOLATION
            nbytes = _size(size)
            if nbytes < 0:
                return _PROTOCOL_VIOLATION
            if nbytes > self.max_payload:
                return (OP_ERR, ERR_MAX_PAYLOAD)
            self._pending = ((OP_PUB, subject, reply), -1)
            self._want = nbytes + 2
            return None
        if verb == b"HPUB":
            if len(args) == 4:
                subject, reply, hsize, tsize = args[1], None, args[2], args[3]
            elif len(args) == 5:
                subject, reply, hsize, tsize = args[1], args[2], args[3], args[4]
            else:
                return _PROTOCOL_VIOLATION
            hdr, total = _size(hsize), _size(tsize)
            if hdr < 0 or total < 0 or hdr > total:
                return _PROTOCOL_VIOLATION
            if total > self.max_payload:
                return (OP_ERR, ERR_MAX_PAYLOAD)
            self._pending = ((OP_PUB, subject, reply), hdr)
            self._want = total + 2
            return None
        if verb == b"SUB":
            if len(args) == 3:
                return (OP_SUB, args[1], None, args[2])
            if len(args) == 4:
                return (OP_SUB, args[1], args[2], args[3])
            return _PROTOCOL_VIOLATION
        if verb == b"UNSUB":
            if len(args) == 2:
                return (OP_UNSUB, args[1], None)
            if len(args) == 3:
                limit = _size(args[2])
                return (OP_UNSUB, args[1], limit) if limit >= 0 else _PROTOCOL_VIOLATION
            return _PROTOCOL_VIOLATION
        if verb == b"PING":
            return (OP_PING,)
        if verb == b"PONG":
            return (OP_PONG,)
        if verb == b"CONNECT":
            return (OP_CONNECT, line[len(args[0]):].strip())
        if verb == b"INFO":
            return (OP_INFO,)
        return (OP_ERR, ERR_UNKNOWN_OP)


def _size(token: bytes) -> int:
    """A decimal size, or -1: nats-server accepts digits only (no sign, no spaces)."""
    return int(token) if token.isdigit() and len(token) <= 12 else -1


# -- server to client ------------------------------------------------------------------------------------------

def no_responders(reply: bytes, sid: bytes) -> bytes:
    """The status message nats-server (2.9) sends a requester when nobody is subscribed to the subject."""
    return b"HMSG " + reply + b" " + sid + b" 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
