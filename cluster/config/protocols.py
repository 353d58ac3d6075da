"""The client protocols the broker speaks, in one table that every place listing protocols reads.

The configuration (its sections, their default ports, which listeners take TLS), the supervisor (which listeners
to bind, what a refused connection is told, which sockets systemd may pass), the workers (which session serves a
listener's connections, what a plaintext client on a TLS port is told, who greets before the handshake) all come
from ``PROTOCOLS``.  Adding a protocol is a folder of its own under ``workers/protocols/`` and one
line here (plus its configuration section's dataclass in ``cluster/config``).

This module imports nothing of the broker: the supervisor reads it without loading any worker code, and a worker
imports a session only when its listener is on (``session_class``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Protocol:
    name: str             # the listener's name: systemd's FileDescriptorName=, /connz "type", the logs
    section: str          # its configuration section
    default_port: int
    session: str          # "module:Class" of its session (workers), imported when its listener is on
    refusal: bytes        # what a connection over limits.max_connections is told before the close
    tls_refusal: bytes    # what a client speaking plaintext to its TLS port is told ("": it waits for a greeting)
    greets_first: bool = False   # the server speaks first and may do so in plaintext before TLS (NATS' INFO)
    optional: bool = True        # its section has ``enabled`` (the NDJSON listener is always on)
    refusals: tuple[tuple[str, bytes], ...] = ()   # its own words for other limits: (limit, bytes)


PROTOCOLS: tuple[Protocol, ...] = (
    Protocol("ndjson", "network", 8080, "shardbroker.workers.protocols.ndjson.session:NdjsonSession",
             refusal=b'{"ok":false,"error":"max_connections"}\n',
             tls_refusal=b'{"ok":false,"error":"tls_required"}\n', optional=False,
             refusals=(("max_connections_per_address", b'{"ok":false,"error":"max_connections_per_address"}\n'),)),
    # nats-server's words for both refusals
    Protocol("nats", "nats", 4222, "shardbroker.workers.protocols.nats.session:NatsSession",
             refusal=b"-ERR 'maximum connections exceeded'\r\n",
             tls_refusal=b"-ERR 'Secure Connection - TLS Required'\r\n", greets_first=True),
    Protocol("bridge", "bridge", 9090, "shardbroker.workers.protocols.bridge.session:BridgeSession", refusal=b"F",
             tls_refusal=b"F"),
    # qlite's FAIL frame (workers/protocols/qlite/codec.fail); its clients wait for the server's greeting, so a
    # plaintext one on a TLS port never gets an answer: it times out, as against qlite itself.
    Protocol("qlite", "qlite", 7070, "shardbroker.workers.protocols.qlite.session:QliteSession",
             refusal=b"E\x00\x00\x00FAIL;error: the max amount of connections have already been connected",
             tls_refusal=b""),
)

BY_NAME = {p.name: p for p in PROTOCOLS}

# Every listener and its configuration section: the client protocols, and the monitoring port (which takes TLS
# and may be passed by systemd like them).
LISTENERS = {p.name: p.section for p in PROTOCOLS} | {"monitoring": "monitoring"}


def listener_on(config, name: str) -> bool:
    """Whether ``config`` (a cluster.config.Config) turns the listener ``name`` (one of ``LISTENERS``) on."""
    protocol = BY_NAME.get(name)
    if protocol is not None and not protocol.optional:
        return True   # its section has no ``enabled``
    return getattr(config, LISTENERS[name]).enabled


def enabled(config) -> list[Protocol]:
    """The protocols whose listeners ``config`` turns on."""
    return [p for p in PROTOCOLS if listener_on(config, p.name)]


def session_class(protocol: Protocol) -> type:
    """The session class that serves ``protocol``'s connections (imports its module)."""
    module, _, name = protocol.session.partition(":")
    return getattr(importlib.import_module(module), name)
