"""One broker to a ``queues.data_dir``.

Each worker replays and appends to ``queues-<index>.journal`` there.  Two brokers started on one directory (the same
configuration file started twice) would each append to the same journals, and at the next start one broker's
acknowledged pushes are gone.  The supervisor holds an exclusive ``flock`` on ``<data_dir>/broker.lock`` for its
whole life (the kernel lets go of it when the process ends, however it ends), and a second broker refuses to start,
naming the holder.  Workers neither open nor inherit the lock's descriptor (close-on-exec).
"""

from __future__ import annotations

import fcntl
import os

LOCK_NAME = "broker.lock"


class DataDirInUse(Exception):
    """Another live broker holds the directory."""


def lock(directory: str) -> int:
    """Hold ``directory`` for this process; -> the descriptor that holds it (closing it lets go)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "a process that wrote nothing yet"
        os.close(fd)
        raise DataDirInUse(f"queues.data_dir {directory} is in use by another broker ({holder}); two brokers on "
                           f"one directory would lose each other's acknowledged pushes: give each its own "
                           f"data_dir") from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    return fd
