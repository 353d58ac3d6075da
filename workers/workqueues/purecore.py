"""The work queues' per-message loops in pure Python: the reference, and the fallback where the compiled ones
(``workers/workqueues/_qcore.c``) are missing.  ``workers.workqueues.core`` picks one.

Both must give identical results and leave identical state for every input (tests/unit/test_qcore.py checks them
against each other on random queues), so any change here is a change there.  What each loop does is the queue's
business (``model``, ``protocols.ndjson.queue_verbs``); these functions are its inner loops, with the state they touch
passed in:

- ``b64url_chunks``: each ``width`` bytes of ``raw`` as unpadded base64url text (receipts, message ids).
- ``grant``: lease ``seqs`` under ``receipts``: the lease tuples, ``leased``, ``deliveries`` counted up.
- ``delivered``: the ``model.D_*`` tuples a receive hands the protocol.
- ``ack_run``: ack ``receipts`` from ``start`` on while each is a text with a live lease; stop at the first that
  is not (the caller's general path answers it, then calls again after it).
- ``render_deliveries``: a ``qrecv`` reply's messages, ``render`` (``protocols.ndjson.queue_verbs._message``)
  applied to each and
  joined; the compiled one writes the common case itself (JSON data, not a dead letter) byte for byte as
  ``render`` does.
- ``store_run``: new messages of one kind, priority and time, with sequence numbers from ``seq`` on, into
  ``store`` as the model's message tuples.  -> their data's bytes.  The compiled one (and its ``grant``) also
  untracks each new tuple at once, as the collector would at its next young pass (they hold only atomic values):
  in a growing queue, those passes walked every new message only to do that.
- ``store_put``: message tuples made elsewhere (a push with options, a batch, replay) into ``store`` by their
  sequence number.  -> their data's bytes.  The compiled one untracks them as ``store_run`` does.  That matters
  more than for ``store_run``'s: one tracked tuple put in the store makes the collector track the whole dict
  again, and its next pass walks every queued message (40 ms with a million queued) before untracking it.
- ``snapshot_pushes``: message tuples, in the order of their sequence numbers, as the journal records that store
  them again: each run of consecutive numbers with one kind, priority and time whose ids are ``width`` ASCII
  characters and that carry nothing of a dead letter is one ``pushcol`` record (as a run of pushes makes it: a
  third less to encode than the tuples, and a fifth fewer bytes) if it is at least ``least`` long; the others,
  in runs, ``pushes`` records.
- ``flat_dumps``: ``obj`` in marshal's format 4, as the journal stores its records; ``marshal.loads`` gives back
  an equal object of the same types from both.  The compiled one writes no back-references (it is otherwise
  marshal's output byte for byte): marshal enters each object held elsewhere too in a table for them, which cost
  more than the rest of a journal record's writing.  The bytes differ where marshal writes references (or
  interned strings), so the tests compare what ``marshal.loads`` makes of them.
"""

from __future__ import annotations

import marshal
from binascii import b2a_base64
from collections.abc import Callable

_URLSAFE = bytes.maketrans(b"+/", b"-_")


def b64url_chunks(raw: bytes, width: int) -> list[str]:
    """-> ``len(raw) // width`` texts.  Each chunk is padded with zero bytes to a multiple of 3 and all are encoded
    in one pass: the first ``ceil(4 * width / 3)`` characters of a padded chunk's encoding are the chunk's own."""
    if width <= 0:
        raise ValueError("width must be positive")
    n = len(raw) // width
    pad = -width % 3
    if pad:
        zeros = b"\0" * pad
        raw = zeros.join([raw[i:i + width] for i in range(0, n * width, width)]) + zeros if n else b""
    else:
        raw = raw[:n * width]
    text = b2a_base64(raw, newline=False).translate(_URLSAFE).decode()
    chars = (4 * width + 2) // 3
    step = (width + pad) // 3 * 4
    return [text[i:i + chars] for i in range(0, n * step, step)]


def grant(leases: dict, leased: dict, deliveries: dict, seqs, receipts, granted: int, deadline: int,
          visibility: int, holder) -> int:
    """-> how many of them had been delivered before (redeliveries)."""
    again = 0
    for seq, receipt in zip(seqs, receipts):
        leases[receipt] = (seq, granted, deadline, visibility, holder)
        leased[seq] = receipt
        d = deliveries.get(seq, 0)
        deliveries[seq] = d + 1
        if d:
            again += 1
    return again


def delivered(store: dict, deliveries: dict, seqs, receipts, ms: int) -> list[tuple]:
    out = []
    for seq, receipt in zip(seqs, receipts):
        m = store[seq]
        out.append((m[1], receipt, m[2], m[3], deliveries[seq], m[4], m[5] // ms, m[6], m[7]))
    return out


def ack_run(leases: dict, leased: dict, store: dict, deliveries: dict, receipts: list, start: int, now: int,
            done: list, results: list, acked: object) -> tuple[int, int]:
    """-> (where it stopped, the acked messages' data bytes).  Each ack: the lease, the message and its count of
    deliveries go, the receipt goes into ``done``, ``acked`` into ``results``."""
    if start < 0:
        raise ValueError("start must not be negative")
    size = 0
    i = start
    n = len(receipts)
    while i < n:
        receipt = receipts[i]
        lease = leases.get(receipt) if type(receipt) is str else None
        if lease is None or lease[2] <= now:
            break
        seq = lease[0]
        del leases[receipt]
        del leased[seq]
        deliveries.pop(seq, None)
        size += len(store.pop(seq)[3])
        done.append(receipt)
        results.append(acked)
        i += 1
    return i, size


def store_run(store: dict, seq: int, ids: list, kind: int, datas: list, priority: int, wall: int) -> int:
    size = 0
    for i, data in enumerate(datas):
        store[seq + i] = (seq + i, ids[i], kind, data, priority, wall, "", "", 0)
        size += len(data)
    return size


def store_put(store: dict, messages: list) -> int:
    size = 0
    for m in messages:
        if not isinstance(m, tuple) or len(m) < 4:
            raise TypeError("a message is a tuple (seq, id, kind, data, ...)")
        size += len(m[3])
        store[m[0]] = m
    return size


def snapshot_pushes(messages: list, width: int, least: int) -> list:
    records: list[tuple] = []
    pending: list[tuple] = []    # messages for a pushes record (odd ones, short runs), unless a long run follows
    run: list[tuple] = []        # a run that a pushcol may carry, once it is ``least`` long
    for m in messages:
        if type(m) is not tuple or len(m) != 9:
            raise TypeError("a message is a tuple of 9")
        seq, _, kind, _, priority, enqueued = m[:6]
        if run:
            first = run[0]
            if seq == first[0] + len(run) and kind == first[2] and priority == first[4] and enqueued == first[5] \
                    and _carried(m, width):
                run.append(m)
                continue
            _end_run(records, pending, run, least)
            run = []
        if _carried(m, width):
            run = [m]
        else:
            pending.append(m)
    _end_run(records, pending, run, least)
    if pending:
        records.append(("pushes", None, pending, None))
    return records


def _carried(m: tuple, width: int) -> bool:
    _, msg_id, _, _, _, _, reason, source, redriven = m
    return type(msg_id) is str and len(msg_id) == width and msg_id.isascii() and type(reason) is str \
        and not reason and type(source) is str and not source and type(redriven) is int and not redriven


def _end_run(records: list, pending: list, run: list, least: int) -> None:
    """A run ends: a pushcol record if it is long enough (after one for what was pending), else it is pending."""
    if not run or len(run) < least:
        pending.extend(run)
        return
    if pending:
        records.append(("pushes", None, pending[:], None))
        pending.clear()
    first = run[0]
    records.append(("pushcol", None, first[0], "".join([m[1] for m in run]), first[2], [m[3] for m in run],
                    first[4], first[5]))


def render_deliveries(messages: list, kind_json: int, render: Callable[[tuple], bytes]) -> bytes:
    return b",".join([render(m) for m in messages])


def flat_dumps(obj: object) -> bytes:
    return marshal.dumps(obj, 4)
