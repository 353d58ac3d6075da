"""What a delivery is: where a message to one subject goes (``Route``), and the bytes this worker's subscribers get.

A route is what matching a subject against the tries gives (``workers.interest``), kept by the route cache
(``router.routes``) until a trie or a permission changes.  It also holds the open batch of consecutive messages to
its subject (``workers.fanout``): their encodings, joined for each subscriber when the run ends.

A delivery is encoded once per message for all of its subscribers of one protocol: NDJSON's delivery line, NATS'
``MSG`` tail (or ``Outgoing``, for headers and subscribers that differ).  These formats are the core's concern, as
the compiled runs of them are (``workers.speedups.msg_tails``): the hub writes them for fan-out, and parsing and
replies stay each protocol's (``workers.protocols.*.codec``), which import what they need of them from here.
"""

from __future__ import annotations

import orjson

from shardbroker.router.subjects import is_literal
from shardbroker.workers.message import KIND_JSON, as_json

_CRLF = b"\r\n"


class Route:
    """Where a message to one subject goes, as of one generation of the tries."""

    __slots__ = ("subject", "subject_b", "msg_head", "ndjson", "nats", "nats_plain", "others", "local", "remote",
                 "queued", "groups", "owner", "prefix", "wild", "msgs", "bytes", "fanout", "members", "lines",
                 "tails", "batched", "batched_bytes", "batched_payload", "generation", "service", "leaf")

    def __init__(self, subject: str, ndjson: tuple, nats: tuple, others: tuple, remote: tuple[int, ...],
                 queued: bool, owner: int, batching: bool = True) -> None:
        self.subject = subject
        self.subject_b = subject_b = subject.encode()
        self.msg_head = head = b"MSG " + subject_b + b" "
        self.ndjson = ndjson          # NDJSON connections, one entry per connection however many patterns match
        self.nats = nats              # NATS subscriptions (plain): one delivery per matching subscription
        self.others = others          # other protocols' connections (Bridge)
        self.fanout = fanout = len(ndjson) + len(nats) + len(others)
        self.local = fanout > 0
        # Batching (workers.fanout), where the caller wants it, needs the common NATS case: no UNSUB limits
        # (counted per message), and one subscription per connection (batching two of one connection would
        # reorder them relative to each other).  Then the NATS subscribers are precomputed as (connection,
        # subscription, "MSG <subject> <sid>"), and ``members`` is who a batch holds messages for; None: no
        # batching, each message delivered as it comes.  (One loop, no comprehensions or generators: a route is
        # made for every new subject, a reply's inbox included, and this is most of what making one costs.)
        self.nats_plain = ()
        self.members = None
        if batching:
            plain = []
            members = set(ndjson)
            for sub in nats:
                conn = sub.conn
                if sub.max_msgs or conn in members:
                    break
                members.add(conn)
                plain.append((conn, sub, head + sub.sid))
            else:
                self.nats_plain = tuple(plain)
                self.members = members
        # The open batch: NDJSON delivery lines; NATS tails (" <size>\r\n<payload>\r\n") after an empty first
        # item, so that joining them with a subscriber's "MSG <subject> <sid>" puts it before every tail.
        self.lines: list[bytes] = []
        self.tails: list[bytes] = [b""]
        # The open batch's messages, bytes and payload bytes (what the out_bytes counters count); the messages and
        # bytes published here in this turn (folded by subject at its end: workers.counters); the generation of the
        # tries it was matched against (router.routes.RouteCache.route_for).
        self.batched = self.batched_bytes = self.batched_payload = self.msgs = self.bytes = self.generation = 0
        self.remote = remote          # workers with a matching plain subscriber
        self.queued = queued          # some queue group of the cluster matches: the owner dispatches
        self.groups = None            # the owner's queue groups for this subject, built when first needed
        self.owner = owner
        self.prefix = ndjson_prefix(subject) if ndjson else b""   # for NDJSON deliveries alone
        # NATS may publish to "foo.*" as a literal; NDJSON may not
        self.wild = ("*" in subject or ">" in subject) and not is_literal(subject)
        # An internal subscription's handler (Hub.serve): the broker's own API on this subject, which it serves
        # alone (no client subscription receives what is published here).
        self.service = None
        # The leaf connections (to NATS hubs) a message published here goes to, each with the queue groups it
        # names there (workers/protocols/leaf/leafnodes.py).
        self.leaf = ()


# -- NDJSON ------------------------------------------------------------------------------------------------------

def ndjson_prefix(subject: str) -> bytes:
    return b'{"topic":' + orjson.dumps(subject) + b',"data":'


def ndjson_delivery(prefix: bytes, kind: int, payload: bytes, reply_to: str | None, headers: bytes | None) -> bytes:
    """A delivery line, built once per message for all its NDJSON subscribers."""
    if kind == KIND_JSON and reply_to is None and headers is None:
        return prefix + payload + b"}\n"
    payload, b64 = as_json(kind, payload)
    extra: dict = {}
    if b64:
        extra["encoding"] = "base64"
    if reply_to is not None:
        extra["reply"] = reply_to
    if headers is not None:
        extra["headers"] = headers.decode("utf-8", "replace")
    if not extra:
        return prefix + payload + b"}\n"
    return prefix + payload + b"," + orjson.dumps(extra)[1:] + b"\n"


def ndjson_deliveries(prefix: bytes, kind: int, payloads: list[bytes], reply_to: str | None) -> list[bytes]:
    """``ndjson_delivery`` for each message of a run without headers."""
    if kind == KIND_JSON and reply_to is None:
        return [prefix + payload + b"}\n" for payload in payloads]
    return [ndjson_delivery(prefix, kind, payload, reply_to, None) for payload in payloads]


# -- NATS --------------------------------------------------------------------------------------------------------

def msg_tail(reply: str | None, payload: bytes) -> bytes:
    """What follows ``MSG <subject> <sid>`` in a message without headers: the same for every subscriber."""
    if reply:
        return b" %s %d\r\n%s\r\n" % (reply.encode(), len(payload), payload)
    return b" %d\r\n%s\r\n" % (len(payload), payload)


class Outgoing:
    """One message as NATS subscribers receive it: the parts shared by all of them, built once.

    Per subscriber only the sid differs: ``MSG <subject> <sid> [reply] <size>\\r\\n<payload>\\r\\n``, or HMSG with
    the header block for subscribers that negotiated headers.
    """

    __slots__ = ("head", "tail", "body", "htail", "hbody")

    def __init__(self, subject: bytes, reply: bytes | None, headers: bytes | None, payload: bytes) -> None:
        reply_part = b" " + reply if reply else b""
        self.head = b"MSG " + subject + b" "
        self.tail = reply_part + b" " + str(len(payload)).encode() + _CRLF
        self.body = payload + _CRLF
        if headers is not None:
            self.htail = reply_part + b" %d %d\r\n" % (len(headers), len(headers) + len(payload))
            self.hbody = headers + payload + _CRLF
        else:
            self.htail = self.hbody = b""

    def msg_line(self, sid: bytes) -> bytes:
        return self.head + sid + self.tail

    def hmsg_line(self, sid: bytes) -> bytes:
        return b"H" + self.head + sid + self.htail
