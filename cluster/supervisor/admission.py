"""Who may connect: the live connections of the whole broker by source address and by user, and the limits on them
(``limits.max_connections_per_address``, ``limits.max_connections_per_user``).

The counts live here, in the supervisor, because it is the one process that sees every connection begin: it
accepts each one (and learns its address then) and picks its worker.  Each worker reports the connections it
closed (one ``closed`` control message per event-loop turn that closed some), and a worker that dies takes its
connections with it, so the counts are exact, not sampled.  A user is known only after a worker has checked the
credentials; the worker then asks here (``claim``) before the login is answered, one round trip on the control
channel beside a password check of a tenth of a second or more.  The alternative, counts shared between the
workers, would need shared memory and locks for what is one dictionary here.  See docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardbroker.cluster.config import LimitsConfig

# Counters of refusals, by the limit that refused: /varz "breaches", /metrics shardbroker_limit_breaches.
MAX_CONNECTIONS = "max_connections"
PER_ADDRESS = "max_connections_per_address"
PER_USER = "max_connections_per_user"


@dataclass(slots=True)
class _Live:
    worker: int
    address: str
    user: str | None = None


class Admission:
    def __init__(self, limits: Callable[[], LimitsConfig]) -> None:
        self._limits = limits   # read at each decision: a reload may change them
        self._live: dict[int, _Live] = {}
        self._by_address: dict[str, int] = {}
        self._by_user: dict[str, int] = {}
        self.breaches = {MAX_CONNECTIONS: 0, PER_ADDRESS: 0, PER_USER: 0}

    def __len__(self) -> int:
        return len(self._live)

    def refusal(self, address: str) -> str | None:
        """Why a connection from ``address`` may not be handed to a worker now (the limit's name), or None."""
        limits = self._limits()
        if len(self._live) >= limits.max_connections:
            self.breaches[MAX_CONNECTIONS] += 1
            return MAX_CONNECTIONS
        limit = limits.max_connections_per_address
        if limit and self._by_address.get(address, 0) >= limit:
            self.breaches[PER_ADDRESS] += 1
            return PER_ADDRESS
        return None

    def opened(self, cid: int, worker: int, address: str) -> None:
        self._live[cid] = _Live(worker, address)
        self._by_address[address] = self._by_address.get(address, 0) + 1

    def moved(self, cid: int, worker: int) -> None:
        """Connection ``cid`` went to another worker (workers/protocols/ndjson/moves.py)."""
        live = self._live.get(cid)
        if live is not None:
            live.worker = worker

    def closed(self, cid: int) -> int | None:
        """Connection ``cid`` is gone: the worker it was on, or None if it was not counted (already gone)."""
        live = self._live.pop(cid, None)
        if live is None:
            return None
        _decrement(self._by_address, live.address)
        if live.user is not None:
            _decrement(self._by_user, live.user)
        return live.worker

    def worker_gone(self, worker: int) -> None:
        """A worker died: its connections died with it."""
        for cid in [cid for cid, live in self._live.items() if live.worker == worker]:
            self.closed(cid)

    def claim(self, cid: int, user: str) -> bool:
        """Connection ``cid`` has proved it is ``user``: whether it may act as that user (within the per-user
        limit).  A refused claim leaves the connection as it was; a re-login as another user moves it."""
        live = self._live.get(cid)
        if live is None:   # closed meanwhile (its report came first): nothing to count
            return False
        if live.user == user:
            return True
        limit = self._limits().max_connections_per_user
        if limit and self._by_user.get(user, 0) >= limit:
            self.breaches[PER_USER] += 1
            return False
        if live.user is not None:
            _decrement(self._by_user, live.user)
        live.user = user
        self._by_user[user] = self._by_user.get(user, 0) + 1
        return True

    def count(self, address: str | None = None, user: str | None = None) -> int:
        if address is not None:
            return self._by_address.get(address, 0)
        if user is not None:
            return self._by_user.get(user, 0)
        return len(self._live)


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
