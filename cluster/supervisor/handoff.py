"""Which worker gets a connection: one just accepted, one a worker moves to another, one a dead worker was sent and
never read.

The socket goes over the worker's control channel (``SCM_RIGHTS``) and the supervisor closes its own copy.  A
worker killed a moment ago still looks ready until the supervisor's loop reads its exit; what it was sent meanwhile
is read back from its end of the socketpair then, and handed on here (``rehand``): the clients notice nothing.

A plain-TCP NATS client is greeted here, before its socket is handed over (``greeting``): its INFO comes from the
acceptor, as nats-server's accept loop sends it, so the client's CONNECT is on its way while the socket crosses to
its worker (workers/protocols/nats/greeting.py).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Protocol

from shardbroker.cluster.config import Config
from shardbroker.cluster.supervisor.acceptor import Listener
from shardbroker.cluster.supervisor.admission import Admission
from shardbroker.cluster.supervisor.slots import WorkerSlot
from shardbroker.workers.protocols.nats.greeting import info_fields, info_line

log = logging.getLogger("broker.supervisor")


class Cluster(Protocol):
    """What the handoff needs of the supervisor (cluster.supervisor.core.Supervisor), named here: it imports this."""

    state: str                   # a move is made only while "ready" or "reloading"
    nworkers: int
    slots: list[Any]             # WorkerSlot or None, by worker index
    admission: Admission
    config: Config
    tls_contexts: dict[str, Any]   # by listener, those with TLS

    def server_info(self) -> dict:
        """What NATS clients are told in INFO (before their own fields)."""


class Handoff:
    def __init__(self, sup: Cluster) -> None:
        self.sup = sup
        self._next_cid = 0
        self._greeting_for: Config | None = None   # the configuration _greeting_info was made for
        self._greeting_info: dict = {}

    def accepted(self, lst: Listener, conn, address: str) -> bool:
        """A connection the acceptor took on ``lst``; False: no worker could take it."""
        # Its home first (the qlite listener's queue owner), else the least loaded: while the home is being
        # replaced its requests wait for the owner as any others do.
        self._next_cid += 1
        message = {"k": "conn", "p": lst.protocol, "cid": self._next_cid}
        greeting = self.greeting(lst.protocol, self._next_cid, address)
        if greeting is not None:
            # Greeted here, the client sends its handshake while the socket crosses to its worker: one process
            # woken between a connect and its greeting, as with nats-server, not two.  A fresh socket's buffer
            # takes a greeting whole; one that fails was reset already, which its worker will find.
            try:
                if conn.send(greeting, socket.MSG_DONTWAIT) == len(greeting):
                    message["greeted"] = True
            except OSError:
                pass
        slot = self.give(self.choices(lst.home), message, conn)
        if slot is None:
            return False
        slot.live += 1
        self.sup.admission.opened(self._next_cid, slot.index, address)
        return True

    def greeting(self, protocol: str, cid: int, address: str) -> bytes | None:
        """The INFO the acceptor greets a NATS client with where it is plain TCP, as its worker would; None for the
        other protocols, and where TLS comes first: the worker that makes the handshake sends INFO
        (workers/tls.py)."""
        sup = self.sup
        if protocol != "nats" or "nats" in sup.tls_contexts:
            return None
        if self._greeting_for is not sup.config:   # what INFO says changes with the configuration alone
            self._greeting_for = sup.config
            self._greeting_info = sup.server_info()
        return info_line(info_fields(self._greeting_info, cid, address, sup.config.security.enabled))

    def move(self, src: WorkerSlot, msg: dict, fds: list[int]) -> None:
        """A worker gives one of its connections to another (workers/protocols/ndjson/moves.py): hand it to ``to`` if
        that one is ready and the broker is running as usual, else back to the worker that sent it."""
        for fd in fds[1:]:
            os.close(fd)
        cid = int(msg["state"]["cid"])
        to = msg.get("to")
        dst = self.sup.slots[to] if type(to) is int and 0 <= to < self.sup.nworkers else None
        choices = [src]
        if dst is not None and dst is not src and self.sup.state in ("ready", "reloading"):
            choices.insert(0, dst)
        sock = socket.socket(fileno=fds[0]) if fds else None
        slot = self.give(choices, {"k": "conn", "p": msg.get("p"), "cid": cid, "moved": msg["state"],
                                   "from": src.index}, sock)
        if slot is src:
            return
        if slot is not None:
            src.live = max(0, src.live - 1)
            slot.live += 1
            self.sup.admission.moved(cid, slot.index)
            return
        if sock is not None:
            sock.close()
        log.error("connection %d could not be moved from worker %d: closed", cid, src.index)
        if self.sup.admission.closed(cid) == src.index:
            src.live = max(0, src.live - 1)

    def choices(self, first: int | None) -> list[WorkerSlot]:
        """The ready workers, ``first`` first if it is one of them, then the least loaded."""
        return sorted((s for s in self.sup.slots if s is not None and s.state == "ready"),
                      key=lambda s: (s.index != first, s.live))

    @staticmethod
    def give(choices: list[WorkerSlot], message: dict, sock: socket.socket | None) -> WorkerSlot | None:
        """Hand ``sock`` to the first ready worker of ``choices``.  One killed a moment ago still looks ready
        until the loop reads its exit; what it was sent meanwhile is read back then (``rehand``)."""
        slot = next((s for s in choices if s.state == "ready"), None)
        if sock is None or slot is None or not slot.channel.send(message, sock=sock):
            return None
        return slot

    def rehand(self, dead: WorkerSlot, unread: list[tuple[dict, list[int]]], stopping: bool) -> None:
        """The connections ``dead`` was sent and never read go to the ready workers instead (a moved one back to
        the worker it came from, if it can), as if they had just been accepted: their clients notice nothing.
        ``stopping``: the broker is stopping, and they are closed instead."""
        for message, fds in unread:
            for fd in fds[1:]:
                os.close(fd)
            if message.get("k") != "conn" or not fds:
                continue
            sock = socket.socket(fileno=fds[0])
            cid = int(message["cid"])
            slot = self.give(self.choices(message.get("from")), message, sock) if not stopping else None
            if slot is None:
                sock.close()
                continue
            slot.live += 1
            self.sup.admission.moved(cid, slot.index)
            log.warning("worker %d died before taking connection %d; handed to worker %d", dead.index, cid,
                        slot.index)
