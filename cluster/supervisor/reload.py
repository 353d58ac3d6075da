"""Configuration reload (SIGHUP, ``brokerctl reload``, ``systemctl reload``): all or nothing, as nats-server's.

1. Read the file again with the command line's overrides, and check it as a start would (not its directories:
   the keys naming them need a restart anyway); read the TLS certificates and keys it names, and make their
   contexts (cluster.security.tls).  Renewed certificates under the same names are taken this way too.
2. Diff it against the running configuration, key by key.
3. If a key that cannot change at run time changed, nothing is applied: the running configuration stays, and the
   answer (log, ``brokerctl reload``, the systemd status line) names each such key.  A start reads it later.
4. Otherwise: the users (hashed on threads, as at start), then the rest on every worker, each acknowledging it
   (the TLS material with it: new handshakes use it, open connections keep theirs), then the supervisor's own
   copy, which is what a worker started later gets.

systemd hears ``RELOADING=1`` (with ``MONOTONIC_USEC``, so ``systemctl reload`` waits for this reload and not an
older one) before step 1, and ``READY=1`` after the last step, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Protocol

from shardbroker.cluster.config import Config, ConfigError, document, load, without_plaintext_passwords
from shardbroker.cluster.config.leafnodes import check_leaf_files
from shardbroker.cluster.security import tls
from shardbroker.cluster.supervisor import systemd

log = logging.getLogger("broker.reload")

# What a running broker can take.  A key is in if it is listed or under a listed section ("limits.").
RUNTIME_KEYS = (
    "security.admin_user", "security.users", "security.no_auth_user", "security.iterations",
    "security.auth_timeout", "security.max_auth_failures", "security.failures_per_address",
    "security.failure_window", "security.block_duration", "security.checks_per_address",
    "limits.", "logging.level", "shutdown.", "workers.heartbeat_timeout",
    # TLS: every key, the shared section's and each listener's (true/false, or its object's keys)
    "tls.", "network.tls", "network.tls.", "nats.tls", "nats.tls.", "bridge.tls", "bridge.tls.", "qlite.tls",
    "qlite.tls.", "monitoring.tls", "monitoring.tls.",
    # the NATS deployments joined: each worker adds, drops and redials remotes (workers/protocols/leaf)
    "leafnodes.",
)
_ACK_TIMEOUT = 10.0


class Cluster(Protocol):
    """What a reload needs of the supervisor (cluster.supervisor.core.Supervisor), named here: it imports this."""

    config: Config
    notifier: systemd.Notifier
    security: Any  # security.SecurityManager
    tls_material: tls.Material
    tls_contexts: dict[str, Any]

    def live_slots(self) -> list[Any]: ...

    async def query(self, message: dict, timeout: float = 2.0, slots: list | None = None) -> list[dict]: ...

    def set_status(self, text: str) -> None: ...


@dataclasses.dataclass
class Outcome:
    ok: bool
    error: str | None = None                                  # why nothing was applied
    changed: list[str] = dataclasses.field(default_factory=list)
    restart: list[str] = dataclasses.field(default_factory=list)   # keys (with old -> new) needing a restart
    digest: str | None = None                                 # of the configuration running afterwards
    loaded: float = 0.0
    tls: list[str] = dataclasses.field(default_factory=list)   # certificate files whose content changed

    def summary(self) -> str:
        if not self.ok:
            return f"configuration not reloaded (the running configuration is kept): {self.error}"
        changed = ", ".join(self.changed) if self.changed else "no key changed"
        files = f"; TLS files re-read ({', '.join(self.tls)} changed)" if self.tls else ""
        return f"configuration reloaded ({self.digest}): {changed}; users re-read from the file{files}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value}; a list (users, queues) is one value."""
    if not isinstance(doc, dict):
        return {prefix[:-1]: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def diff(old: Config, new: Config) -> list[str]:
    """The dotted keys whose values differ (plaintext passwords left out: the running copy has none)."""
    a = flatten(document(without_plaintext_passwords(old)))
    b = flatten(document(without_plaintext_passwords(new)))
    return sorted(key for key in b if a.get(key) != b[key])


def runtime_key(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RUNTIME_KEYS)


def _shown(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return "…"
    return "null" if value is None else str(value)


class Reloader:
    def __init__(self, cluster: Cluster) -> None:
        self.sup = cluster
        self._lock = asyncio.Lock()  # one at a time: a second request waits, then reads the file again
        self.last: Outcome | None = None   # the last reload's (None: none yet), for /varz and /metrics
        self.last_at = 0.0                 # when it ended (epoch seconds)
        self.outcomes = {"ok": 0, "failed": 0}

    async def reload(self, origin: str) -> Outcome:
        async with self._lock:
            self.sup.notifier.send(RELOADING=1, MONOTONIC_USEC=systemd.monotonic_usec(),
                                   STATUS="reloading the configuration")
            try:
                outcome = await self._reload()
            except Exception as exc:  # a bug must not leave systemd waiting for READY=1
                log.exception("%s: reload failed", origin)
                outcome = Outcome(False, f"internal error: {exc}")
            if outcome.ok:
                log.info("%s: %s", origin, outcome.summary())
            else:
                log.error("%s: %s", origin, outcome.summary())
            self.last, self.last_at = outcome, time.time()
            self.outcomes["ok" if outcome.ok else "failed"] += 1
            self.sup.set_status(outcome.summary())
            self.sup.notifier.send(READY=1)
            return outcome

    async def _reload(self) -> Outcome:
        running = self.sup.config
        if running.source is None:
            return Outcome(False, "started without --config: there is no file to read", digest=running.digest,
                           loaded=running.loaded)
        try:
            new = load(running.source, dict(running.overrides), check_paths=False)
            # the leaf remotes' credential and certificate files: a reload that names one that cannot be read is
            # refused, as a start is, rather than leave every worker's link failing at its next dial
            check_leaf_files(new.leafnodes)
        except ConfigError as exc:
            return Outcome(False, str(exc), digest=running.digest, loaded=running.loaded)
        try:
            # The certificates too: a file that no longer loads refuses the reload, and the running ones stay.
            material, contexts = tls.load(new)
        except tls.TlsError as exc:
            return Outcome(False, str(exc), digest=running.digest, loaded=running.loaded)
        changed = diff(running, new)
        old_flat, new_flat = flatten(document(running)), flatten(document(new))
        restart = [f"{k} ({_shown(old_flat.get(k))} -> {_shown(new_flat.get(k))})"
                   for k in changed if not runtime_key(k)]
        if restart:
            return Outcome(False, f"{', '.join(restart)}: {'needs' if len(restart) == 1 else 'need'} a restart",
                           restart=restart, digest=running.digest, loaded=running.loaded)
        # The users first: every login after this reload's answer checks against the file's users.
        await self.sup.security.reload_users(new)
        stripped = without_plaintext_passwords(new)
        replies = await self.sup.query({"k": "config", "doc": document(stripped), "tls": material},
                                       timeout=_ACK_TIMEOUT, slots=self.sup.live_slots())
        late = [r["worker"] for r in replies if r.get("unresponsive")]
        if late:
            log.error("worker(s) %s did not acknowledge the new configuration (they are killed if stuck, and "
                      "their replacements start with it)", late)
        for r in replies:
            if r.get("error"):   # the material was checked here: a worker should not fail where we did not
                log.error("worker %s kept its running TLS contexts: %s", r.get("worker"), r["error"])
        files = sorted(path for path, text in material.items() if self.sup.tls_material.get(path) != text)
        self.sup.tls_material, self.sup.tls_contexts = material, contexts
        self.sup.config = stripped
        _set_log_level(stripped.logging.level)
        for line in tls.warnings(stripped, material):
            log.warning("%s", line)
        return Outcome(True, changed=changed, digest=stripped.digest, loaded=stripped.loaded, tls=files)


def _set_log_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())
