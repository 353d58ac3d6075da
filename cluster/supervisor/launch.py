"""Starting worker processes as fresh interpreters, and what the supervisor holds of each worker, however started.

A worker is forked by the fork server where there is one (``cluster.supervisor.forkserver``, ``ForkedWorker``): a
process that imported the workers' modules once.  Where there is none (not Linux, ``workers.fork_server`` off, or
the fork server failed), and to start the fork server itself, a fresh interpreter is started: no worker is a fork
of a process that ran an event loop or read plaintext passwords.  It gets the supervisor's interpreter flags plus
``-S``: the supervisor's ``sys.path`` is handed over whole, so the ``site`` module (and an editable install's path
hooks, ~15 ms per process) has nothing left to do.  Unlike multiprocessing's ``spawn`` method this starts no
resource-tracker process, never re-runs the supervisor's ``__main__`` (the ``brokerctl`` script would import the
whole CLI into every worker), and needs none of the workers' modules in the supervisor.

A fresh worker's start-up is mostly its own imports (~0.1 s: asyncio, uvloop, zmq, the hub), and it reads its
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

from shardbroker.workers.entry import MARKER

# A fresh worker's command line is `<python> <flags> -S -c BOOT broker-worker <index> <boot fd> <control fd>`, the
# fork server's the same with its own module and `broker-forkserver <request fd>`.  With -S no site hook runs, so
# the package is found where the supervisor found it: the folder that holds its __init__.py, which an editable
# install (the repository's root) names nothing like "shardbroker".
PATH_ENV = "BROKER_WORKER_SYS_PATH"
PACKAGE_ENV = "BROKER_WORKER_PACKAGE"


def _boot(module: str) -> str:
    return (f"import os, sys, importlib.util as u; sys.path[:0] = os.environ.pop({PATH_ENV!r}).split(os.pathsep); "
            f"r = os.environ.pop({PACKAGE_ENV!r}); s = u.spec_from_file_location('shardbroker', "
            "os.path.join(r, '__init__.py'), submodule_search_locations=[r]); "
            "m = sys.modules['shardbroker'] = u.module_from_spec(s); s.loader.exec_module(m); "
            f"from {module} import main; main()")


BOOT = _boot("shardbroker.workers.entry")


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


def interpreter(module: str, args: list[str], pass_fds: list[int], drop: tuple[str, ...] = ()) -> subprocess.Popen:
    """A fresh interpreter running ``module``'s ``main`` with ``sys.argv[1:]`` = ``args``, holding ``pass_fds``,
    with this process's environment but the variables in ``drop``."""
    cmd = [sys.executable, *subprocess._args_from_interpreter_flags(), "-S", "-c", _boot(module), *args]
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env[PATH_ENV] = os.pathsep.join(_worker_sys_path())
    env[PACKAGE_ENV] = _package_folder()
    # A process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches the supervisor
    # alone, which stops the workers in order; a worker still importing its modules would otherwise die of it
    # with a KeyboardInterrupt traceback, and the start end as a failed boot.
    return subprocess.Popen(cmd, pass_fds=pass_fds, stdin=subprocess.DEVNULL, env=env, process_group=0)


class WorkerProcess:
    """One worker process, with what the supervisor needs of it: ``pid``, ``sentinel`` (readable once it has
    exited), ``join``, ``exitcode`` (negative: killed by that signal), as multiprocessing's Process has them,
    ``ctl_sock``, the supervisor's end of its control socketpair (cluster.control), and ``worker_sock``, a copy of
    the worker's end: never read while the worker lives, it keeps what the worker did not read readable after it
    died (``unread``), where it would otherwise be dropped with the worker's descriptors.

    This one is a fresh interpreter; ``cluster.supervisor.forkserver.ForkedWorker`` is the same for a fork of the
    fork server, started by ``_start`` the other way.  ``started_by`` says which (``/varz``)."""

    started_by = "exec"

    def __init__(self, index: int) -> None:
        self.index = index
        self._payload = memoryview(b"")
        self._remove_writer: Callable[[int], None] | None = None
        # = control.socketpair(), which would import asyncio here
        self.ctl_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot_r, self._boot_w = os.pipe()
        self.sentinel = -1
        try:
            try:
                self.pid = self._start(boot_r, child_sock)
            finally:
                # before the sentinel is opened, which takes its number: the supervisor's descriptors stay dense
                # (with its open-files limit lowered to their count, an accept fails: scripts/stress/faults.py fds)
                os.close(boot_r)
            if self.sentinel < 0:
                self.sentinel = self._open_sentinel()
        except BaseException:
            os.close(self._boot_w)
            self.ctl_sock.close()
            child_sock.close()
            raise
        self.worker_sock = child_sock

    def _start(self, boot_r: int, child_sock: socket.socket) -> int:
        """Start the worker with these descriptors -> its pid."""
        watch_r, watch_w = (-1, -1) if _PIDFD else os.pipe()  # without pidfds: EOF once the worker is gone
        try:
            self._popen = interpreter("shardbroker.workers.entry",
                                      [MARKER, str(self.index), str(boot_r), str(child_sock.fileno())],
                                      [fd for fd in (boot_r, child_sock.fileno(), watch_w) if fd >= 0])
        except BaseException:
            if watch_r >= 0:
                os.close(watch_r)
            raise
        finally:
            if watch_w >= 0:
                os.close(watch_w)
        self.sentinel = watch_r
        return self._popen.pid

    def _open_sentinel(self) -> int:
        return os.pidfd_open(self.pid)

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
        if not self._wait(timeout):
            return
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1
        self._close_boot()

    def _wait(self, timeout: float | None) -> bool:
        """Wait for the exit (reaping it); False if it has not come in ``timeout`` seconds."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

