"""What a lease is to a queue: granting leases (a receive), and everything that ends or extends one: an ack, an
extend, a nack, a dead-lettering (a consumer's ``qdead``, or the last allowed delivery ended), a holder gone; which
receipt names a live lease and what became of the others (``lease_lost``, ``already_acked``, ``purged``); the heap of
lease deadlines; and taking back leases that were never journaled.

A mixin of ``workers.workqueues.model.Queue``: leases are one family of what clients ask of that one object, whose
state (``Queue.__init__``) and records (``Queue.apply``) are the model's; kept in a room of its own so that the
model's room holds the state and the records.
"""

from __future__ import annotations

import heapq

from shardbroker.workers.workqueues import core
from shardbroker.workers.workqueues.messages import L_DEADLINE, L_GRANTED, L_HOLDER, L_SEQ, L_VISIBILITY, MS, PRIORITY
from shardbroker.workers.workqueues.receipts import RECEIPT_CHARS, canonical_receipt, new_receipts, record_text
from shardbroker.workers.workqueues.rules import QueueError

# The lease deadlines' heap keeps an entry until its deadline even when the lease ended long before (acked: the
# usual case).  Once the receipts its entries name are more than twice the live leases plus this, the heap is
# rebuilt with the live ones only: its size follows the leases held, not the ack rate times the visibility timeout
# (measured before: 80 B per message acked within its visibility timeout, 30 s by default, up to 12 h).
DEADLINES_SLACK = 1024

_ACKED = {"ok": True}                               # shared: many of them in one reply cost one (marshal's refs)
_ALREADY_ACKED = {"ok": True, "already_acked": True}
_PURGED = {"ok": True, "purged": True}


class Leases:
    """``model.Queue``'s leases (its state is the Queue's)."""

    def _grant(self, seqs, receipts: list[str], granted: int, deadline: int, visibility: int,
               holder: tuple | None) -> None:
        """Lease the messages ``seqs`` (out of every heap already) under ``receipts``."""
        again = core.grant(self.leases, self.leased, self.deliveries, seqs, receipts, granted, deadline, visibility,
                           holder)
        heapq.heappush(self._deadlines, (deadline, tuple(receipts)))
        refs = self._deadline_refs = self._deadline_refs + len(receipts)
        if refs > 2 * len(self.leases) + DEADLINES_SLACK:
            self._compact_deadlines()
        self._at(deadline)
        self.delivered += len(receipts)
        self.redelivered += again

    def _acked(self, receipts: list | tuple) -> None:
        leases, leased, store, deliveries = self.leases, self.leased, self.messages, self.deliveries
        size = 0
        for receipt in receipts:
            seq = leases.pop(receipt)[0]
            del leased[seq]
            deliveries.pop(seq, None)
            size += len(store.pop(seq)[3])
        self._remember_acks(receipts)
        self.bytes -= size
        self.acked += len(receipts)

    def _end_lease(self, receipt: str, fate: str) -> int:
        seq = self.leases.pop(receipt)[L_SEQ]
        del self.leased[seq]
        self._remember(receipt, fate, seq)
        return seq

    def _remember(self, receipt: str, fate: str, seq: int) -> None:
        recent = self._recent
        recent[receipt] = (fate, seq, self.deliveries.get(seq, 0))

    def lease(self, now: int, count: int, visibility_ms: int, holder: tuple | None) -> list[tuple]:
        """Lease up to ``count`` visible messages, in serving order, each under a fresh receipt; one record for
        all.  -> their deliveries (``D_*`` tuples)."""
        ready = self._ready
        n = min(count, ready.count)
        if not n:
            return []
        seqs = ready.pop_many(n)
        receipts = new_receipts(n)
        deadline = now + visibility_ms * MS
        self._grant(seqs, receipts, now, deadline, visibility_ms, holder)
        self._journal(self.name, ("leases", seqs, receipts, now, deadline, visibility_ms))
        return core.delivered(self.messages, self.deliveries, seqs, receipts, MS)

    def current(self, receipt: str, now: int) -> tuple:
        """The live lease of ``receipt`` (text, canonical), or QueueError saying what became of it."""
        lease = self.leases.get(receipt)
        if lease is not None and lease[L_DEADLINE] > now:
            return lease
        if lease is not None:  # past its deadline, the timer not yet run: lost all the same
            self.expire(now)
        fate = self._recent.get(receipt)
        if fate is None:
            raise QueueError("already_acked" if receipt in self._acks else "unknown_receipt")
        what, seq, deliveries = fate
        if what == "lost":  # with the message's deliveries as they are now (it may have been leased again since)
            self.stale_receipts += 1
            raise QueueError("lease_lost", deliveries=self.deliveries.get(seq, 0)
                             if seq in self.messages else deliveries)
        raise QueueError(what)

    def ack_many(self, receipts: list, now: int) -> list[dict]:
        """Ack each receipt (text, as the client sent it), in order, and journal those that ended a lease as one
        record (``acks``; applying it is ``_acked``, done here inline).  -> one result per receipt."""
        leases, leased, store, deliveries = self.leases, self.leased, self.messages, self.deliveries
        results = []
        done = []
        remembered = 0   # done[:remembered] are in _acks already
        size = 0
        i = 0
        while True:
            # the live leases named as issued, in one run each (core.ack_run), up to the first receipt that is not
            i, run_size = core.ack_run(leases, leased, store, deliveries, receipts, i, now, done, results, _ACKED)
            size += run_size
            if i == len(receipts):
                break
            if len(done) > remembered:   # a repeat in this batch finds its lease gone, like any repeat
                self._remember_acks(done[remembered:])
                remembered = len(done)
            receipt = self._ack_other(receipts[i], now)
            i += 1
            if type(receipt) is dict:
                results.append(receipt)
                continue
            seq = leases.pop(receipt)[0]   # a live receipt spelled in another (non-canonical) way
            del leased[seq]
            deliveries.pop(seq, None)
            size += len(store.pop(seq)[3])
            done.append(receipt)
            results.append(_ACKED)
        if len(done) > remembered:
            self._remember_acks(done[remembered:] if remembered else done)
        if done:
            self.bytes -= size
            self.acked += len(done)
            self._journal(self.name, ("acks", done))
        return results

    def _remember_acks(self, receipts: list[str] | tuple[str, ...]) -> None:
        """Acked receipts into the acks' history, joined, so that it holds one object for them, not one each.
        They are the leases' keys, canonical texts of one length; were one not, the length check keeps the list."""
        packed = "".join(receipts)
        if len(packed) == RECEIPT_CHARS * len(receipts):
            self._acks.add(packed, True, RECEIPT_CHARS)
        else:
            self._acks.add(receipts, True)

    def _ack_other(self, receipt: object, now: int) -> dict | str:
        """An ack whose receipt is not a live lease as sent: what the client is told, or the receipt's canonical
        text if that is a live lease."""
        text = canonical_receipt(receipt)
        if text is None:
            return {"ok": False, "error": "invalid_receipt"}
        try:
            self.current(text, now)   # a non-canonical spelling of a live receipt gets here
        except QueueError as exc:
            if exc.code == "already_acked":
                self.duplicate_acks += 1
                return _ALREADY_ACKED
            if exc.code == "purged":
                return _PURGED
            return exc.result()
        return text

    def ack(self, receipt: str, now: int) -> dict:
        """One ack (tests, tools): ``{}``, ``{"already_acked": True}``, ``{"purged": True}``, or QueueError."""
        result = self.ack_many([receipt], now)[0]
        if not result["ok"]:
            extra = {k: v for k, v in result.items() if k not in ("ok", "error")}
            raise QueueError(result["error"], **extra)
        return {k: v for k, v in result.items() if k != "ok"}

    def extend(self, receipt: str, now: int, visibility_ms: int | None) -> int:
        """Deadline = now + visibility (None: the lease's own, a heartbeat), at most ``max_lease_ms`` after the
        grant.  -> the deadline (ns)."""
        lease = self.current(receipt, now)
        if visibility_ms is None:
            visibility_ms = lease[L_VISIBILITY]
        if type(visibility_ms) is not int or not 0 <= visibility_ms <= self.settings.max_visibility_ms:
            raise QueueError("invalid_visibility", max=self.settings.max_visibility_ms)
        deadline = min(now + visibility_ms * MS, lease[L_GRANTED] + self.settings.max_lease_ms * MS)
        self._do(("deadline", receipt, deadline))
        self.extended += 1
        if deadline <= now:
            self.expire(now)
        return deadline

    def nack(self, receipt: str, now: int, delay_ms: int) -> str:
        """Back to visible (after ``delay_ms``), or to the DLQ after its last delivery.  -> where it went."""
        lease = self.current(receipt, now)
        if type(delay_ms) is not int or not 0 <= delay_ms <= self.settings.max_delay_ms:
            raise QueueError("invalid_delay", max=self.settings.max_delay_ms)
        self.nacked += 1
        return self._release(receipt, lease, now + delay_ms * MS if delay_ms else 0)

    def terminate(self, receipt: str, now: int) -> None:
        """A consumer's verdict: dead-letter the leased message now."""
        lease = self.current(receipt, now)
        self._do(("dead", lease[L_SEQ], "terminated"))

    def release_holder(self, holder: tuple) -> int:
        """A connection that received with ``release_on_close`` closed: its leases go back at once.  -> count."""
        mine = [(receipt, lease) for receipt, lease in self.leases.items() if lease[L_HOLDER] == holder]
        for receipt, lease in mine:
            self._release(receipt, lease, 0)
        return len(mine)

    def _release(self, receipt: str, lease: tuple, ready_at: int) -> str:
        limit = self.settings.max_deliveries
        seq = lease[L_SEQ]
        if limit and self.deliveries.get(seq, 0) >= limit:
            self._do(("dead", seq, "max_deliveries"))
            return "dead"
        self._do(("requeue", receipt, ready_at))
        return "delayed" if ready_at else "visible"

    def _compact_deadlines(self) -> None:
        """Rebuild the deadlines' heap (in place) with the entries of live leases only (see DEADLINES_SLACK):
        each live lease has one entry at its current deadline.  O(entries), once per as many new ones."""
        leases = self.leases
        held = leases.__contains__
        live = []
        refs = 0
        for deadline, receipts in self._deadlines:
            # most entries are of batches acked whole: the receipts still leased first (a loop in C), then theirs
            keep = tuple(filter(held, receipts))
            if keep:
                keep = tuple(r for r in keep if leases[r][L_DEADLINE] == deadline)
            if keep:
                live.append((deadline, keep))
                refs += len(keep)
        heapq.heapify(live)
        self._deadlines[:] = live
        self._deadline_refs = refs

    # -- undoing what could not be journaled ------------------------------------------------------------------
    def undo_leases(self, seqs: list[int], receipts: list, gone: set[int]) -> None:
        """Take back a ``leases`` record that was never written: the messages are visible again where they were,
        with the deliveries they had, and the receipts never existed (those in ``gone`` are pushes undone next: they
        go back to no heap)."""
        leases, leased, deliveries, ready, store = self.leases, self.leased, self.deliveries, self._ready, \
            self.messages
        for seq, receipt in zip(seqs, receipts):
            del leases[record_text(receipt)]   # its entry in _deadlines is stale now
            del leased[seq]
            d = deliveries.get(seq, 1) - 1
            if d:
                deliveries[seq] = d
                self.redelivered -= 1
            else:
                deliveries.pop(seq, None)
            self.delivered -= 1
            if seq not in gone:
                ready.add(seq, store[seq][PRIORITY])
