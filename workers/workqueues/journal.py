"""The per-shard append-only journal of work queues: every record a ``Queue`` makes, so a replacement worker can
rebuild the shard after the old one died (``kill -9`` included) without losing anything it acknowledged.

Group commit.  ``append`` only buffers the record; the shard's event loop calls ``commit`` once per turn, BEFORE
that turn's replies are sent, and ``commit`` encodes everything buffered and writes it with one ``os.write``.  So
a reply is only ever sent for a change already in the file (in the kernel's page cache: it survives the process,
whatever kills it).  A record that cannot be encoded (a bug: the queues make none) is logged and left out, and
the rest of the turn is written.  Surviving a crash of the machine is the ``fsync`` policy: ``"no"`` leaves it to
the kernel, ``"everysec"`` fsyncs at most once a second, in a thread (started from ``commit``, or from ``tick``
which the owner calls every second; what is lost with the machine is at most about a second of acknowledged
changes, plus those of a sync still under way; a sync that fails is raised by the next ``commit`` or ``tick``:
``journal_disk.Syncer``, which also keeps room allocated past the file's end), ``"always"`` fsyncs in every
commit, before its replies.  A commit that fails (ENOSPC, EFBIG, EIO) cuts the file back to where it was and keeps
its records buffered, so the file always ends on a record boundary and the next commit retries them; ``failed``
then holds that commit's own records (as appended), and the owner may take some of them back (``take_back``: the
shard rolls back the pushes and leases among them and refuses their requests, ``Shard._write_failed`` in
``shard_commit``).  A cut that fails too is tried again before the next write: nothing is appended after a torn
record.

Torn tail.  A crash in the middle of ``os.write`` (the process killed by the kernel, the machine losing power)
can leave the last record incomplete, and a disk can return garbage.  ``replay`` yields the records in order and
stops at the first one that is truncated, fails its CRC or does not decode: it logs a warning with that record's
byte offset and truncates the file there, so records appended afterwards follow the last good one and replay
cleanly.  Anything after a corrupt record is dropped with it (records depend on the ones before them, so a queue
cannot be rebuilt from a journal with a hole in it).

A journal that only has to outlive its worker (``durable`` false: the runtime directory, no ``queues.data_dir``)
is never fsynced, not even by a rewrite (whose writeback is only started early: ``rewrite_flush``): the page cache
survives a process, and the machine's crash takes the runtime directory's meaning with it.

Rooms.  ``Journal`` is one object, in two rooms: this one appends, commits, syncs as its policy says and replays;
``journal_rewrite`` compacts it (the live state rewritten to a new file put in place of this one, at once at start
or a batch at a time while serving; a mixin, since a rewrite replaces this object's file).  Below them,
``journal_codec`` makes a record into bytes and back, and ``journal_disk`` holds the calls on the disk (the tests
replace them there) and the ``everysec`` syncer's thread.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

from shardbroker.workers.workqueues import journal_disk
from shardbroker.workers.workqueues.journal_codec import HEADER_SIZE, crc32, dumps, encode_turn, loads, unpack_header
from shardbroker.workers.workqueues.journal_rewrite import Rewrite, Rewriting

log = logging.getLogger("broker.journal")

FSYNC_MODES = ("no", "everysec", "always")

SLOW_SYNC_S = 2.0                    # an everysec fsync under way this long is logged (a slow or failing disk)
# Room allocated past an everysec journal's end before each sync: twice what was written since the last one (the
# next sync starts about a second later; a slow one, later still), within these bounds.
RESERVE_MIN = 4 << 20
RESERVE_MAX = 256 << 20


class Journal(Rewriting):
    """The journal of one shard; ``path`` None turns journaling off (everything a no-op, nothing replayed)."""

    def __init__(self, path: str | None, fsync: str = "no", durable: bool = True) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"journal fsync must be one of {', '.join(FSYNC_MODES)}, not {fsync!r}")
        self.path = path
        self.fsync = fsync
        self.durable = durable            # to survive the machine (a rewrite fsyncs), not only the worker
        self._rewriting: Rewrite | None = None       # a rewrite under way (start_rewrite)
        self._enabled = path is not None
        self._pending: list[tuple[str, tuple]] = []   # appended, not yet encoded
        self._buf: list[bytes] = []                   # encoded, not yet written (a failed write's, to retry)
        self._fd: int | None = None
        self._size = 0
        self._torn = False                # a failed write could not be cut back: cut before writing again
        self.failed: list[tuple[str, tuple]] | None = None   # the last failed commit's own records (see take_back)
        self._failed_chunk: bytes | None = None               # ... as encoded, the last item of _buf
        self._synced_at = float("-inf")   # monotonic s of the last fsync: the first everysec commit syncs
        self._unsynced = False            # written since the last fsync (everysec)
        self._dir_unsynced = False        # a rename in the directory not yet fsynced (everysec, after a rewrite)
        self._written = 0                 # bytes committed by this journal, all files (everysec: its write rate)
        self._written_at_sync = 0         # ... when the last everysec fsync started
        self._syncer = journal_disk.Syncer() if fsync == "everysec" and path is not None else None
        self._slow_logged = False         # the everysec fsync under way was logged as slow
        if path is not None:
            self._fd = os.open(path, journal_disk.OPEN_FLAGS, 0o600)
            for stale in glob.glob(glob.escape(path) + ".rewrite-*"):   # an earlier worker's, never finished
                journal_disk.unlink(stale)
            self._size = os.fstat(self._fd).st_size

    # -- writing ------------------------------------------------------------------------------------------------
    def append(self, queue: str, record: tuple) -> None:
        """Buffer one record, for the next ``commit``."""
        if self._enabled:
            self._pending.append((queue, record))

    @property
    def dirty(self) -> bool:
        """Records are buffered, not yet written."""
        return bool(self._pending or self._buf)

    def _encode(self, pending: list, strict: bool = False) -> bytes:
        """A turn's records as they go to the file: one record as itself, several as one batch record.  ``strict``:
        an unencodable record raises ValueError (a rewrite must not leave anything out)."""
        try:
            return encode_turn(pending)
        except ValueError:
            if strict:
                raise
            good = []
            for queue, record in pending:
                try:
                    dumps(record)
                except ValueError as exc:
                    log.error("journal %s: record %r of queue %r cannot be encoded (%s); left out",
                              self.path, record[:2], queue, exc)
                    continue
                good.append((queue, record))
            return self._encode(good) if good else b""

    def commit(self) -> None:
        """Write every buffered record with one write; fsync as the policy says.  A failed write: see the module's
        docstring (the file is cut back, the records stay buffered, ``failed`` names this commit's own)."""
        pending = None
        encoded = b""
        if self._pending:
            pending, self._pending = self._pending, []
            encoded = self._encode(pending)
            if encoded:
                self._buf.append(encoded)
        self.failed = self._failed_chunk = None
        buf = self._buf
        if not buf:
            return
        fd = self._fd
        if fd is None:
            raise ValueError("journal is closed")
        data = b"".join(buf) if len(buf) > 1 else buf[0]
        try:
            if self._torn:
                os.ftruncate(fd, self._size)
                self._torn = False
            journal_disk.write_all(fd, data)
        except BaseException:
            # Keep the file ending on a record boundary, and the records for the next commit to retry.
            try:
                os.ftruncate(fd, self._size)
            except OSError:
                self._torn = True
            if len(buf) > 2:   # one chunk for what earlier commits left, one for this commit's (take_back's)
                buf[:] = [b"".join(buf[:-1]), buf[-1]] if encoded else [data]
            if encoded:
                self.failed, self._failed_chunk = pending, encoded
            raise
        buf.clear()
        self._size += len(data)
        self._written += len(data)
        mode = self.fsync
        if mode == "always":
            journal_disk.sync(fd)
        elif mode == "everysec":
            self._unsynced = True
            self._sync_in_background(fd, journal_disk.monotonic() - self._synced_at >= 1.0)

    def take_back(self, keep: list[tuple[str, tuple]]) -> None:
        """After a failed ``commit``: of its own records (``failed``), only ``keep`` (in order) stay buffered for the
        next commit; the others are dropped, never written (their owner has undone them)."""
        chunk = self._failed_chunk
        if chunk is None:
            raise AssertionError("take_back without a failed commit")
        assert self._buf and self._buf[-1] is chunk
        self._buf.pop()
        self.failed = self._failed_chunk = None
        if keep:
            encoded = self._encode(keep)
            if encoded:
                self._buf.append(encoded)

    def tick(self) -> None:
        """Once a second (the owner's timer): fsync what was written since the last fsync (``everysec``)."""
        if self._syncer is not None and self._fd is not None:
            self._sync_in_background(self._fd, self._unsynced)

    def _sync_in_background(self, fd: int, due: bool) -> None:
        """``everysec``: raise what the last fsync failed with; start another if ``due`` and none is under way."""
        syncer = self._syncer
        assert syncer is not None
        error, syncer.error = syncer.error, None
        if error is not None:
            self._unsynced = True
            self._dir_unsynced |= syncer.failed_directory
            raise error
        if not due:
            return
        ahead = min(RESERVE_MAX, max(RESERVE_MIN, 2 * (self._written - self._written_at_sync)))
        if syncer.start(fd, ahead, self._directory() if self._dir_unsynced else None):
            self._dir_unsynced = False
            self._written_at_sync = self._written
            self._synced_at = journal_disk.monotonic()
            self._unsynced = False
            self._slow_logged = False
        elif not self._slow_logged and journal_disk.monotonic() - self._synced_at >= SLOW_SYNC_S:
            self._slow_logged = True
            log.warning("journal %s: an fsync begun %.0f s ago is still under way (a slow or failing disk?); until "
                        "it ends, a crash of the machine can take everything written since it began",
                        self.path, journal_disk.monotonic() - self._synced_at)

    # -- reading --------------------------------------------------------------------------------------------------
    def replay(self) -> Iterator[tuple[str, tuple]]:
        """The (queue, record) pairs in the file, in order, up to the first truncated or corrupt record, where the
        file is then cut (see the module's docstring)."""
        if not self._enabled:
            return
        fd = self._fd
        if fd is None:
            raise ValueError("journal is closed")
        end = os.fstat(fd).st_size
        offset = 0      # file offset of the next record
        buf = b""       # file bytes from offset - pos on
        pos = 0
        reason = ""
        while offset < end:
            if len(buf) - pos < HEADER_SIZE:
                if end - offset < HEADER_SIZE:
                    reason = "truncated header"
                    break
                buf = buf[pos:] + os.pread(fd, journal_disk.CHUNK, offset + len(buf) - pos)
                pos = 0
                if len(buf) < HEADER_SIZE:
                    reason = "truncated header"
                    break
            n, crc = unpack_header(buf, pos)
            stop = offset + HEADER_SIZE + n
            if stop > end:
                reason = f"truncated record (length {n}, {end - offset - HEADER_SIZE} bytes left)"
                break
            start = pos + HEADER_SIZE
            if start + n > len(buf):
                have = len(buf) - pos
                buf = buf[pos:] + os.pread(fd, max(journal_disk.CHUNK, HEADER_SIZE + n - have), offset + have)
                pos = 0
                start = HEADER_SIZE
                if start + n > len(buf):
                    reason = "truncated record"
                    break
            body = buf[start:start + n]
            if crc32(body) != crc:
                reason = "checksum mismatch"
                break
            try:
                queue, record = loads(body)
            except (EOFError, ValueError, TypeError) as exc:
                reason = f"undecodable record ({exc})"
                break
            if not queue and record[0] == "batch":
                yield from record[1]
            else:
                yield queue, record
            pos = start + n
            offset = stop
        if reason:
            log.warning("journal %s: %s at byte %d of %d; truncating the journal there (%d bytes dropped)",
                        self.path, reason, offset, end, end - offset)
            os.ftruncate(fd, offset)
            if self.fsync != "no":
                journal_disk.sync(fd)
        self._size = os.fstat(fd).st_size

    # -- the rest -------------------------------------------------------------------------------------------------
    def _directory(self) -> str:
        assert self.path is not None
        return os.path.dirname(os.path.abspath(self.path))

    @property
    def size(self) -> int:
        """Bytes in the file now (committed records; buffered ones not counted)."""
        return self._size

    def close(self) -> None:
        """Commit what is buffered, fsync what ``everysec`` has not yet, close.  Closing twice is harmless."""
        fd = self._fd
        if fd is None:
            return
        self.abort_rewrite()
        syncer = self._syncer
        try:
            self.commit()
            if syncer is not None:
                syncer.stop()
                if syncer.error is not None:   # that one failed: this one says whether the disk took it now
                    self._unsynced = True
                    self._dir_unsynced |= syncer.failed_directory
            if self._unsynced:
                journal_disk.sync(fd)
            if self._dir_unsynced:
                journal_disk.sync_dir(self._directory())
                self._dir_unsynced = False
            if syncer is not None:
                try:   # the room allocated past the end (everysec), given back
                    os.ftruncate(fd, self._size)
                except OSError:
                    pass   # it stays, for the next start's appends
        finally:
            self._fd = None
            self._unsynced = False
            os.close(fd)
