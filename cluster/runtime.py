"""The private runtime directory of one broker instance.

It holds the ZeroMQ ``ipc://`` endpoints of the fabric.  ``mkdtemp`` gives a fresh name and mode 0700, so two brokers
on one host never share (or steal, as ipc endpoints silently do) an endpoint, and other users cannot connect.
The supervisor removes it on exit; if the supervisor is SIGKILLed its workers remove it; and a directory left by a
broker that was killed whole (say by the OOM killer) is swept by the next start, recognised by its dead owner pid.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil

log = logging.getLogger("broker.runtime")

PREFIX = "shardbroker-"
_OWNER = "owner.pid"


SHM = "/dev/shm"
SHM_MIN_SIZE = 1 << 30   # a container's /dev/shm is often 64 MiB: the first journals would fill it


def default_parent() -> str:
    """``$XDG_RUNTIME_DIR`` (a writable directory), else ``/dev/shm`` (Linux's tmpfs for everyone, if writable and
    of ``SHM_MIN_SIZE`` or more), else the temp directory.  A tmpfs if there is one, as the systemd unit's
    ``/run/shardbroker`` is: the work queues' journals live here by default, need only outlive a worker, and cost
    ~5 % more of the owner's CPU per message on a disk's filesystem (docs/performance-notes.md).  The size, not the room
    left, decides: ``brokerctl reload`` must find the directory however full the journals have made it."""
    import tempfile  # here and in create: workers import this module for remove() alone

    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return xdg
    try:
        st = os.statvfs(SHM)
        if st.f_blocks * st.f_frsize >= SHM_MIN_SIZE and os.access(SHM, os.W_OK | os.X_OK):
            return SHM
    except OSError:
        pass
    return tempfile.gettempdir()


def create(parent: str | None) -> str:
    import tempfile

    parent = parent or default_parent()
    sweep(parent)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    os.chmod(path, 0o700)
    with open(os.path.join(path, _OWNER), "w") as fh:
        fh.write(str(os.getpid()))
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def sweep(parent: str) -> None:
    """Remove runtime directories whose owner process is gone."""
    for path in glob.glob(os.path.join(parent, PREFIX + "*")):
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER)) as fh:
                pid = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid and not _pid_exists(pid):
            log.info("removing stale runtime directory %s (owner pid %d is gone)", path, pid)
            remove(path)


def _pid_exists(pid: int) -> bool:
    import psutil  # here, not at the top: workers import this module too, and only the supervisor sweeps

    return psutil.pid_exists(pid)
