"""The fork server: one process that imports the workers' modules once, then forks a worker for each request.

The supervisor's process starts it (``brokerctl start``, first thing: ``cluster.supervisor.forkserver``) as it would
start a worker, a fresh interpreter (``cluster.supervisor.launch``), whose command line is ``<python> <flags> -S -c
<boot> broker-forkserver <request fd>``, and asks it for workers over the request socket.  It imports what a worker
imports (``PRELOAD``; ~0.1 s of asyncio, uvloop, zmq, the hub, every protocol's session) and nothing else: it runs
no event loop, makes no ZeroMQ context, starts no thread and never sees the configuration, so a worker forked from
it inherits nothing a fresh interpreter would not have, while its start-up is a fork and its own boot.

A request is one datagram, ``REQUEST`` (an id, the worker's index) with two descriptors (``SCM_RIGHTS``): the
read end of the worker's boot pipe and its end of the control socketpair.  The fork server forks twice: the first
child forks the worker and exits at once, so the worker, orphaned, is handed to the supervisor (a child subreaper:
``prctl(PR_SET_CHILD_SUBREAPER)``) and is its child like any other, whose exit it waits for and whose exit status
it reads.  The reply, ``REPLY`` (the request's id, the worker's pid; 0 and the error's text after a failure), is
sent once the first child has been reaped, i.e. once the worker is the supervisor's.  Its first datagram, before
any reply, is ``REPLY`` with id 0 and its own pid: it is ready.

The worker closes every descriptor of the fork server's but the two it was sent (and stdin, stdout, stderr), puts
back the signal dispositions a fresh interpreter has, takes a process group of its own, and rewrites its command
line to ``<python> broker-worker <index> forked`` (``ps``; the tests find workers by ``broker-worker``), then runs
``workers.entry.run`` as a fresh worker does.  ``random`` reseeds itself after a fork; the string hash seed is the
fork server's, shared by the forked workers, as in any pre-forking server.

The fork server exits when its request socket reads EOF: the supervisor closed it (stopping), or died.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import importlib
import os
import resource
import signal
import socket
import struct
import sys
import traceback
from typing import NoReturn

from shardbroker.workers import entry

MARKER = "broker-forkserver"
FORKED = "forked"   # the last word of a forked worker's command line
REQUEST = struct.Struct("=II")    # request id (from 1), worker index; with SCM_RIGHTS: boot pipe, control socket
REPLY = struct.Struct("=Ii")      # request id (0: ready), pid (0: failed, the error's text follows)
MAX_REPLY = REPLY.size + 512

# What a worker imports, imported here once, as is every protocol's session (~8 ms; a fresh worker imports those of
# the listeners that are on).  Not the leaf link (~12 ms, which a worker imports where remotes are configured):
# this is all on the way of every start, which waits for the fork server.
PRELOAD = ("shardbroker.workers.process", "uvloop")
# Signals meant for the supervisor that may reach every process of the unit (`systemctl kill -s HUP`, or a
# terminal's Ctrl-C sent to the group): the fork server outlives them, as the workers do.
_IGNORED = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
_PID = struct.Struct("=i")


def main() -> None:
    """The fork server's interpreter (``sys.argv``: ``-c broker-forkserver <request fd>``)."""
    sock = socket.socket(fileno=int(sys.argv[2]))
    sock.set_inheritable(False)
    defaults = {signum: signal.signal(signum, signal.SIG_IGN) for signum in _IGNORED}
    faulthandler.enable()
    _die_with_parent()
    _raise_open_files_limit()
    _preload()
    # Out of the collector's way in every worker for good (a worker's boot collects once, then freezes): neither
    # walked at each full collection nor written to by it, which would copy the shared pages into each worker.
    gc.collect()
    gc.freeze()
    if _threads() != 1:  # forking a process with threads copies their locks, held or not
        print(f"fork server: {_threads()} threads after the imports; not forking", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        sock.send(REPLY.pack(0, os.getpid()))
        serve(sock, defaults)
    except OSError:   # the supervisor is gone
        pass


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:   # uvloop is optional; a worker that needs what failed fails the same way itself
            pass
    from shardbroker.cluster.config import protocols

    for protocol in protocols.PROTOCOLS:
        try:
            protocols.session_class(protocol)
        except ImportError:
            pass


def serve(sock: socket.socket, defaults: dict) -> None:
    """Fork a worker for each request, until EOF."""
    while True:
        data, fds, flags, _ = socket.recv_fds(sock, REQUEST.size, 2)
        if not data:   # EOF: the supervisor closed its end, or died
            return
        try:
            req, index = REQUEST.unpack(data) if len(data) == REQUEST.size else (0, 0)
            try:
                if not req or len(fds) != 2 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                    raise OSError("malformed request")
                pid = _fork(sock, index, fds[0], fds[1], defaults)
            except OSError as exc:   # EAGAIN, ENOMEM: the supervisor starts this one as a fresh interpreter
                sock.send(REPLY.pack(req, 0) + str(exc).encode()[:MAX_REPLY - REPLY.size])
            else:
                sock.send(REPLY.pack(req, pid))
        finally:
            for fd in fds:
                os.close(fd)


def _fork(sock: socket.socket, index: int, boot_fd: int, ctl_fd: int, defaults: dict) -> int:
    """Fork the worker (by way of a child that exits at once) -> its pid, once it is the supervisor's child."""
    sys.stdout.flush()   # or what is buffered would be written by each child too
    sys.stderr.flush()
    r, w = os.pipe()
    try:
        middle = os.fork()
        if middle == 0:
            code = 1
            try:
                os.close(r)
                pid = os.fork()
                if pid == 0:
                    os.close(w)
                    _worker(sock, index, boot_fd, ctl_fd, defaults)
                os.write(w, _PID.pack(pid))
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        w = -1
        data = os.read(r, _PID.size)   # written whole (a pipe write this small is atomic), or EOF on a failure
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    _, status = os.waitpid(middle, 0)   # the worker is orphaned now, so the supervisor's child
    if status != 0 or len(data) != _PID.size:
        raise OSError(f"the intermediate process failed (wait status {status})")
    return _PID.unpack(data)[0]


def _worker(sock: socket.socket, index: int, boot_fd: int, ctl_fd: int, defaults: dict) -> NoReturn:
    """The forked worker: shed the fork server, then boot as a fresh worker does.  Never returns."""
    code = 1
    try:
        _retitle([sys.executable, entry.MARKER, str(index), FORKED])   # first: named as the fork server no longer
        sys.argv = ["-c", entry.MARKER, str(index), str(boot_fd), str(ctl_fd)]
        sock.close()
        _close_fds_but(0, 1, 2, boot_fd, ctl_fd)
        for signum, handler in defaults.items():
            signal.signal(signum, handler)
        os.setpgid(0, 0)   # as a fresh worker (cluster.supervisor.launch): signals to a group reach it alone
        entry.run(boot_fd, ctl_fd)   # exits the process
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _close_fds_but(*keep: int) -> None:
    """Close every descriptor but ``keep``: no worker holds another's sockets, or the fork server's."""
    low = 0
    for fd in sorted(set(keep)):
        if low < fd:   # closerange(0, 0) would close every descriptor: 3.11 asks close_range for 0 to (unsigned) -1
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max(low + 1, os.sysconf("SC_OPEN_MAX")))


def _retitle(args: list[str]) -> None:
    """Write ``args`` over this process's command line (``/proc/<pid>/cmdline``, what ``ps`` shows), within the
    room the fork server's own took: the kernel shows the memory between ``arg_start`` and ``arg_end``, which
    nothing reads once the interpreter has started.  Not ``setproctitle``: it writes one title string, which
    ``psutil`` reads back as one argument padded with empty ones, and ``brokerctl top`` and the scripts find workers
    by their arguments (``broker-worker <index>``)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])   # proc(5): fields 48 and 49, counted from the state (3)
    except (OSError, ValueError, IndexError):
        return
    data = b"\0".join(arg.encode(errors="replace") for arg in args) + b"\0"
    if not start or len(data) > end - start:
        return
    ctypes.memmove(start, data + bytes(end - start - len(data)), end - start)


def _raise_open_files_limit() -> None:
    """The hard limit, as the supervisor takes it for its workers (it may not have yet: ``prestart``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _die_with_parent() -> None:
    """SIGKILL when the supervisor dies, even while importing (a fork's children do not inherit it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
