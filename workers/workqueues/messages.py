"""What a work queue keeps and hands out, as plain tuples of atomic values: a message, a lease, a delivery, with
the indexes of their fields; the unit their times are counted in and the range of a message's priority; and which
messages a record that stores them names (``pushed_seqs``).

Tuples rather than objects for the collector's sake (``model``'s docstring, Representation), and a delivery crosses
between workers with marshal.  The queue (``model`` and its rooms), the shard and the protocols all read them, so
they live here, below all of them.
"""

from __future__ import annotations

MS = 1_000_000  # ns
MAX_PRIORITY = 9

# A message: (seq, id, kind, data, priority, enqueued_at, dead_reason, source, redriven).
SEQ, ID, KIND, DATA, PRIORITY, ENQUEUED, REASON, SOURCE, REDRIVEN = range(9)
# A lease: (seq, granted, deadline, visibility_ms, holder) under its receipt (text).
L_SEQ, L_GRANTED, L_DEADLINE, L_VISIBILITY, L_HOLDER = range(5)
# A delivery, what a receive hands the protocol: (id, receipt, kind, data, deliveries, priority, enqueued_at_ms,
# dead_reason, source).  Plain tuples: they cross between workers with marshal, and nothing is built per field.
D_ID, D_RECEIPT, D_KIND, D_DATA, D_DELIVERIES, D_PRIORITY, D_ENQUEUED, D_REASON, D_SOURCE = range(9)


def pushed_seqs(record: tuple) -> list[int] | range:
    """The messages a ``push``, ``pushes`` or ``pushcol`` record stores, by sequence number, in order."""
    kind = record[0]
    if kind == "push":
        return [record[1]]
    if kind == "pushcol":
        return range(record[2], record[2] + len(record[5]))
    return [m[0] for m in record[2]]
