"""Work queues for NATS clients: request/reply on ``$Q.<OP>.<queue>``, so a nats-py program needs nothing but
``nc.request`` and the ``Msg`` methods it already has (docs/queues.md).

- ``$Q.PUSH.<queue>``: the payload is the message; headers ``Q-Priority`` (0-9), ``Q-Delay`` (ms) and
  ``Nats-Msg-Id`` (the push's ``dedup_id``, as JetStream deduplicates).  Reply: ``{"ok":true,"id":...}``.
  A connection's consecutive pushes to one queue in one read go to the owner as one request, as NDJSON's do.
- ``$Q.RECV.<queue>``: a JSON body as JetStream's pull requests, ``{"batch": n, "expires": ns, "no_wait": b}``,
  plus ``visibility_ms`` and ``release_on_close``.  Each message goes to the reply subject with headers
  ``Q-Receipt``, ``Q-Deliveries``, ``Q-Msg-Id`` and the reply subject ``$Q.ACK.<queue>.<receipt>``; none: a status
  message, ``404 No Messages`` (or ``408 Request Timeout`` after a wait), as JetStream sends.
- ``$Q.ACK.<queue>.<receipt>`` (or ``$Q.ACK.<queue>`` with a ``Q-Receipt`` header): JetStream's vocabulary, so
  nats-py's ``msg.ack()``, ``msg.nak(delay)``, ``msg.in_progress()`` and ``msg.term()`` work on these messages:
  empty or ``+ACK``, ``-NAK`` (optionally ``{"delay": ns}``), ``+WPI`` (the lease again, a heartbeat), ``+TERM``
  (to the DLQ).  With a reply subject (``ack_sync``) the result comes back as JSON.  A connection's consecutive
  acks to one queue in one read go to the owner as one request (``receipts``), each answered on its own.
- ``$Q.STAT``, ``$Q.PURGE``, ``$Q.REDRIVE`` (JSON body ``{"to": ..., "max": ...}``): JSON replies.
Errors are JSON replies ``{"ok":false,"error":...}`` with the NDJSON protocol's error names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import orjson

from shardbroker.router.subjects import is_valid_literal
from shardbroker.workers.delivery import Outgoing
from shardbroker.workers.message import KIND_RAW, as_bytes
from shardbroker.workers.workqueues import fields as known
from shardbroker.workers.workqueues.messages import D_DATA, D_DELIVERIES, D_ID, D_KIND, D_RECEIPT, MS
from shardbroker.workers.workqueues.operations import OPERATIONS
from shardbroker.workers.workqueues.service import PUSH_WORK, allowed
from shardbroker.workers.workqueues.shard_requests import MAX_BATCH, MAX_WAIT_MS

if TYPE_CHECKING:
    from shardbroker.workers.hub import Hub
    from shardbroker.workers.subscription import Subscription


class Session(Protocol):
    """What the queue verbs need of a NATS session (``workers.protocols.nats.session.NatsSession``)."""

    hub: Hub
    cid: int
    user: Any
    closed: bool
    gathered: _Gathered | None
    _secure: bool

_OPS = {op.nats: op.name for op in OPERATIONS if op.nats}   # $Q.<VERB> -> the operation
_NO_MESSAGES = b"NATS/1.0 404 No Messages\r\n\r\n"
_TIMEOUT = b"NATS/1.0 408 Request Timeout\r\n\r\n"


def _headers(block: bytes | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if block:
        for line in block.decode("utf-8", "replace").split("\r\n")[1:]:
            name, sep, value = line.partition(":")
            if sep:
                out[name.strip().lower()] = value.strip()
    return out


def _json(payload: bytes) -> dict:
    if not payload.strip():
        return {}
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return {"__invalid__": True}
    return body if type(body) is dict else {"__invalid__": True}


def _ack_args(verb: bytes, args: dict) -> tuple[str, dict] | dict | None:
    """JetStream's ack payloads -> (op, args); a refusal (dict) for a -NAK body it cannot take; None: no verb."""
    word, _, rest = verb.strip().partition(b" ")
    if word in (b"", b"+ACK"):
        return "ack", args
    if word == b"-NAK":
        body = _json(rest) if rest else {}
        if "__invalid__" in body:
            return {"ok": False, "error": "invalid_json"}
        refusal = known.unknown(body, known.NATS["nack"])
        if refusal is not None:
            return refusal
        delay = body.get("delay", 0)
        if type(delay) is not int or delay < 0:
            return {"ok": False, "error": "invalid_delay", "min": 0}
        return "nack", dict(args, delay_ms=delay // MS)
    if word == b"+WPI":
        return "extend", args
    if word == b"+TERM":
        return "dead", args
    return None


def handle(session: Session, subject_b: bytes, reply: str | None, headers: bytes | None, payload: bytes) -> None:
    """A PUB to ``$Q.…`` (the work queues' internal subscription, ``service.API``): run it on the queue's owner,
    answer on ``reply`` (if any)."""
    try:
        subject = subject_b.decode()
    except UnicodeDecodeError:
        return
    _, _, tail = subject.partition(".")
    verb, _, queue = tail.partition(".")
    op = _OPS.get(verb)
    if reply is not None and not is_valid_literal(reply, session.hub.limits.max_topic_length):
        reply = None
    if op is None or not queue:
        _answer(session, reply, "", {"ok": False, "error": "unknown_op" if op is None else "invalid_queue"})
        return
    hdrs = _headers(headers)
    args: dict = {}
    if op == "ack":
        receipt = hdrs.get("q-receipt")
        if receipt is None:
            queue, _, receipt = queue.rpartition(".")
        args["receipt"] = receipt
        mapped = _ack_args(payload, args)
        if mapped is None or type(mapped) is dict:
            _answer(session, reply, "", mapped or {"ok": False, "error": "invalid_ack"})
            return
        op, args = mapped
    elif op == "push":
        args.update(data=payload, kind=KIND_RAW)
        for header, key in (("q-priority", "priority"), ("q-delay", "delay_ms")):
            if header in hdrs:
                value = hdrs[header]
                # ASCII digits only ("٣".isdigit() too); anything else is refused by the shard
                args[key] = int(value) if value.isascii() and value.isdigit() else value
        if "nats-msg-id" in hdrs:   # JetStream's header for the same: a publish sent again is stored once
            args["dedup_id"] = hdrs["nats-msg-id"]
    else:
        body = _json(payload)
        if "__invalid__" in body:
            _answer(session, reply, op, {"ok": False, "error": "invalid_json"})
            return
        refusal = known.unknown(body, known.NATS[op])
        if refusal is not None:
            _answer(session, reply, op, refusal)
            return
        if op == "recv":
            args["max"] = body.get("batch", 1)
            expires, no_wait = body.get("expires", 0), body.get("no_wait", False)
            if type(no_wait) is not bool:
                _answer(session, reply, op, {"ok": False, "error": "invalid_no_wait"})
                return
            if type(expires) is not int or expires < 0:   # 1e24 (beyond 64 bits) is a float: not a no-wait
                _answer(session, reply, op, {"ok": False, "error": "invalid_wait", "min": 0,
                                             "max": MAX_WAIT_MS * MS})
                return
            args["wait_ms"] = 0 if no_wait else expires // MS
            for key in ("visibility_ms", "release_on_close", "attempt"):
                if key in body:
                    args[key] = body[key]
        elif op == "redrive":
            args.update({k: body[k] for k in ("to", "max") if k in body})
    if not allowed(session.user.permissions if session._secure else None, op, queue):
        _answer(session, reply, op, {"ok": False, "error": "permission_denied"})
        return
    if op == "recv" and (reply is None or not _own_subscriptions(session, reply)):
        return   # nobody could be handed its messages: lease none (they would wait out the lease for nothing)
    if op in _GATHERED:
        if op == "push":
            session.hub.turn_work += PUSH_WORK
        _gather(session, op, queue, args, reply)
        return
    if session.gathered is not None:   # the pushes and acks before this request go first
        flush_gathered(session)
    args["queue"] = queue
    session.hub.queue_service.request(session.cid, op, args,
                                      lambda result: _answer(session, reply, op, result, args))


def _pushes(queue: str, each: list[dict]) -> tuple[str, dict]:
    """Pushes gathered: as their data's bytes, with their kind once, when none has more than its data (no header
    set a priority, a delay or a ``Nats-Msg-Id``), as NDJSON's canonical pushes travel; else each push's args."""
    if all([len(args) == 2 for args in each]):   # data and kind alone
        return "pushes", {"queue": queue, "pushes": [args["data"] for args in each], "kind": KIND_RAW}
    return "pushes", {"queue": queue, "pushes": each}


# Requests a connection sends many of in a row, gathered while a read is processed: op -> how the owner takes a
# group of them (one request), from the args of each.
_GATHERED = {
    "push": _pushes,
    "ack": lambda queue, each: ("ack", {"queue": queue, "receipts": [args["receipt"] for args in each]}),
}


class _Gathered:
    """A connection's consecutive pushes, or acks, to one queue read together: one request to the queue's owner,
    each push or ack still done or refused on its own and answered on its own reply subject."""

    __slots__ = ("op", "queue", "args", "replies")

    def __init__(self, op: str, queue: str) -> None:
        self.op = op
        self.queue = queue
        self.args: list[dict] = []            # each request's args, without the queue
        self.replies: list[str | None] = []   # each request's reply subject


def _gather(session: Session, op: str, queue: str, args: dict, reply: str | None) -> None:
    group = session.gathered
    if group is not None and (group.op != op or group.queue != queue or len(group.args) >= MAX_BATCH):
        flush_gathered(session)
        group = None
    if group is None:
        group = session.gathered = _Gathered(op, queue)
    group.args.append(args)
    group.replies.append(reply)


def flush_gathered(session: Session) -> None:
    """Send the connection's gathered requests: at the end of what it read, or before anything else it sent."""
    group, session.gathered = session.gathered, None
    service = session.hub.queue_service
    op, replies = group.op, group.replies
    if len(replies) == 1:
        args = group.args[0]
        args["queue"] = group.queue
        service.request(session.cid, op, args, lambda result: _answer(session, replies[0], op, result))
        return

    def answer(result: dict) -> None:
        if not any(replies):
            return
        ids = result.get("ids")   # every push stored
        if ids is not None:
            results = [{"ok": True, "id": msg_id} for msg_id in ids]
        else:   # each its own result; none: the whole request failed (its owner unavailable), each is told so
            results = result.get("results") or [result] * len(replies)
        for reply, one in zip(replies, results):
            _answer(session, reply, op, one)

    service.request(session.cid, *_GATHERED[op](group.queue, group.args), answer)


def _answer(session: Session, reply: str | None, op: str, result: dict, args: dict | None = None) -> None:
    """The broker's answer to a queue request goes to the requesting connection alone, on its own subscriptions
    that match ``reply``: never through the subject space, where it would reach whoever else subscribes to the
    reply subject (another user's inbox sniffer) or land on subjects the requester may not publish to."""
    if reply is None or session.closed:
        return
    hub = session.hub
    subs = _own_subscriptions(session, reply)
    if not subs:
        return
    reply_b = reply.encode()
    # The broker's answer, not the requester's publish: a requester that asked for no echo gets it all the same.
    if op == "recv" and result.get("ok"):
        messages = result["messages"]
        if not messages:
            status = _TIMEOUT if args and args.get("wait_ms") else _NO_MESSAGES
            _deliver(hub, subs, Outgoing(reply_b, None, status, b""))
            return
        queue = args["queue"]
        for sub in subs:
            if sub.conn.headers and not sub.max_msgs:   # the common case: its frames made here, in one loop
                _deliveries(hub, sub, reply_b, queue, messages)
                continue
            for m in messages:   # messages.D_* tuples
                ack = f"$Q.ACK.{queue}.{m[D_RECEIPT]}".encode()
                if not _deliver(hub, [sub], Outgoing(reply_b, ack, _delivery_headers(m), as_bytes(m[D_KIND],
                                                                                                   m[D_DATA]))):
                    break   # its delivery limit (UNSUB <sid> <max>) was reached
        return
    _deliver(hub, subs, Outgoing(reply_b, None, None, orjson.dumps(result)))


def _own_subscriptions(session: Session, reply: str) -> list:
    """The connection's plain subscriptions that match ``reply`` and may receive it now."""
    return [sub for sub in session.hub.route(reply).nats if sub.conn is session]


def _deliver(hub: Hub, subs: list, out: Outgoing) -> bool:
    """``out`` to each of ``subs`` (one connection's), honouring delivery limits; False if the last one's was
    reached."""
    alive = True
    for sub in subs:
        conn = sub.conn
        hub.send_frames(sub, [conn.frame_for(sub, out)], conn.payload_size(out))
        alive = not sub.max_msgs or sub.delivered < sub.max_msgs
        if not alive:
            conn.remove_subscription(sub)
    return alive


_CHUNK = 1 << 16   # payload bytes of a receive's frames joined at most into one delivery (_deliveries)


def _delivery_headers(m: tuple) -> bytes:
    """The header block of a received message (a ``messages.D_*`` tuple) as it goes to a NATS consumer."""
    return ("NATS/1.0\r\nQ-Receipt: %s\r\nQ-Deliveries: %d\r\nQ-Msg-Id: %s\r\n\r\n"
            % (m[D_RECEIPT], m[D_DELIVERIES], m[D_ID])).encode()


def _deliveries(hub: Hub, sub: Subscription, reply_b: bytes, queue: str, messages: list) -> None:
    """A receive's messages as HMSG frames for ``sub`` (no delivery limit, headers negotiated), made in one loop
    and delivered in chunks of at most ``_CHUNK`` payload bytes and one message (``Hub.send_frames``)."""
    head = b"HMSG %s %s $Q.ACK.%s." % (reply_b, sub.sid, queue.encode())
    frames = []
    size = 0
    for m in messages:   # messages.D_* tuples
        block = _delivery_headers(m)
        body = as_bytes(m[D_KIND], m[D_DATA])
        n = len(block) + len(body)
        frames.append(b"%s%s %d %d\r\n%s%s\r\n" % (head, m[D_RECEIPT].encode(), len(block), n, block, body))
        size += n
        if size >= _CHUNK:   # a thousand messages of up to a MiB each: never one join of all of them
            hub.send_frames(sub, frames, size)
            frames, size = [], 0
    if frames:
        hub.send_frames(sub, frames, size)
