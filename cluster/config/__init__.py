"""The broker's one typed configuration object, and its loader.

A Jolt config file (``network``, ``security``) is accepted as is; the other sections are this broker's extensions.
The loader rejects unknown keys, wrong types and out-of-range values with one line naming the key
(``ConfigError``), before anything starts.  CLI flags are applied as dotted-key overrides on the raw document, so a
bad flag is reported exactly like a bad file entry.  See docs/configuration.md for every key.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import re
import stat
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import orjson

from shardbroker.router.subjects import is_valid_literal

from shardbroker.cluster.config import certnames, passwords
from shardbroker.cluster.config.permissions import PermissionFormatError, Permissions
from shardbroker.cluster.config.protocols import BY_NAME, LISTENERS


class ConfigError(Exception):
    """One line: which key is wrong and why."""


def _meta(minimum: float | None = None, maximum: float | None = None, doc: str = "") -> dict:
    return {"min": minimum, "max": maximum, "doc": doc}


def _port(default: int) -> Any:
    return field(default=default, metadata=_meta(0, 65535, "TCP port; 0 picks a free one"))


def _directory(kind: Literal["parent", "own"]) -> Any:
    """A key naming a directory, checked at load against the file system (``_check_paths``): ``parent``, one the
    broker makes its private directories in; ``own``, one it uses itself (and makes if missing)."""
    return field(default=None, metadata={"directory": kind})


# -- TLS (docs/security.md#tls): a shared section, and a ``tls`` key on each listener ---------------------------

@dataclass(frozen=True)
class TlsConfig:
    """The shared ``tls`` section: what a listener with ``"tls": true`` runs with.  Off by itself."""
    cert: str | None = None     # PEM: the certificate, then any intermediates
    key: str | None = None      # PEM, unencrypted
    ca: str | None = None       # PEM: client certificates are asked for and verified against it
    verify: bool = False        # a client certificate is required (needs ca)
    verify_and_map: bool = False   # required, and it names the user (security.users[].cert_names; needs ca)
    min_version: Literal["1.2", "1.3"] = "1.2"
    # null: security.auth_timeout; how long a client may take from the accept to the end of its handshake
    handshake_timeout: float | None = field(default=None, metadata=_meta(0.1, 3600))


@dataclass(frozen=True)
class ListenerTlsConfig:
    """A listener's own ``tls`` object: each key given replaces the shared section's for that listener."""
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    verify: bool | None = None
    verify_and_map: bool | None = None
    min_version: Literal["1.2", "1.3"] | None = None
    handshake_timeout: float | None = field(default=None, metadata=_meta(0.1, 3600))
    # NATS only, as nats-server's: true, the handshake comes before INFO (clients must ask for it: nats-py's
    # tls_handshake_first); "auto", before INFO when the client starts one within 50 ms, after INFO otherwise.
    handshake_first: bool | Literal["auto"] = False


# false: plain TCP; true: the shared ``tls`` section; an object: that section with the object's keys over it
ListenerTls = Union[bool, ListenerTlsConfig]
TLS_LISTENERS = LISTENERS   # listener -> its configuration section (cluster/config/protocols.py)


@dataclass(frozen=True)
class TlsSettings:
    """One listener's TLS as it runs (``tls_settings``), and for each key the configuration key it came from."""
    listener: str
    cert: str
    key: str
    ca: str | None
    verify: bool
    verify_and_map: bool
    min_version: str
    handshake_timeout: float
    handshake_first: bool | str
    origin: tuple[tuple[str, str], ...]

    def key_of(self, name: str) -> str:
        return dict(self.origin).get(name, f"tls.{name}")


@dataclass(frozen=True)
class NetworkConfig:
    bind: str = "127.0.0.1"
    port: int = _port(BY_NAME["ndjson"].default_port)
    tls: ListenerTls = False


@dataclass(frozen=True)
class UserConfig:
    username: str = ""
    password: str | None = None
    password_hash: str | None = None
    permissions: list[str] = field(default_factory=list)
    token: bool = False  # NATS clients authenticate with CONNECT {"auth_token": <password>}
    # qlite's handshake (docs/qlite.md) proves bcrypt(secret ‖ challenge): the server needs the secret itself, in
    # plaintext (<= 56 bytes), so a qlite user has this besides its password.  None: no qlite login.
    qlite_secret: str | None = None
    # tls.verify_and_map: the names a client certificate may prove to log in as this user (certnames.py)
    cert_names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SecurityConfig:
    enabled: bool = False
    admin_user: UserConfig = field(default_factory=UserConfig)
    users: list[UserConfig] = field(default_factory=list)
    no_auth_user: str = ""  # nats-server's: the user a client without credentials acts as (empty: refused)
    iterations: int = field(default=600_000, metadata=_meta(1000, 10_000_000))
    auth_timeout: float = field(default=10.0, metadata=_meta(0.1, 3600))
    max_auth_failures: int = field(default=5, metadata=_meta(1, 1000))
    failures_per_address: int = field(default=20, metadata=_meta(1, 1_000_000))
    checks_per_address: int = field(default=4, metadata=_meta(1, 1000))   # password checks under way at once
    failure_window: float = field(default=60.0, metadata=_meta(1, 86400))
    block_duration: float = field(default=60.0, metadata=_meta(1, 86400))


@dataclass(frozen=True)
class WorkersConfig:
    count: int | Literal["auto"] = field(default="auto", metadata=_meta(1, 256))
    boot_timeout: float = field(default=30.0, metadata=_meta(1, 600))
    heartbeat_timeout: float = field(default=10.0, metadata=_meta(1, 600))
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    def resolved_count(self) -> int:
        return (os.cpu_count() or 1) if self.count == "auto" else int(self.count)


@dataclass(frozen=True)
class LimitsConfig:
    max_line_bytes: int = field(default=1 << 20, metadata=_meta(64, 1 << 30))
    max_pending_bytes: int = field(default=8 << 20, metadata=_meta(1024, 1 << 34))
    max_connections: int = field(default=65536, metadata=_meta(1, 10_000_000))
    max_topic_length: int = field(default=4096, metadata=_meta(1, 1 << 20))
    max_subscriptions: int = field(default=65536, metadata=_meta(1, 10_000_000))
    # ... and per user (with security off: per client address) on each worker, whatever its connections
    max_subscriptions_per_user: int = field(default=65536, metadata=_meta(1, 10_000_000))
    max_tracked_subjects: int = field(default=100_000, metadata=_meta(100, 100_000_000))
    # Counted by the supervisor over all workers (docs/architecture.md); 0: no limit.  Off by default: many
    # clients may share one address (NAT, a proxy, every test on 127.0.0.1) or one user.
    max_connections_per_address: int = field(default=0, metadata=_meta(0, 10_000_000))
    max_connections_per_user: int = field(default=0, metadata=_meta(0, 10_000_000))
    # Work-queue receives waiting for a message, per connection and over one worker's connections.
    max_pending_polls: int = field(default=1000, metadata=_meta(1, 1_000_000))
    max_pending_polls_per_worker: int = field(default=100_000, metadata=_meta(1, 10_000_000))
    # Seconds from the accept to a connection's first complete frame.  Long enough for a person typing into nc.
    handshake_timeout: float = field(default=30.0, metadata=_meta(0.1, 3600))


@dataclass(frozen=True)
class FabricConfig:
    hwm: int = field(default=100_000, metadata=_meta(100, 100_000_000))
    window_bytes: int = field(default=8 << 20, metadata=_meta(1 << 16, 1 << 34))
    stall_timeout: float = field(default=2.0, metadata=_meta(0.01, 3600))


@dataclass(frozen=True)
class NatsConfig:
    enabled: bool = True
    bind: str | None = None
    port: int = _port(BY_NAME["nats"].default_port)
    max_payload: int = field(default=1 << 20, metadata=_meta(1, 64 << 20))
    max_control_line: int = field(default=4096, metadata=_meta(256, 1 << 20))
    ping_interval: float = field(default=120.0, metadata=_meta(0.05, 86400))
    ping_max: int = field(default=2, metadata=_meta(1, 1000))
    server_name: str | None = None
    tls: ListenerTls = False


@dataclass(frozen=True)
class BridgeConfig:
    enabled: bool = False
    bind: str | None = None
    port: int = _port(BY_NAME["bridge"].default_port)
    max_publish_bytes: int = field(default=1 << 20, metadata=_meta(1, 64 << 20))
    user: str | None = None  # with security on: the user whose permissions Bridge clients (no auth) act with
    tls: ListenerTls = False


@dataclass(frozen=True)
class QliteConfig:
    """The qlite wire protocol (docs/qlite.md): one listener serving one work queue."""
    enabled: bool = False
    bind: str | None = None
    port: int = _port(BY_NAME["qlite"].default_port)  # qlite's own default, 8080, is the NDJSON port
    queue: str = "qlite"
    max_publishers: int = field(default=1, metadata=_meta(1, 65535))     # per worker process
    max_subscribers: int = field(default=2, metadata=_meta(1, 65535))    # per worker process
    max_message_size: int = field(default=9437184, metadata=_meta(1, 10 << 20))
    io_timeout: float = field(default=3.0, metadata=_meta(0.1, 3600))
    max_polling_time: float = field(default=10.0, metadata=_meta(0, 300))
    max_hidden_time: int = field(default=30, metadata=_meta(1, 0xFFFFFFFF))  # seconds; clamped to 12 h at load
    tls: ListenerTls = False


QLITE_MAX_HIDDEN = 43200   # the longest lease a queue grants (12 h): qlite.max_hidden_time is clamped to it


@dataclass(frozen=True)
class QueueDefinition:
    """A configured queue: it exists from the start, and these keys (when given) replace the defaults for it."""
    name: str = ""
    visibility_timeout: float | None = field(default=None, metadata=_meta(0, 43200))
    max_deliveries: int | None = field(default=None, metadata=_meta(0, 1000))
    max_message_bytes: int | None = field(default=None, metadata=_meta(1, 64 << 20))
    max_messages: int | None = field(default=None, metadata=_meta(1, 1_000_000_000))
    max_bytes: int | None = field(default=None, metadata=_meta(1024, 1 << 40))


@dataclass(frozen=True)
class QueuesConfig:
    """Work queues (docs/queues.md): the defaults every queue gets, and where the journal lives."""
    journal: bool = True          # false: queues live in memory only, and a worker crash loses its shard's queues
    data_dir: str | None = _directory("own")   # journal here (kept across restarts) instead of the runtime directory
    fsync: Literal["everysec", "always", "no"] = "everysec"   # with data_dir; the runtime directory never syncs
    visibility_timeout: float = field(default=30.0, metadata=_meta(0, 43200))
    max_deliveries: int = field(default=20, metadata=_meta(0, 1000))
    max_message_bytes: int = field(default=1 << 20, metadata=_meta(1, 64 << 20))
    max_messages: int = field(default=1_000_000, metadata=_meta(1, 1_000_000_000))
    max_bytes: int = field(default=256 << 20, metadata=_meta(1024, 1 << 40))
    queues: list[QueueDefinition] = field(default_factory=list)
    # Queues a client's push or long poll may bring one worker to (an empty queue costs ~4.5 KB, and a client may
    # name any number of them); a queue empty and untouched for forget_idle seconds (up to twice that) is forgotten
    max_queues_per_worker: int = field(default=10_000, metadata=_meta(1, 10_000_000))
    # ... of which one user (with security off, one client address) may make this many on each worker
    max_queues_per_user: int = field(default=1_000, metadata=_meta(1, 10_000_000))
    forget_idle: float = field(default=600.0, metadata=_meta(1, 86400))
    # An NDJSON connection whose first queue request is for a queue another worker owns moves there
    # (workers/protocols/ndjson/moves.py), so that its requests do not cross between workers
    move_connections: bool = True


@dataclass(frozen=True)
class MonitoringConfig:
    enabled: bool = True
    # Loopback whatever the client listeners bind to: /connz lists every client's address, user and subjects,
    # to anyone who reaches the port (it has no login).  Exposing it is a decision of its own (tls.warnings).
    bind: str = "127.0.0.1"
    port: int = _port(8222)
    tls: ListenerTls = False   # HTTPS, served by the supervisor


@dataclass(frozen=True)
class ShutdownConfig:
    grace_period: float = field(default=5.0, metadata=_meta(0, 3600))
    # Lame duck mode (SIGUSR2, brokerctl lameduck): nats-server's defaults; unlike it, short ones are allowed.
    lame_duck_duration: float = field(default=120.0, metadata=_meta(0.1, 86400))
    lame_duck_grace_period: float = field(default=10.0, metadata=_meta(0, 3600))


@dataclass(frozen=True)
class RuntimeConfig:
    # parent of the private runtime directory; default $XDG_RUNTIME_DIR, /dev/shm or the temp dir (runtime.py)
    dir: str | None = _directory("parent")


@dataclass(frozen=True)
class LoggingConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"   # text is journal-aware by itself (cluster/logs.py)
    # floods of one message: `flood_burst` lines per `flood_interval` seconds, then one line with the count
    flood_interval: float = field(default=10.0, metadata=_meta(0, 3600))
    flood_burst: int = field(default=5, metadata=_meta(1, 1_000_000))


@dataclass(frozen=True)
class Config:
    network: NetworkConfig = field(default_factory=NetworkConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    fabric: FabricConfig = field(default_factory=FabricConfig)
    nats: NatsConfig = field(default_factory=NatsConfig)
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    qlite: QliteConfig = field(default_factory=QliteConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    queues: QueuesConfig = field(default_factory=QueuesConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    source: str | None = field(default=None, metadata={"internal": True})
    # What a reload needs to load the file the same way (the command line's dotted-key overrides), and what
    # /varz shows of the load: the file's sha256 (compare with `sha256sum FILE`) and when it was read.
    overrides: tuple[tuple[str, Any], ...] = field(default=(), metadata={"internal": True})
    digest: str | None = field(default=None, metadata={"internal": True})
    loaded: float = field(default=0.0, compare=False, metadata={"internal": True})

    def bind_for(self, section_bind: str | None) -> str:
        return section_bind if section_bind is not None else self.network.bind


def load(path: str | None = None, overrides: dict[str, Any] | None = None, check_paths: bool = True) -> Config:
    """Read ``path`` (JSON; None: embedded defaults), apply dotted-key ``overrides``, validate.

    ``check_paths``: also check the directories the keys name against the file system, as a start must (a
    SIGHUP, which re-reads the users only, and tools reading a file meant for another machine leave it out)."""
    doc: dict[str, Any] = {}
    digest = None
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: the top level must be a JSON object")
        if any(v is not None for v in (overrides or {}).values()):
            # The file's own values are checked too, the ones a command-line option overrides now included: the
            # next start without that option would fail on them, so they are reported now.
            try:
                _build(Config, copy.deepcopy(doc), "")
            except ConfigError as exc:
                raise ConfigError(f"{exc} (in {path}, whatever the command line overrides)") from None
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = doc
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: expected an object")
        node[leaf] = value
    config = _build(Config, doc, "")
    kept = tuple((k, v) for k, v in (overrides or {}).items() if v is not None)
    config = dataclasses.replace(config, source=os.path.abspath(path) if path else None, overrides=kept,
                                 digest=digest, loaded=time.time())
    _check(config)
    if check_paths:
        _check_paths(config)
    return _with_qlite_queue(config)


def _with_qlite_queue(config: Config) -> Config:
    """With qlite on: ``max_hidden_time`` clamped to 12 h, and the qlite queue configured as qlite's (messages up
    to ``max_message_size``, redelivered without end: no dead-lettering), unless ``queues.queues`` names it."""
    ql = config.qlite
    if not ql.enabled:
        return config
    if ql.max_hidden_time > QLITE_MAX_HIDDEN:
        config = dataclasses.replace(config, qlite=dataclasses.replace(ql, max_hidden_time=QLITE_MAX_HIDDEN))
    q = config.queues
    if any(d.name == ql.queue for d in q.queues):
        return config
    own = QueueDefinition(name=ql.queue, max_message_bytes=ql.max_message_size, max_deliveries=0)
    return dataclasses.replace(config, queues=dataclasses.replace(q, queues=[*q.queues, own]))


def _check(config: Config) -> None:
    """Rules that span keys."""
    seen = set()
    for i, q in enumerate(config.queues.queues):
        if not is_valid_literal(q.name, config.limits.max_topic_length):
            raise ConfigError(f"queues.queues[{i}].name: {q.name!r} is not a queue name (a subject without wildcards)")
        if q.name in seen:
            raise ConfigError(f"queues.queues[{i}].name: {q.name!r} is configured twice")
        seen.add(q.name)
    sec = config.security
    if sec.enabled and not sec.admin_user.username:
        raise ConfigError("security.admin_user.username: must be set when security.enabled is true")
    _check_users(sec)
    names = {u.username for _, u, _ in configured_users(sec)}
    if sec.no_auth_user and sec.no_auth_user not in names:
        raise ConfigError(f"security.no_auth_user: {sec.no_auth_user!r} is not a configured user (name one of "
                          f"security.users or the security.admin_user)")
    if config.qlite.enabled and not is_valid_literal(config.qlite.queue, config.limits.max_topic_length):
        raise ConfigError(f"qlite.queue: {config.qlite.queue!r} is not a queue name (a subject without wildcards)")
    if sec.enabled and config.bridge.enabled:
        if config.bridge.user not in names:
            raise ConfigError("bridge.user: Bridge clients cannot authenticate; with security on, name the "
                              "configured user whose permissions they get")
    sd = config.shutdown
    if sd.lame_duck_grace_period >= sd.lame_duck_duration:
        raise ConfigError(f"shutdown.lame_duck_grace_period: must be less than shutdown.lame_duck_duration "
                          f"({sd.lame_duck_duration:g}), got {sd.lame_duck_grace_period:g}")
    _check_tls(config)


# -- TLS: which listeners have it, and with what (cluster/security/tls.py makes the contexts, and reads the files) --------

def tls_settings(config: Config, listener: str) -> TlsSettings | None:
    """The TLS ``listener`` ("ndjson", "nats", ... : ``TLS_LISTENERS``) runs with, or None: plain TCP."""
    section = TLS_LISTENERS[listener]
    own = getattr(config, section).tls
    if own is False:
        return None
    shared = config.tls
    values: dict[str, Any] = {}
    origin: list[tuple[str, str]] = []
    for f in dataclasses.fields(TlsConfig):
        value = getattr(own, f.name, None) if isinstance(own, ListenerTlsConfig) else None
        if value is not None:
            values[f.name] = value
            origin.append((f.name, f"{section}.tls.{f.name}"))
        else:
            values[f.name] = getattr(shared, f.name)
            origin.append((f.name, f"tls.{f.name}"))
    if values["handshake_timeout"] is None:
        values["handshake_timeout"] = config.security.auth_timeout
    first = own.handshake_first if isinstance(own, ListenerTlsConfig) else False
    return TlsSettings(listener=listener, cert=values["cert"] or "", key=values["key"] or "", ca=values["ca"],
                       verify=values["verify"], verify_and_map=values["verify_and_map"],
                       min_version=values["min_version"], handshake_timeout=float(values["handshake_timeout"]),
                       handshake_first=first, origin=tuple(origin))


def _check_tls(config: Config) -> None:
    for listener, section in TLS_LISTENERS.items():
        own = getattr(config, section).tls
        if isinstance(own, ListenerTlsConfig) and own.handshake_first is not False and listener != "nats":
            raise ConfigError(f"{section}.tls.handshake_first: only the NATS listener has it (nats.tls)")
        s = tls_settings(config, listener)
        if s is None:
            continue
        for name in ("cert", "key"):
            if not getattr(s, name):
                raise ConfigError(f"{section}.tls: needs a {'certificate' if name == 'cert' else 'private key'}: "
                                  f"set tls.{name} (or {section}.tls.{name})")
        for name in ("verify", "verify_and_map"):
            if getattr(s, name) and not s.ca:
                raise ConfigError(f"{s.key_of(name)}: needs a CA to verify client certificates with: set tls.ca "
                                  f"(or {section}.tls.ca)")
    seen: dict[str, str] = {}
    for where, user, _ in configured_users(config.security):
        for i, name in enumerate(user.cert_names):
            key = f"{where}.cert_names[{i}]"
            if not name.strip():
                raise ConfigError(f"{key}: must not be empty")
            try:
                dn = certnames.canonical_dn(name)
            except certnames.DnError as exc:
                raise ConfigError(f"{key}: {exc}") from None
            for form in {name, dn} - {None}:
                if form in seen and seen[form] != user.username:
                    raise ConfigError(f"{key}: {name!r} already logs in {seen[form]!r}: a certificate name picks one "
                                      f"user")
                seen[form] = user.username


# -- the configured users: what the file may say about them (cluster.security.users builds the registry from it) ---------

_USER_NAME = re.compile(r"^[^\s\x00-\x1f\x7f]{1,128}$")


def valid_name(name: object) -> bool:
    """A user name: 1-128 characters, no whitespace or control characters (the configuration's and the admin
    protocol's rule)."""
    return isinstance(name, str) and bool(_USER_NAME.match(name))


def configured_users(security: SecurityConfig) -> list[tuple[str, UserConfig, bool]]:
    """(config key, user, is the admin_user) for every user the configuration defines."""
    out = []
    if security.admin_user.username:
        out.append(("security.admin_user", security.admin_user, True))
    out += [(f"security.users[{i}]", u, False) for i, u in enumerate(security.users)]
    return out


def _check_users(sec: SecurityConfig) -> None:
    seen: set[str] = set()
    for where, user, _ in configured_users(sec):
        if not valid_name(user.username):
            raise ConfigError(f"{where}.username: must be 1-128 characters without spaces or control characters")
        if user.username in seen:
            raise ConfigError(f"{where}.username: {user.username!r} is defined twice")
        seen.add(user.username)
        if user.password is not None and user.password_hash is not None:
            raise ConfigError(f"{where}: give password or password_hash, not both")
        if sec.enabled and not user.password and user.password_hash is None and not user.cert_names:
            raise ConfigError(f"{where}: needs a non-empty password or a password_hash (or, to log in by "
                              f"certificate alone, cert_names)")
        try:
            Permissions(user.permissions)
        except PermissionFormatError as exc:
            raise ConfigError(f"{where}.permissions: {exc}") from None
        if user.password_hash is not None:
            try:
                passwords.parse(user.password_hash)
            except passwords.HashFormatError as exc:
                raise ConfigError(f"{where}.password_hash: {exc}") from None
        secret = user.qlite_secret
        if secret is not None:
            size = len(secret.encode())
            if not secret or "\0" in secret:
                raise ConfigError(f"{where}.qlite_secret: must be a non-empty string without NUL characters")
            if size > 56:
                raise ConfigError(f"{where}.qlite_secret: must be at most 56 bytes (UTF-8), got {size}: qlite "
                                  f"hashes secret and challenge within bcrypt's 72 bytes, so a longer secret leaves "
                                  f"challenge bytes out and a captured login could be replayed")


def has_plaintext_passwords(config: Config) -> bool:
    return any(u.password for _, u, _ in configured_users(config.security))


def has_qlite_secrets(config: Config) -> bool:
    """Whether any user has a ``qlite_secret``: plaintext the server must keep (docs/qlite.md)."""
    return any(u.qlite_secret for _, u, _ in configured_users(config.security))


# -- directories: a start must be able to use them, and the error is the key's, not a traceback ---------------

def _check_paths(config: Config) -> None:
    for key, kind, path in _directory_keys(config, ""):
        if key == "queues.data_dir" and not config.queues.journal:
            continue  # unused: a start must not fail over it
        problem = (_usable_parent if kind == "parent" else _creatable_directory)(path)
        if problem:
            raise ConfigError(f"{key}: {path!r} {problem}")


def _directory_keys(node: Any, prefix: str):
    """(key, kind, path) for every directory key that is set."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if f.metadata.get("directory") and value is not None:
            yield prefix + f.name, f.metadata["directory"], value
        elif dataclasses.is_dataclass(value):
            yield from _directory_keys(value, f"{prefix}{f.name}.")


def _usable_parent(path: str) -> str | None:
    """Why the broker cannot make its private directories in ``path``, or None."""
    if not path:
        return "is not a directory (give null for the default)"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be used: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"is not writable by this user (mode {stat.S_IMODE(st.st_mode):04o})"
    if (why := _unwritable(path)) is not None:
        return f"is not writable by this user: {why}"
    # There anyone could rename the broker's directory away and put their own in its place, endpoints included;
    # the sticky bit (as on /tmp) lets only an entry's owner rename or remove it.
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (f"is writable by every user without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"another user could replace what the broker puts there")
    return None


def _creatable_directory(path: str) -> str | None:
    """Why the broker cannot use ``path`` as its own directory (made, mode 0700, if missing), or None."""
    if not path:
        return "is not a directory (give null for the default)"
    if os.path.isdir(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            return f"is not readable and writable by this user (mode {mode:04o})"
        if (why := _unwritable(path)) is not None:
            return f"is not readable and writable by this user: {why}"
        if mode & stat.S_IWOTH:  # the journal names are fixed: anyone could plant one (sticky bit or not)
            return f"is writable by every user (mode {mode:04o}): another user could plant or replace journals"
        return None
    if os.path.lexists(path):
        return "is not a directory"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK) or _unwritable(parent) is not None:
        return f"cannot be created: {parent} is not writable by this user"
    return None


def _unwritable(path: str) -> str | None:
    """Why no directory can be made in ``path`` (the error's words), or None: found by making one and removing it.
    The mode bits are not the whole answer: root passes every access check, yet a read-only or special file
    system (sysfs, a read-only bind mount) refuses it, and the start would fail there with a traceback."""
    import tempfile  # here: only a start's path check needs it

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".shardbroker-probe-", dir=path))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def without_plaintext_passwords(config: Config) -> Config:
    """The same configuration, its plaintext passwords dropped once the registry holds their hashes (and the
    qlite secrets, which the registry carries)."""
    sec = config.security
    strip = lambda u: dataclasses.replace(u, password=None, qlite_secret=None)  # noqa: E731
    return dataclasses.replace(config, security=dataclasses.replace(
        sec, admin_user=strip(sec.admin_user), users=[strip(u) for u in sec.users]))


# -- reloads: the configuration as a document, to diff it and to send it to the workers ------------------------

def document(node: Any) -> Any:
    """The configuration as its JSON document (internal fields left out): what ``from_document`` rebuilds."""
    if dataclasses.is_dataclass(node):
        return {f.name: document(getattr(node, f.name)) for f in dataclasses.fields(node)
                if not f.metadata.get("internal")}
    if isinstance(node, list):
        return [document(v) for v in node]
    return node


def from_document(doc: dict[str, Any]) -> Config:
    """A ``document`` back as a Config (checked as a file would be, key by key; cross-key rules were checked
    where it was loaded)."""
    return _build(Config, doc, "")


# -- the generic part: a dataclass schema walker ---------------------------------------------------------------

def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(orjson.dumps(a).decode() for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}s"
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def _fail(path: str, tp: Any, value: Any) -> typing.NoReturn:
    shown = orjson.dumps(value).decode() if _jsonable(value) else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise ConfigError(f"{path}: expected {_describe(tp)}, got {shown}")


def _jsonable(value: Any) -> bool:
    try:
        orjson.dumps(value)
        return True
    except TypeError:
        return False


def _convert(tp: Any, value: Any, path: str, meta: dict) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _convert(option, value, path, meta)
            except ConfigError as exc:
                if "must be" in str(exc):  # right type, wrong range: that is the error to report
                    raise
                if dataclasses.is_dataclass(option) and isinstance(value, dict):   # an object: its own key's error
                    raise
        _fail(path, tp, value)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        _fail(path, tp, value)
    if origin is list:
        if not isinstance(value, list):
            _fail(path, tp, value)
        (item_tp,) = typing.get_args(tp)
        return [_convert(item_tp, v, f"{path}[{i}]", {}) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(path, tp, value)
        return _build(tp, value, path + ".")
    if tp is type(None):
        if value is not None:
            _fail(path, tp, value)
        return None
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, tp, value)
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, tp, value)
        if tp is int and isinstance(value, float):
            if not value.is_integer():
                _fail(path, tp, value)
            value = int(value)
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ConfigError(f"{path}: must be between {lo:g} and {hi:g}, got {value}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, tp, value)
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _build(cls: type, doc: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = [k for k in doc if k not in fields]
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known here: {known})")
    kwargs = {name: _convert(hints[name], doc[name], prefix + name, dict(fields[name].metadata))
              for name in fields if name in doc}
    return cls(**kwargs)
