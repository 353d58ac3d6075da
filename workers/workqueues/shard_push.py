"""A shard's pushes: ``push`` (one message, or a batch stored whole or not at all) and ``pushes`` (single pushes to
one queue that arrived together, each stored or refused on its own, stored as one record where they can be), with
their tokens (a client's ``dedup_id``, a worker's resend after a crash) and the DLQ's bound on them.

A mixin of ``workers.workqueues.shard.Shard``: pushing is one family of the requests that one object answers, over
its state (``Shard.__init__``); kept in a room of its own so that the shard's room holds the state and the entry
point.
"""

from __future__ import annotations

import time

from shardbroker.workers.message import KIND_JSON
from shardbroker.workers.workqueues.messages import MAX_PRIORITY
from shardbroker.workers.workqueues.model import Queue
from shardbroker.workers.workqueues.rules import QueueError
from shardbroker.workers.workqueues.shard_requests import MAX_BATCH, Reply, int_arg

MAX_DEDUP_ID = 128          # characters of a push's dedup_id (SQS's MessageDeduplicationId)
# A ``pushes`` request's options for those of its pushes that are data's bytes alone (kind: JSON unless it says)
_RUN_OPTIONS = ("priority", "delay_ms", "kind")
DEFAULT_PRIORITY = 4


def _is_dedup_id(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_DEDUP_ID


def _run_push(item: dict | bytes, options: dict) -> tuple | None:
    """One of a ``pushes`` request's pushes as (data, kind, priority, delay_ms, dedup_id), the data's bytes alone
    taking the request's ``options``; None: it has fields that a run of pushes stored together does not take."""
    if type(item) is bytes:
        return (item, options.get("kind", KIND_JSON), options.get("priority", DEFAULT_PRIORITY),
                options.get("delay_ms", 0), None)
    if len(item) > 2 + ("priority" in item) + ("delay_ms" in item) + ("dedup_id" in item):
        return None
    return (item.get("data"), item.get("kind"), item.get("priority", DEFAULT_PRIORITY), item.get("delay_ms", 0),
            item.get("dedup_id"))


class Pushing:
    """``Shard``'s pushes (its state is the Shard's)."""

    def _pushed_to(self, args: dict) -> Queue:
        """The queue a push names, created if new (a name that cannot be a queue's raises in ``queue``)."""
        return self._opened(args.get("queue"), args.get("party"))

    @staticmethod
    def _token(args: dict) -> tuple | str | None:
        """A push request's token, which names it among resends: the client's ``dedup_id`` (a str), or the one its
        worker gave it to cross the fabric (a tuple; a list once it crossed)."""
        dedup = args.get("dedup_id")
        if dedup is not None:
            if not _is_dedup_id(dedup):
                raise QueueError("invalid_dedup_id", min=1, max=MAX_DEDUP_ID)
            return dedup
        token = args.get("token")
        return tuple(token) if token is not None else None

    def _repeat(self, q: Queue, stored: str | tuple, token: tuple | str, args: dict | None) -> dict:
        """The answer to a push (``args``; None: a batch) whose token names one already stored: ``stored``, its id
        (a batch's ids).  Only a client's ``dedup_id`` can name the other form of push, a conflict."""
        batch = args is None
        if (type(stored) is tuple) != batch:
            raise QueueError("dedup_id_conflict")
        result = {"ok": True, "ids": list(stored)} if batch else self._pushed(q, stored, args)
        if type(token) is str:   # a client's retry, which may want to know (a resend after a crash is not one)
            result["duplicate"] = True
            q.duplicate_pushes += len(stored) if batch else 1
        return result

    def _push(self, args: dict, holder: tuple, reply: Reply) -> dict:
        q = self._pushed_to(args)
        if "messages" in args or "datas" in args:
            return self._push_many(q, args)
        return self._push_one(q, args, self._token(args))

    def _push_one(self, q: Queue, args: dict | bytes, token: tuple | str | None, clock: tuple[int, int] | None = None,
                  options: dict | None = None) -> dict:
        """One push; ``clock``: (monotonic, wall) ns, read once for the pushes that arrived together."""
        if type(args) is bytes:   # a push of data and ``options`` (``pushes``): JSON unless they say
            args = {"data": args, "kind": KIND_JSON, **(options or {})}
        if token is not None:
            stored = q.tokens.get(token)
            if stored is not None:  # sent again (a client's retry, a resend after a crash): one copy
                return self._repeat(q, stored, token, args)
        data, kind = args.get("data", b""), args.get("kind", 0)
        priority = args.get("priority", DEFAULT_PRIORITY)
        if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
            priority = int_arg(args, "priority", DEFAULT_PRIORITY, 0, MAX_PRIORITY)
        delay = int_arg(args, "delay_ms", 0, 0, q.settings.max_delay_ms) if "delay_ms" in args else 0
        self._check_dead_letters(q, 1)
        q.check_push(len(data))
        now, wall = clock or (time.monotonic_ns(), time.time_ns())
        msg_id = q.push(kind, data, priority, now, wall, delay, token=token)
        if not delay and q.name in self.waiters:
            self._wake[q.name] = q
        return self._pushed(q, msg_id, args)

    def _pushes(self, args: dict, holder: tuple, reply: Reply) -> dict:
        """Single pushes to one queue that arrived together (``pushes``: a list of push args without ``queue``, or
        the bytes of a push's data with the request's ``priority``, ``delay_ms`` and ``kind``, if any: JSON from
        protocols.ndjson.queue_verbs.push_run, raw from protocols.nats.queue_verbs), each stored or refused on its own,
        as if sent one by one (unlike
        a batch push's all or nothing); one call and, from another worker, one request instead of one each.
        -> ``{"ok": true, "results": [...]}``, or ``{"ok": true, "ids": [...]}`` when every one was stored."""
        q = self._pushed_to(args)
        token = self._token(args)
        clock = (time.monotonic_ns(), time.time_ns())
        options = {key: args[key] for key in _RUN_OPTIONS if key in args}
        if token is None:
            stored = self._push_run(q, args["pushes"], clock, options)
            if stored is not None:
                return stored
        results = []
        for i, item in enumerate(args["pushes"]):
            try:
                results.append(self._push_one(q, item, self._item_token(item, token, i), clock, options))
            except QueueError as exc:
                results.append(exc.result())
        return {"ok": True, "results": results}

    def _item_token(self, item: dict | bytes, token: tuple | None, i: int) -> tuple | str | None:
        """The token of the ``i``-th of single pushes that travelled together under ``token``: its own
        ``dedup_id``, or its place under the request's."""
        if type(item) is not bytes and "dedup_id" in item:
            return self._token(item)
        return token + (i,) if token is not None else None

    def _push_run(self, q: Queue, items: list[dict | bytes], clock: tuple[int, int], options: dict) -> dict | None:
        """Single pushes from this worker with one kind, priority and delay (args with data, kind and at most
        those and a ``dedup_id``; or data's bytes, with ``options``' kind, priority and delay) that all fit now:
        stored together, as one record (with each push's ``dedup_id``, if any), which is what pushing them one by
        one would have come to (each stored, in order), for less work per push.  None: not such a run (a push with
        other fields, pushes of different kinds, priorities or delays, one too large, a queue too full for all of
        them, a priority or delay out of range, a ``dedup_id`` invalid, known or named twice), for the one-by-one
        path to decide each on its own.  Pushes from another worker carry tokens, one per push under the
        request's: they go one by one."""
        s = q.settings
        datas, kind, tokens = items, options.get("kind", KIND_JSON), None
        priority, delay = options.get("priority", DEFAULT_PRIORITY), options.get("delay_ms", 0)
        sizes = [len(item) for item in items if type(item) is bytes]
        if len(sizes) != len(items):   # not all of them JSON data's bytes alone (the common case, checked at once)
            pushes = [_run_push(item, options) for item in items]
            if None in pushes:
                return None
            datas, kinds, priorities, delays, dedups = (list(column) for column in zip(*pushes))
            kind, priority, delay = kinds[0], priorities[0], delays[0]
            # one kind, priority and delay; ints alone (a True or a 1.0 equals a 1, and is refused on its own)
            if None in datas or type(kind) is not int or not all(type(v) is int for v in priorities + delays) \
                    or kinds.count(kind) + priorities.count(priority) + delays.count(delay) != 3 * len(pushes):
                return None
            named = [dedup for dedup in dedups if dedup is not None]
            if named:   # each dedup_id valid, new, and once: else each push is judged on its own
                if not all(_is_dedup_id(dedup) and q.tokens.get(dedup) is None for dedup in named) \
                        or len(set(named)) != len(named):
                    return None
                tokens = dedups
            sizes = [len(data) for data in datas]
        if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY or type(delay) is not int \
                or not 0 <= delay <= s.max_delay_ms:
            return None
        total = sum(sizes)
        if not sizes or max(sizes) > s.max_message_bytes or len(q.messages) + len(datas) > s.max_messages \
                or q.bytes + total > s.max_bytes or self._dead_letters_full(q):
            return None
        ids = q.push_data(kind, datas, priority, delay, *clock, tokens)
        if not delay and q.name in self.waiters:
            self._wake[q.name] = q
        return {"ok": True, "ids": ids}

    def _push_many(self, q: Queue, args: dict) -> dict:
        """A batch: ``messages`` is a list of ``(data, kind, priority, delay_ms)`` (priority and delay None: the
        request's own, or the defaults), or ``datas`` a list of JSON data's bytes (the request's priority and
        delay for all).  Every message is checked before any is stored, and they are stored
        together (one journal record) or not at all.  -> ``{"ok": true, "ids": [...]}`` in order."""
        token = self._token(args)
        if token is not None:
            stored = q.tokens.get(token)
            if stored is not None:  # sent again (a client's retry, a resend after a crash): one copy
                return self._repeat(q, stored, token, None)
        # JSON data alone, the request's priority and delay for all (protocols.ndjson.queue_verbs)
        datas = args.get("datas")
        items = args["messages"] if datas is None else datas
        if type(items) is not list or not 1 <= len(items) <= MAX_BATCH:
            raise QueueError("invalid_messages", min=1, max=MAX_BATCH)
        priority = int_arg(args, "priority", DEFAULT_PRIORITY, 0, MAX_PRIORITY)
        max_delay = q.settings.max_delay_ms
        delay = int_arg(args, "delay_ms", 0, 0, max_delay)
        max_size = q.settings.max_message_bytes
        if datas is not None:
            sizes = [len(data) for data in datas]
            if max(sizes) > max_size:
                raise QueueError("message_too_large", max=max_size,
                                 index=next(i for i, size in enumerate(sizes) if size > max_size))
        else:
            checked = []
            sizes = []
            for i, (data, kind, p, d) in enumerate(items):
                if p is None:
                    p = priority
                elif type(p) is not int or not 0 <= p <= MAX_PRIORITY:
                    raise QueueError("invalid_priority", min=0, max=MAX_PRIORITY, index=i)
                if d is None:
                    d = delay
                elif type(d) is not int or not 0 <= d <= max_delay:
                    raise QueueError("invalid_delay", min=0, max=max_delay, index=i)
                size = len(data)
                if size > max_size:
                    raise QueueError("message_too_large", max=max_size, index=i)
                sizes.append(size)
                checked.append((kind, data, p, d))
        self._check_dead_letters(q, len(sizes))
        q.check_batch(sizes)
        now, wall = time.monotonic_ns(), time.time_ns()
        ids = q.push_many(checked, now, wall, token) if datas is None else \
            q.push_data(KIND_JSON, datas, priority, delay, now, wall, token)
        if q.name in self.waiters and q.visible:
            self._wake[q.name] = q
        return {"ok": True, "ids": ids}

    def _dead_letters_full(self, q: Queue) -> str:
        """The name of ``q``'s DLQ if it is at its bound, else "".  Dead letters are never dropped and never
        refused, so while the DLQ is full the queue takes no pushes: what the consumers end without an ack can
        only come from what the queue holds, and the two stay bounded together."""
        dlq = self.queues.get(q.dlq_name) if q.dlq_name else None
        if dlq is None:
            return ""
        s = dlq.settings
        return dlq.name if len(dlq.messages) >= s.max_messages or dlq.bytes >= s.max_bytes else ""

    def _check_dead_letters(self, q: Queue, pushes: int) -> None:
        dlq = self._dead_letters_full(q)
        if dlq:
            q.rejected += pushes
            raise QueueError("queue_full", retry=True, dlq=dlq)

    @staticmethod
    def _pushed(q: Queue, msg_id: str, args: dict) -> dict:
        """A push's result; ``report_visible`` (qlite's PUSH answers with it) adds the visible count after it."""
        if args.get("report_visible"):
            return {"ok": True, "id": msg_id, "visible": q.visible}
        return {"ok": True, "id": msg_id}
