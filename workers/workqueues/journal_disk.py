"""The work-queue journal's calls on the disk: a whole write, a copy between two files, an fsync (``everysec``'s in
a thread of its own: ``Syncer``), room allocated past a file's end, a directory's fsync after a rename.

They are module-level names that the tests replace (partial writes, failing disks, a fake clock), and every room
of the journal (``journal``, ``journal_rewrite``) calls them through this module: one replacement reaches them all,
the syncer's thread included.

Room ahead of the end (``everysec``).  On ext4 an append to blocks not yet allocated waits for the file's block map,
which an fsync under way holds while it allocates the blocks it writes back: a commit stood still 4-11 ms once a
second with a producer pushing (``scripts/measure/serving_latency.py --during fsync``).  So before each sync the
syncer's
thread allocates about two seconds of the journal's writes past its end (``fallocate`` keeping the size: the file's
length and content are unchanged, replay never sees the room), and the commits meanwhile write into blocks already
there; ``close`` gives back what is left of it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from queue import SimpleQueue

log = logging.getLogger("broker.journal")

CHUNK = 1 << 20                      # replay, and a rewrite catching up with the journal, read this much at a time
OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
# Indirections the tests replace (partial writes, failing disks, a fake clock).
write = os.write
sync = getattr(os, "fdatasync", os.fsync)
writeback = getattr(os, "posix_fadvise", None)
monotonic = time.monotonic


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


fallocate = _keep_size_fallocate()


def reserve_ahead(fd: int, ahead: int) -> None:
    """At least half of ``ahead`` bytes allocated past the end of the file open as ``fd``, or ``ahead`` made so."""
    global fallocate
    if fallocate is None:
        return
    st = os.fstat(fd)
    if st.st_blocks * 512 - st.st_size >= ahead // 2:
        return
    try:
        fallocate(fd, st.st_size, ahead)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            fallocate = None   # this filesystem cannot: appends allocate as they go, as they did
        # Otherwise (ENOSPC) nothing: a commit that cannot write says so itself, to its clients.


def write_all(fd: int, data: bytes) -> None:
    done = write(fd, data)
    if done < len(data):
        view = memoryview(data)
        while done < len(data):
            done += write(fd, view[done:])


def copy(source: int, start: int, end: int, fd: int) -> None:
    """Append bytes ``start`` to ``end`` of the file open as ``source`` to the one open as ``fd``."""
    offset = start
    while offset < end:
        data = os.pread(source, min(CHUNK, end - offset), offset)
        if not data:
            raise OSError(f"the journal ends at {offset}, short of {end}")
        write_all(fd, data)
        offset += len(data)


class Syncer:
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
        """Sync the file open as ``fd``, first keeping ``ahead`` bytes allocated past its end (``reserve_ahead``),
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
                    reserve_ahead(fd, ahead)
                sync(fd)
                if directory is not None:
                    sync_dir(directory)
            except OSError as exc:
                self.error = exc
                self.failed_directory = directory is not None
            finally:
                os.close(fd)
                self._idle.set()


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def sync_dir(directory: str) -> None:
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
