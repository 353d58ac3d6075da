"""Every worker's way to its queues' owners: a request goes to the shard that owns the queue, here or over the
fabric, and its reply comes back to the connection that asked.

- A queue's owner is the owner of its name (``router.shardmap``), except that ``<queue>.dlq`` lives with
  ``<queue>``, so dead-lettering and redrive never cross workers.
- Requests and replies are fabric control items: ordered, acknowledged and never dropped (``router.fabric``).
- While an owner is down (killed, being replaced), requests for it wait, up to ``UNAVAILABLE_AFTER``; they are sent
  again once its replacement has replayed its journal and said hello, or answered ``queue_unavailable`` with
  ``retry``.  A push carries a token (this worker, its epoch, the request), journaled with the message, so a push
  sent again after its first copy was stored is answered with that copy's id instead of storing another.
- When a connection closes, the owners it used drop its long polls and release its ``release_on_close`` leases.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shardbroker.router import control, shardmap
from shardbroker.workers.message import as_bytes
from shardbroker.workers.turn import TURN_BUDGET, Turn
from shardbroker.workers.workqueues.operations import ADMIN, BY_NAME, OPERATIONS, PUBLISH
from shardbroker.workers.workqueues.rules import DLQ_SUFFIX
from shardbroker.workers.workqueues.shard import Shard

if TYPE_CHECKING:
    from shardbroker.cluster.config import Config
    from shardbroker.router.fabric import Fabric
    from shardbroker.workers.auth import Authenticator
    from shardbroker.workers.polls import PendingPolls

log = logging.getLogger("broker.queues")

REQUEST, REPLY, GONE = control.WQ_REQUEST, control.WQ_REPLY, control.WQ_GONE   # fabric control items
API = "$Q.>"   # the subjects of the work queues' API (docs/queues.md#nats), served by the broker itself
UNAVAILABLE_AFTER = 2.0
Reply = Callable[[dict], None]


# A turn's share of pushes, whatever the protocol: each message pushed counts this much of the turn's budget
# (``hub.turn_work``), so a read of a thousand pipelined pushes yields to the event loop every PUSHES_PER_TURN of them
# (the rest of the read goes on in the next turn).  The queue's owner then reads its other clients and workers in
# between, consumers included: a producer at full speed does not starve the receives and acks of the queue it fills.
PUSHES_PER_TURN = 128
PUSH_WORK = TURN_BUDGET // PUSHES_PER_TURN

_TOKENED = frozenset(op.name for op in OPERATIONS if op.tokened)
_MAKERS = frozenset(op.name for op in OPERATIONS if op.makes)   # requests that may make a queue


def allowed(permissions, op: str, queue: str) -> bool:
    """Whether a user's ``permissions`` (None: security off) allow ``op`` on ``queue``: ``publish:<queue>`` to
    push, ``subscribe:<queue>`` for everything a consumer does, ``admin`` for purge, redrive and any stat; the
    same patterns and wildcards as for subjects."""
    if permissions is None:
        return True
    need = BY_NAME[op].permission
    if need == PUBLISH:
        return permissions.may_publish(queue)
    if need == ADMIN:
        return permissions.admin
    return permissions.may_subscribe(queue) or (op == "stat" and permissions.admin)


def home(queue: str) -> str:
    """The name that places a queue: a dead-letter queue is placed with its source."""
    return queue[:-len(DLQ_SUFFIX)] if queue.endswith(DLQ_SUFFIX) and len(queue) > len(DLQ_SUFFIX) else queue


class _Pending:
    __slots__ = ("reply", "owner", "item", "down_since")

    def __init__(self, reply: Reply, owner: int, item: tuple) -> None:
        self.reply = reply
        self.owner = owner
        self.item = item
        self.down_since = 0.0


class Host(Protocol):
    """What the service needs of the worker's hub (``workers.hub.Hub``), which hosts it as a part."""

    index: int
    workers: int
    loop: asyncio.AbstractEventLoop
    config: Config
    auth: Authenticator
    fabric: Fabric | None
    conns: dict
    polls: PendingPolls
    turn: Turn
    turn_work: int

    def schedule_flush(self) -> None: ...
    def serve(self, pattern: str, handler: Callable) -> None: ...
    def handle(self, kinds: tuple[str, ...], handler: Callable[[int, tuple], None]) -> None: ...
    def attach(self, part: object) -> None: ...


class QueueService:
    def __init__(self, hub: Host, shard: Shard) -> None:
        self.hub = hub
        self.shard = shard
        self._journal_retry = False
        # Its shares of every turn's end (workers.turn), its fabric control items, and the worker's news.
        hub.turn.add("journal", self._commit)
        hub.turn.add("background", shard.turn_done)
        hub.handle(control.WORK_QUEUE_KINDS, self.on_control)
        hub.attach(self)
        hub.serve(API, self._api)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._used: dict[int, set[int]] = {}     # cid -> owners its requests went to
        self._owners: dict[str, int] = {}        # queue -> owner, as computed (a cache: cleared when large)
        shard.owns = lambda queue: self.owner(queue) == hub.index
        shard.may_receive = self._may_receive

    def _may_receive(self, name: str, queue: str) -> bool:
        user = self.hub.auth.registry.get(name)
        return user is not None and allowed(user.permissions, "recv", queue)

    def users_changed(self) -> None:
        """Users or permissions changed (in force here now): waiting receivers that may no longer receive go."""
        self.shard.recheck_waiters()
        self.hub.schedule_flush()

    def owner(self, queue: str) -> int:
        owner = self._owners.get(queue)
        if owner is None:
            owner = shardmap.owner(home(queue), self.hub.workers)
            if len(self._owners) >= 10_000:
                self._owners.clear()
            self._owners[queue] = owner
        return owner

    def used_by(self, cid: int) -> bool:
        """Whether the connection ``cid`` has made a queue request here."""
        return cid in self._used

    def request(self, cid: int, op: str, args: dict, reply: Reply) -> None:
        """Run ``op`` on the owner of ``args["queue"]`` (a str) for the connection ``cid``; ``reply`` gets the
        result dict."""
        hub = self.hub
        if op in _MAKERS:
            # who asks: a receive is asked again at the owner when messages are handed over (user), and a queue
            # one of these makes counts against its maker's share of the owner's queues (party)
            conn = hub.conns.get(cid)
            if conn is not None:
                args = dict(args, party=conn.party)
                if op == "recv" and conn.user is not None and hub.auth.enabled:
                    args["user"] = conn.user.name
        if op == "recv":
            if args.get("wait_ms"):   # a long poll: bounded per connection and worker (workers.polls)
                reply = hub.polls.admit(cid, reply)
                if reply is None:
                    return
        queue = args["queue"]
        owner = self._owners.get(queue)
        if owner is None:
            owner = self.owner(queue)
        used = self._used.get(cid)
        if used is None:
            used = self._used[cid] = set()
        if owner not in used:
            used.add(owner)
        if owner == hub.index:
            self.shard.handle(op, args, (owner, cid), reply)
            return
        holder = (hub.index, cid)
        rid = next(self._ids)
        if op in _TOKENED:  # a push is sent again if its owner dies: the token lets the replacement see a repeat
            args = dict(args, token=(hub.index, hub.fabric.epoch, rid))
        pending = self._pending[rid] = _Pending(reply, owner, (REQUEST, rid, op, args, holder))
        if owner in hub.fabric.up_peers():
            hub.fabric.control(owner, pending.item)
            hub.schedule_flush()
        else:
            self._park(pending)

    def _park(self, pending: _Pending) -> None:
        pending.down_since = time.monotonic()
        self.hub.loop.call_later(UNAVAILABLE_AFTER, self._give_up)

    def _give_up(self) -> None:
        """Requests whose owner has been down for ``UNAVAILABLE_AFTER``: a retryable error, never silence."""
        now = time.monotonic()
        for rid, pending in list(self._pending.items()):
            if pending.down_since and now - pending.down_since >= UNAVAILABLE_AFTER - 0.01:
                del self._pending[rid]
                pending.reply({"ok": False, "error": "queue_unavailable", "retry": True})

    # -- fabric ---------------------------------------------------------------------------------------------
    def on_control(self, src: int, item: tuple) -> None:
        kind = item[0]
        if kind == REQUEST:
            _, rid, op, args, holder = item
            self.shard.handle(op, args, tuple(holder), lambda result: self._answer(src, rid, result))
        elif kind == REPLY:
            pending = self._pending.pop(item[1], None)
            if pending is not None:
                pending.reply(item[2])
        elif kind == GONE:
            self.shard.drop_holder(tuple(item[1]))

    def _answer(self, dst: int, rid: int, result: dict) -> None:
        fabric = self.hub.fabric
        if dst in fabric.links:
            fabric.control(dst, (REPLY, rid, result))
            self.hub.schedule_flush()

    def peer_reset(self, peer: int) -> None:
        """``peer`` died: its connections are gone, and requests to it wait for its replacement."""
        self.shard.drop_worker(peer)
        for pending in self._pending.values():
            if pending.owner == peer and not pending.down_since:
                self._park(pending)

    def peer_ready(self, peer: int) -> None:
        """``peer``'s replacement answered: it replayed its journal before it started, so send again."""
        for pending in self._pending.values():
            if pending.owner == peer and pending.down_since:
                pending.down_since = 0.0
                self.hub.fabric.control(peer, pending.item)
        self.hub.schedule_flush()

    def connection_closed(self, cid: int) -> None:
        holder = (self.hub.index, cid)
        for owner in self._used.pop(cid, ()):
            if owner == self.hub.index:
                self.shard.drop_holder(holder)
            elif owner in self.hub.fabric.links:
                self.hub.fabric.control(owner, (GONE, holder))
                self.hub.schedule_flush()

    # -- the $Q API --------------------------------------------------------------------------------------------
    def _api(self, origin, subject_b: bytes, reply: str | None, headers: bytes | None, kind: int, payload) -> None:
        """A publish on ``$Q.…`` (an internal subscription, ``Hub.serve``): a work-queue request in the spelling
        of the publisher's protocol, if it has one there (NATS: ``workers/protocols/nats/queue_verbs.py``).
        NDJSON, Bridge and qlite have queue operations of their own: what they publish there reaches nobody."""
        speak = getattr(origin, "queue_api", None)
        if speak is not None:
            speak(subject_b, reply, headers, as_bytes(kind, payload))

    # -- turn and tick --------------------------------------------------------------------------------------
    def _commit(self) -> None:
        try:
            self.shard.commit()  # journal this turn's queue changes before any reply to them leaves
        except OSError as exc:
            self._journal_failed(exc)

    def _journal_failed(self, exc: OSError) -> None:
        """The queue journal could not be written (a full disk, an I/O error).  The replies to what it holds wait
        until a later commit gets it into the file (the journal keeps it, and the file ends on a record boundary),
        tried again every second; everything else this worker carries (pub/sub, the fabric, other replies) goes on
        meanwhile instead of stopping with this turn's end."""
        log.error("work-queue journal: %s; replies to queue changes wait until it can be written (retrying every "
                  "second)", exc.strerror or exc)
        if not self._journal_retry:
            self._journal_retry = True

            def retry() -> None:
                self._journal_retry = False
                self.hub.schedule_flush()
            self.hub.loop.call_later(1.0, retry)

    def stats(self) -> dict:
        shard = self.shard
        return {
            # pushes and receives refused because the queue journal could not be written (a full disk)
            "journal_refused": shard.journal_refused,
            # the queue journal's size now, and its rewrites as the live state (compactions) since the start
            "journal_bytes": shard.journal.size,
            "journal_compactions": shard.compactions,
            # the work queues it holds, pushes and long polls refused for making one too many, idle ones forgotten
            "workqueues": len(shard.queues),
            "queues_refused": shard.queues_refused,
            "queues_forgotten": shard.queues_forgotten,
        }

    def tick(self) -> None:
        self.shard.tick()
        self._owners_stuck()

    def _owners_stuck(self) -> None:
        """Requests to an owner that is alive but acknowledges nothing (stopped, stuck) get ``queue_unavailable``
        once it has been silent ``UNAVAILABLE_AFTER``, as if it were down, instead of waiting for its heartbeat
        to run out (10 s) and its replacement."""
        fabric = self.hub.fabric
        if not self._pending or fabric is None:
            return
        silent = {p for p in fabric.links if fabric.unacked_for(p) >= UNAVAILABLE_AFTER}
        if not silent:
            return
        for rid, pending in list(self._pending.items()):
            if pending.owner in silent and not pending.down_since:
                del self._pending[rid]
                pending.reply({"ok": False, "error": "queue_unavailable", "retry": True})

    def close(self, graceful: bool) -> None:
        """The worker exits: journal what is pending.  Without ``queues.data_dir`` the journal lives in the
        runtime directory, which goes with the broker: say what a stop of the whole broker drops."""
        shard = self.shard
        shard.journal.close()
        kept = self.hub.config.queues.data_dir and self.hub.config.queues.journal
        messages = sum(len(q.messages) for q in shard.queues.values())
        if graceful and messages and not kept:
            log.warning("worker %d stops with %d queued message(s) in %d queue(s); without queues.data_dir they "
                        "are not kept", self.hub.index, messages, sum(1 for q in shard.queues.values() if q.messages))
