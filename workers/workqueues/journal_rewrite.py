"""The work-queue journal's compaction: the file rewritten as the live state, at once (start-up) or a batch at a
time while the broker serves.

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

A mixin of ``workers.workqueues.journal.Journal``: a rewrite replaces that one object's file (its descriptor, its
size, what is synced of it), so it works on the journal's own state (``Journal.__init__``); kept in a room of its
own so that the journal's room holds appending, committing and replaying.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator

from shardbroker.workers.workqueues import journal_disk


class Rewriting:
    """``Journal``'s compaction (its state is the Journal's)."""

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
            journal_disk.unlink(tmp)
            raise
        self._size = size
        old, self._fd = self._fd, fd
        # The last close of the file replaced frees its page cache (~25 ms for 200 MB here): not in the event loop.
        threading.Thread(target=os.close, args=(old,), name="journal-close", daemon=True).start()
        if sync:
            self._unsynced = False
            self._synced_at = journal_disk.monotonic()
            journal_disk.sync_dir(self._directory())
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
        fd = os.open(tmp, journal_disk.OPEN_FLAGS | os.O_TRUNC, 0o600)
        self._rewriting = Rewrite(fd, tmp, self._size, iter(batches))

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
                journal_disk.write_all(rw.fd, self._encode(batch, strict=True))
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
                journal_disk.copy(journal, start, end, fd)
                if durable:
                    os.fsync(fd)
                elif journal_disk.writeback is not None:
                    journal_disk.writeback(fd, 0, 0, os.POSIX_FADV_DONTNEED)
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
        self._replace_with(rw.fd, rw.tmp, lambda: journal_disk.copy(journal, start, end, rw.fd),
                           sync=self.durable and self.fsync == "always")
        return True

    def abort_rewrite(self) -> None:
        """Stop the rewrite under way, if one is, and remove its file."""
        rw, self._rewriting = self._rewriting, None
        if rw is not None:
            os.close(rw.fd)
            journal_disk.unlink(rw.tmp)


class Rewrite:
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
