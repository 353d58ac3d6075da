"""State a worker keeps for the subjects it owns (see ``router.shardmap``).

For now: per-subject counters of published messages and bytes, fed by every worker once a second.  The table is
bounded: past ``limit`` subjects the least recently active tenth is forgotten, so a stream of unique subjects
(reply inboxes) cannot grow it without end.
"""

from __future__ import annotations

import itertools
import time


class SubjectTable:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        # subject -> (messages, bytes, first seen, last seen) (wall-clock seconds), the least recently active
        # first: a merged entry moves to the end, so forgetting the least active takes from the front (no sort).
        # Tuples of numbers, which the cyclic collector stops tracking: a table of unique reply subjects is
        # otherwise a hundred thousand lists it walks again and again.
        self.subjects: dict[str, tuple] = {}

    def __len__(self) -> int:
        return len(self.subjects)

    def merge(self, counts: dict[str, tuple]) -> None:
        """Add ``counts`` (subject -> (messages, bytes), as a worker's ``Hub.tick`` ships them)."""
        now = time.time()
        table = self.subjects
        pop = table.pop
        for subject, (msgs, nbytes) in counts.items():
            entry = pop(subject, None)
            table[subject] = (msgs, nbytes, now, now) if entry is None else \
                (entry[0] + msgs, entry[1] + nbytes, entry[2], now)
        excess = len(table) - self.limit
        if excess > 0:   # down to nine tenths of the limit
            for subject in list(itertools.islice(table, excess + self.limit // 10)):
                del table[subject]

    def top(self, limit: int, subject: str | None = None) -> list[dict]:
        if subject is not None:
            entry = self.subjects.get(subject)
            rows = [(subject, entry)] if entry else []
        else:
            rows = sorted(self.subjects.items(), key=lambda kv: kv[1][0], reverse=True)[:limit]
        return [{"subject": s, "msgs": e[0], "bytes": e[1], "first": e[2], "last": e[3]} for s, e in rows]
