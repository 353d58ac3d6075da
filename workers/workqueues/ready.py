"""The visible messages of a queue in serving order (``Ready``): priority 9 first, then by sequence number.

Its own room because it is its own structure, with its own invariants (a FIFO of runs and a heap per priority),
which the queue (``model``) only adds to and takes from; tests/queues/test_wq_journal.py checks it against one heap.
"""

from __future__ import annotations

import collections
import heapq
import itertools

from shardbroker.workers.workqueues.messages import MAX_PRIORITY

_NO_RUNS: tuple = ()   # a priority's FIFO of runs until it gets one (``Ready``)


def _append_run(fifo: collections.deque[range], run: range) -> None:
    """``run`` (numbers after all of the FIFO's) at the FIFO's end: one run with the last if it continues it."""
    if fifo and fifo[-1].stop == run.start:
        fifo[-1] = range(fifo[-1].start, run.stop)
    else:
        fifo.append(run)


class Ready:
    """The visible messages' sequence numbers in serving order: priority 9 first, then by sequence number.

    Per priority, a FIFO of the sequence numbers that arrived in increasing order (new pushes: nearly all of them;
    taking from it is O(1), where a heap of a million entries cost half a microsecond a message), and a heap of
    those that did not (a message coming back after a lease or a delay keeps its place near the head).  The next
    message of a priority is the smaller of the two heads.

    The FIFO holds runs of consecutive numbers as ``range``s: a batch is one run, and so are single pushes in a
    row.  A deque of the numbers themselves is a container the collector walks whole on every full pass, and on a
    queue growing by a million messages those passes cost 20-70 ms each (``qwork1`` in the bench); a run is one
    entry."""

    __slots__ = ("fifo", "back", "count", "top")

    def __init__(self) -> None:
        # a priority's FIFO is made when it first gets a run: ten empty deques were 7.6 KB of every queue's ~12
        self.fifo: list[collections.deque[range] | tuple] = [_NO_RUNS] * (MAX_PRIORITY + 1)
        self.back: list[list[int]] = [[] for _ in range(MAX_PRIORITY + 1)]
        self.count = 0
        self.top = -1            # no priority above this one has messages

    def __len__(self) -> int:
        return self.count

    def add(self, seq: int, priority: int) -> None:
        fifo = self.fifo[priority]
        if not fifo or seq >= fifo[-1].stop:
            if fifo is _NO_RUNS:
                fifo = self.fifo[priority] = collections.deque()
            _append_run(fifo, range(seq, seq + 1))
        else:
            heapq.heappush(self.back[priority], seq)
        self.count += 1
        if priority > self.top:
            self.top = priority

    def extend(self, seqs: list[int], priorities: list[int]) -> None:
        """``add`` each (seqs in increasing order), in one step where they are of one priority."""
        p = priorities[0]
        if priorities.count(p) != len(priorities):
            for seq, priority in zip(seqs, priorities):
                self.add(seq, priority)
            return
        self.extend_run(seqs, p)

    def extend_run(self, seqs: list[int] | range, priority: int) -> None:
        """``add`` each (in increasing order, all of ``priority``), in one step where they are new pushes with
        consecutive numbers (a ``range``, or a list that is one)."""
        if not seqs:
            return
        fifo = self.fifo[priority]
        if type(seqs) is not range:
            if seqs[-1] - seqs[0] != len(seqs) - 1:   # increasing, so not consecutive
                for seq in seqs:
                    self.add(seq, priority)
                return
            seqs = range(seqs[0], seqs[-1] + 1)
        if fifo and seqs.start < fifo[-1].stop:
            for seq in seqs:
                self.add(seq, priority)
            return
        if fifo is _NO_RUNS:
            fifo = self.fifo[priority] = collections.deque()
        _append_run(fifo, seqs)
        self.count += len(seqs)
        if priority > self.top:
            self.top = priority

    def pop_many(self, n: int) -> list[int]:
        """The next ``n`` (at most ``count``) in serving order, taken out."""
        out: list[int] = []
        p = self.top
        while len(out) < n:
            fifo, back = self.fifo[p], self.back[p]
            if not fifo and not back:
                p -= 1
                continue
            want = n - len(out)
            # the FIFO's head runs while the heap's head is not before them (it is never inside one: a number is
            # in one place only)
            while want and fifo and not (back and back[0] < fifo[0].start):
                head = fifo[0]
                if want >= len(head):
                    out.extend(head)
                    fifo.popleft()
                    want -= len(head)
                else:
                    out.extend(head[:want])
                    fifo[0] = head[want:]
                    want = 0
            while want and back and (not fifo or back[0] < fifo[0].start):
                out.append(heapq.heappop(back))
                want -= 1
        while p >= 0 and not self.fifo[p] and not self.back[p]:
            p -= 1
        self.top = p
        self.count -= len(out)
        return out

    def remove(self, seq: int, priority: int) -> None:
        """Take one message out, wherever it is (replay, dead-lettering: rare; the ends of the FIFO are O(1))."""
        fifo, back = self.fifo[priority], self.back[priority]
        if back and back[0] == seq:
            heapq.heappop(back)
        else:
            # the head run (taken from the front), the newest (a push undone: shard_commit.roll_back, newest first),
            # then the rest
            at = 0 if fifo and seq in fifo[0] else len(fifo) - 1 if fifo and seq in fifo[-1] else None
            if at is None:
                at = next((i for i, run in enumerate(fifo) if seq in run), None)
            if at is None:
                back.remove(seq)
                heapq.heapify(back)
            else:
                run = fifo[at]
                parts = [part for part in (run[:seq - run.start], run[seq - run.start + 1:]) if part]
                if len(parts) == 1:
                    fifo[at] = parts[0]
                else:
                    del fifo[at]
                    for part in reversed(parts):
                        fifo.insert(at, part)
        self.count -= 1

    def discard(self, taken: set) -> None:
        """Take these out (a redrive)."""
        for p in range(MAX_PRIORITY + 1):
            old, fifo = self.fifo[p], collections.deque()
            self.fifo[p] = fifo
            for seq in itertools.chain.from_iterable(old):
                if seq not in taken:
                    _append_run(fifo, range(seq, seq + 1))
            self.back[p] = [seq for seq in self.back[p] if seq not in taken]
            heapq.heapify(self.back[p])
        self.count = sum(sum(map(len, f)) + len(b) for f, b in zip(self.fifo, self.back))

    def peek(self, limit: int) -> list[int]:
        """The first ``limit`` in serving order, left where they are."""
        out: list[int] = []
        for p in range(MAX_PRIORITY, -1, -1):
            for seq in heapq.merge(itertools.chain.from_iterable(self.fifo[p]), sorted(self.back[p])):
                if len(out) >= limit:
                    return out
                out.append(seq)
        return out

    def seqs(self):
        for fifo, back in zip(self.fifo, self.back):
            yield from itertools.chain.from_iterable(fifo)
            yield from back

    def clear(self) -> None:
        self.fifo[:] = [_NO_RUNS] * (MAX_PRIORITY + 1)
        for back in self.back:
            back.clear()
        self.count = 0
        self.top = -1
