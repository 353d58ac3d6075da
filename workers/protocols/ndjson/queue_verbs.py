"""Work-queue requests on the NDJSON protocol: ``qpush``, ``qrecv``, ``qack``, ``qextend``, ``qnack``, ``qdead``,
``qstat``, and for administrators ``qpurge`` and ``qredrive`` (docs/queues.md).

Queue requests are pipelined: each reserves its place among the connection's replies and the requests after it go
on (a long poll, and a request past ``MAX_PIPELINED``, suspend the connection instead).  The owner answers a push
only once it is journaled.  A message's ``data`` is delivered as the JSON value it was pushed as; bytes pushed by
a NATS client are a JSON string, or base64 with ``"encoding":"base64"``.

``qpush`` takes one message (``data``) or a batch (``messages``: a list of ``{"data", "priority", "delay_ms"}``
objects, stored together or not at all, answered with their ids in order).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from shardbroker.workers.connection import Connection
from shardbroker.workers.message import KIND_JSON, as_json
from shardbroker.workers.protocols.ndjson import codec, moves
from shardbroker.workers.speedups import qpush_batch, unplain
from shardbroker.workers.turn import TURN_BUDGET
from shardbroker.workers.workqueues import core
from shardbroker.workers.workqueues import fields as known
from shardbroker.workers.workqueues.operations import OPERATIONS
from shardbroker.workers.workqueues.service import PUSH_WORK, allowed
from shardbroker.workers.workqueues.shard_requests import MAX_BATCH


class Session(Protocol):
    """What the queue verbs need of an NDJSON session (``workers.protocols.ndjson.session.NdjsonSession``)."""

    hub: Any
    cid: int
    user: Any
    leftover: Any
    movable: bool
    push_group: _PushGroup | None
    pending_replies: int
    _secure: bool

    def reserve(self) -> list: ...
    def fill(self, slot: list, data: bytes) -> None: ...
    def send(self, data: bytes) -> None: ...
    def suspend(self, items: list | None = None, keep_reading: bool = False) -> None: ...
    def _reply_and_resume(self, reply: bytes | None) -> None: ...

MAX_PIPELINED = 1024   # queue requests of one connection awaiting their replies before it waits for them

_FIELDS = known.ARGS   # request field -> the shard's argument, for each op (anything else is refused first)

_dumps = orjson.dumps
_LONG_DIGIT_RUN = codec._LONG_DIGIT_RUN
_DIGITS = codec._DIGITS
_LOSSY_FLOAT = codec._LOSSY_FLOAT
_loads = orjson.loads
_NO_REQUEST: dict = {}   # what a push of a run (push_run) is answered for: a request with nothing to echo
# A batch push's fields that leave it canonical (its data taken as written, qpush_batch) when they follow the
# messages: the request's own (a push's fields and the id its reply echoes), which apply to the whole batch as
# they would anyway.
_CANONICAL_BATCH = frozenset(("op", "queue", "messages", "id", *_FIELDS["push"]))


def _message(m: tuple) -> bytes:
    """One delivery (a ``messages.D_*`` tuple) as the JSON object a ``qrecv`` reply lists.  Ids and receipts are
    base64url, which JSON takes as it is."""
    mid, receipt, kind, data, deliveries, priority, enqueued_at, reason, source = m
    extra = b""
    if kind != KIND_JSON:
        data, b64 = as_json(kind, data)
        if b64:
            extra = b',"encoding":"base64"'
    if reason:
        extra += b',"dead_reason":%s,"source":%s' % (_dumps(reason), _dumps(source))
    return b'{"id":"%s","receipt":"%s","data":%s,"deliveries":%d,"priority":%d,"enqueued_at":%d%s}' % (
        mid.encode(), receipt.encode(), data, deliveries, priority, enqueued_at, extra)


def _render(req: dict, result: dict) -> bytes:
    rid = req.get("id")
    messages = result.get("messages")
    if messages is not None and result.get("ok"):
        tail = b"]}\n" if rid is None else b'],"id":%s}\n' % _dumps(rid)
        if result.get("replayed"):   # a receive named by an attempt id, answered again (attempts.py)
            tail = b'],"replayed":true' + tail[1:]
        return b'{"ok":true,"messages":[' + core.render_deliveries(messages, KIND_JSON, _message) + tail
    if rid is not None:
        result = dict(result, id=rid)
    return _dumps(result) + b"\n"


def _pushed(req: dict, result: dict) -> bytes:
    """A single push's reply: pre-rendered in the common case (an id is base64url)."""
    msg_id = result.get("id")
    if msg_id is not None and len(result) == 2 and "id" not in req:
        return b'{"ok":true,"id":"%s"}\n' % msg_id.encode()
    if msg_id is not None and "id" in req:   # "id" echoes the request's, as on every reply: the message's moves
        result = dict(result, msg_id=msg_id)
    return _render(req, result)


def _exact_values(line: bytes) -> list:
    """The batch's ``data`` values read again with the standard library, which keeps integers beyond 64 bits
    exact (as ``protocols.ndjson.codec.encode_data`` does for one message)."""
    items = json.loads(line.decode()).get("messages")
    return [item.get("data") if type(item) is dict else None for item in items]


def _exact(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _batch(line: bytes, req: dict, items: object) -> list | bytes:
    """A push's ``messages`` as the shard takes them: ``(data, kind, priority, delay_ms)`` each, priority and delay
    None where the item has none (the request's, or the default); or the error reply (bytes)."""
    if type(items) is not list or not 1 <= len(items) <= MAX_BATCH or "data" in req:
        return codec.reply_with(req, {"ok": False, "error": "invalid_messages", "min": 1, "max": MAX_BATCH})
    for i, item in enumerate(items):
        if type(item) is not dict:
            return codec.reply_with(req, {"ok": False, "error": "invalid_message", "index": i})
        refusal = known.unknown(item, known.BATCH_ITEM)
        if refusal is not None:
            return codec.reply_with(req, dict(refusal, index=i))
    try:
        return _batch_data(line, items)
    except (orjson.JSONEncodeError, RecursionError):
        raise codec.TooDeep("data nested too deeply") from None


def _batch_data(line: bytes, items: list) -> list:
    if _LONG_DIGIT_RUN in line.translate(_DIGITS) or any(
            type(data) is float and (data >= _LOSSY_FLOAT or data <= -_LOSSY_FLOAT)
            for data in [item.get("data") for item in items]):
        # numbers orjson would not keep exact (once for the line, not per message)
        return [(_exact(value), KIND_JSON, item.get("priority"), item.get("delay_ms"))
                for value, item in zip(_exact_values(line), items)]
    # copied out of orjson's buffer: see protocols.ndjson.codec.encode_data
    return [(b"%s" % _dumps(item.get("data")), KIND_JSON, item.get("priority"), item.get("delay_ms"))
            for item in items]


def _op(op: str) -> Callable[[Session, dict, bytes], None]:
    fields = _FIELDS[op]
    defined = known.ALLOWED[op]
    render = _pushed if op == "push" else _render

    def run(session: Session, req: dict, line: bytes) -> None:
        queue = req.get("queue")
        if type(queue) is not str or not queue:
            session.send(codec.reply(req, "invalid_queue"))
            return
        if session._secure and not allowed(session.user.permissions, op, queue):
            session.send(codec.reply(req, "permission_denied"))
            return
        if not defined.issuperset(req):   # before anything is done
            session.send(codec.reply_with(req, known.unknown(req, defined)))
            return
        if session.movable:   # its first queue request: to the queue's owner, if it holds nothing here
            to = moves.target(session, queue)
            if to is not None:
                moves.start(session, line, to)
                return
        args = {key: req[key] for key in fields if key in req}
        args["queue"] = queue
        hub = session.hub
        if op == "push":
            items = req.get("messages")
            if items is None:
                args["data"] = codec.encode_data(line, req.get("data"))
                args["kind"] = KIND_JSON
                hub.turn_work += PUSH_WORK
            else:
                # The canonical form (nothing but JSON data in each item) travels as the data's text, as written.
                datas = qpush_batch(line) if req.keys() <= _CANONICAL_BATCH else None
                if datas is not None and 0 < len(datas) <= MAX_BATCH:
                    args["datas"] = datas
                else:
                    datas = _batch(line, req, items)
                    if type(datas) is bytes:
                        session.send(datas)
                        return
                    args["messages"] = datas
                hub.turn_work += PUSH_WORK * len(datas)
            if items is None and session.pending_replies < MAX_PIPELINED:
                group = session.push_group
                if group is not None and (group.queue != queue or len(group.pushes) >= MAX_BATCH):
                    flush_pushes(session)
                    group = None
                if group is None:
                    group = session.push_group = _PushGroup(queue)
                del args["queue"]
                group.pushes.append(args)
                group.replies.append((req, session.reserve(), 1))
                return
        if session.push_group is not None:   # the pushes before this request go first
            flush_pushes(session)
        service = hub.queue_service
        if (op == "recv" and args.get("wait_ms")) or session.pending_replies >= MAX_PIPELINED:
            # A long poll holds the requests after it (and keeps reading: a client that leaves, or half-closes,
            # cancels its wait); so does a request past the pipelining bound, until it is answered.
            session.suspend(keep_reading=op == "recv")
            service.request(session.cid, op, args, lambda result: session._reply_and_resume(render(req, result)))
            return
        # Pipelined: the requests after it go on (to the same owner they arrive in order), and its reply keeps
        # its place among the connection's replies.
        slot = session.reserve()
        service.request(session.cid, op, args, lambda result: session.fill(slot, render(req, result)))

    return run


OPS = {op.ndjson: _op(op.name) for op in OPERATIONS if op.ndjson}
PUSH = OPS["qpush"]


def push_run(session: Session, run: tuple) -> None:
    """A run of canonical single pushes to one queue with the same options (``speedups.ndjson_runs``: nothing but
    op, queue and data, in that order, then a priority and a delay or either, then a dedup_id for all or none),
    gathered as ``qpush`` gathers them, with one reply slot for the run instead of one per push and the data stored
    as the client wrote it.  The turn takes its share (``PUSHES_PER_TURN``); the rest waits for the next turn
    (``leftover``).  Anything that needs more goes one line at a time: a connection still movable, a login or
    permission to check, data that is not valid JSON, a connection near its pipelining bound."""
    queue_b, datas, lines, options, dedups = run
    queue = queue_b.decode()   # ASCII: ndjson_runs lets nothing else through
    if session.movable or session.pending_replies >= MAX_PIPELINED - 1 or (session._secure and (
            session.user is None or not allowed(session.user.permissions, "push", queue))):
        Connection._run(session, lines)
        return
    hub = session.hub
    room = max(1, min(len(datas), (TURN_BUDGET - hub.turn_work) // PUSH_WORK, MAX_BATCH,
                      MAX_PIPELINED - 1 - session.pending_replies))
    try:
        for data in unplain(datas[:room]):   # a string of plain characters is JSON as it stands: not parsed
            _loads(data)
    except orjson.JSONDecodeError:
        Connection._run(session, lines)
        return
    if room < len(datas):
        session.leftover = (queue_b, datas[room:], lines[room:], options,
                            dedups[room:] if dedups is not None else None)
        datas = datas[:room]
    if dedups is not None:   # each its own dedup_id: a push's args, with the run's priority and delay
        fields = _options(options)
        datas = [{"data": data, "kind": KIND_JSON, "dedup_id": dedup, **fields} for data, dedup in zip(datas, dedups)]
    hub.turn_work += PUSH_WORK * room
    group = session.push_group
    if group is not None and (group.queue != queue or group.options != options
                              or len(group.pushes) + room > MAX_BATCH):
        flush_pushes(session)
        group = None
    if group is None:
        group = session.push_group = _PushGroup(queue, options)
    group.pushes.extend(datas)   # a push of nothing but JSON data (and the group's options) travels as its bytes
    group.replies.append((_NO_REQUEST, session.reserve(), room))


def _options(text: bytes) -> dict:
    """A run's options (``,"priority":4,"delay_ms":100``, either, or ``b""``) as a push's args have them."""
    return _loads(b"{%s}" % text[1:]) if text else {}


class _PushGroup:
    """Single pushes to one queue read together: sent to its owner as one request (``pushes``), each still stored
    or refused on its own and answered in its own place."""

    __slots__ = ("queue", "options", "pushes", "replies")

    def __init__(self, queue: str, options: bytes = b"") -> None:
        self.queue = queue
        self.options = options   # the runs' options (push_run): the text after their data, b"" for none
        self.pushes: list[dict | bytes] = []   # a push's args, or the data of a run's push (push_run)
        # (request, reply slot, how many pushes in order it answers: 1, or a run's pushes in one reply)
        self.replies: list[tuple[dict, list, int]] = []


def flush_pushes(session: Session) -> None:
    """Send the connection's gathered pushes: at the end of what it read, or before any other request."""
    group, session.push_group = session.push_group, None
    service = session.hub.queue_service
    options = _options(group.options)   # for those of its pushes that are data's bytes alone
    if len(group.pushes) == 1:
        (args,), ((req, slot, _),) = group.pushes, group.replies
        if type(args) is bytes:
            args = {"data": args, "kind": KIND_JSON, **options}
        args["queue"] = group.queue
        service.request(session.cid, "push", args, lambda result: session.fill(slot, _pushed(req, result)))
        return

    def answer(result: dict) -> None:
        ids = result.get("ids")   # every one stored
        if ids is not None:
            i = 0
            for req, slot, n in group.replies:
                if req is _NO_REQUEST:   # a run: its replies rendered at once
                    session.fill(slot, ('{"ok":true,"id":"' + '"}\n{"ok":true,"id":"'.join(ids[i:i + n])
                                        + '"}\n').encode())
                else:
                    session.fill(slot, _pushed(req, {"ok": True, "id": ids[i]}))
                i += n
            return
        results = result.get("results")
        if results is None:   # the whole request failed (its owner unavailable): each push is told so
            results = [result] * len(group.pushes)
        i = 0
        for req, slot, n in group.replies:
            session.fill(slot, b"".join([_pushed(req, one) for one in results[i:i + n]]))
            i += n

    service.request(session.cid, "pushes", {"queue": group.queue, "pushes": group.pushes, **options}, answer)
