"""A shard's receives and the long polls that wait for messages: ``recv`` leases what is visible or waits, in a FIFO
per queue (``Waiter``), until a message comes (served at the end of the turn, ``_serve``) or its deadline passes;
and holders, the connections requests come from, whose waiters go and whose ``release_on_close`` leases come back
when they close (``drop_holder``) or their worker dies (``drop_worker``).

A mixin of ``workers.workqueues.shard.Shard``: receiving is one family of the requests that one object answers,
over its state (``Shard.__init__``); kept in a room of its own so that the shard's room holds the state and the
entry point.
"""

from __future__ import annotations

import collections
import time

from shardbroker.workers.workqueues.attempts import check_id
from shardbroker.workers.workqueues.messages import MS
from shardbroker.workers.workqueues.model import Queue
from shardbroker.workers.workqueues.rules import QueueError
from shardbroker.workers.workqueues.shard_requests import MAX_BATCH, MAX_WAIT_MS, Reply, int_arg

# Long polls waiting at once: a waiter costs a few hundred bytes, but a client must not be able to add them
# without end (a NATS connection can send any number of receives).
MAX_WAITERS_PER_CONNECTION = 1000
MAX_WAITERS_PER_QUEUE = 100_000
DENIED = {"ok": False, "error": "permission_denied"}


class Waiter:
    """A long poll waiting in its queue's FIFO for messages, until its deadline."""

    __slots__ = ("reply", "holder", "user", "max", "visibility", "release", "deadline", "done", "attempt")

    def __init__(self, reply: Reply, holder: tuple, user: str | None, count: int, visibility: int, release: bool,
                 deadline: int, attempt: str | None = None) -> None:
        self.reply = reply
        self.holder = holder
        self.user = user   # who waits (security on), asked again whether it may receive when it is served
        self.max = count
        self.visibility = visibility
        self.release = release
        self.deadline = deadline
        self.done = False
        self.attempt = attempt   # the receive's attempt id (attempts.py), remembered with what it leases


class Receiving:
    """``Shard``'s receives and waiters (its state is the Shard's)."""

    def _recv(self, args: dict, holder: tuple, reply: Reply) -> dict | None:
        name = args.get("queue")
        q = self._look_up(name)
        settings = q.settings if q is not None else self._settings_of(name)
        count = int_arg(args, "max", 1, 1, MAX_BATCH)
        wait = int_arg(args, "wait_ms", 0, 0, MAX_WAIT_MS)
        visibility = int_arg(args, "visibility_ms", settings.visibility_ms, 0, settings.max_visibility_ms)
        release = args.get("release_on_close", False)
        if type(release) is not bool:   # "yes" was taken for true
            raise QueueError("invalid_release_on_close")
        attempt = args.get("attempt")
        if attempt is not None:
            check_id(attempt)
        user = args.get("user")
        if user is not None and not self.may_receive(user, name):
            # checked here too, at the owner: a receive still on its way when the user's permission was revoked
            raise QueueError("permission_denied")
        if q is None:   # nothing to receive: only a long poll makes the queue exist, to wait in
            if not wait:
                return {"ok": True, "messages": []}
            q = self._opened(name, args.get("party"))
        now = time.monotonic_ns()
        if attempt is not None:
            again = q.attempts.replay(attempt, q.leases, now)
            if again is not None:   # the same receive again (a retried task): the same deliveries
                return {"ok": True, "messages": again, "replayed": True}
        if q.name in self._wake:   # waiters that arrived earlier are served first: arrival order, all workers
            del self._wake[q.name]
            self._serve(q, now)
        if q.visible or not self.waiters.get(q.name):  # else earlier waiters first
            got = self._lease(q, count, visibility, release, holder, now, attempt)
            if got or not wait:
                return {"ok": True, "messages": got}
        queued = self.waiters.setdefault(q.name, collections.deque())
        if self._waiting.get(holder, 0) >= MAX_WAITERS_PER_CONNECTION or len(queued) >= MAX_WAITERS_PER_QUEUE:
            raise QueueError("too_many_waiters", retry=True)
        waiter = Waiter(reply, holder, user, count, visibility, release, now + wait * MS, attempt)
        queued.append(waiter)
        self._waiting[holder] = self._waiting.get(holder, 0) + 1
        self._holders.setdefault(holder, set()).add(q.name)
        self._wait_until(waiter.deadline, q)
        return None

    def _lease(self, q: Queue, count: int, visibility: int, release: bool, holder: tuple, now: int,
               attempt: str | None = None) -> list[tuple]:
        """-> the deliveries (``messages.D_*`` tuples), in serving order."""
        out = q.lease(now, count, visibility, holder if release else None)
        if release and out:
            self._holders.setdefault(holder, set()).add(q.name)
        if attempt is not None and out:
            q.attempts.record(attempt, out, now + visibility * MS)
        return out

    def _serve(self, q: Queue, now: int) -> None:
        """Visible messages and waiting receivers: the first waiter first, each served once."""
        queued = self.waiters.get(q.name)
        while queued and q.visible:
            w = queued.popleft()
            if w.done:
                continue
            if w.user is not None and not self.may_receive(w.user, q.name):
                self._finish(w, [], DENIED)   # revoked while it waited (recheck_waiters answers the others)
            else:   # noted: a failed journal write puts it back (_write_failed)
                self._served.append((q.name, w, self._finish(w, self._lease(q, w.max, w.visibility, w.release,
                                                                            w.holder, now, w.attempt))))
        if queued is not None and not queued:
            del self.waiters[q.name]

    def _finish(self, w: Waiter, messages: list[dict], error: dict | None = None) -> dict:
        w.done = True
        left = self._waiting[w.holder] - 1
        if left:
            self._waiting[w.holder] = left
        else:
            del self._waiting[w.holder]
        result = {"ok": True, "messages": messages} if error is None else dict(error)
        self._answer(w.reply, result)
        return result

    def recheck_waiters(self) -> None:
        """Users or permissions changed: receivers waiting that may no longer receive from their queue are told
        ``permission_denied`` now, before the change is acknowledged ("in force at once")."""
        for name, queued in list(self.waiters.items()):
            for w in queued:
                if not w.done and w.user is not None and not self.may_receive(w.user, name):
                    self._finish(w, [], DENIED)

    def _expire_waiters(self, name: str, now: int) -> None:
        queued = self.waiters.get(name)
        if not queued:
            return
        keep = collections.deque()
        for w in queued:
            if w.done:
                continue
            if w.deadline <= now:
                self._finish(w, [])
            else:
                keep.append(w)
        if keep:
            self.waiters[name] = keep
        else:
            del self.waiters[name]

    def drop_holder(self, holder: tuple) -> None:
        """The connection ``holder`` closed: its waiters go, and its release-on-close leases come back."""
        names = self._holders.pop(holder, ())
        now = time.monotonic_ns()
        for name in names:
            for w in self.waiters.get(name, ()):
                if w.holder == holder and not w.done:
                    self._finish(w, [])  # nobody reads it; the asking worker forgets the request
            q = self.queues.get(name)
            if q is not None and q.release_holder(holder):
                self._settle(q, now)
        if names:
            self._schedule_flush()

    def drop_worker(self, worker: int) -> None:
        """Worker ``worker`` died: every connection it held is gone."""
        for holder in [h for h in self._holders if h[0] == worker]:
            self.drop_holder(holder)
