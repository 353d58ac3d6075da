"""The supervisor's side of security: the authoritative user registry and everything cluster-wide about it.

- Admin changes: a worker forwards a checked request; the supervisor applies it, sends it to every worker, and
  answers the worker only when every live worker has acknowledged it.  So a user created through worker 1 can
  authenticate on worker 3 as soon as the creator reads ``ok``.
- Failures per source address are counted here, across all workers (a client's connections are spread over all
  of them): past ``failures_per_address`` within ``failure_window`` the address is blocked on every worker for
  ``block_duration``.
- A reload (SIGHUP, ``brokerctl reload``: cluster.supervisor.reload) re-reads the configuration file's users
  (runtime changes
  are dropped: users are not persisted).
- At start, the configured plaintext passwords are hashed on threads while the workers boot (hashlib releases the
  GIL); the workers start with an empty registry and get the configured users, as one change they acknowledge,
  before the supervisor lets any client in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from shardbroker.cluster.config import Config, has_plaintext_passwords, has_qlite_secrets
from shardbroker.cluster.security import users
from shardbroker.cluster.security.attempts import Attempts


class Cluster(Protocol):
    """What security needs of the supervisor (cluster.supervisor.core.Supervisor), named here rather than imported:
    the supervisor imports this module."""

    config: Config

    def live_slots(self) -> list[Any]: ...  # WorkerSlots: .index, .channel


log = logging.getLogger("broker.security")

_ACK_TIMEOUT = 10.0


class SecurityManager:
    def __init__(self, supervisor: Cluster, config: Config) -> None:
        self.sup = supervisor
        self.settings = config.security
        warn_if_exposed(config)
        self.registry = users.Registry()  # the configured users join it in load_configured_users
        # Hashing a configured password costs ~0.2 s at the default iterations: it runs on threads while the
        # workers start, instead of before them.
        hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hash-config")
        self._configured: Future[users.Registry] = hashing.submit(users.from_config, config.security)
        hashing.shutdown(wait=False)
        self.version = 0
        self._pending: dict[int, tuple[set[int], asyncio.Future]] = {}
        self.attempts = Attempts(lambda: self.settings, self._block)

    def worker_state(self) -> list[dict]:
        """What a new worker starts with: the registry as it is now."""
        return self.registry.snapshot()

    async def load_configured_users(self) -> None:
        """Once the configured passwords are hashed: the configured users, here and on every live worker (the
        supervisor waits for this before it accepts clients)."""
        registry = await asyncio.wrap_future(self._configured)
        warn_if_open_admin(self.sup.config, registry)
        if registry.users:
            await self.apply({"op": "replace", "users": registry.snapshot()})

    # -- changes --------------------------------------------------------------------------------------------
    async def admin(self, slot: Any, msg: dict) -> None:
        change = msg.get("change") or {}
        error = self.registry.check(change)
        if error is None:
            await self.apply(change)
            log.info("admin change: %s %s", change.get("op"), change.get("user"))
        slot.channel.send({"k": "reply", "req": msg.get("req"), "data": {"error": error}})

    async def apply(self, change: dict) -> None:
        """Apply ``change`` here and on every live worker; return once all have acknowledged it."""
        self.registry.apply(change)
        self.version += 1
        version = self.version
        waiting = set()
        for slot in self.sup.live_slots():
            slot.channel.send({"k": "users", "v": version, "change": change})
            waiting.add(slot.index)
        if not waiting:
            return
        fut = asyncio.get_running_loop().create_future()
        self._pending[version] = (waiting, fut)
        try:
            await asyncio.wait_for(fut, _ACK_TIMEOUT)
        except TimeoutError:
            log.error("workers %s did not acknowledge user change %d", sorted(waiting), version)
        finally:
            self._pending.pop(version, None)

    def acknowledged(self, slot: Any, version: int) -> None:
        pending = self._pending.get(version)
        if pending is not None:
            self._settle(pending, slot.index)

    def worker_gone(self, index: int) -> None:
        """A dead worker acknowledges nothing, and ends none of its password checks; its replacement starts from
        the current registry."""
        for pending in list(self._pending.values()):
            self._settle(pending, index)
        self.attempts.worker_gone(index)

    @staticmethod
    def _settle(pending: tuple[set[int], asyncio.Future], index: int) -> None:
        waiting, fut = pending
        waiting.discard(index)
        if not waiting and not fut.done():
            fut.set_result(None)

    async def reload_users(self, config: Config) -> None:
        """A reload (cluster.supervisor.reload): the file's users replace every user, those made at run time included,
        and its settings (failure counting, no_auth_user) replace the running ones."""
        warn_if_exposed(config)
        registry = await asyncio.to_thread(users.from_config, config.security)
        self.settings = config.security
        await self.apply({"op": "replace", "users": registry.snapshot()})
        warn_if_open_admin(config, registry)
        log.info("%d user(s) reloaded from %s", len(registry.users), config.source)

    # -- failures per address (cluster.security.attempts) -------------------------------------------------------------
    def auth_failure(self, address: str) -> None:
        """An authentication from ``address`` failed without a password check (a refused hash, say)."""
        self.attempts.failure(address)

    def _block(self, address: str, seconds: float) -> None:
        for slot in self.sup.live_slots():
            slot.channel.send({"k": "block", "ip": address, "seconds": seconds})


def warn_if_open_admin(config: Config, registry: users.Registry) -> None:
    """``no_auth_user`` naming an administrator makes every client without credentials one: allowed (nats-server
    allows it), but worth saying."""
    sec = config.security
    user = registry.get(sec.no_auth_user) if sec.enabled and sec.no_auth_user else None
    if user is not None and user.permissions.admin:
        log.warning("security.no_auth_user %r has the admin permission: every client that connects without "
                    "credentials is an administrator", user.name)


def warn_if_exposed(config: Config) -> None:
    """Plaintext passwords or qlite secrets in a file others can read deserve a warning that says how to fix it."""
    passwords, secrets = has_plaintext_passwords(config), has_qlite_secrets(config)
    if config.source is None or not (passwords or secrets):
        return
    try:
        mode = stat.S_IMODE(os.stat(config.source).st_mode)
    except OSError:
        return
    if not mode & 0o077:
        return
    who = "others" if mode & 0o007 else "its group"
    if passwords:
        log.warning("%s holds plaintext passwords and is readable by %s (mode %04o): restrict it with "
                    "'chmod 600 %s', or replace each password with a password_hash from 'brokerctl hash-password'",
                    config.source, who, mode, config.source)
    if secrets:  # no hash can stand in for a qlite secret: the handshake needs the secret itself
        log.warning("%s holds qlite secrets and is readable by %s (mode %04o): restrict it with 'chmod 600 %s'",
                    config.source, who, mode, config.source)
