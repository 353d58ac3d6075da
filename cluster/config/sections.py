"""The configuration's typed sections: one frozen dataclass per section of the file, and ``Config`` holding them.

Each field is a key of the file, with its default, and in its metadata the range a number must be in
(``cluster.config.schema`` checks it) or the kind of directory a path names (``cluster.config.paths`` checks it).
The classes only describe: reading a document into them is ``cluster.config.loader``'s; see docs/configuration.md
for every key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from shardbroker.cluster.config.leafnodes import LeafnodesConfig
from shardbroker.cluster.config.protocols import BY_NAME, LISTENERS


def _meta(minimum: float | None = None, maximum: float | None = None, doc: str = "") -> dict:
    return {"min": minimum, "max": maximum, "doc": doc}


def _port(default: int) -> Any:
    return field(default=default, metadata=_meta(0, 65535, "TCP port; 0 picks a free one"))


def _directory(kind: Literal["parent", "own"]) -> Any:
    """A key naming a directory, checked at load against the file system (``cluster.config.paths``): ``parent``,
    one the broker makes its private directories in; ``own``, one it uses itself (and makes if missing)."""
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
ListenerTls = Union[bool, ListenerTlsConfig]   # noqa: UP007 (the loader reads typing.Union)
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
    # secret: a wrong type is reported without the value (cluster/config/schema.py)
    password: str | None = field(default=None, metadata={"secret": True})
    password_hash: str | None = None
    permissions: list[str] = field(default_factory=list)
    token: bool = False  # NATS clients authenticate with CONNECT {"auth_token": <password>}
    # qlite's handshake (docs/qlite.md) proves bcrypt(secret ‖ challenge): the server needs the secret itself, in
    # plaintext (<= 56 bytes), so a qlite user has this besides its password.  None: no qlite login.
    qlite_secret: str | None = field(default=None, metadata={"secret": True})
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
    # Workers forked from one process that imported their modules once (cluster.supervisor.forkserver); false: each
    # worker is a fresh interpreter, which reads the code on disk again (a replacement after an upgrade in place).
    fork_server: bool = True

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
    # How long a push's dedup_id is remembered (and a resent push recognised): at least this many seconds, bounded
    # too by history.LIMIT ids per queue and a worker's budget (docs/queues.md).  Spark's sink needs it to outlive
    # a restart of its query (docs/spark.md).
    dedup_window: float = field(default=300.0, metadata=_meta(1, 7 * 86400))
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
    leafnodes: LeafnodesConfig = field(default_factory=LeafnodesConfig)
    source: str | None = field(default=None, metadata={"internal": True})
    # What a reload needs to load the file the same way (the command line's dotted-key overrides), and what
    # /varz shows of the load: the file's sha256 (compare with `sha256sum FILE`) and when it was read.
    overrides: tuple[tuple[str, Any], ...] = field(default=(), metadata={"internal": True})
    digest: str | None = field(default=None, metadata={"internal": True})
    loaded: float = field(default=0.0, compare=False, metadata={"internal": True})

    def bind_for(self, section_bind: str | None) -> str:
        return section_bind if section_bind is not None else self.network.bind
