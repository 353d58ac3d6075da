"""The worker's side of security, for every protocol: who may connect, as whom, and with which permissions.

- The registry is a replica of the supervisor's (``cluster.security.users``), kept current by the changes it broadcasts.
- Password checks run in a small thread pool, never on the event loop: hashlib releases the GIL, so deliveries to
  other connections keep flowing while clients authenticate.
- An unknown user is checked against a dummy hash, and every check is made to cost the most any stored hash (or
  ``security.iterations``) costs, so the reply time does not tell which users exist, whatever cost each hash was
  made at.
- Every check is begun with the supervisor's leave (``attempt``): it counts checks per address as they start, lets a
  few run at once and makes the rest wait their turn, and blocks an address that failed too often, refusing
  what it still has waiting (``cluster.security.attempts``).  Addresses it has blocked are refused here without asking.
- ``security.no_auth_user`` (nats-server's): a client that presents no credentials at all acts as that user,
  looked up in the registry each time, so a deleted user lets nobody in without credentials until it exists again.
- ``tls.verify_and_map`` (nats-server's): a verified client certificate names its user (``by_certificate``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shardbroker.cluster.config import SecurityConfig, passwords
from shardbroker.cluster.security.attempts import Blocked
from shardbroker.cluster.security.users import Registry, User

log = logging.getLogger("broker.auth")

HASH_NICENESS = 10  # added to the worker's own
T = TypeVar("T")


class RateLimited(Exception):
    """The address may not have a password checked now: blocked, or its turn did not come."""


async def _always(address: str) -> bool:
    return True


def yield_to_the_loop() -> None:
    """Hashing threads run at a lower priority than the event loop: hashlib releases the GIL, but the threads
    still compete for the CPU, and at equal priority a storm of logins delays deliveries by the scheduler's
    time slices (milliseconds).  Linux applies a thread id's priority to that thread alone."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + HASH_NICENESS))
    except (AttributeError, OSError):
        pass  # not Linux: equal priority, still off the event loop


class Authenticator:
    def __init__(self, config: SecurityConfig, snapshot: list[dict]) -> None:
        self.enabled = config.enabled
        self.config = config
        self.registry = Registry.from_snapshot(snapshot)
        self._dummy = passwords.dummy_hash(passwords.MIN_ITERATIONS)   # made to cost what the others do
        self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="auth",
                                        initializer=yield_to_the_loop)
        self._blocked = Blocked()   # the supervisor's blocks (cluster.security.attempts)
        # Set by the worker process: the supervisor's leave to check a password from an address, and the outcome.
        self.begin: Callable[[str], Awaitable[bool]] = _always
        self.end: Callable[[str, bool], None] = lambda address, failed: None

    async def attempt(self, address: str, check: Callable[[], Awaitable[T]]) -> T:
        """``await check()`` (a password check: a false result is a failure) once the supervisor lets
        ``address`` have one; raises ``RateLimited`` if it does not.  A supervisor that does not answer lets it
        through: a limit must not lock everyone out."""
        if self.is_blocked(address):
            raise RateLimited
        try:
            granted = await self.begin(address)
        except Exception as exc:
            log.warning("no answer from the supervisor about a login from %s (%s); checking it", address, exc)
            granted = None
        if granted is False:
            raise RateLimited
        result = None
        try:
            result = await check()
            return result
        finally:
            if granted:
                self.end(address, not result)

    async def verify(self, name: str, password: str) -> User | None:
        user = self.registry.get(name)
        # Every check costs the most any stored hash (or a new one) costs: known or unknown, whatever cost its
        # hash was made at, the answer comes after the same time.
        cost = max(self.config.iterations, self.registry.hash_cost())
        # A user without a password (it logs in by certificate) is checked like an unknown one: same cost, no.
        stored = user.password_hash if user is not None and user.password_hash else self._dummy
        ok = await asyncio.get_running_loop().run_in_executor(self._pool, passwords.verify, stored, password, cost)
        # The registry may have changed while the hash was computed: the answer holds for the user as it is now.
        if not ok or user is None or self.registry.get(name) is not user or user.password_hash != stored:
            return None
        return user

    def by_certificate(self, peercert: dict | None) -> User | None:
        """The user a verified client certificate names (tls.verify_and_map; cluster.config.certnames), or None.  No
        password check: the handshake proved the certificate, and the CA vouched for its names."""
        if not self.enabled:
            return None
        found = self.registry.by_certificate(peercert)
        return found[0] if found is not None else None

    async def verify_token(self, token: str) -> User | None:
        """NATS ``auth_token``: the password of one of the token users (configuration ``"token": true``).
        Each token user costs one check, so keep them few; with none, the dummy hash keeps the cost uniform."""
        names = [u.name for u in self.registry.users.values() if u.token] or [""]
        for name in names:
            user = await self.verify(name, token)
            if user is not None:
                return user
        return None

    def no_auth_user(self) -> User | None:
        """The user a client without credentials acts as (security on, ``no_auth_user`` set and that user in the
        registry now), or None: such a client must authenticate.  No password check: none was given."""
        name = self.config.no_auth_user
        if not self.enabled or not name:
            return None
        return self.registry.get(name)

    async def hash(self, password: str) -> str:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, passwords.hash_password, password, self.config.iterations)

    def block(self, address: str, seconds: float) -> None:
        self._blocked.block(address, seconds)

    def is_blocked(self, address: str) -> bool:
        return address in self._blocked

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
