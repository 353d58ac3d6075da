"""Which worker owns a subject.

owner(subject) = CRC-32 (zlib, IEEE polynomial) of the subject's UTF-8 bytes, modulo the number of workers.
CRC-32 is fixed by the standard, unlike Python's randomised ``hash()``, so the map is identical across restarts,
processes and machines, and any tool can compute it.  The owner keeps the subject's state (counters; queues and
queue groups build on the same map).
"""

from __future__ import annotations

import zlib


def owner(subject: str, workers: int) -> int:
    return zlib.crc32(subject.encode()) % workers
