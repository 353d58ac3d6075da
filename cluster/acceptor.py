"""Listening sockets and the accept loop of the supervisor.

The acceptor owns the listening sockets; it accepts and hands every connection to a worker (``handoff``), which
adopts the fd.  Which worker is the supervisor's choice (fewest live connections).  Over the connection limit a
client gets the protocol's own refusal line and is closed here.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("broker.acceptor")

_ACCEPT_BATCH = 128  # accepts per readiness callback, so one busy listener cannot starve the loop


@dataclass
class Listener:
    protocol: str            # "ndjson", "nats", ... : which codec the worker puts on the connection
    sock: socket.socket
    refusal: bytes = b""     # written before closing a connection over the limit

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    def describe(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A non-blocking listening socket; OSError names what failed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Acceptor:
    def __init__(self, listeners: list[Listener],
                 handoff: Callable[[Listener, socket.socket], bool], at_capacity: Callable[[], bool]) -> None:
        self.listeners = listeners
        self._handoff = handoff
        self._at_capacity = at_capacity
        self._loop: asyncio.AbstractEventLoop | None = None
        self.accepted = 0
        self.refused = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for lst in self.listeners:
            self._loop.add_reader(lst.sock.fileno(), self._on_readable, lst)

    def _on_readable(self, lst: Listener) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _addr = lst.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("accept failed: %s (raise the open-files limit?)", exc.strerror)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            if self._at_capacity():
                self.refused += 1
                try:
                    conn.setblocking(False)
                    conn.send(lst.refusal)
                except OSError:
                    pass
                conn.close()
                continue
            self.accepted += 1
            if not self._handoff(lst, conn):
                conn.close()

    def close(self) -> None:
        for lst in self.listeners:
            if self._loop is not None:
                try:
                    self._loop.remove_reader(lst.sock.fileno())
                except (ValueError, OSError):
                    pass
            lst.sock.close()
