"""A queue's snapshot for the journal's compaction: the records that rebuild it as it was when taken, in batches.

``model.Queue.snapshot`` takes the state (the messages, tuples that never change, and copies of the maps that do);
``snapshot_batches`` makes the records of it, a batch at a time, as a rewrite while serving writes them over many
turns.  Apart from the queue because none of it is the queue's life: only what its records look like once
compacted, and how big a batch is (``SNAPSHOT_RUN``, ``SNAPSHOT_BYTES``: the tests make them small).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator

from shardbroker.workers.workqueues import core
from shardbroker.workers.workqueues.messages import (
    DATA,
    ENQUEUED,
    ID,
    KIND,
    L_DEADLINE,
    L_GRANTED,
    L_VISIBILITY,
    PRIORITY,
    REASON,
    REDRIVEN,
    SEQ,
    SOURCE,
)
from shardbroker.workers.workqueues.receipts import ID_CHARS

LIMBO = -1                       # delay_at of a journal snapshot's leased message until its lease record
# A batch of a journal snapshot (one step of a rewrite while serving): this many messages, or about this much of
# their data.  ~0.04 ms a batch of 128-byte messages: a step runs at the end of a turn, and a request that arrives
# meanwhile waits for it (1,024 a batch: ~0.16 ms; scripts/measure/serving_latency.py --during compaction).
SNAPSHOT_RUN = 256
SNAPSHOT_BYTES = 1 << 18
SNAPSHOT_PUSHCOL = 8             # runs of messages pushed together this long or longer: pushcol records


def snapshot_batches(messages: list[tuple], leased: dict, leases: dict, deliveries: dict, delay_at: dict,
                     tokens: list) -> Iterator[list[tuple]]:
    """``Queue.snapshot``'s batches: its messages' (``_message_batches``), then the push tokens it still remembers
    (``tokens`` records), ``SNAPSHOT_RUN`` a batch."""
    return itertools.chain(_message_batches(messages, leased, leases, deliveries, delay_at),
                           ([("tokens", tokens[i:i + SNAPSHOT_RUN])] for i in range(0, len(tokens), SNAPSHOT_RUN)))


def _message_batches(messages: list[tuple], leased: dict, leases: dict, deliveries: dict, delay_at: dict
                     ) -> Iterator[list[tuple]]:
    """``Queue.snapshot``'s batches of messages.  A batch of visible messages never leased, in the order of their
    the store holds them), is stored as pushes store them: ``pushcol`` records for its runs of one kind, priority
    and time (messages pushed together), ``pushes`` records for the rest (``core.snapshot_pushes``); any other
    has a ``push`` record per message (a leased one as in no heap, then its lease)."""
    special = leased.keys() | deliveries.keys() | delay_at.keys()
    data_of, seq_of = operator.itemgetter(DATA), operator.itemgetter(SEQ)
    i = 0
    while i < len(messages):
        batch = messages[i:i + SNAPSHOT_RUN]
        if sum(map(len, map(data_of, batch))) > SNAPSHOT_BYTES:
            size = n = 0
            while n < len(batch) and size <= SNAPSHOT_BYTES:
                size += len(batch[n][DATA])
                n += 1
            batch = batch[:n]
        i += len(batch)
        seqs = list(map(seq_of, batch))
        if special.isdisjoint(seqs) and seqs == sorted(seqs):
            yield core.snapshot_pushes(batch, ID_CHARS, SNAPSHOT_PUSHCOL)
            continue
        records = []
        for m in batch:
            seq = m[SEQ]
            receipt = leased.get(seq)
            d = deliveries.get(seq, 0)
            records.append(("push", seq, m[ID], m[KIND], m[DATA], m[PRIORITY], m[ENQUEUED],
                            delay_at.get(seq, 0) if receipt is None else LIMBO, d - 1 if receipt is not None else d,
                            m[REASON], m[SOURCE], m[REDRIVEN], None))
            if receipt is not None:
                lease = leases[receipt]
                records.append(("lease", seq, receipt, lease[L_GRANTED], lease[L_DEADLINE], lease[L_VISIBILITY]))
        yield records
