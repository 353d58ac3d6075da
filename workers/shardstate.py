"""State a worker keeps for the subjects it owns (see ``router.shardmap``).

For now: per-subject counters of published messages and bytes, fed by every worker once a second.  The table is
bounded: past ``limit`` subjects the least recently active tenth is forgotten, so a stream of unique subjects
(reply inboxes) cannot grow it without end.
"""

from __future__ import annotations

import time


class SubjectTable:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        # subject -> [messages, bytes, first seen, last seen] (wall-clock seconds)
        self.subjects: dict[str, list] = {}

    def __len__(self) -> int:
        return len(self.subjects)

    def merge(self, items: list) -> None:
        now = time.time()
        table = self.subjects
        for subject, msgs, nbytes in items:
            entry = table.get(subject)
            if entry is None:
                table[subject] = [msgs, nbytes, now, now]
            else:
                entry[0] += msgs
                entry[1] += nbytes
                entry[3] = now
        if len(table) > self.limit:
            keep = sorted(table.items(), key=lambda kv: kv[1][3], reverse=True)[: self.limit * 9 // 10]
            self.subjects = dict(keep)

    def top(self, limit: int, subject: str | None = None) -> list[dict]:
        if subject is not None:
            entry = self.subjects.get(subject)
            rows = [(subject, entry)] if entry else []
        else:
            rows = sorted(self.subjects.items(), key=lambda kv: kv[1][0], reverse=True)[:limit]
        return [{"subject": s, "msgs": e[0], "bytes": e[1], "first": e[2], "last": e[3]} for s, e in rows]
