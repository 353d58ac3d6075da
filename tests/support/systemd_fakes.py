"""Stand-ins for systemd in tests: a notify socket that records what the broker says, with the time it said it."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path


class NotifyReceiver:
    """An AF_UNIX datagram socket at a path, as systemd's $NOTIFY_SOCKET: ``messages`` holds (monotonic time,
    {key: value}) for every datagram received, in order."""

    def __init__(self, directory: Path, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"shardbroker-test-{os.getpid()}-{id(self)}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.address = str(directory / f"notify-{id(self)}.sock")
            self.sock.bind(self.address)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            with self._lock:
                self.messages.append((time.monotonic(), fields))

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.address}

    def snapshot(self) -> list[tuple[float, dict[str, str]]]:
        with self._lock:
            return list(self.messages)

    def with_key(self, key: str, after: float = 0.0) -> list[tuple[float, dict[str, str]]]:
        return [(t, m) for t, m in self.snapshot() if key in m and t >= after]

    def wait_for(self, key: str, value: str | None = None, timeout: float = 10.0, after: float = 0.0,
                 ) -> tuple[float, dict[str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, m in self.with_key(key, after):
                if value is None or m[key] == value:
                    return t, m
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} within {timeout}s; got {self.snapshot()}")

    def close(self) -> None:
        self._closed = True
        self._thread.join(1)
        self.sock.close()


# Puts the listed fds at 3, 4, ... and sets LISTEN_PID to its own pid, then execs the broker in its place: what
# systemd does before it starts a socket-activated service.
_PASS = """
import fcntl, os, sys
copies = [fcntl.fcntl(int(fd), fcntl.F_DUPFD_CLOEXEC, 100) for fd in sys.argv[1].split(",")]
for i, fd in enumerate(copies):
    os.dup2(fd, 3 + i)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execvp(sys.argv[2], sys.argv[2:])
"""


def passing(socks: list[socket.socket], names: str | None = None) -> dict:
    """``Broker(...)`` arguments that hand it ``socks`` as systemd would (``names``: $LISTEN_FDNAMES)."""
    import sys

    env = {"LISTEN_FDS": str(len(socks))}
    if names is not None:
        env["LISTEN_FDNAMES"] = names
    return {"prefix": [sys.executable, "-c", _PASS, ",".join(str(s.fileno()) for s in socks)], "env": env,
            "pass_fds": tuple(s.fileno() for s in socks)}
