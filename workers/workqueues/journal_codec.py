"""The work-queue journal's records as bytes, and back: what a record looks like on disk, with nothing of files
(``journal`` writes and reads them).

Format.  The file is a plain sequence of records, nothing before or between them::

    +----------------+----------------+---------------------------------------+
    | N: u32 LE      | crc: u32 LE    | body: N bytes                         |
    +----------------+----------------+---------------------------------------+
    body = (queue_name, record) in marshal's format 4 (see below)      crc = zlib.crc32(body)

A record is the tuple a ``Queue`` applies (``model.Queue.apply``): str, int, bytes, None, list and tuple values.
A turn's records are written as one body when there are several: ``("", ("batch", [(queue_name, record), ...]))``,
which ``Journal.replay`` yields as the records it holds (one marshal call and one CRC for a turn, not one per record:
half the journal's cost per single push; and a turn is in the file whole or not at all).

Why marshal.  It is the fastest (de)serializer in the standard library for exactly these types, several times
faster than pickle on small tuples, and it round-trips tuples, lists, bytes and ints exactly (JSON does not).
It is not safe against crafted input, which is fine here: the file lives in the broker's private (0700) runtime
directory, is created 0600, and is only ever read back by the broker that wrote it; the CRC catches accidental
damage before ``marshal.loads`` sees a body.  Format version 4 is pinned, and every later Python reads it.  The
records are written by ``core.flat_dumps``: compiled, it writes that format without marshal's back-references,
whose bookkeeping was most of what encoding a turn's records cost (a receipt or a sequence number that a dict also
holds is entered in marshal's table of them); ``marshal.loads`` reads both alike.
"""

from __future__ import annotations

import marshal
import struct
import zlib

from shardbroker.workers.workqueues import core

_HEADER = struct.Struct("<II")       # body length, crc32 of the body
HEADER_SIZE = _HEADER.size
_pack_header = _HEADER.pack
unpack_header = _HEADER.unpack_from
dumps = core.flat_dumps
loads = marshal.loads
crc32 = zlib.crc32


def encode(queue: str, record: tuple) -> bytes:
    """One record as it is on disk: header and body."""
    body = dumps((queue, record))
    return _pack_header(len(body), crc32(body)) + body


def encode_turn(pending: list[tuple[str, tuple]]) -> bytes:
    """A turn's records as they go to the file: one record as itself, several as one batch record.  A record that
    cannot be encoded raises ValueError."""
    return encode(*pending[0]) if len(pending) == 1 else encode("", ("batch", pending))
