"""systemd's side of the service, hand-written: sd_notify, the watchdog's settings and socket activation.

The protocol is small and documented as stable (``sd_notify(3)``, ``sd_listen_fds(3)``), and the libraries that
wrap it are stale or heavy (docs/operations.md), so this is the whole of it, as gunicorn's systemd.py is:

- ``Notifier``: ``KEY=VALUE`` lines in one datagram to ``$NOTIFY_SOCKET`` (``@`` is the abstract namespace).
- ``watchdog_usec``: ``$WATCHDOG_USEC``, honoured only when ``$WATCHDOG_PID`` is unset or names this process.
- ``listen_fds``: the listeners systemd passes (``$LISTEN_FDS`` from fd 3, named by ``$LISTEN_FDNAMES``), for
  this process only (``$LISTEN_PID``).

``take_environment`` removes every one of these variables from ``os.environ`` once read: workers (and anything else
the supervisor starts) must not notify in its name, arm its watchdog, or adopt its listeners.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time

log = logging.getLogger("broker.systemd")

LISTEN_FDS_START = 3
NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class Notifier:
    """Sends state to the service manager; does nothing where there is none (no ``$NOTIFY_SOCKET``)."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: object) -> bool:
        """``send(READY=1, STATUS="...")``: one datagram, the fields in the order given.  A STATUS is one line."""
        if self.address is None:
            return False
        lines = [f"{key}={str(value).replace(chr(10), ' ')}" for key, value in fields.items()]
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # a full socket must never stall the supervisor's loop
            addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
            self._sock.sendto("\n".join(lines).encode(), addr)
            return True
        except OSError as exc:
            if not self._failed:  # once: a manager that went away must not flood the log every ping
                log.warning("cannot notify the service manager at %s: %s", self.address, exc.strerror or exc)
                self._failed = True
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, as MONOTONIC_USEC= wants it (systemd compares it with its own clock)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def watchdog_usec(env: dict[str, str] | os._Environ) -> int:
    """The watchdog timeout this process must honour, in microseconds; 0 without one."""
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return 0
    pid = env.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return 0  # meant for another process (our parent's, say)
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a number", raw)
        return 0
    return max(0, usec)


def take_environment() -> tuple[Notifier, int]:
    """The notifier and the watchdog timeout (µs, 0: none), with their variables removed from the environment."""
    env = {k: os.environ.pop(k) for k in NOTIFY_VARS if k in os.environ}
    return Notifier(env.get("NOTIFY_SOCKET")), watchdog_usec(env)


class ActivationError(Exception):
    """What systemd passed cannot be used (one line)."""


def listen_fds() -> list[tuple[str, socket.socket]]:
    """The listening sockets passed by socket activation, with their ``FileDescriptorName=`` (``unknown`` without
    one); [] without any.

    The variables are removed from the environment whatever happens; the sockets are non-blocking and
    close-on-exec (so no worker inherits them).  A passed fd that is not a listening stream socket is an
    ``ActivationError``: the unit and the code would disagree about what listens where."""
    env = {k: os.environ.pop(k) for k in LISTEN_VARS if k in os.environ}
    if not env.get("LISTEN_FDS"):
        return []
    if env.get("LISTEN_PID", "").strip() != str(os.getpid()):
        return []  # passed to another process (a parent's), not to this one
    try:
        count = int(env["LISTEN_FDS"])
    except ValueError:
        raise ActivationError(f"LISTEN_FDS={env['LISTEN_FDS']!r} is not a number") from None
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    out: list[tuple[str, socket.socket]] = []
    for i in range(count):
        fd = LISTEN_FDS_START + i
        name = names[i] if i < len(names) else "unknown"
        os.set_inheritable(fd, False)
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ActivationError(f"passed fd {fd} ({name}) is not a socket")
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ActivationError(f"passed fd {fd} ({name}) is not a listening stream socket (Accept=no in the "
                                  f".socket unit, ListenStream=)")
        sock.setblocking(False)
        out.append((name or "unknown", sock))
    return out
