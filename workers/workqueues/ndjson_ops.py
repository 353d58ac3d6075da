"""Work-queue requests on the NDJSON protocol: ``qpush``, ``qrecv``, ``qack``, ``qextend``, ``qnack``, ``qdead``,
``qstat``, and for administrators ``qpurge`` and ``qredrive`` (docs/queues.md).

Each request suspends its connection until the queue's owner answers (replies stay in request order, as for
``sub``); the owner answers a push only once it is journaled.  A message's ``data`` is delivered as the JSON value
it was pushed as; bytes pushed by a NATS client are a JSON string, or base64 with ``"encoding":"base64"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import orjson

from workers import ndjson_codec as codec
from workers.message import KIND_JSON, as_json

from .service import allowed

if TYPE_CHECKING:
    from workers.ndjson import NdjsonSession

# request field -> the shard's argument, for each op (anything else in a request is ignored, as everywhere)
MAX_PIPELINED = 1024   # queue requests of one connection awaiting their replies before it waits for them

_FIELDS = {
    "push": ("priority", "delay_ms"),
    "recv": ("max", "wait_ms", "visibility_ms", "release_on_close"),
    "ack": ("receipt", "receipts"),
    "extend": ("receipt", "visibility_ms"),
    "nack": ("receipt", "delay_ms"),
    "dead": ("receipt",),
    "stat": (),
    "purge": (),
    "redrive": ("to", "max"),
}


def _message(m: dict) -> dict:
    data, b64 = as_json(m["kind"], m["data"])
    out = {"id": m["id"], "receipt": m["receipt"], "data": orjson.Fragment(data), "deliveries": m["deliveries"],
           "priority": m["priority"], "enqueued_at": m["enqueued_at"]}
    if b64:
        out["encoding"] = "base64"
    if "dead_reason" in m:
        out["dead_reason"], out["source"] = m["dead_reason"], m["source"]
    return out


def _render(req: dict, result: dict) -> bytes:
    if "messages" in result:
        result = dict(result, messages=[_message(m) for m in result["messages"]])
    rid = req.get("id")
    if rid is not None:
        result = dict(result, id=rid)
    return orjson.dumps(result) + b"\n"


def _op(op: str) -> Callable[["NdjsonSession", dict, bytes], None]:
    fields = _FIELDS[op]

    def run(session: "NdjsonSession", req: dict, line: bytes) -> None:
        queue = req.get("queue")
        if type(queue) is not str or not queue:
            session.send(codec.reply(req, "invalid_queue"))
            return
        if not allowed(session.user.permissions if session._secure else None, op, queue):
            session.send(codec.reply(req, "permission_denied"))
            return
        args = {key: req[key] for key in fields if key in req}
        args["queue"] = queue
        if op == "push":
            args["data"] = codec.encode_data(line, req.get("data"))
            args["kind"] = KIND_JSON
        if (op == "recv" and args.get("wait_ms")) or session.pending_replies >= MAX_PIPELINED:
            # A long poll holds the requests after it (and keeps reading: a client that leaves, or half-closes,
            # cancels its wait); so does a request past the pipelining bound, until it is answered.
            session.suspend(keep_reading=op == "recv")
            session.hub.queue_service.request(session.cid, op, args,
                                              lambda result: session._reply_and_resume(_render(req, result)))
            return
        # Pipelined: the requests after it go on (to the same owner they arrive in order), and its reply keeps
        # its place among the connection's replies.
        slot = session.reserve()
        session.hub.queue_service.request(session.cid, op, args,
                                          lambda result: session.fill(slot, _render(req, result)))

    return run


OPS = {"q" + op: _op(op) for op in _FIELDS}
