"""A shard's requests that settle a lease: ``ack`` (one receipt, a batch, or the leases of receives named by attempt
ids), ``extend`` (one, or such a group), ``nack`` and ``dead``; and
what every change that may free or dead-letter messages ends with (``_settle``): the queue's dead letters pushed to
its DLQ, and the queues with visible messages and waiters marked to be served at the end of the turn.

A mixin of ``workers.workqueues.shard.Shard``: settling leases is one family of the requests that one object
answers, over its state (``Shard.__init__``); kept in a room of its own so that the shard's room holds the state
and the entry point.
"""

from __future__ import annotations

import time

from shardbroker.workers.workqueues.attempts import check_ids
from shardbroker.workers.workqueues.messages import DATA, ENQUEUED, ID, KIND, MS, PRIORITY, SOURCE
from shardbroker.workers.workqueues.model import Queue
from shardbroker.workers.workqueues.receipts import canonical_receipt
from shardbroker.workers.workqueues.rules import DLQ_SUFFIX, QueueError, is_dlq
from shardbroker.workers.workqueues.shard_requests import MAX_BATCH, Reply


class Settling:
    """``Shard``'s acks, extends, nacks and dead-letterings (its state is the Shard's)."""

    def _existing(self, args: dict) -> Queue:
        q = self._look_up(args.get("queue"))
        if q is None:  # a valid name with nothing in it: no receipt of it can be known
            raise QueueError("unknown_receipt")
        return q

    def _ack(self, args: dict, holder: tuple, reply: Reply) -> dict:
        if "attempts" in args:
            return self._group(args, ack=True)
        many = args.get("receipts")
        if many is None:
            receipt = args.get("receipt")
            if canonical_receipt(receipt) is None:
                raise QueueError("invalid_receipt")
            many = [receipt]
        elif type(many) is not list or not 1 <= len(many) <= MAX_BATCH:
            raise QueueError("invalid_receipts", max=MAX_BATCH)
        q = self._existing(args)
        now = time.monotonic_ns()
        results = q.ack_many(many, now)
        if q.dead or q.visible:
            self._settle(q, now)
        if "receipts" in args:
            return {"ok": True, "results": results}
        return dict(results[0])

    def _one(self, args: dict) -> tuple[Queue, str, int]:
        receipt = canonical_receipt(args.get("receipt"))
        if receipt is None:
            raise QueueError("invalid_receipt")
        return self._existing(args), receipt, time.monotonic_ns()

    def _extend(self, args: dict, holder: tuple, reply: Reply) -> dict:
        if "attempts" in args:
            return self._group(args, ack=False)
        q, receipt, now = self._one(args)
        deadline = q.extend(receipt, now, args.get("visibility_ms"))  # none given: the lease's own again
        self._settle(q, now)
        return {"ok": True, "deadline_in_ms": max(0, (deadline - now) // MS)}

    def _group(self, args: dict, ack: bool) -> dict:
        """An ack or an extend of every live lease of the receives named by ``attempts`` (attempts.py): what each
        lease's own ack or extend would do, in one request.  -> counts: done (an ack of one acked already counts
        as done), lost (the lease ended otherwise: expired, the message visible again), and the attempt ids
        unknown here (acked before, swept, or never seen)."""
        attempts = check_ids(args.get("attempts"), MAX_BATCH)
        q = self._look_up(args.get("queue"))
        if q is None:
            return {"ok": True, "acked" if ack else "extended": 0, "lost": 0, "unknown": attempts}
        now = time.monotonic_ns()
        receipts, unknown = q.attempts.receipts(attempts, forget=ack)
        done = lost = 0
        if ack:
            for start in range(0, len(receipts), MAX_BATCH):
                for result in q.ack_many(receipts[start:start + MAX_BATCH], now):
                    if result["ok"]:
                        done += 1
                    else:
                        lost += 1
        else:
            visibility = args.get("visibility_ms")
            latest = 0
            for receipt in receipts:
                try:
                    latest = max(latest, q.extend(receipt, now, visibility))
                    done += 1
                except QueueError as exc:
                    if exc.code == "invalid_visibility":
                        raise
                    lost += 1
            q.attempts.extended(attempts, latest)
        self._settle(q, now)
        return {"ok": True, "acked" if ack else "extended": done, "lost": lost, "unknown": unknown}

    def _nack(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q, receipt, now = self._one(args)
        went = q.nack(receipt, now, args.get("delay_ms", 0) or 0)
        self._settle(q, now)
        return {"ok": True, "state": went}

    def _dead(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q, receipt, now = self._one(args)
        q.terminate(receipt, now)
        self._settle(q, now)
        return {"ok": True}

    def _settle(self, q: Queue, now: int) -> None:
        """Move what ``q`` dead-lettered to its DLQ, and give freed messages to waiters."""
        if q.dead:
            dead, q.dead = q.dead, []
            # A DLQ's own dead letters (qdead there) stay in it, visible again: never dropped.
            dlq = q if is_dlq(q.name) else self.queue(q.name + DLQ_SUFFIX)
            wall = time.time_ns()
            for msg, deliveries, reason in dead:
                dlq.push(msg[KIND], msg[DATA], msg[PRIORITY], now, wall, 0, msg_id=msg[ID],
                         enqueued_at=msg[ENQUEUED], deliveries=deliveries, reason=reason,
                         source=msg[SOURCE] if dlq is q else q.name)
            if dlq is not q and dlq.visible and dlq.name in self.waiters:
                self._wake[dlq.name] = dlq
        if q.visible and q.name in self.waiters:
            self._wake[q.name] = q
