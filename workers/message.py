"""The payload of a message inside the broker, whichever protocol published it.

A message travels as ``(subject, kind, payload, reply, headers)``:
- ``KIND_JSON``: ``payload`` is the JSON encoding of an NDJSON ``data`` value;
- ``KIND_RAW``: ``payload`` is opaque bytes (a NATS or Bridge payload).
Each protocol converts at delivery, once per message: see ``as_json`` here and the codecs.
"""

from __future__ import annotations

import base64

import orjson

KIND_JSON = 0
KIND_RAW = 1


def as_json(kind: int, payload: bytes) -> tuple[bytes, bool]:
    """(JSON encoding of the payload as an NDJSON ``data`` value, whether it is base64).

    Raw bytes that are valid UTF-8 become a JSON string; other bytes become a base64 string, flagged so the
    delivery can say ``"encoding":"base64"``.
    """
    if kind == KIND_JSON:
        return payload, False
    try:
        return orjson.dumps(payload.decode()), False
    except UnicodeDecodeError:
        return b'"' + base64.b64encode(payload) + b'"', True


def as_bytes(kind: int, payload: bytes) -> bytes:
    """The payload as NATS (or Bridge) subscribers receive it: an NDJSON string as its UTF-8 bytes, any other JSON
    value as its JSON encoding, raw bytes as they are."""
    if kind == KIND_JSON and payload[:1] == b'"':
        return orjson.loads(payload).encode()
    return payload
