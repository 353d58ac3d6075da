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


def default_parent() -> str:
    import tempfile  # here and in create: workers import this module for remove() alone

    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return xdg if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK) else tempfile.gettempdir()


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
