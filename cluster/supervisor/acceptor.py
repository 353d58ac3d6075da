"""Listening sockets and the accept loop of the supervisor.

The acceptor owns the listening sockets; it accepts and hands every connection to a worker (``handoff``), which
adopts the fd.  Which worker is the supervisor's choice (fewest live connections, or the listener's ``home``).
Over a connection limit (cluster.supervisor.admission) a client gets the protocol's own refusal line and is closed here.

Out of file descriptors (EMFILE, ENFILE) the pending connection stays in the kernel's backlog, so the listener stays
readable: accepting again at once would spin the event loop at 100 % CPU and log a line each time.  So that
listener is left alone for a while instead, 10 ms at first, doubling up to 1 s while accepts keep failing (nats-server
sleeps the same way), with one log line per pause.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("broker.acceptor")

_ACCEPT_BATCH = 128  # accepts per readiness callback, so one busy listener cannot starve the loop
_PAUSE_MIN, _PAUSE_MAX = 0.01, 1.0   # seconds a listener rests after an accept failed for want of descriptors
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass
class Listener:
    protocol: str            # "ndjson", "nats", ... : which codec the worker puts on the connection
    sock: socket.socket
    refusal: bytes = b""     # written before closing a connection over the limit
    # by limit (cluster.supervisor.admission), where not ``refusal``
    refusals: dict[str, bytes] = field(default_factory=dict)
    home: int | None = None  # the worker its connections go to while that one is ready (qlite: its queue's owner)
    # Where it listens, read once: in lame duck the socket is closed, and monitoring still reports the address.
    address: tuple[str, int] = field(init=False)

    def __post_init__(self) -> None:
        host, port = self.sock.getsockname()[:2]
        self.address = (host, port)

    def describe(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A non-blocking listening socket; OSError names what failed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        no_delay(sock)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def no_delay(listener: socket.socket) -> None:
    """Nagle off for every connection ``listener`` accepts: Linux copies TCP_NODELAY from the listener to each
    accepted socket, so no worker spends a system call per client on it."""
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Acceptor:
    def __init__(self, listeners: list[Listener], handoff: Callable[[Listener, socket.socket, str], bool],
                 refusal: Callable[[str], str | None]) -> None:
        """``handoff(listener, conn, address)``: pass it on (False: it could not be); ``refusal(address)``: the
        limit a connection from ``address`` would break, or None."""
        self.listeners = listeners
        self._handoff = handoff
        self._refusal = refusal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pause: dict[int, float] = {}    # listener fd -> its current rest after a failed accept
        self._resting: dict[int, asyncio.TimerHandle] = {}
        self._closed = False
        self.accepted = 0
        self.refused = 0
        self.accept_errors = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for lst in self.listeners:
            self._loop.add_reader(lst.sock.fileno(), self._on_readable, lst)

    def _on_readable(self, lst: Listener) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, addr = lst.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._rest(lst, exc)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            self._pause.pop(lst.sock.fileno(), None)
            address = addr[0] if isinstance(addr, tuple) else ""
            reason = self._refusal(address)
            if reason is not None:
                self.refused += 1
                try:
                    conn.setblocking(False)
                    conn.send(lst.refusals.get(reason, lst.refusal))
                except OSError:
                    pass
                conn.close()
                continue
            self.accepted += 1
            if not self._handoff(lst, conn, address):
                conn.close()

    def _rest(self, lst: Listener, exc: OSError) -> None:
        self.accept_errors += 1
        fd = lst.sock.fileno()
        pause = self._pause.get(fd, _PAUSE_MIN / 2) * 2
        pause = self._pause[fd] = min(pause, _PAUSE_MAX)
        log.error("%s: accept failed: %s (raise the open-files limit?); accepting again in %g ms", lst.protocol,
                  exc.strerror, pause * 1000)
        try:
            self._loop.remove_reader(fd)
        except (ValueError, OSError):
            return
        self._resting[fd] = self._loop.call_later(pause, self._wake, lst)

    def _wake(self, lst: Listener) -> None:
        self._resting.pop(lst.sock.fileno(), None)
        if not self._closed:
            self._loop.add_reader(lst.sock.fileno(), self._on_readable, lst)

    def close(self) -> None:
        self._closed = True
        for timer in self._resting.values():
            timer.cancel()
        self._resting.clear()
        for lst in self.listeners:
            if self._loop is not None:
                try:
                    self._loop.remove_reader(lst.sock.fileno())
                except (ValueError, OSError):
                    pass
            lst.sock.close()
