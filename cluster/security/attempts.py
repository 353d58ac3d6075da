"""Password checks per source address, over all workers: counted as they start, a few at a time, and blocked.

A password check costs ~0.3 s of a core at the default cost.  Counting failures only once checks finished let an
address with 300 connections get 300 guesses checked before the 20th failure was counted, and everyone's logins
waited behind them in the workers' thread pools.  So a worker asks here before each check (``begin``) and reports
its outcome (``end``):

- An address has at most ``security.checks_per_address`` checks under way at once; more wait here, in arrival
  order, without costing anything (up to ``_QUEUED_MAX`` per address and ``_WAIT_S`` each, then refused).  A
  login from another address never waits behind them: the thread pools hold a few of each address's checks.
- A check starts only while the address's failures in ``security.failure_window`` plus its checks under way stay
  below ``security.failures_per_address``: however many connections it opens, an address gets that many guesses
  a window.  Reaching it blocks the address for ``security.block_duration``, and everything it has waiting is
  refused (``rate_limited``) without a check.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from shardbroker.cluster.config import SecurityConfig

log = logging.getLogger("broker.security")

# Checks one address may have waiting for their turn: a legitimate client may open thousands of connections at
# once from one address (a NAT, a load test: scripts/stress/soak.py logs in 10,000), and a wait costs a future here.
_QUEUED_MAX = 4096
_WAIT_S = 20.0      # the longest one waits (a worker gives up on the supervisor's answer after 30 s)
_ADDRESSES_MAX = 10_000


class Blocked:
    """Addresses blocked until a time (the supervisor's decision, every worker's copy)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def block(self, address: str, seconds: float) -> None:
        self._until[address] = time.monotonic() + seconds

    def __contains__(self, address: str) -> bool:
        until = self._until.get(address)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._until[address]
            return False
        return True

    def prune(self) -> None:
        now = time.monotonic()
        self._until = {a: u for a, u in self._until.items() if u > now}


class Attempts:
    def __init__(self, settings: Callable[[], SecurityConfig], block: Callable[[str, float], None]) -> None:
        self._settings = settings
        self._block_everywhere = block
        self._failures: dict[str, collections.deque[float]] = {}
        self._blocked = Blocked()
        self._under_way: dict[str, int] = {}
        self._by_worker: dict[int, collections.Counter] = {}
        self._waiting: dict[str, collections.deque[tuple[float, int, asyncio.Future]]] = {}

    async def begin(self, worker: int, address: str) -> bool:
        """Whether worker ``worker`` may check a password from ``address`` now (it waits its turn here)."""
        settings = self._settings()
        if address in self._blocked:
            return False
        if not self._waiting.get(address) and self._may_start(address, settings):
            self._start(worker, address)
            return True
        queue = self._waiting.setdefault(address, collections.deque())
        if len(queue) >= _QUEUED_MAX:
            return False
        fut = asyncio.get_running_loop().create_future()
        queue.append((time.monotonic(), worker, fut))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), _WAIT_S)
        except TimeoutError:
            if not fut.done():
                fut.set_result(False)
            elif fut.result():   # granted as the wait ran out: give the turn back
                self.end(worker, address, failed=False)
            return False

    def end(self, worker: int, address: str, failed: bool) -> None:
        """A check begun on ``worker`` finished (``failed``: the credentials were wrong)."""
        counts = self._by_worker.get(worker)
        if counts is None or not counts[address]:
            return   # that worker died and was forgotten meanwhile
        counts[address] -= 1
        self._finished(address)
        if failed:
            self.failure(address)
        self._next(address)

    def failure(self, address: str) -> None:
        """A failed authentication from ``address`` (a check that failed, or a certificate refused...)."""
        settings = self._settings()
        now = time.monotonic()
        times = self._failures.setdefault(address, collections.deque())
        times.append(now)
        while times and now - times[0] > settings.failure_window:
            times.popleft()
        if len(times) >= settings.failures_per_address and address not in self._blocked:
            self._blocked.block(address, settings.block_duration)
            times.clear()
            log.warning("%s: %d failed authentications within %gs; blocking it for %gs",
                        address, settings.failures_per_address, settings.failure_window, settings.block_duration)
            self._block_everywhere(address, settings.block_duration)
            self._refuse_waiting(address)
        if len(self._failures) > _ADDRESSES_MAX:  # bounded memory under a spray of addresses
            window = settings.failure_window
            self._failures = {a: t for a, t in self._failures.items() if t and now - t[-1] <= window}
            self._blocked.prune()

    def worker_gone(self, worker: int) -> None:
        """A worker died: its checks under way end with it."""
        for address, n in (self._by_worker.pop(worker, None) or {}).items():
            for _ in range(n):
                self._finished(address)
            self._next(address)

    def under_way(self, address: str | None = None) -> int:
        if address is not None:
            return self._under_way.get(address, 0)
        return sum(self._under_way.values())

    # -- inside ---------------------------------------------------------------------------------------------
    def _may_start(self, address: str, settings: SecurityConfig) -> bool:
        under_way = self._under_way.get(address, 0)
        if under_way >= settings.checks_per_address:
            return False
        times = self._failures.get(address)
        now = time.monotonic()
        while times and now - times[0] > settings.failure_window:
            times.popleft()
        return (len(times) if times else 0) + under_way < settings.failures_per_address

    def _start(self, worker: int, address: str) -> None:
        self._under_way[address] = self._under_way.get(address, 0) + 1
        self._by_worker.setdefault(worker, collections.Counter())[address] += 1

    def _finished(self, address: str) -> None:
        left = self._under_way.get(address, 0) - 1
        if left > 0:
            self._under_way[address] = left
        else:
            self._under_way.pop(address, None)

    def _next(self, address: str) -> None:
        """Start the address's waiting checks that may start now, in arrival order."""
        queue = self._waiting.get(address)
        settings = self._settings()
        while queue:
            _, worker, fut = queue[0]
            if fut.done():   # its wait ran out
                queue.popleft()
                continue
            if address in self._blocked:
                self._refuse_waiting(address)
                return
            if not self._may_start(address, settings):
                break
            queue.popleft()
            self._start(worker, address)
            fut.set_result(True)
        if not queue:
            self._waiting.pop(address, None)

    def _refuse_waiting(self, address: str) -> None:
        for _, _, fut in self._waiting.pop(address, ()):
            if not fut.done():
                fut.set_result(False)
