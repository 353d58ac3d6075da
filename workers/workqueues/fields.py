"""The fields each work-queue request may carry, and the error for one it may not.

A field nobody defines was silently ignored: ``{"op":"qrecv","visibility":1}`` (meant: ``visibility_ms``) took the
default 30 s lease, ``"delay":5000`` pushed at once.  Now it is refused before anything is done, naming the field
and the nearest one that exists (``unknown_field``), on NDJSON and in the JSON bodies of NATS ``$Q`` requests.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from shardbroker.workers.workqueues.operations import OPERATIONS

# NDJSON: the request fields that go to the shard as its arguments, for each op it spells (operations.OPERATIONS)
ARGS = {op.name: op.args for op in OPERATIONS if op.ndjson}
BATCH_ITEM = ("data", "priority", "delay_ms")   # a qpush ``messages`` item's
_EVERY_REQUEST = ("op", "cmd", "queue", "id")

# NATS $Q JSON bodies, by op (``$Q.PUSH``'s payload is the message itself, an ack's is JetStream's verb)
NATS = {op.name: op.nats_body for op in OPERATIONS if op.nats_body is not None}

ALLOWED = {op.name: frozenset(_EVERY_REQUEST + tuple(name for name, _ in op.fields)) for op in OPERATIONS if op.ndjson}


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
