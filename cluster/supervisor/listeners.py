"""The client listeners and the monitoring socket: those systemd passed (socket activation), each recognised as
the listener it stands for, and the others bound here.

All of it happens before any worker starts: a port in use, or a passed socket the configuration has no listener
for, is one line and an exit code, not a half-started broker.
"""

from __future__ import annotations

import logging
import socket

from shardbroker.cluster.config import Config, protocols
from shardbroker.cluster.supervisor import systemd
from shardbroker.cluster.supervisor.acceptor import Listener, bind, no_delay
from shardbroker.router import shardmap

log = logging.getLogger("broker.supervisor")

# The config key a passed listener stands in for (socket activation), by FileDescriptorName=.
_SECTIONS = protocols.LISTENERS


def adopt(cfg: Config, passed: list[tuple[str, socket.socket]]) -> dict[str, socket.socket]:
    """Which listener each socket passed by systemd is: its FileDescriptorName= if that names one (ndjson,
    nats, bridge, qlite, monitoring), else the listener whose configured port is the socket's (one
    shardbroker.socket unit with several ListenStream= gives every fd the unit's name)."""
    enabled = {name: (protocols.listener_on(cfg, name), getattr(cfg, section).port)
               for name, section in _SECTIONS.items()}
    out: dict[str, socket.socket] = {}
    for name, sock in passed:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise systemd.ActivationError(f"the passed listener {name!r} is not a TCP socket (ListenStream= "
                                          f"takes an address and port here)")
        port = sock.getsockname()[1]
        if name not in enabled:
            name = next((n for n, (on, p) in enabled.items() if on and p and p == port), name)
        if name not in enabled:
            raise systemd.ActivationError(
                f"the passed listener on port {port} is named {name!r} and no enabled listener is configured "
                f"on that port: name it (FileDescriptorName= {', '.join(enabled)}) or configure its port")
        if not enabled[name][0]:
            raise systemd.ActivationError(f"a {name} listener was passed, but {_SECTIONS[name]}.enabled is "
                                          f"false")
        if name in out:
            raise systemd.ActivationError(f"two {name} listeners were passed")
        out[name] = sock
    return out


def open_listeners(cfg: Config, nworkers: int,
                   passed: dict[str, socket.socket]) -> tuple[list[Listener], socket.socket | None]:
    """The client listeners, and the monitoring socket (None: monitoring is off): those systemd passed (socket
    activation, after ``adopt``), else bound here."""
    monitor_sock = passed.pop("monitoring", None)
    if monitor_sock is not None:
        host, port = monitor_sock.getsockname()[:2]
        log.info("monitoring: listening on %s:%d, passed by systemd (monitoring.bind and monitoring.port are "
                 "not used)", host, port)
    wanted = []
    for p in protocols.enabled(cfg):
        section = getattr(cfg, p.section)
        # the NDJSON listener's bind is its own; the others default to it (Config.bind_for)
        wanted.append((p.name, section.bind if not p.optional else cfg.bind_for(section.bind), section.port,
                       p.refusal))
    listeners = []
    own = {p.name: dict(p.refusals) for p in protocols.PROTOCOLS}
    # A qlite listener serves one queue: its connections go to the queue's owner, where every request they make
    # is answered without a hop between workers (and qlite's connection limits are the whole broker's).
    homes = {"qlite": shardmap.owner(cfg.qlite.queue, nworkers)}
    for proto, host, port, refusal in wanted:
        if proto in passed:
            no_delay(passed[proto])
            listeners.append(Listener(proto, passed.pop(proto), refusal, own.get(proto, {}), homes.get(proto)))
            section = _SECTIONS[proto]
            log.info("%s: listening on %s, passed by systemd (%s.bind and %s.port are not used)", proto,
                     listeners[-1].describe(), section, section)
            continue
        try:
            listeners.append(Listener(proto, bind(host, port), refusal, own.get(proto, {}), homes.get(proto)))
        except OSError as exc:
            for lst in listeners:
                lst.sock.close()
            raise OSError(exc.errno, f"cannot listen for {proto} on {host}:{port}: {exc.strerror}") from None
    if cfg.monitoring.enabled and monitor_sock is None:
        # Bound here with the others: a port in use is one line and exit 1 before any worker starts, and the
        # monitoring port answers from the first moment ("starting") to the last ("stopping").
        host, port = cfg.monitoring.bind, cfg.monitoring.port
        try:
            monitor_sock = bind(host, port, backlog=128)
        except OSError as exc:
            for lst in listeners:
                lst.sock.close()
            raise OSError(exc.errno, f"cannot listen for monitoring on {host}:{port}: {exc.strerror}") from None
    return listeners, monitor_sock
