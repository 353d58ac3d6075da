"""What a push does to a queue: the bounds a message or a batch must fit, storing it (one message, a batch of
messages, a batch of data of one kind and priority), and taking back a push that was never journaled.

A mixin of ``workers.workqueues.model.Queue``: pushing is one family of what clients ask of that one object, whose
state (``Queue.__init__``) and records (``Queue.apply``) are the model's; kept in a room of its own so that the
model's room holds the state and the records.
"""

from __future__ import annotations

from shardbroker.workers.workqueues import core
from shardbroker.workers.workqueues.messages import ID, MS, PRIORITY, pushed_seqs
from shardbroker.workers.workqueues.receipts import new_id, new_ids
from shardbroker.workers.workqueues.rules import QueueError


class Pushes:
    """``model.Queue``'s pushes (its state is the Queue's)."""

    def check_push(self, size: int) -> None:
        """Whether a message of ``size`` bytes fits (the caller checked its priority and delay)."""
        s = self.settings
        if size > s.max_message_bytes:
            raise QueueError("message_too_large", max=s.max_message_bytes)
        if len(self.messages) >= s.max_messages or self.bytes + size > s.max_bytes:
            self.rejected += 1
            raise QueueError("queue_full", retry=True)

    def check_batch(self, sizes: list[int]) -> None:
        """Whether all these messages fit together (each checked for ``max_message_bytes`` already): a batch is
        stored whole or not at all.  ``queue_full`` says how many of them would fit now (``room``)."""
        s = self.settings
        total = sum(sizes)
        if len(self.messages) + len(sizes) <= s.max_messages and self.bytes + total <= s.max_bytes:
            return
        room, left = 0, s.max_bytes - self.bytes
        for size in sizes[:max(0, s.max_messages - len(self.messages))]:
            left -= size
            if left < 0:
                break
            room += 1
        self.rejected += len(sizes)
        raise QueueError("queue_full", retry=True, room=room)

    def push(self, kind: int, data: bytes, priority: int, now: int, wall: int, delay_ms: int, *,
             msg_id: str | None = None, enqueued_at: int = 0, deliveries: int = 0, reason: str = "",
             source: str = "", redriven: int = 0, token: tuple | None = None) -> str:
        """Store a message (checked by ``check_push``).  The optional fields carry a message over from another
        queue (dead-lettering, redrive); ``token`` names the request, so that a resent one is known.  -> its id."""
        seq = self.next_seq
        msg_id = msg_id or new_id()
        record = ("push", seq, msg_id, kind, data, priority, enqueued_at or wall,
                  now + delay_ms * MS if delay_ms else 0, deliveries, reason, source, redriven, token)
        if delay_ms or deliveries:
            self.apply(record)
        else:   # the common case, applied directly (as apply's "push" would)
            if token is not None:
                self._token(token, msg_id)
            self.bytes += core.store_put(self.messages, [(seq, msg_id, kind, data, priority, enqueued_at or wall,
                                                          reason, source, redriven)])
            self._ready.add(seq, priority)
            self.next_seq = seq + 1
            self.pushed += 1
        self._journal(self.name, record)
        return msg_id

    def push_many(self, items: list[tuple], now: int, wall: int, token: tuple | str | list | None = None) -> list[str]:
        """Store a batch of checked messages, ``(kind, data, priority, delay_ms)`` each, in one record (``token``:
        ``_tokens``).  -> ids."""
        seq = self.next_seq
        ids = new_ids(len(items))
        messages = [(seq + i, ids[i], kind, data, priority, wall, "", "", 0)
                    for i, (kind, data, priority, _) in enumerate(items)]
        ready_ats = None
        if any(item[3] for item in items):
            ready_ats = [now + delay * MS if delay else 0 for _, _, _, delay in items]
        self._do(("pushes", token, messages, ready_ats))
        return ids

    def push_data(self, kind: int, datas: list[bytes], priority: int, delay_ms: int, now: int, wall: int,
                  token: tuple | str | list | None = None) -> list[str]:
        """Store a batch of checked data of one kind, priority and delay, in one record (``pushcol`` without a
        delay: applied here directly, as ``apply`` would, without splitting its ids again; ``token``: ``_tokens``).
        -> ids."""
        if delay_ms:   # a pushcol has no delays: a delayed batch is a pushes record, as push_many makes it
            return self.push_many([(kind, data, priority, delay_ms) for data in datas], now, wall, token)
        seq = self.next_seq
        ids = new_ids(len(datas))
        if token is not None:
            self._tokens(token, ids)
        self._store_run(seq, ids, kind, datas, priority, wall)
        self._journal(self.name, ("pushcol", token, seq, "".join(ids), kind, datas, priority, wall))
        return ids

    # -- undoing what could not be journaled ------------------------------------------------------------------
    def undo_push(self, record: tuple, off_heap: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
        """Take back a client's ``push`` or ``pushes`` record that was never written (a failed journal write), as if
        never made: the messages, their token, their counts.  Only right for the newest records, newest first,
        before anything else touched these messages (shard_commit.roll_back sees to it; a lease of them in the same
        turn is undone first, with ``undo_leases``, and named in ``off_heap``).  -> the messages' ids."""
        items, token = pushed_seqs(record), record[12] if record[0] == "push" else record[1]
        for one in token if type(token) is list else (token,):
            if one is not None:
                self.tokens.pop(one, None)
        store, delay_at, ready = self.messages, self.delay_at, self._ready
        ids = []
        for seq in reversed(items):
            msg = store[seq]
            if seq in delay_at:
                del delay_at[seq]   # its entry in _delayed is stale now, skipped when due
            elif seq not in off_heap:   # leased in its turn: undo_leases left it in no heap
                ready.remove(seq, msg[PRIORITY])
            self._drop(seq)
            ids.append(msg[ID])
        self.pushed -= len(items)
        return ids
