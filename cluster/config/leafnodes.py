"""The ``leafnodes`` section: the NATS deployments this broker joins as a leaf node (docs/leafnodes.md).

Each worker dials every remote (one leaf connection per worker per remote, nats-server's own leaf-cluster shape:
``workers/protocols/leaf``).  The keys are nats-server's ``leafnodes.remotes`` where it has them, so that a
nats-server leaf's configuration reads across; ``reconnect_max`` (a capped exponential backoff) and the bounds are
this broker's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Union
from urllib.parse import unquote, urlsplit

from shardbroker.cluster.config.schema import ConfigError
from shardbroker.router.subjects import is_valid_pattern

SCHEMES = ("nats-leaf", "nats", "tls")   # tls:// asks for TLS as the remote's ``tls: true`` does


def _meta(minimum: float, maximum: float) -> dict:
    return {"min": minimum, "max": maximum}


# A password, a token, a URL that may carry either: the loader's errors never show the value (cluster.config.schema),
# nor does the dataclass's repr (``_redacted_repr``); logs, systemd's status and /varz's last reload error quote both.
_SECRET = {"secret": True}


@dataclass(frozen=True)
class LeafTlsConfig:
    """A remote's ``tls`` object; ``true`` is this with every default (the system's CAs verify the hub)."""
    ca: str | None = None          # PEM: the CAs the hub's certificate is verified against (null: the system's)
    cert: str | None = None        # PEM: this broker's client certificate (the hub's verify asks for one)
    key: str | None = None
    verify: bool = True            # false: any hub certificate is taken (a test hub; never in production)
    server_name: str | None = None   # the name checked in the hub's certificate (null: the URL's host)
    handshake_first: bool = False  # the TLS handshake before the hub's INFO (the hub's tls.handshake_first)
    timeout: float = field(default=2.0, metadata=_meta(0.1, 600))   # nats-server's leaf TLS timeout


LeafTls = Union[bool, LeafTlsConfig]   # noqa: UP007 (the loader reads typing.Union)


@dataclass(frozen=True)
class LeafRemoteConfig:
    """One NATS deployment to join: its leafnode URLs (tried in turn) and how to log in there."""
    urls: list[str] = field(default_factory=list, metadata=_SECRET)   # nats-leaf://[user:password@]host:port
    user: str | None = None
    password: str | None = field(default=None, metadata=_SECRET)
    token: str | None = field(default=None, metadata=_SECRET)
    nkey_file: str | None = None      # a file holding a user nkey seed (SU...): the nonce is signed with it
    credentials: str | None = None    # a .creds file (a user JWT and its seed), as nats-server's remotes take it
    tls: LeafTls = False
    deny_imports: list[str] = field(default_factory=list)   # subjects never taken from this remote
    deny_exports: list[str] = field(default_factory=list)   # subjects never sent to it
    account: str = "$G"               # this side's account (the broker has one): the CONNECT's remote_account
    no_randomize: bool = False        # try the URLs in the order given (default: shuffled, as nats-server)
    ignore_discovered_servers: bool = False   # keep to ``urls``, ignore the hub cluster's leafnode_urls

    def __repr__(self) -> str:
        return _redacted_repr(self)


@dataclass(frozen=True)
class LeafnodesConfig:
    # The instance's cluster name on the hubs: every worker's connection carries it, so the hub never echoes one
    # worker's interest or messages to another.  null: nats.server_name, else the broker's server id.
    name: str | None = None
    remotes: list[LeafRemoteConfig] = field(default_factory=list)
    reconnect: float = field(default=1.0, metadata=_meta(0.01, 3600))        # first retry after this + jitter
    reconnect_max: float = field(default=30.0, metadata=_meta(0.01, 3600))   # the backoff's cap
    ping_interval: float = field(default=120.0, metadata=_meta(0.05, 86400))
    ping_max: int = field(default=2, metadata=_meta(1, 1000))
    # Per leaf connection: bytes waiting to reach the hub before messages are dropped (slow_consumer), and the
    # hub's subscriptions a connection keeps (a flood past it closes the connection and retries).
    max_pending_bytes: int = field(default=32 << 20, metadata=_meta(1024, 1 << 34))
    max_hub_subscriptions: int = field(default=1_000_000, metadata=_meta(1, 100_000_000))


@dataclass(frozen=True)
class LeafUrl:
    url: str            # as configured, without its password (what logs and /leafz show)
    host: str
    port: int
    tls: bool
    user: str | None = field(repr=False)       # a user alone is a token (nats-server's reading)
    password: str | None = field(repr=False)


def redact(url: str) -> str:
    """``url`` with its credentials masked (``user:***@``, or ``***@`` for a user alone: that is a token), for
    messages: it need not parse."""
    # Up to the last "@": a password with an unencoded "@" or "/" in it is masked whole too.
    return re.sub(r"^((?:[A-Za-z][\w+.-]*://)?)(.*)@",
                  lambda m: m[1] + (m[2].split(":", 1)[0] + ":***@" if ":" in m[2] else "***@"), url, flags=re.S)


def _redacted_repr(node: object) -> str:
    shown = []
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        value = getattr(node, f.name)
        if f.metadata.get("secret") and isinstance(value, list):
            value = [redact(v) if isinstance(v, str) else v for v in value]
        elif f.metadata.get("secret") and value is not None:
            value = "***"
        shown.append(f"{f.name}={value!r}")
    return f"{type(node).__name__}({', '.join(shown)})"


def parse_url(url: str, path: str) -> LeafUrl:
    """A remote's URL, or a ConfigError naming ``path`` (the key); the errors show it without its credentials."""
    shown_url = redact(url)
    try:
        parts = urlsplit(url if "://" in url else "nats-leaf://" + url)
        port = parts.port or 7422
    except ValueError:   # the URL not shown: in "user:password" without its "@host" the password reads as a port
        raise ConfigError(f"{path}: not a URL (the value is not shown: it may hold a password): a port is a number "
                          f"up to 65535, an IPv6 address goes in brackets") from None
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"{path}: {shown_url!r}: the scheme must be one of "
                          f"{', '.join(s + '://' for s in SCHEMES)}")
    if not parts.hostname:
        raise ConfigError(f"{path}: {shown_url!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{path}: {shown_url!r}: only scheme://[user:password@]host[:port] (websocket leafs are "
                          "not supported)")
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    shown = f"{parts.scheme}://{parts.hostname if ':' not in parts.hostname else '[' + parts.hostname + ']'}:{port}"
    return LeafUrl(shown, parts.hostname, port, parts.scheme == "tls", user, password)


def check_leafnodes(section: LeafnodesConfig) -> None:
    """The rules that span a remote's keys."""
    name = section.name
    if name is not None and (not name or any(c.isspace() for c in name)):
        raise ConfigError(f"leafnodes.name: {name!r}: a cluster name must be non-empty and have no spaces")
    if section.reconnect_max < section.reconnect:
        raise ConfigError("leafnodes.reconnect_max: must be at least leafnodes.reconnect")
    for i, remote in enumerate(section.remotes):
        key = f"leafnodes.remotes[{i}]"
        if not remote.urls:
            raise ConfigError(f"{key}.urls: at least one URL (nats-leaf://host:port)")
        for j, url in enumerate(remote.urls):
            # A URL's credentials ride along with an nkey or a .creds file (nats-server sends both, for auth
            # callout), but beside user or token one of them would be dropped without a word.
            other = "user" if remote.user is not None else "token" if remote.token is not None else None
            if parse_url(url, f"{key}.urls[{j}]").user is not None and other:
                raise ConfigError(f"{key}.urls[{j}]: credentials in the URL and {key}.{other}: one way to log in")
        ways = [k for k in ("token", "nkey_file", "credentials") if getattr(remote, k) is not None]
        if remote.user is not None or remote.password is not None:
            ways.append("user")
        if len(ways) > 1:
            raise ConfigError(f"{key}: one way to log in, got {' and '.join(ways)}")
        if (remote.user is None) != (remote.password is None):
            raise ConfigError(f"{key}: user and password go together")
        for which in ("deny_imports", "deny_exports"):
            for j, subject in enumerate(getattr(remote, which)):
                if not is_valid_pattern(subject, 4096):
                    raise ConfigError(f"{key}.{which}[{j}]: {subject!r} is not a subject or pattern")
        tls = remote.tls
        if isinstance(tls, LeafTlsConfig) and (tls.cert is None) != (tls.key is None):
            raise ConfigError(f"{key}.tls: cert and key go together")


def check_leaf_files(section: LeafnodesConfig) -> None:
    """At a start (``load(check_paths=True)``): each file a remote names can be read now, or the key is named.  Only
    that: the workers read them at each connection (workers/protocols/leaf/credentials.py), and say what is wrong
    inside."""
    for i, remote in enumerate(section.remotes):
        tls = remote.tls if isinstance(remote.tls, LeafTlsConfig) else LeafTlsConfig()
        for key, path in (("nkey_file", remote.nkey_file), ("credentials", remote.credentials),
                          ("tls.ca", tls.ca), ("tls.cert", tls.cert), ("tls.key", tls.key)):
            if path is None:
                continue
            try:   # opened, not os.access'd: root passes that; non-blocking: a FIFO must not hang the start
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                raise ConfigError(f"leafnodes.remotes[{i}].{key}: {path!r}: cannot read: {exc.strerror}") from None
            try:
                regular = stat.S_ISREG(os.fstat(fd).st_mode)
            finally:
                os.close(fd)
            if not regular:
                raise ConfigError(f"leafnodes.remotes[{i}].{key}: {path!r}: is not a file")
