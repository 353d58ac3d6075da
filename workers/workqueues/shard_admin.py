"""A shard's administration: ``stat`` (a queue's counts, also for a subscriber), ``purge`` and ``redrive`` (dead
letters back from a DLQ), and every queue's stat for /queuez (``stats``).

A mixin of ``workers.workqueues.shard.Shard``: these are one family of the requests that one object answers, over
its state (``Shard.__init__``); kept in a room of its own so that the shard's room holds the state and the entry
point.
"""

from __future__ import annotations

import time

from shardbroker.workers.workqueues.messages import DATA, ENQUEUED, ID, KIND, PRIORITY, REDRIVEN
from shardbroker.workers.workqueues.model import Queue
from shardbroker.workers.workqueues.rules import DLQ_SUFFIX, QueueError, is_dlq
from shardbroker.workers.workqueues.shard_requests import MAX_BATCH, Reply, int_arg


class Administration:
    """``Shard``'s stats, purges and redrives (its state is the Shard's)."""

    def _stat(self, args: dict, holder: tuple, reply: Reply) -> dict:
        name = args.get("queue")
        q = self._look_up(name)
        if q is None:
            q = self._new(name)  # an unknown valid name reads as an empty queue, which is not kept
        if args.get("brief"):  # the counts only, in O(1) (qlite's LEN): no scan for the oldest message
            return {"ok": True, "stat": {"queue": q.name, "visible": q.visible, "in_flight": q.in_flight,
                                         "delayed": q.delayed, "messages": len(q.messages)}}
        return {"ok": True, "stat": self._stat_of(q, time.time_ns())}

    def _stat_of(self, q: Queue, wall: int) -> dict:
        stat = q.stat(wall)
        stat["waiters"] = sum(1 for w in self.waiters.get(q.name, ()) if not w.done)
        stat["owner"] = self.index
        return stat

    def _purge(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q = self.queue(args.get("queue"))
        return {"ok": True, "purged": q.purge()}

    def _redrive(self, args: dict, holder: tuple, reply: Reply) -> dict:
        """Move dead letters back: from ``queue`` (a DLQ) to ``to``, by default the queue it belongs to (``<queue>``
        of ``<queue>.dlq``, placed here with it).  A ``to`` placed on another worker is refused: taking messages
        here and pushing them there could lose them in between."""
        src = self.queue(args.get("queue"))
        if not is_dlq(src.name):
            raise QueueError("not_a_dlq")
        target_name = args.get("to") or src.name[:-len(DLQ_SUFFIX)]
        if not self.owns(target_name):
            raise QueueError("target_elsewhere")  # docs/queues.md: redrive to the source, or a queue placed with it
        target = self.queue(target_name)
        count = int_arg(args, "max", MAX_BATCH, 1, 1_000_000)
        # no more than the target can take: a redrive never overfills a queue
        room_bytes = target.settings.max_bytes - target.bytes
        count = min(count, target.settings.max_messages - len(target.messages))
        picked = []
        for msg in src.peek_visible(count):
            room_bytes -= len(msg[DATA])
            if room_bytes < 0:
                break
            picked.append(msg)
        now, wall = time.monotonic_ns(), time.time_ns()
        moved = src.take(picked)
        for msg in moved:
            target.push(msg[KIND], msg[DATA], msg[PRIORITY], now, wall, 0, msg_id=msg[ID],
                        enqueued_at=msg[ENQUEUED], redriven=msg[REDRIVEN] + 1)
        self._settle(target, now)
        return {"ok": True, "moved": len(moved)}

    def stats(self, name: str | None = None) -> list[dict]:
        """``qstat`` of every queue here (or of ``name``), for /queuez."""
        wall = time.time_ns()
        return [self._stat_of(q, wall) for q in self.queues.values() if not name or q.name == name]
