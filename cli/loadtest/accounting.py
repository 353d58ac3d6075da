"""Exact accounting of what arrived: lost, duplicated and reordered messages, per publisher.

Ordered delivery (a subscription, one publisher connection) keeps the next expected sequence number and the open
gaps as intervals, so memory grows with the gaps, not the messages.  Competing consumers (queue groups, work
queues) cannot see order, so each member keeps bitmaps (1 bit per message) that the driver ORs: what no member saw
is lost, what was seen more often than once is a redelivery or a duplicate.
"""

from __future__ import annotations

import base64
import bisect
import zlib


class OrderedTracker:
    """One (subscription, publisher) stream.  ``first`` is where the expected messages begin (0, or later for a
    subscription made during the run): sequence numbers below it are counted as ``early``, not as expected."""

    __slots__ = ("next", "_lo", "_hi", "received", "duplicates", "reordered", "max_distance", "first_seen",
                 "last_seen")

    def __init__(self) -> None:
        self.next = 0
        self._lo: list[int] = []     # open gaps [lo, hi), sorted, disjoint
        self._hi: list[int] = []
        self.received = 0
        self.duplicates = 0
        self.reordered = 0
        self.max_distance = 0
        self.first_seen = -1
        self.last_seen = -1

    def add(self, seq: int) -> None:
        self.received += 1
        if self.first_seen < 0:
            self.first_seen = seq
        self.last_seen = seq
        if seq == self.next:
            self.next = seq + 1
        elif seq > self.next:
            self._lo.append(self.next)
            self._hi.append(seq)
            self.next = seq + 1
        else:
            i = bisect.bisect_right(self._lo, seq) - 1
            if i >= 0 and seq < self._hi[i]:
                self.reordered += 1
                self.max_distance = max(self.max_distance, self.next - 1 - seq)
                lo, hi = self._lo[i], self._hi[i]
                if lo == seq and hi == seq + 1:
                    del self._lo[i], self._hi[i]
                elif lo == seq:
                    self._lo[i] = seq + 1
                elif hi == seq + 1:
                    self._hi[i] = seq
                else:
                    self._hi[i] = seq
                    self._lo.insert(i + 1, seq + 1)
                    self._hi.insert(i + 1, hi)
            else:
                self.duplicates += 1

    def complete(self, final: int) -> bool:
        return self.next >= final and not self._lo

    def _missing(self, lo: int, hi: int) -> int:
        return sum(max(0, min(h, hi) - max(low, lo)) for low, h in zip(self._lo, self._hi))

    def result(self, final: int, first: int = 0) -> dict:
        """Counts against ``final`` messages published (sequence numbers 0 .. final-1), expected from ``first``."""
        upto = min(self.next, final)
        missing = self._missing(first, final) + max(0, final - max(self.next, first))
        below = min(self.next, first)
        early = below - self._missing(0, below)
        unique = upto - self._missing(0, upto)
        gaps = [(max(low, first), min(h, final)) for low, h in zip(self._lo, self._hi)
                if min(h, final) > max(low, first)]
        if final > max(self.next, first):
            gaps.append((max(self.next, first), final))
        return {"published": max(0, final - first), "received": self.received, "unique": unique - early,
                "lost": missing, "duplicates": self.duplicates, "reordered": self.reordered,
                "max_reorder_distance": self.max_distance, "early": early,
                "first_seq": self.first_seen, "last_seq": self.last_seen,
                "gap_ranges": [{"lo": lo, "hi": hi} for lo, hi in gaps[:1000]], "gap_count": len(gaps)}


class Bitmap:
    """A growable bit set over sequence numbers."""

    __slots__ = ("bits",)

    def __init__(self, bits: bytearray | None = None) -> None:
        self.bits = bits if bits is not None else bytearray()

    def set(self, i: int) -> bool:
        """Sets bit ``i``; True if it was clear."""
        byte = i >> 3
        if byte >= len(self.bits):
            self.bits.extend(bytes(max(byte + 1 - len(self.bits), len(self.bits))))
        mask = 1 << (i & 7)
        if self.bits[byte] & mask:
            return False
        self.bits[byte] |= mask
        return True

    def __contains__(self, i: int) -> bool:
        byte = i >> 3
        return byte < len(self.bits) and bool(self.bits[byte] & (1 << (i & 7)))

    def count(self) -> int:
        return int.from_bytes(self.bits, "little").bit_count()

    def encode(self) -> str:
        return base64.b64encode(zlib.compress(bytes(self.bits), 1)).decode()

    @classmethod
    def decode(cls, blob: str) -> Bitmap:
        return cls(bytearray(zlib.decompress(base64.b64decode(blob)))) if blob else cls()

    def __or__(self, other: Bitmap) -> Bitmap:
        n = max(len(self.bits), len(other.bits))
        a = int.from_bytes(self.bits, "little") | int.from_bytes(other.bits, "little")
        return Bitmap(bytearray(a.to_bytes(n, "little")))

    def __and__(self, other: Bitmap) -> Bitmap:
        n = max(len(self.bits), len(other.bits))
        a = int.from_bytes(self.bits, "little") & int.from_bytes(other.bits, "little")
        return Bitmap(bytearray(a.to_bytes(n, "little")))

    def below(self, final: int) -> Bitmap:
        """Only the bits under ``final``."""
        a = int.from_bytes(self.bits, "little") & ((1 << final) - 1)
        return Bitmap(bytearray(a.to_bytes(max(len(self.bits), 1), "little")))


class GroupMember:
    """One competing consumer's view of one publisher: what it saw and, for work queues, what it acked."""

    __slots__ = ("seen", "acked", "deliveries", "acks_ok", "redelivered_reported")

    def __init__(self) -> None:
        self.seen = Bitmap()
        self.acked = Bitmap()
        self.deliveries = 0
        self.acks_ok = 0                 # acks the broker answered ok (not already_acked)
        self.redelivered_reported = 0    # deliveries the broker itself numbered > 1

    def row(self) -> dict:
        return {"seen": self.seen.encode(), "acked": self.acked.encode(), "deliveries": self.deliveries,
                "acks_ok": self.acks_ok, "redelivered_reported": self.redelivered_reported}


def merge_group(members: list[dict], final: int, confirmed: str | None) -> dict:
    """Streams row counts for one (group, publisher) from its members' rows.

    ``final`` is how many messages the publisher sent; ``confirmed`` (work queues) the bitmap of pushes the broker
    acknowledged: only those must arrive, and a push whose reply never came is ``unconfirmed``, expected by nobody.
    A message acknowledged twice (two acks answered ok) was handed out again after its ack or to two consumers at
    once: a duplicate, which at-least-once delivery does not allow; other extra deliveries are redeliveries of
    leases that ended without an ack.
    """
    seen, acked = Bitmap(), Bitmap()
    deliveries = acks_ok = reported = 0
    for m in members:
        seen = seen | Bitmap.decode(m["seen"])
        acked = acked | Bitmap.decode(m["acked"])
        deliveries += m["deliveries"]
        acks_ok += m["acks_ok"]
        reported += m["redelivered_reported"]
    seen = seen.below(final)
    unique = seen.count()
    if confirmed is None:
        published, lost, unconfirmed = final, final - unique, 0
    else:
        conf = Bitmap.decode(confirmed).below(final)
        published = conf.count()
        lost = published - (conf & seen).count()
        unconfirmed = final - published
    if confirmed is None:
        duplicates, redeliveries, unacked = deliveries - unique, 0, 0
    else:
        acked_unique = acked.below(final).count()
        duplicates = acks_ok - acked_unique
        redeliveries = deliveries - unique - duplicates
        unacked = unique - acked_unique
    return {"published": published, "received": deliveries, "unique": unique, "lost": lost,
            "duplicates": duplicates, "redeliveries": redeliveries, "unacked": unacked,
            "unconfirmed": unconfirmed, "redelivered_reported": reported}
