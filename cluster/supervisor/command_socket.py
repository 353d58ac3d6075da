"""The supervisor's command socket: how ``brokerctl reload`` and ``brokerctl lameduck`` reach a running broker.

A unix stream socket, ``control.sock`` in the broker's private runtime directory (mode 0700, so only its user,
and root, can connect: no password to configure, none on a command line).  One JSON request line, one JSON answer
line.  A reload is answered once it is over, with its outcome: that is what makes ``ExecReload=brokerctl reload``
synchronous, as systemd wants it, and lets the command print which keys need a restart.  A signal (SIGHUP, SIGUSR2)
does the same work but can return nothing, and a pid read from a file may by then name another process.

``find`` is the client's half: the runtime directories under a parent ($XDG_RUNTIME_DIR, the temp directory, or
``runtime.dir``; the unit sets ``XDG_RUNTIME_DIR=/run/shardbroker``) whose owner is alive, optionally the one owned
by a given pid (``$MAINPID`` in the unit).
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable

from shardbroker.cluster import runtime

log = logging.getLogger("broker.command")

NAME = "control.sock"
_MAX_REQUEST = 4096

Handler = Callable[[dict], Awaitable[dict]]


class CommandServer:
    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.base_events.Server | None = None
        self.path = ""

    async def start(self, runtime_dir: str) -> None:
        self.path = os.path.join(runtime_dir, NAME)
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=_MAX_REQUEST)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            try:
                os.unlink(self.path)
            except OSError:
                pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10.0)
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError
            except ValueError:
                answer = {"ok": False, "error": "a request is one JSON object on one line"}
            else:
                answer = await self._handler(request)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        except Exception:
            log.exception("command failed")
        finally:
            writer.close()


# -- the client's half (brokerctl) ------------------------------------------------------------------------------

class NotFound(Exception):
    """No broker to talk to, or several and no way to choose (one line)."""


def find(parent: str, pid: int | None = None) -> tuple[int, str]:
    """(owner pid, socket path) of the running broker under ``parent`` (the one owned by ``pid``, if given)."""
    found = []
    for path in sorted(glob.glob(os.path.join(parent, runtime.PREFIX + "*"))):
        sock = os.path.join(path, NAME)
        try:
            with open(os.path.join(path, "owner.pid")) as fh:
                owner = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if owner and os.path.exists(sock) and _alive(owner) and (pid is None or owner == pid):
            found.append((owner, sock))
    if not found:
        whose = f"with pid {pid} " if pid is not None else ""
        raise NotFound(f"no running broker {whose}found in {parent} (give --runtime-dir: the parent of its "
                       f"runtime directory, as its log's 'runtime directory' line says)")
    if len(found) > 1:
        pids = ", ".join(str(p) for p, _ in found)
        raise NotFound(f"several brokers run in {parent} (pids {pids}): name one with --pid")
    return found[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def request(path: str, message: dict, timeout: float) -> dict:
    """Send one request and wait for its answer (blocking: this is the command line's side)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data:
        raise ConnectionError("the broker closed the command socket without an answer")
    return json.loads(data)
