"""Moving a client connection to the worker that owns the work queue it uses.

A request for a queue is answered by the queue's owner; from any other worker it crosses the fabric there and
back, which costs both workers CPU and the client two ZeroMQ hops of latency (~60 µs each here, more under load).
A consumer on the owner drains a backlog about twice as fast as one a hop away (docs/performance-notes.md).  So an
NDJSON connection whose first work-queue request is for a queue another worker owns, and which holds nothing on
its worker, is handed to that owner together with what it sent and was not yet processed; the owner answers it
from then on.  It happens once: later requests for queues owned elsewhere cross the fabric as they always did.

"Holds nothing": plain TCP (a TLS session's state cannot be handed over), no subscription, no earlier queue
request (so no lease, long poll or pipelined reply is tied to this worker), no reply outstanding or unwritten,
nothing paused, and neither this worker nor the client closing.  ``queues.move_connections: false`` turns it off.

How: the connection stops reading, its queued output is written, and a duplicate of its descriptor goes to the
supervisor (``move``, over the control channel) with its identity (cid, user, start time) and the bytes read but
not processed.  Then this worker lets go of its own descriptor without closing the connection (the duplicate
keeps it open) and without reporting it closed.  The supervisor hands it on as it does an accepted connection
(``conn`` with ``moved``): to the owner if that one is ready, else back here.  The receiving session processes
the carried bytes before it reads the socket again, so the client sees one ordered stream of replies.  If the
client is not reading (output still buffered), or the bytes cannot be carried, the connection stays.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Protocol


class Session(Protocol):
    """What a move needs of an NDJSON session (``workers.protocols.ndjson.session.NdjsonSession``)."""

    hub: Any
    cid: int
    user: Any
    protocol: str
    started: float
    transport: Any
    tls: bool
    subs: dict
    closed: bool
    peer_eof: bool
    paused: bool
    moved: bool
    reason: str
    movable: bool
    push_group: object | None
    pending_replies: int
    unprocessed: bytes

    def suspend(self, items: list | None = None, keep_reading: bool = False) -> None: ...
    def resume_held(self) -> None: ...
    def flush(self) -> None: ...

log = logging.getLogger("broker.moves")

MAX_CARRIED = 1 << 20   # bytes read and not processed that may travel with a connection; more: it stays


def target(session: Session, queue: str) -> int | None:
    """Where ``session`` should go for its first request for ``queue`` (then it is started), or None (it stays;
    and it will not be asked again)."""
    session.movable = False
    hub = session.hub
    service = hub.queue_service
    if (session.tls or session.subs or session.pending_replies or session.push_group is not None or session.closed
            or session.peer_eof or session.paused or hub.stopping or service.used_by(session.cid)):
        return None
    owner = service.owner(queue)
    return None if owner == hub.index else owner


def start(session: Session, line: bytes, to: int) -> None:
    """Hold ``line`` (the request that decided it) and everything read after it, and move at the end of the turn,
    once the replies before it are written."""
    session.suspend([line])
    session.hub.loop.call_soon(_hand_over, session, to)


def _carried(session: Session) -> bytes | None:
    """The held requests and the partial line after them, as the client sent them; None if they cannot travel."""
    held, tail = session.unprocessed()
    parts = []
    for item in held:
        if type(item) is bytes:
            parts.append(item + b"\n")
        elif type(item) is tuple:   # a run of publishes (speedups.ndjson_runs): its lines
            parts.extend(line + b"\n" for line in item[2])
        else:                        # a line past the limit: answered here, as it always is
            return None
    parts.append(tail)
    data = b"".join(parts)
    return data if len(data) <= MAX_CARRIED else None


def _hand_over(session: Session, to: int) -> None:
    if session.closed:
        return
    hub = session.hub
    transport = session.transport
    session.flush()
    data = _carried(session) if not hub.stopping and not session.closed else None
    if data is None or transport.get_write_buffer_size():
        session.resume_held()   # it stays: the held requests are processed here
        return
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    state = {"cid": session.cid, "user": session.user.name if session.user is not None else None,
             "started": session.started, "data": data.decode("latin-1")}
    if not hub.hand_over({"k": "move", "p": session.protocol, "to": to, "state": state}, sock):
        sock.close()   # the supervisor is gone: the worker is about to stop anyway
        session.resume_held()
        return
    session.moved = True
    session.reason = f"moved to worker {to}"
    session.closed = True   # nothing more is processed or written here: the connection is the other worker's
    transport.abort()       # closes this worker's descriptor only (the duplicate keeps the connection open)
    hub.moved_out += 1
    log.debug("cid:%d moved to worker %d with %d bytes", session.cid, to, len(data))
