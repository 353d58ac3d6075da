"""Clock offsets between tasks on different hosts, measured through the broker (Cristian's algorithm).

Monotonic clocks are one clock per machine, so end-to-end latency between two processes of one host is exact.
Across hosts, a subscriber task probes each publisher task it receives from: a request carrying its send time t1
goes to the publisher's clock subject, the publisher answers with its own clock reading t_r, and the answer arrives
at t2.  With the smallest round trip of the probes, the publisher's clock is ahead of ours by t_r - (t1 + t2) / 2,
give or take half that round trip: the bound stored with the offset.  Probes travel in the load test's own header
format, marked by the top bits of the publisher id.
"""

from __future__ import annotations

import asyncio
import time

REQUEST = 1 << 31
REPLY = 1 << 30
PROBE_SIZE = 64          # the smallest message every protocol's header fits in
_now = time.monotonic_ns


class Clock:
    def __init__(self, task: int, subject_of) -> None:
        self.task = task
        self.subject_of = subject_of     # task -> its clock subject
        self.conn = None
        self.waiting: dict[int, asyncio.Future] = {}
        self.seq = 0

    def handle(self, pub_id: int, seq: int, t1: int, t_r: int, t_recv: int) -> None:
        if pub_id & REQUEST:
            if self.conn is not None and not self.conn.closed.done():
                # The reply's write time (stamped by publish) is our clock reading.
                self.conn.publish(self.subject_of(pub_id & 0xFFFF).encode(), [(REPLY | self.task, seq, t1)],
                                  PROBE_SIZE)
        elif pub_id & REPLY:
            fut = self.waiting.pop(seq, None)
            if fut is not None and not fut.done():
                fut.set_result((t1, t_r, t_recv))

    async def probe(self, target: int, count: int, deadline: int) -> tuple[int, int, int] | None:
        """(offset_ns: target's clock minus ours, bound_ns, probes answered), or None if none was answered."""
        best = None
        answered = 0
        subject = self.subject_of(target).encode()
        for _ in range(count):
            if _now() >= deadline or self.conn is None or self.conn.closed.done():
                break
            self.seq += 1
            fut = asyncio.get_running_loop().create_future()
            self.waiting[self.seq] = fut
            self.conn.publish(subject, [(REQUEST | self.task, self.seq, _now())], PROBE_SIZE)
            try:
                t1, t_r, t2 = await asyncio.wait_for(fut, max(0.001, (deadline - _now()) / 1e9))
            except TimeoutError:
                self.waiting.pop(self.seq, None)
                break
            answered += 1
            rtt = t2 - t1
            if best is None or rtt < best[1]:
                best = (t_r - (t1 + t2) // 2, rtt)
        if best is None:
            return None
        return best[0], (best[1] + 1) // 2, answered
