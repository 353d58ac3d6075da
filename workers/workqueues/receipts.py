"""Receipts and message ids: random texts drawn from a CSPRNG a pool at a time, and a receipt's text and bytes.

Every lease has a fresh receipt (16 random bytes, text form base64url) and every message an id (12 random bytes);
drawing them is per message, so they are drawn a few hundred at a time, and a forked child draws its own.  What a
receipt names (a live lease, or what became of it) is the queue's (``queue_leases``); this room only makes them and
reads them.
"""

from __future__ import annotations

import base64
import os

from shardbroker.workers.workqueues import core

try:   # OpenSSL's generator (a CTR-DRBG the OS seeds, reseeded after a fork): what TLS keys come from, and 7x
    # cheaper than the getrandom system call for the 28 bytes each message takes (a receive's receipt, a push's id)
    from ssl import RAND_bytes as _random_bytes
except ImportError:   # a Python built without ssl
    _random_bytes = os.urandom
_receipt_pool: list[str] = []
_id_pool: list[str] = []
_POOL = 256                     # receipts (ids) drawn at once when the pool runs dry


def _forget_pools() -> None:
    """A forked child must not hand out the receipts (ids) its parent drew: it draws its own."""
    _receipt_pool.clear()
    _id_pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def receipt_text(receipt: bytes) -> str:
    return base64.urlsafe_b64encode(receipt).rstrip(b"=").decode()


def receipt_bytes(text: object) -> bytes | None:
    """The 16 bytes of a receipt's text form, or None if it cannot be one."""
    if type(text) is not str or len(text) != 22:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "==")
    except (ValueError, TypeError):
        return None
    return raw if len(raw) == 16 else None


def canonical_receipt(text: object) -> str | None:
    """The text under which the receipt ``text`` names a lease (its canonical base64url), or None if it is not a
    receipt at all (``invalid_receipt``)."""
    raw = receipt_bytes(text)
    return None if raw is None else receipt_text(raw)


def _draw_receipts(n: int) -> list[str]:
    """``n`` fresh receipts' texts.  16 bytes each from a CSPRNG (``_random_bytes``) with no ``;`` and no NUL
    (qlite's wire carries a receipt raw, and clients that split its replies on ``;`` or hash it as a C string would
    break on those): those two byte values are dropped from the random stream, which leaves every other byte value
    equally likely and independent, 254^16 receipts (more than 127 bits).  One draw and one base64 pass for all
    ``n``."""
    need = 16 * n
    raw = b""
    while len(raw) < need:
        raw += _random_bytes(need - len(raw) + 16 + (need >> 6)).translate(None, b";\0")
    return core.b64url_chunks(raw[:need], 16)


def new_receipts(n: int) -> list[str]:
    """``n`` fresh receipts (text), from a pool refilled ``_POOL`` at a time: a receive of one message costs no
    system call of its own."""
    pool = _receipt_pool
    if len(pool) < n:
        pool.extend(_draw_receipts(max(n - len(pool), _POOL)))
    out = pool[-n:]
    del pool[-n:]
    return out


def new_receipt() -> str:
    return new_receipts(1)[0]


ID_CHARS = 16   # a message id's length: 12 random bytes, base64url
RECEIPT_CHARS = 22   # a receipt's canonical text: 16 random bytes, base64url


def new_ids(n: int) -> list[str]:
    """``n`` message ids: 12 random bytes each, base64url (16 characters)."""
    pool = _id_pool
    if len(pool) < n:
        pool.extend(core.b64url_chunks(_random_bytes(12 * max(n - len(pool), _POOL)), 12))
    out = pool[-n:]
    del pool[-n:]
    return out


def new_id() -> str:
    pool = _id_pool
    if not pool:
        new_ids(1)
        pool = _id_pool
    return pool.pop()


def record_text(receipt: object) -> str:
    """A receipt as kept: its text (journals written before receipts were kept as text hold the 16 bytes)."""
    return receipt if type(receipt) is str else receipt_text(receipt)  # type: ignore[arg-type]
