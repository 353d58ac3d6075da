"""Starting worker processes: fresh interpreters that run ``workers.entry``, their arguments sent over a pipe.

Each worker is a new interpreter (no worker is a fork of a process that ran an event loop or read plaintext
passwords), started with the supervisor's interpreter flags plus ``-S``: the supervisor's ``sys.path`` is handed
over whole, so the ``site`` module (and an editable install's path hooks, ~15 ms per process) has nothing left to
do.  Unlike multiprocessing's ``spawn`` method this starts no resource-tracker process, never re-runs the
supervisor's ``__main__`` (the ``brokerctl`` script would import the whole CLI into every worker), and needs none
of the workers' modules in the supervisor.

A worker's start-up is mostly its own imports (~0.1 s: asyncio, uvloop, zmq, the hub), and it reads its
arguments only once they are done: the supervisor starts every worker at once, then prepares and sends their
arguments (``send_args``) while they import.  A worker whose boot pipe closes without arguments exits quietly
(the supervisor died first).

A worker holds: the boot pipe (read once), its end of the control socketpair, and nothing else.  Its exit is
watched through a pidfd (where there are none, a pipe whose write end only the worker holds), which the
supervisor's event loop reads.  docs/performance-notes.md has the measurements.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

# The worker's command line is `<python> <flags> -S -c BOOT broker-worker <index> <boot fd> <control fd>`.  With
# -S no site hook runs, so the package is found where the supervisor found it: the folder that holds its
# __init__.py, which an editable install (the repository's root) names nothing like "shardbroker".
PATH_ENV = "BROKER_WORKER_SYS_PATH"
PACKAGE_ENV = "BROKER_WORKER_PACKAGE"
BOOT = (f"import os, sys, importlib.util as u; sys.path[:0] = os.environ.pop({PATH_ENV!r}).split(os.pathsep); "
        f"r = os.environ.pop({PACKAGE_ENV!r}); s = u.spec_from_file_location('shardbroker', "
        "os.path.join(r, '__init__.py'), submodule_search_locations=[r]); "
        "m = sys.modules['shardbroker'] = u.module_from_spec(s); s.loader.exec_module(m); "
        "from shardbroker.workers.entry import main; main()")
MARKER = "broker-worker"


def _package_folder() -> str:
    import shardbroker

    return os.path.dirname(os.path.abspath(shardbroker.__file__))


def _worker_sys_path() -> list[str]:
    """The supervisor's sys.path (its site-packages included, which ``-S`` leaves out)."""
    out: list[str] = []
    for entry in sys.path:
        entry = os.path.abspath(entry) if entry else os.getcwd()
        if entry not in out:
            out.append(entry)
    return out


def _pidfd_works() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):  # not Linux, or a kernel older than 5.3
        return False


_PIDFD = _pidfd_works()


class WorkerProcess:
    """One worker process, with what the supervisor needs of it: ``pid``, ``sentinel`` (readable once it has
    exited), ``join``, ``exitcode`` (negative: killed by that signal), as multiprocessing's Process has them,
    ``ctl_sock``, the supervisor's end of its control socketpair (cluster.control), and ``worker_sock``, a copy of
    the worker's end: never read while the worker lives, it keeps what the worker did not read readable after it
    died (``unread``), where it would otherwise be dropped with the worker's descriptors."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._payload = memoryview(b"")
        self._remove_writer: Callable[[int], None] | None = None
        # = control.socketpair(), which would import asyncio here
        self.ctl_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot_r, self._boot_w = os.pipe()
        watch_r, watch_w = (-1, -1) if _PIDFD else os.pipe()  # without pidfds: EOF once the worker is gone
        cmd = [sys.executable, *subprocess._args_from_interpreter_flags(), "-S", "-c", BOOT,
               MARKER, str(index), str(boot_r), str(child_sock.fileno())]
        env = dict(os.environ)
        env[PATH_ENV] = os.pathsep.join(_worker_sys_path())
        env[PACKAGE_ENV] = _package_folder()
        try:
            # A process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches the
            # supervisor alone, which stops the workers in order; a worker still importing its modules would
            # otherwise die of it with a KeyboardInterrupt traceback, and the start end as a failed boot.
            self._popen = subprocess.Popen(
                cmd, pass_fds=[fd for fd in (boot_r, child_sock.fileno(), watch_w) if fd >= 0],
                stdin=subprocess.DEVNULL, env=env, process_group=0)
        except BaseException:
            for fd in (self._boot_w, watch_r):
                if fd >= 0:
                    os.close(fd)
            self.ctl_sock.close()
            child_sock.close()
            raise
        finally:
            for fd in (boot_r, watch_w):
                if fd >= 0:
                    os.close(fd)
        self.worker_sock = child_sock
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid) if _PIDFD else watch_r

    def send_args(self, args: tuple[Any, ...], add_writer: Callable[[int, Callable[[], None]], None],
                  remove_writer: Callable[[int], None]) -> None:
        """Hand the worker the arguments of ``workers.process.main`` (all but the control socket).  The worker
        reads them once its modules are imported; this never blocks the supervisor's event loop (whose
        ``add_writer``/``remove_writer`` these are) on a worker that reads them late."""
        self._payload = memoryview(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        self._remove_writer = remove_writer
        os.set_blocking(self._boot_w, False)
        if not self._write_more():
            add_writer(self._boot_w, self._write_more)

    def _write_more(self) -> bool:
        """Write what the pipe takes; True once all is written (or the worker is gone) and the pipe closed."""
        try:
            while self._payload:
                n = os.write(self._boot_w, self._payload)
                self._payload = self._payload[n:]
        except BlockingIOError:
            return False
        except OSError:  # the worker is gone already: its exit is reported through the sentinel
            pass
        self._close_boot()
        return True

    def _close_boot(self) -> None:
        if self._boot_w < 0:
            return
        if self._remove_writer is not None:
            self._remove_writer(self._boot_w)
        os.close(self._boot_w)
        self._boot_w = -1
        self._payload = memoryview(b"")

    def unread(self) -> list[tuple[bytes, list[int]]]:
        """Once the worker is dead: the datagrams sent to it that it never read, with their descriptors."""
        out = []
        self.worker_sock.setblocking(False)
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.worker_sock, 1 << 17, 8)
            except OSError:   # nothing left (EAGAIN), or already closed
                break
            if not data:
                break
            out.append((data, fds))
        self.worker_sock.close()
        return out

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1
        self._close_boot()

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

