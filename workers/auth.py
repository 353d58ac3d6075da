"""The worker's side of security, for every protocol: who may connect, as whom, and with which permissions.

- The registry is a replica of the supervisor's (``cluster.users``), kept current by the changes it broadcasts.
- Password checks run in a small thread pool, never on the event loop: hashlib releases the GIL, so deliveries to
  other connections keep flowing while clients authenticate.
- An unknown user is checked against a dummy hash of the same cost, so the reply time does not tell which users
  exist.
- Addresses the supervisor has blocked (too many failures across all workers) are refused without a check.
- ``security.no_auth_user`` (nats-server's): a client that presents no credentials at all acts as that user,
  looked up in the registry each time, so a deleted user lets nobody in without credentials until it exists again.
- ``tls.verify_and_map`` (nats-server's): a verified client certificate names its user (``by_certificate``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from cluster import passwords
from cluster.config import SecurityConfig
from cluster.users import Registry, User


HASH_NICENESS = 10  # added to the worker's own


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
    def __init__(self, config: SecurityConfig, snapshot: list[dict], dummy_hash: str) -> None:
        self.enabled = config.enabled
        self.config = config
        self.registry = Registry.from_snapshot(snapshot)
        self._dummy = dummy_hash
        self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="auth",
                                        initializer=yield_to_the_loop)
        self._blocked: dict[str, float] = {}

    async def verify(self, name: str, password: str) -> User | None:
        user = self.registry.get(name)
        # A user without a password (it logs in by certificate) is checked like an unknown one: same cost, no.
        stored = user.password_hash if user is not None and user.password_hash else self._dummy
        ok = await asyncio.get_running_loop().run_in_executor(self._pool, passwords.verify, stored, password)
        # The registry may have changed while the hash was computed: the answer holds for the user as it is now.
        if not ok or user is None or self.registry.get(name) is not user or user.password_hash != stored:
            return None
        return user

    def by_certificate(self, peercert: dict | None) -> User | None:
        """The user a verified client certificate names (tls.verify_and_map; cluster.certnames), or None.  No
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
        self._blocked[address] = time.monotonic() + seconds

    def is_blocked(self, address: str) -> bool:
        until = self._blocked.get(address)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._blocked[address]
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
