"""What many connections need from the machine: source addresses beyond the ephemeral ports, and open files.

Source addresses: a TCP connection is one (source address, source port, server address, server port), and the
kernel picks source ports from net.ipv4.ip_local_port_range (about 28,000 of them by default), so one source
address reaches one server port at most that many times.  The generators open connection ``i`` (counted over
all of a run's generators, so that two processes do not each fill 127.0.0.1) from 127.0.0.1 for the first
``PER_SOURCE``, then from 127.0.0.2, 127.0.0.3 ...: on Linux all of 127.0.0.0/8 is loopback, nothing to set up.
``PER_SOURCE`` is well under the port range because a run's connections, closed by the generator, stay in
TIME_WAIT for a minute on their source ports: the next round to the same server (the fan-outs keep their server)
needs ports of its own beside them.

Open files: a connection is a file descriptor in the generator that holds it and in the server, and nats-server
and Redis hold every one of theirs in one process, so a scenario of ``n`` connections needs ``n`` and some
descriptors per process.  The bench raises its soft limit to the hard one (the servers and generators it starts
inherit it); a scenario the hard limit cannot hold is skipped with the reason, not run into EMFILE.
"""

from __future__ import annotations

import ipaddress
import resource
import socket

PER_SOURCE = 10_000          # connections from one loopback source address, at most
FD_HEADROOM = 1_024          # descriptors a process needs besides the connections (listeners, logs, pipes)
# The source port is chosen at connect(), for the whole 4-tuple, not at bind() for the address alone (where
# every socket bound to that address, TIME_WAIT ones included, would take a port of its own): Linux >= 4.2.
_BIND_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
_FIRST = int(ipaddress.IPv4Address("127.0.0.1"))
_LAST = int(ipaddress.IPv4Address("127.255.255.254"))


def source_address(index: int) -> str | None:
    """The loopback address connection ``index`` of a run goes out from; None for the first ``PER_SOURCE`` (the
    kernel's choice, 127.0.0.1 towards 127.0.0.1, as for any small scenario)."""
    if index < PER_SOURCE:
        return None
    address = _FIRST + index // PER_SOURCE
    if address > _LAST:
        raise ValueError(f"connection {index:,}: more than 127.0.0.0/8 holds at {PER_SOURCE:,} an address")
    return str(ipaddress.IPv4Address(address))


def connect(host: str, port: int, index: int, timeout: float) -> socket.socket:
    """A connection to ``host:port`` (a loopback address), from the source address of connection ``index``."""
    source = source_address(index) if host.startswith("127.") else None
    if source is None:
        return socket.create_connection((host, port), timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, _BIND_NO_PORT, 1)
        sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (what it starts inherits it); -> the
    limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return _count(soft)


def fd_shortfall(connections: int) -> str | None:
    """Why a scenario of ``connections`` connections cannot run here (the hard limit on open files), or None."""
    hard = _count(resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    need = connections + FD_HEADROOM
    if need <= hard:
        return None
    return (f"needs {need:,} open files in one process (nats-server and redis-server hold all its {connections:,} "
            f"connections in one), the hard limit on open files here is {hard:,} (ulimit -Hn; raise it with "
            f"LimitNOFILE= or in /etc/security/limits.conf)")


def _count(limit: int) -> int:
    return 1 << 30 if limit == resource.RLIM_INFINITY else limit


def broker_limits(connections: int) -> dict:
    """This broker's limits in the bench, for ``connections`` at once: no cap per source address (the default,
    said outright: the generators share a handful of addresses), and room for them all and a subscription each
    (the subscriptions per user are counted per client address with security off)."""
    room = max(65_536, connections + FD_HEADROOM)
    return {"max_connections": room, "max_connections_per_address": 0, "max_subscriptions_per_user": room}
