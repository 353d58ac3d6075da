"""What every family of the shard's request handlers shares, and what the protocols check before they ask: the
reply callback's type, how many items one request may carry and how long a receive may wait, and the check of an
int argument's range.

Apart from ``shard`` because the rooms of the shard (``shard_push``, ``shard_receive``, ``shard_admin``, ...) all
read it, and ``shard`` is made of them.
"""

from __future__ import annotations

from collections.abc import Callable

from shardbroker.workers.workqueues.rules import QueueError

Reply = Callable[[dict], None]
MAX_BATCH = 1000            # messages a receive leases, receipts an ack takes, messages a push stores, at most
MAX_WAIT_MS = 300_000


def int_arg(args: dict, key: str, default: int, lo: int, hi: int) -> int:
    """``args[key]``, an int from ``lo`` to ``hi`` (absent or None: ``default``), or ``invalid_<key>``."""
    value = args.get(key, default)
    if value is None:
        return default
    if type(value) is not int or not lo <= value <= hi:
        raise QueueError(f"invalid_{key.removesuffix('_ms')}", min=lo, max=hi)
    return value
