"""The control channel between the supervisor and one worker.

One ``AF_UNIX``/``SOCK_SEQPACKET`` socketpair per worker.  It carries accepted client sockets (``SCM_RIGHTS``, one fd
per message), membership and stop orders, heartbeats, and stats.  It is reliable and ordered, unlike the ZeroMQ
PUB/SUB fabric, which is why control traffic never goes over the fabric.  When the supervisor dies its worker reads
EOF: that is how a worker notices that its supervisor is gone, even after a SIGKILL.  (The supervisor learns of a
worker's death from its pidfd instead: it holds a copy of the worker's end, to read back what the worker never
read: ``decode_all``, cluster.supervisor.launch.)

Messages are orjson objects.  A datagram is one flag byte (``1``: more chunks follow) and up to ``CHUNK`` bytes, so
a large reply (a connection listing) crosses in several datagrams without raising the socket buffers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Callable
from typing import Any

import orjson

log = logging.getLogger("broker.control")

CHUNK = 60 * 1024
# Descriptors received close on exec from the start (Linux): no worker spends a system call per client on it.
RECV_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_MORE, _LAST = b"\x01", b"\x00"


def socketpair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def encode(message: dict[str, Any]) -> list[bytes]:
    """One control message -> the datagrams that carry it."""
    data = orjson.dumps(message)
    if len(data) <= CHUNK:
        return [_LAST + data]
    parts = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    return [_MORE + p for p in parts[:-1]] + [_LAST + parts[-1]]


class Reassembler:
    """Datagrams in, complete messages out."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def feed(self, datagram: bytes) -> dict[str, Any] | None:
        self._parts.append(datagram[1:])
        if datagram[:1] == _MORE:
            return None
        data = b"".join(self._parts)
        self._parts = []
        return orjson.loads(data)


def decode_all(datagrams: list[tuple[bytes, list[int]]]) -> list[tuple[dict, list[int]]]:
    """Datagrams read back from a dead worker's queue (cluster.supervisor.launch) -> its messages with their
    descriptors. A message whose first datagram the worker had read, or that does not parse, is dropped (its descriptors
    closed)."""
    out = []
    reasm = Reassembler()
    held: list[int] = []
    for data, fds in datagrams:
        held += fds
        try:
            msg = reasm.feed(data)
        except orjson.JSONDecodeError:   # the tail of a message whose head the worker read
            msg = None
        if data[:1] == _LAST:
            if msg is not None:
                out.append((msg, held))
            else:
                for fd in held:
                    socket.close(fd)
            held = []
    for fd in held:
        socket.close(fd)
    return out


class Channel:
    """An asyncio endpoint of a control socketpair.

    ``send`` never blocks: datagrams the socket cannot take now wait in a queue drained when it becomes writable.
    A socket handed over with ``send(..., sock=s)`` is closed here once its fd is on its way.
    """

    def __init__(self, sock: socket.socket, on_message: Callable[[dict, list[int]], None],
                 on_close: Callable[[], None]) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._on_close = on_close
        self._queue: collections.deque[tuple[bytes, socket.socket | None]] = collections.deque()
        self._reasm = Reassembler()
        self._held: list[int] = []   # descriptors of a message whose datagrams are still arriving
        self._writing = False
        self.closed = False
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def send(self, message: dict[str, Any], sock: socket.socket | None = None) -> bool:
        """Queue ``message`` (with ``sock``'s fd attached); False if the channel is already closed."""
        if self.closed:
            return False
        datagrams = encode(message)
        for i, dg in enumerate(datagrams):
            self._queue.append((dg, sock if i == 0 else None))
        if not self._writing:
            self._drain()
        return True

    def _drain(self) -> None:
        while self._queue:
            dg, handed = self._queue[0]
            try:
                if handed is not None:
                    socket.send_fds(self.sock, [dg], [handed.fileno()])
                else:
                    self.sock.send(dg)
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(self.sock.fileno(), self._drain)
                return
            except OSError:
                self.close()
                return
            self._queue.popleft()
            if handed is not None:
                handed.close()  # our copy: the peer owns the connection now
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self.sock.fileno())

    def _on_readable(self) -> None:
        while not self.closed:
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, CHUNK + 1, 1, RECV_FLAGS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            if not data:
                self.close()
                return
            if flags & socket.MSG_CTRUNC:
                log.error("control message lost its file descriptor (MSG_CTRUNC)")
            # A socket handed over rides on its message's first datagram (send): held until the message is whole
            # (a connection moved with a large request still unread, say).
            self._held += fds
            msg = self._reasm.feed(data)
            if msg is None:
                continue
            fds, self._held = self._held, []
            self._on_message(msg, fds)

    def unsent(self) -> list[tuple[bytes, list[int]]]:
        """Take back the datagrams still waiting to be sent (the peer died), with their sockets' descriptors."""
        out = [(dg, [handed.detach()] if handed is not None else []) for dg, handed in self._queue]
        self._queue.clear()
        return out

    def read_pending(self) -> None:
        """Deliver what the peer sent and was not read yet (it died: what it said before still counts)."""
        if not self.closed:
            self._on_readable()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._loop.remove_reader(self.sock.fileno())
            if self._writing:
                self._loop.remove_writer(self.sock.fileno())
        except (ValueError, OSError):
            pass
        for _, handed in self._queue:
            if handed is not None:
                handed.close()
        self._queue.clear()
        for fd in self._held:
            socket.close(fd)
        self._held = []
        self.sock.close()
        self._on_close()
