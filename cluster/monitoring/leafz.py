"""/leafz, and the leaf-node fields of /varz, in nats-server's shapes (server/monitor.go: ``Leafz``, ``LeafInfo``,
``LeafNodeOptsVarz``).

Every worker holds its own leaf connection to each remote (workers/protocols/leaf), and answers for its own: the
supervisor lists the workers' answers one after the other, each entry with its ``worker``.  An entry is
nats-server's ``LeafInfo`` plus this broker's view of the link's life (``state``, ``url``, ``hub``, ``connects``,
``reconnects``, ``failures``, ``last_error``, ...); unlike nats-server, which lists only the connections it has,
a link that is connecting or waiting to redial is listed too, with its ``state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardbroker.cluster.config import LeafTlsConfig, parse_url

if TYPE_CHECKING:
    from shardbroker.cluster.config import LeafnodesConfig

# Go's strconv.ParseBool, which nats-server's monitoring reads its flags with; ``detail`` as /connz takes it.
_TRUE = ("1", "t", "T", "TRUE", "true", "True", "detail")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def flag(query: dict[str, str], name: str) -> bool:
    """A boolean query parameter (absent or empty: false), or ValueError with nats-server's text."""
    value = query.get(name, "")
    if value == "" or value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise ValueError(f"Error decoding boolean for '{name}': strconv.ParseBool: parsing \"{value}\": invalid syntax")


def leafs(replies: list[dict], account: str = "") -> list[dict]:
    """The workers' leaf connections, worker by worker, each with its ``worker``; ``account``: only that account's
    (nats-server's ``acc=``)."""
    out = []
    for reply in sorted(replies, key=lambda r: r["worker"]):
        for entry in reply.get("leafz", ()):
            if not account or entry.get("account") == account:
                out.append({**entry, "worker": reply["worker"]})
    return out


def connected(replies: list[dict]) -> int:
    """Leaf connections up now, over the workers that answered (/varz ``leafnodes``)."""
    return sum(r.get("leafnodes", {}).get("connections", 0) for r in replies)


def varz_leaf(section: LeafnodesConfig) -> dict:
    """nats-server's /varz ``leaf``: no ``host``/``port`` (this broker accepts no leaf connections, it only
    solicits), and each remote as configured: ``local_account``, ``urls`` (host:port, never credentials),
    ``tls_timeout`` (with TLS), ``deny`` (with deny rules)."""
    remotes = []
    for remote in section.remotes:
        entry: dict = {"local_account": remote.account,
                       "urls": [parse_url(u, "leafnodes.remotes[].urls").url.split("://", 1)[1]
                                for u in remote.urls]}
        if remote.tls:
            tls = remote.tls if isinstance(remote.tls, LeafTlsConfig) else LeafTlsConfig()
            entry["tls_timeout"] = tls.timeout
        if remote.deny_imports or remote.deny_exports:
            deny = {}
            if remote.deny_exports:
                deny["exports"] = list(remote.deny_exports)
            if remote.deny_imports:
                deny["imports"] = list(remote.deny_imports)
            entry["deny"] = deny
        remotes.append(entry)
    return {"remotes": remotes} if remotes else {}
