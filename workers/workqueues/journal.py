"""The per-shard append-only journal of work queues: every record a ``Queue`` makes, so a replacement worker can
rebuild the shard after the old one died (``kill -9`` included) without losing anything it acknowledged.

Format.  The file is a plain sequence of records, nothing before or between them::

    +----------------+----------------+---------------------------------------+
    | N: u32 LE      | crc: u32 LE    | body: N bytes                         |
    +----------------+----------------+---------------------------------------+
    body = (queue_name, record) in marshal's format 4 (see below)      crc = zlib.crc32(body)

A record is the tuple a ``Queue`` applies (``model.Queue.apply``): str, int, bytes, None, list and tuple values.
A turn's records are written as one body when there are several: ``("", ("batch", [(queue_name, record), ...]))``,
which ``replay`` yields as the records it holds (one marshal call and one CRC for a turn, not one per record:
half the journal's cost per single push; and a turn is in the file whole or not at all).

Group commit.  ``append`` only buffers the record; the shard's event loop calls ``commit`` once per turn, BEFORE
that turn's replies are sent, and ``commit`` encodes everything buffered and writes it with one ``os.write``.  So
a reply is only ever sent for a change already in the file (in the kernel's page cache: it survives the process,
whatever kills it).  A record that cannot be encoded (a bug: the queues make none) is logged and left out, and
the rest of the turn is written.  Surviving a crash of the machine is the ``fsync`` policy: ``"no"`` leaves it to
the kernel, ``"everysec"`` fsyncs at most once a second, in a thread (started from ``commit``, or from ``tick``
which the owner calls every second; what is lost with the machine is at most about a second of acknowledged
changes, plus those of a sync still under way; a sync that fails is raised by the next ``commit`` or ``tick``:
``_Syncer``, which also keeps room allocated past the file's end: see below), ``"always"`` fsyncs in every
commit, before its replies.  A commit that fails (ENOSPC, EFBIG, EIO) cuts the file back to where it was and keeps
its records buffered, so the file always ends on a record boundary and the next commit retries them; ``failed``
then holds that commit's own records (as appended), and the owner may take some of them back (``take_back``: the
shard rolls back the pushes and leases among them and refuses their requests, ``shard.Shard._write_failed``).  A
cut that fails too is tried again before the next write: nothing is appended after a torn record.

Why marshal.  It is the fastest (de)serializer in the standard library for exactly these types, several times
faster than pickle on small tuples, and it round-trips tuples, lists, bytes and ints exactly (JSON does not).
It is not safe against crafted input, which is fine here: the file lives in the broker's private (0700) runtime
directory, is created 0600, and is only ever read back by the broker that wrote it; the CRC catches accidental
damage before ``marshal.loads`` sees a body.  Format version 4 is pinned, and every later Python reads it.  The
records are written by ``core.flat_dumps``: compiled, it writes that format without marshal's back-references,
whose bookkeeping was most of what encoding a turn's records cost (a receipt or a sequence number that a dict also
holds is entered in marshal's table of them); ``marshal.loads`` reads both alike.

Torn tail.  A crash in the middle of ``os.write`` (the process killed by the kernel, the machine losing power)
can leave the last record incomplete, and a disk can return garbage.  ``replay`` yields the records in order and
stops at the first one that is truncated, fails its CRC or does not decode: it logs a warning with that record's
byte offset and truncates the file there, so records appended afterwards follow the last good one and replay
cleanly.  Anything after a corrupt record is dropped with it (records depend on the ones before them, so a queue
cannot be rebuilt from a journal with a hole in it).

Compaction.  A rewrite writes the live state, given as batches of records (each written as one batch record), to
``<path>.rewrite-<pid>``, flushes it, and renames it over the journal (``os.replace``: atomic, a crash leaves either
the old journal or the new one), then appends to the new file.  ``rewrite`` does it all at once (at start); that
stops the owner's event loop for as long as the writing takes, so while the broker serves, compaction goes a batch
at a time between the owner's other work:
``start_rewrite`` is given the state as it was at a commit (the queues hand over their messages, tuples that never
change, and copies of what does: ``model.Queue.snapshot``) and opens ``<path>.rewrite-<pid>``; each ``rewrite_step``
writes one batch (the shard takes one step at the end of each turn, once its replies are out: ``Shard.turn_done``)
while the owner goes on appending to the journal; then another thread appends to that file what the journal
gained since the start (whole records: it started at a commit) and flushes it (``rewrite_flush``), and
``finish_rewrite`` appends what came meanwhile and renames it over the journal (syncing nothing in the event loop
but with ``always``).  Replaying it is replaying the old one: the same state at the start, then the same records.
A rewrite that fails (a full disk) leaves the journal as it was, and so does a worker that dies meanwhile: its
replacement clears the file away.  There is no child process: a fork of a worker holding a million messages made
the worker fault on every page of its memory afterwards (copy-on-write), which cost more than the writing itself.

Room ahead of the end (``everysec``).  On ext4 an append to blocks not yet allocated waits for the file's block map,
which an fsync under way holds while it allocates the blocks it writes back: a commit stood still 4-11 ms once a
second with a producer pushing (``scripts/serving_latency.py --during fsync``).  So before each sync the syncer's
thread allocates about two seconds of the journal's writes past its end (``fallocate`` keeping the size: the file's
length and content are unchanged, replay never sees the room), and the commits meanwhile write into blocks already
there; ``close`` gives back what is left of it.

A journal that only has to outlive its worker (``durable`` false: the runtime directory, no ``queues.data_dir``)
is never fsynced, not even by a rewrite (whose writeback is only started early: ``rewrite_flush``): the page cache
survives a process, and the machine's crash takes the runtime directory's meaning with it.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import logging
import marshal
import os
import struct
import threading
import time
import zlib
from queue import SimpleQueue
from typing import Callable, Iterable, Iterator

from shardbroker.workers.workqueues import core

log = logging.getLogger("broker.journal")

FSYNC_MODES = ("no", "everysec", "always")

_HEADER = struct.Struct("<II")       # body length, crc32 of the body
_HEADER_SIZE = _HEADER.size
_pack_header = _HEADER.pack
_unpack_header = _HEADER.unpack_from
_dumps = core.flat_dumps
_loads = marshal.loads
_crc32 = zlib.crc32
_CHUNK = 1 << 20                     # replay, and a rewrite catching up with the journal, read this much at a time
SLOW_SYNC_S = 2.0                    # an everysec fsync under way this long is logged (a slow or failing disk)
# Room allocated past an everysec journal's end before each sync: twice what was written since the last one (the
# next sync starts about a second later; a slow one, later still), within these bounds.
RESERVE_MIN = 4 << 20
RESERVE_MAX = 256 << 20
# Indirections the tests replace (partial writes, failing disks, a fake clock).
_write = os.write
_sync = getattr(os, "fdatasync", os.fsync)
_writeback = getattr(os, "posix_fadvise", None)
_monotonic = time.monotonic
_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


def _keep_size_fallocate() -> Callable[[int, int, int], None] | None:
    """Linux's fallocate(2) with FALLOC_FL_KEEP_SIZE (blocks allocated, the file's size unchanged), or None where
    the C library has none (the os module has only posix_fallocate, which grows the file)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    call.restype = ctypes.c_int

    def fallocate(fd: int, offset: int, length: int) -> None:
        if call(fd, 1, offset, length) != 0:   # 1: FALLOC_FL_KEEP_SIZE
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return fallocate


_fallocate = _keep_size_fallocate()


def _reserve_ahead(fd: int, ahead: int) -> None:
    """At least half of ``ahead`` bytes allocated past the end of the file open as ``fd``, or ``ahead`` made so."""
    global _fallocate
    if _fallocate is None:
        return
    st = os.fstat(fd)
    if st.st_blocks * 512 - st.st_size >= ahead // 2:
        return
    try:
        _fallocate(fd, st.st_size, ahead)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            _fallocate = None   # this filesystem cannot: appends allocate as they go, as they did
        # Otherwise (ENOSPC) nothing: a commit that cannot write says so itself, to its clients.


def encode(queue: str, record: tuple) -> bytes:
    """One record as it is on disk: header and body."""
    body = _dumps((queue, record))
    return _pack_header(len(body), _crc32(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    done = _write(fd, data)
    if done < len(data):
        view = memoryview(data)
        while done < len(data):
            done += _write(fd, view[done:])


def _copy(source: int, start: int, end: int, fd: int) -> None:
    """Append bytes ``start`` to ``end`` of the file open as ``source`` to the one open as ``fd``."""
    offset = start
    while offset < end:
        data = os.pread(source, min(_CHUNK, end - offset), offset)
        if not data:
            raise OSError(f"the journal ends at {offset}, short of {end}")
        _write_all(fd, data)
        offset += len(data)


class Journal:
    """The journal of one shard; ``path`` None turns journaling off (everything a no-op, nothing replayed)."""

    def __init__(self, path: str | None, fsync: str = "no", durable: bool = True) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"journal fsync must be one of {', '.join(FSYNC_MODES)}, not {fsync!r}")
        self.path = path
        self.fsync = fsync
        self.durable = durable            # to survive the machine (a rewrite fsyncs), not only the worker
        self._rewriting: _Rewrite | None = None       # a rewrite under way (start_rewrite)
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
        self._syncer = _Syncer() if fsync == "everysec" and path is not None else None
        self._slow_logged = False         # the everysec fsync under way was logged as slow
        if path is not None:
            self._fd = os.open(path, _OPEN_FLAGS, 0o600)
            for stale in glob.glob(glob.escape(path) + ".rewrite-*"):   # an earlier worker's, never finished
                _unlink(stale)
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
            return encode(*pending[0]) if len(pending) == 1 else encode("", ("batch", pending))
        except ValueError:
            if strict:
                raise
            good = []
            for queue, record in pending:
                try:
                    _dumps(record)
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
            _write_all(fd, data)
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
            _sync(fd)
        elif mode == "everysec":
            self._unsynced = True
            self._sync_in_background(fd, _monotonic() - self._synced_at >= 1.0)

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
            self._synced_at = _monotonic()
            self._unsynced = False
            self._slow_logged = False
        elif not self._slow_logged and _monotonic() - self._synced_at >= SLOW_SYNC_S:
            self._slow_logged = True
            log.warning("journal %s: an fsync begun %.0f s ago is still under way (a slow or failing disk?); until "
                        "it ends, a crash of the machine can take everything written since it began",
                        self.path, _monotonic() - self._synced_at)

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
            if len(buf) - pos < _HEADER_SIZE:
                if end - offset < _HEADER_SIZE:
                    reason = "truncated header"
                    break
                buf = buf[pos:] + os.pread(fd, _CHUNK, offset + len(buf) - pos)
                pos = 0
                if len(buf) < _HEADER_SIZE:
                    reason = "truncated header"
                    break
            n, crc = _unpack_header(buf, pos)
            stop = offset + _HEADER_SIZE + n
            if stop > end:
                reason = f"truncated record (length {n}, {end - offset - _HEADER_SIZE} bytes left)"
                break
            start = pos + _HEADER_SIZE
            if start + n > len(buf):
                have = len(buf) - pos
                buf = buf[pos:] + os.pread(fd, max(_CHUNK, _HEADER_SIZE + n - have), offset + have)
                pos = 0
                start = _HEADER_SIZE
                if start + n > len(buf):
                    reason = "truncated record"
                    break
            body = buf[start:start + n]
            if _crc32(body) != crc:
                reason = "checksum mismatch"
                break
            try:
                queue, record = _loads(body)
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
                _sync(fd)
        self._size = os.fstat(fd).st_size

    # -- compaction -----------------------------------------------------------------------------------------------
    def rewrite(self, batches: Iterable[list[tuple[str, tuple]]]) -> None:
        """Replace the file with exactly these records, given in batches (lists of (queue, record), each written as
        one batch record), at once: a rewrite (``start_rewrite``) whose steps all run now (``complete_rewrite``),
        then go on appending to it.  Only right after ``commit``: buffered records would be neither here nor
        there."""
        if not self._enabled:
            return
        if self._buf or self._pending:
            raise AssertionError("journal rewrite with uncommitted records: commit first")
        if self._fd is None:
            raise ValueError("journal is closed")
        if self._torn:   # what a failed commit could not cut off goes first, as the next commit would do
            os.ftruncate(self._fd, self._size)
            self._torn = False
        self.abort_rewrite()
        self.start_rewrite(batches)
        self.complete_rewrite()

    def complete_rewrite(self) -> None:
        """Write what is left of the rewrite under way, flush it and put it in place, now: what the shard does a
        step per turn of its loop (start-up, tools).  A failure raises; the journal stays as it was."""
        while not self.rewrite_step():
            if not self.rewriting:
                return
        flush = self.rewrite_flush()
        if flush is not None:
            try:
                flush()
            except BaseException:
                self.abort_rewrite()
                raise
        if not self.finish_rewrite():
            raise AssertionError("journal rewrite with uncommitted records: commit first")

    def _replace_with(self, fd: int, tmp: str, fill: Callable[[], object], sync: bool) -> None:
        """``fill`` completes ``tmp`` (open as ``fd``), which then becomes the journal, appended to from now on; with
        ``sync``, the file is fsynced before and its directory after the rename.  If anything fails, ``tmp`` is
        removed and the journal stays as it was."""
        assert self.path is not None and self._fd is not None
        try:
            fill()
            size = os.fstat(fd).st_size
            if sync:
                os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        self._size = size
        old, self._fd = self._fd, fd
        # The last close of the file replaced frees its page cache (~25 ms for 200 MB here): not in the event loop.
        threading.Thread(target=os.close, args=(old,), name="journal-close", daemon=True).start()
        if sync:
            self._unsynced = False
            self._synced_at = _monotonic()
            _sync_dir(self._directory())
        elif self.durable and self._syncer is not None:
            self._unsynced = self._dir_unsynced = True

    # -- compaction while serving --------------------------------------------------------------------------------
    @property
    def rewriting(self) -> bool:
        return self._rewriting is not None

    @property
    def rewrite_unwritten(self) -> bool:
        """The rewrite under way has batches left for ``rewrite_step`` to write."""
        rw = self._rewriting
        return rw is not None and not rw.written

    @property
    def rewrite_written(self) -> bool:
        """The rewrite under way has written all its batches and flushed them (``rewrite_flush``):
        ``finish_rewrite`` puts it in place."""
        rw = self._rewriting
        return rw is not None and rw.written and rw.flushed

    def start_rewrite(self, batches: Iterable[list[tuple[str, tuple]]]) -> None:
        """Start rewriting the file as ``batches`` (as ``rewrite`` takes them: the live state, taken by the caller
        at this commit, for it is read while the journal goes on changing), written by ``rewrite_step`` one batch
        at a time and put in place by ``finish_rewrite``.  Only right after ``commit``, and one at a time."""
        if not self._enabled or self._fd is None or self._rewriting is not None:
            return
        if self._buf or self._pending or self._torn:
            raise AssertionError("journal rewrite with uncommitted records: commit first")
        tmp = f"{self.path}.rewrite-{os.getpid()}"
        fd = os.open(tmp, _OPEN_FLAGS | os.O_TRUNC, 0o600)
        self._rewriting = _Rewrite(fd, tmp, self._size, iter(batches))

    def rewrite_step(self) -> bool:
        """Write the next batch of the rewrite under way.  -> True once every batch is written.  A failure (a full
        disk, a record that cannot be encoded) ends the rewrite, removes its file and raises; the journal stays
        as it was."""
        rw = self._rewriting
        if rw is None or rw.written:
            return rw is not None
        try:
            batch = next(rw.batches, None)
            if batch is None:
                rw.written = True
                return True
            if batch:
                _write_all(rw.fd, self._encode(batch, strict=True))
        except BaseException:
            self.abort_rewrite()
            raise
        return False

    def rewrite_flush(self) -> Callable[[], None] | None:
        """What the rewrite needs once written, before it is put in place, for the caller to run in another thread
        while it serves (on descriptors of its own, so that the rewrite may end meanwhile): the records the journal
        gained since the start, up to now, appended to the rewrite's file (leaving ``finish_rewrite`` only those of
        the flush's own time to copy), then a durable journal's file fsynced, another's writeback started, which
        renaming it over the journal would otherwise do in the event loop (ext4 allocates a file's delayed blocks
        when it is renamed over another: ~50 ms for 200 MB here).  None when the rewrite is not written, or was
        flushed.  A failure here (no descriptor to be had) ends the rewrite, as in ``rewrite_step``."""
        rw = self._rewriting
        if rw is None or not rw.written or rw.flushed:
            return None
        assert self._fd is not None
        fds: list[int] = []
        try:
            fds += os.dup(self._fd), os.dup(rw.fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            self.abort_rewrite()
            raise
        journal, fd = fds
        start, end, durable = rw.copied, self._size, self.durable

        def flush() -> None:
            try:
                _copy(journal, start, end, fd)
                if durable:
                    os.fsync(fd)
                elif _writeback is not None:
                    _writeback(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                rw.copied = end
                rw.flushed = True
            finally:
                os.close(journal)
                os.close(fd)

        return flush

    def finish_rewrite(self) -> bool:
        """Once every batch is written (and flushed) and the journal committed: append what the journal gained since
        the flush to the rewrite's file and make it the journal.  -> True if it did; False if not yet (batches
        left, not flushed, records buffered).  A failure raises OSError; the journal stays as it was.

        Only ``always`` fsyncs here, in the event loop (its every commit does, and the rename must be durable
        before the next reply).  ``everysec`` leaves what was copied here and the rename to its next sync, begun
        at the next commit or tick: what the flush synced (all but the records of its own time) is on the disk
        before the rename can be, so a crash meanwhile takes no more than a sync under way can."""
        rw = self._rewriting
        if not self.rewrite_written or self._buf or self._pending or self._torn:
            return False
        assert rw is not None and self._fd is not None
        self._rewriting = None
        journal, start, end = self._fd, rw.copied, self._size
        self._replace_with(rw.fd, rw.tmp, lambda: _copy(journal, start, end, rw.fd),
                           sync=self.durable and self.fsync == "always")
        return True

    def abort_rewrite(self) -> None:
        """Stop the rewrite under way, if one is, and remove its file."""
        rw, self._rewriting = self._rewriting, None
        if rw is not None:
            os.close(rw.fd)
            _unlink(rw.tmp)

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
                _sync(fd)
            if self._dir_unsynced:
                _sync_dir(self._directory())
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


class _Syncer:
    """``everysec``'s fsync, in a thread of its own.  An ``fdatasync`` of a busy journal takes tens of milliseconds
    (~30 ms on this machine's ext4 with a producer pushing as fast as it can), and the event loop that waited for
    it stood still that long once a second, every reply of every connection of the worker with it.  One sync at a
    time, of a duplicate of the descriptor (the journal may replace its file meanwhile); a failure is kept for the
    owner to raise at its next commit or tick, as it would have raised the sync's own."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[tuple[int, int, str | None] | None] = SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self.error: OSError | None = None
        self.failed_directory = False    # the sync that failed had a directory to sync after the file

    def start(self, fd: int, ahead: int = 0, directory: str | None = None) -> bool:
        """Sync the file open as ``fd``, first keeping ``ahead`` bytes allocated past its end (``_reserve_ahead``),
        then ``directory`` if given; False if the last sync is still under way (the next one covers this)."""
        if not self._idle.is_set():
            return False
        job = (os.dup(fd), ahead, directory)
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="journal-fsync", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return True

    def wait(self) -> None:
        """Until the sync under way, if one is, is done."""
        self._idle.wait()

    def stop(self) -> None:
        """Wait for the sync under way, then end the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fd, ahead, directory = job
            try:
                if ahead:
                    _reserve_ahead(fd, ahead)
                _sync(fd)
                if directory is not None:
                    _sync_dir(directory)
            except OSError as exc:
                self.error = exc
                self.failed_directory = directory is not None
            finally:
                os.close(fd)
                self._idle.set()


class _Rewrite:
    """A rewrite under way: its file, how much of the journal it holds (the journal's size when it started, then
    up to where the flush copied), the batches it has yet to write."""

    __slots__ = ("fd", "tmp", "copied", "batches", "written", "flushed")

    def __init__(self, fd: int, tmp: str, start: int, batches: Iterator[list[tuple[str, tuple]]]) -> None:
        self.fd = fd
        self.tmp = tmp
        self.copied = start      # the journal's bytes up to here are in the rewrite's file (as state, then as is)
        self.batches = batches
        self.written = False
        self.flushed = False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _sync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (where directories can be opened and fsynced)."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError as exc:
        log.warning("journal: fsync of directory %s failed: %s", directory, exc)
    finally:
        os.close(dfd)
