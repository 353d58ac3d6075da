"""The fields each work-queue request may carry, and the error for one it may not.

A field nobody defines was silently ignored: ``{"op":"qrecv","visibility":1}`` (meant: ``visibility_ms``) took the
default 30 s lease, ``"delay":5000`` pushed at once.  Now it is refused before anything is done, naming the field
and the nearest one that exists (``unknown_field``), on NDJSON and in the JSON bodies of NATS ``$Q`` requests.
"""

from __future__ import annotations

import difflib
from typing import Iterable

# NDJSON: the request fields that go to the shard as its arguments, for each op
ARGS = {
    "push": ("priority", "delay_ms", "dedup_id"),
    "recv": ("max", "wait_ms", "visibility_ms", "release_on_close"),
    "ack": ("receipt", "receipts"),
    "extend": ("receipt", "visibility_ms"),
    "nack": ("receipt", "delay_ms"),
    "dead": ("receipt",),
    "stat": (),
    "purge": (),
    "redrive": ("to", "max"),
}
BATCH_ITEM = ("data", "priority", "delay_ms")   # a qpush ``messages`` item's
_EVERY_REQUEST = ("op", "cmd", "queue", "id")
_CONTENT = {"push": ("data", "messages")}   # what a push stores, read by ndjson_ops itself

# NATS $Q JSON bodies, by op (``$Q.PUSH``'s payload is the message itself, an ack's is JetStream's verb)
NATS = {
    "recv": ("batch", "expires", "no_wait", "visibility_ms", "release_on_close"),
    "redrive": ("to", "max"),
    "stat": (),
    "purge": (),
    "nack": ("delay",),
}

ALLOWED = {op: frozenset(_EVERY_REQUEST + args + _CONTENT.get(op, ())) for op, args in ARGS.items()}


def unknown(keys: Iterable[str], allowed: Iterable[str]) -> dict | None:
    """The refusal of the first of ``keys`` not in ``allowed`` (``{"ok": false, "error": "unknown_field",
    "field": ..., "did_you_mean": ...}``, the last if one is close), or None if every key is allowed."""
    allowed = set(allowed)
    for key in keys:
        if key not in allowed:
            refusal = {"ok": False, "error": "unknown_field", "field": key}
            near = difflib.get_close_matches(str(key), sorted(allowed - {"op", "cmd"}), n=1, cutoff=0.5)
            if near:
                refusal["did_you_mean"] = near[0]
            return refusal
    return None
