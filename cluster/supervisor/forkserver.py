"""How the supervisor starts its workers: forked by the fork server (``workers.forkserver``) where it can, fresh
interpreters (``cluster.supervisor.launch``) where it cannot.

A fresh worker spends ~0.1 s of CPU importing its modules, all of them at the same time at a start (on two cores,
four workers took 1.8 times as long as one to be ready), and a replacement the same again.  The fork server imports
them once, when the broker starts; a worker is then a fork and its own boot (docs/performance-notes.md).

``Launcher.spawn`` hands back a ``WorkerProcess`` either way, with the same face.  The supervisor makes itself a
child subreaper first, so that a worker the fork server forked (by way of a child that exits at once) is its child:
it waits for it and reads its exit status as for any other.  ``brokerctl start`` starts the fork server first
thing (``prestart``: its imports then run while the CLI's and the supervisor's do, on another core), and the
broker's start waits for it to be ready; a replacement never waits, and is a fresh interpreter while the fork
server is not there.  Where it cannot be used (not Linux, no pidfds, the prctl refused; ``workers.fork_server:
false``, which stops the one ``prestart`` started), every worker is a fresh interpreter.  A fork server that dies
is restarted for the later workers, unless it dies again and again; one that fails a request (or does not answer
in ``FORK_TIMEOUT``) is killed, and restarted.  Each time, the log says so once.  Its exit is never a worker's: it
is watched apart.  It goes with the broker: its request socket closed, it exits (it reads EOF, as when the
supervisor dies), and is reaped before the supervisor exits (or at exit, by ``atexit``, when the start failed
before it was used).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardbroker.cluster.supervisor import launch
from shardbroker.cluster.supervisor.systemd import LISTEN_VARS, NOTIFY_VARS
from shardbroker.workers.forkserver import MARKER, MAX_REPLY, REPLY, REQUEST

if TYPE_CHECKING:   # not imported here: ``prestart`` runs before anything heavy is imported
    import asyncio

    from shardbroker.cluster.config.sections import WorkersConfig

log = logging.getLogger("broker.supervisor")

FORK_TIMEOUT = 2.0            # seconds a ready fork server may take to fork a worker (it takes milliseconds)
STOP_WAIT = 1.0               # seconds the fork server gets to exit on EOF before SIGKILL
_RESTARTS, _WINDOW = 3, 60.0  # more deaths than this in the window: workers are fresh interpreters from then on


class ForkFailed(Exception):
    """The fork server did not fork the worker (one line: why)."""


class ForkServer:
    """One fork server process, and the supervisor's end of its request socket."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Without systemd's variables even when started before the supervisor took them (``prestart``): the
            # workers' environment is the fork server's
            self._popen = launch.interpreter("shardbroker.workers.forkserver", [MARKER, str(theirs.fileno())],
                                             [theirs.fileno()], drop=NOTIFY_VARS + LISTEN_VARS)
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid)
        self.ready = False   # its first datagram came: its imports are done
        self.watched: asyncio.AbstractEventLoop | None = None   # the loop that reads its sentinel
        self._next = 0

    def fork(self, index: int, boot_r: int, ctl_fd: int, timeout: float) -> int:
        """Ask for worker ``index`` with these descriptors -> its pid (a child of this process by then)."""
        self._next += 1
        deadline = time.monotonic() + timeout
        try:
            self.sock.settimeout(timeout)
            socket.send_fds(self.sock, [REQUEST.pack(self._next, index)], [boot_r, ctl_fd])
            while True:
                self.sock.settimeout(max(0.0, deadline - time.monotonic()))
                req, pid, error = self._reply(self.sock.recv(MAX_REPLY))
                if req == self._next:
                    if pid <= 0:
                        raise ForkFailed(error or "it could not fork")
                    return pid
        except TimeoutError:
            raise ForkFailed(f"no answer in {timeout:g}s") from None
        except OSError as exc:
            raise ForkFailed(exc.strerror or str(exc)) from None

    def check_ready(self) -> bool:
        """Whether it is ready, without waiting."""
        while not self.ready and select.select([self.sock], [], [], 0)[0]:
            try:
                self.sock.settimeout(0)
                self._reply(self.sock.recv(MAX_REPLY))
            except (OSError, ForkFailed):   # it exited: its sentinel says so
                break
        return self.ready

    def _reply(self, data: bytes) -> tuple[int, int, str]:
        if len(data) < REPLY.size:
            raise ForkFailed("it exited" if not data else "a malformed reply")
        req, pid = REPLY.unpack_from(data)
        if req == 0 and pid > 0:
            self.ready = True
        return req, pid, data[REPLY.size:].decode(errors="replace")

    def exitcode(self) -> int | None:
        return self._popen.poll()

    def stop(self, kill: bool = False) -> None:
        """Close its request socket (it exits on EOF), kill it if it has not in ``STOP_WAIT`` (or at once), and
        reap it."""
        self.sock.close()
        if kill:
            self._popen.kill()
        try:
            self._popen.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:   # stuck, or stopped
            self._popen.kill()
            self._popen.wait()
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class ForkedWorker(launch.WorkerProcess):
    """A worker forked by the fork server: a ``WorkerProcess`` whose exit is waited for with ``waitpid``."""

    started_by = "forkserver"

    def __init__(self, index: int, server: ForkServer, timeout: float) -> None:
        self._server, self._timeout = server, timeout
        self._status: int | None = None
        super().__init__(index)

    def _start(self, boot_r: int, child_sock: socket.socket) -> int:
        return self._server.fork(self.index, boot_r, child_sock.fileno(), self._timeout)

    def _open_sentinel(self) -> int:
        try:
            return os.pidfd_open(self.pid)   # it is our child: its pid is not reused before we reap it
        except OSError as exc:   # cannot be (but then no worker may be left unwatched)
            os.kill(self.pid, signal.SIGKILL)
            self._reap(0)
            raise ForkFailed(f"pidfd_open: {exc.strerror}") from None

    def _wait(self, timeout: float | None) -> bool:
        if self._status is None and (timeout is None or select.select([self.sentinel], [], [], timeout)[0]):
            self._reap(0)
        return self._status is not None

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:   # not ours after all: its exit status is lost
            self._status = -1
            return
        if pid:
            self._status = status

    @property
    def exitcode(self) -> int | None:
        if self._status is None:
            self._reap(os.WNOHANG)
        return None if self._status is None or self._status < 0 else os.waitstatus_to_exitcode(self._status)


class Launcher:
    """Starts the workers (``spawn``), by the fork server while there is one (docstring above)."""

    def __init__(self, config: WorkersConfig, stopping: Callable[[], bool]) -> None:
        self._config = config
        self._stopping = stopping   # the broker is stopping: a dead fork server stays dead
        self._server: ForkServer | None = None
        self._first = True          # the broker's first fork server: its start waits for it
        self._deaths: list[float] = []
        self._started = False
        self._closed = False
        self._mine: weakref.WeakValueDictionary[int, launch.WorkerProcess] = weakref.WeakValueDictionary()

    def spawn(self, index: int) -> launch.WorkerProcess:
        """Start worker ``index`` -> its process (it reads its arguments from ``send_args``)."""
        if not self._started:
            self._started = True
            self._begin()
        server = self._server
        if server is not None:
            self._watch(server)
            waits = self._first and not server.ready
            if waits or server.check_ready():
                try:
                    return self._keep(ForkedWorker(index, server, self._config.boot_timeout if waits else FORK_TIMEOUT))
                except ForkFailed as exc:
                    self._lost(server, f"failed to fork worker {index} ({exc})")
        return self._keep(launch.WorkerProcess(index))

    def _keep(self, proc: launch.WorkerProcess) -> launch.WorkerProcess:
        self._mine[proc.pid] = proc
        return proc

    def _begin(self) -> None:
        global _early
        early, _early = _early, None
        if not self._config.fork_server:
            if early is not None:
                early.stop(kill=True)   # not waiting for it to finish its imports
            log.info("workers.fork_server is off: every worker starts as a fresh interpreter")
            return
        if early is not None:
            self._server = early
            log.debug("fork server started (pid %d)", early.pid)
            return
        why = _unavailable()
        if why is not None:
            log.warning("no fork server (%s): every worker starts as a fresh interpreter", why)
            return
        self._start_server()

    def _start_server(self) -> None:
        try:
            self._server = ForkServer()
        except OSError as exc:
            log.warning("cannot start the fork server (%s): workers start as fresh interpreters", exc)
            return
        log.debug("fork server started (pid %d)", self._server.pid)

    def _watch(self, server: ForkServer) -> None:
        if server.watched is None:
            import asyncio  # the supervisor imported it long ago; prestart (this module) must not

            server.watched = asyncio.get_running_loop()
            server.watched.add_reader(server.sentinel, self._on_exit, server)

    def _on_exit(self, server: ForkServer) -> None:
        code = server.exitcode()
        self._drop(server)
        if not self._closed and not self._stopping():
            self._replace(f"fork server (pid {server.pid}) exited ({_how(code)})")

    def _lost(self, server: ForkServer, why: str) -> None:
        code = server.exitcode()   # dead already (its sentinel not read yet): that is the news
        self._drop(server, kill=True)
        self._replace(f"fork server (pid {server.pid}) {why if code is None else f'exited ({_how(code)})'}")

    def _drop(self, server: ForkServer, kill: bool = False) -> None:
        if server is self._server:
            self._server = None
        self._first = False
        if server.watched is not None and not server.watched.is_closed():
            server.watched.remove_reader(server.sentinel)
            # Killed in the middle of a fork, it leaves its first child, or the worker it forked, to us
            # (a subreaper): reaped once they have exited.
            server.watched.call_later(STOP_WAIT, self._reap_strays)
        server.watched = None
        server.stop(kill)

    def _reap_strays(self) -> None:
        """Reap the exited children that are none of the workers (whose exits are the supervisor's to read)."""
        while True:
            try:
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if found is None or found.si_pid in self._mine or self._server and found.si_pid == self._server.pid:
                return   # nothing, or a worker (or the fork server) whose exit is read elsewhere: the rest later
            os.waitpid(found.si_pid, 0)
            log.debug("reaped pid %d, left over by a fork server", found.si_pid)

    def _replace(self, what: str) -> None:
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < _WINDOW] + [now]
        if len(self._deaths) > _RESTARTS:
            log.error("%s, %d times in %gs: every worker starts as a fresh interpreter from now on", what,
                      len(self._deaths), _WINDOW)
            return
        log.warning("%s; restarting it (meanwhile workers start as fresh interpreters)", what)
        self._start_server()
        if self._server is not None:
            self._watch(self._server)

    def close(self) -> None:
        """Stop the fork server (the broker stops): nothing is left of it once this returns."""
        self._closed = True
        if self._server is not None:
            self._drop(self._server)


_early: ForkServer | None = None   # started by ``prestart``, not yet the Launcher's


def prestart() -> None:
    """Start the fork server now (``brokerctl start``, first thing): its imports (~0.1 s) run while the CLI's, the
    configuration's and the supervisor's do, instead of after them.  The supervisor's ``Launcher`` takes it (or
    stops it: ``workers.fork_server: false``); a start that fails before that stops it at exit."""
    global _early
    if _early is None and _unavailable() is None:
        try:
            _early = ForkServer()
        except OSError:   # the Launcher says why, when it tries again
            return
        atexit.register(_stop_early)


def _stop_early() -> None:
    global _early
    if _early is not None:
        _early.stop()
        _early = None


def _how(code: int | None) -> str:
    if code is None:
        return "unknown status"
    return f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"


def _unavailable() -> str | None:
    """Why the fork server cannot be used here (None: it can); makes this process a child subreaper."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if not launch._PIDFD:
        return "no pidfd_open: a kernel older than 5.3"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(36, 1, 0, 0, 0) != 0:   # PR_SET_CHILD_SUBREAPER, before the fork server is started
            return f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:
        return f"prctl: {exc}"
    return None
