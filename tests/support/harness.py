"""Start the real broker as a subprocess on free ports, and talk to it over real sockets.

``Broker`` runs ``python -m shardbroker.cli start`` in its own session (so every process it starts can be found and
reaped),
waits for the ready line, and reads the ports and worker pids from it.  ``Raw`` is a line-oriented raw socket for
byte-exact protocol tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

from shardbroker.cli.wire import nats, ndjson

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"ready: (.*) workers=(\d+) pids=([\d,]+)")
T = TypeVar("T")   # a connection of any kind (landed)


class LogFile:
    """A server's log file (``log_path``), read and waited on: the broker's and a nats-server's (natshub)."""

    log_path: Path
    name = "broker"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, pattern: str, timeout: float = 10.0, after: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            m = rx.search(self.log(), after)
            if m:
                return m
            time.sleep(0.05)
        raise AssertionError(f"{self.name}'s log never matched {pattern!r}:\n{self.log()[-8000:]}")


class Broker(LogFile):
    def __init__(self, tmp: Path, workers: int = 2, config: dict | None = None, args: list[str] = (),
                 grace: float = 5.0, env: dict | None = None, pass_fds: tuple[int, ...] = (),
                 prefix: list[str] = ()) -> None:
        """``env``: extra environment variables; ``pass_fds``: fds the broker inherits; ``prefix``: a command
        the broker's command line is appended to (systemd-socket-activate, a shell that sets LISTEN_PID)."""
        self.tmp = tmp
        self.env = dict(env or {})
        self.pass_fds = tuple(pass_fds)
        self.prefix = list(prefix)
        self.workers = workers
        self.config = config
        self.args = list(args)
        self.grace = grace
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.pids: list[int] = []
        self.log_path = tmp / f"broker-{id(self)}.log"

    # -- life cycle -----------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "shardbroker.cli", "start", "--workers", str(self.workers), "--port", "0",
               "--nats-port", "0", "--monitor-port", "0", "--grace", str(self.grace)]
        if self.config is not None:
            path = self.tmp / f"config-{id(self)}.json"
            path.write_text(json.dumps(self.config))
            cmd += ["--config", str(path)]
        return self.prefix + cmd + self.args

    def start(self, timeout: float = 30.0) -> Broker:
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                     pass_fds=self.pass_fds)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY.search(self.log())
            if m:
                for part in m.group(1).split():
                    name, _, addr = part.partition("=")
                    self.ports[name] = int(addr.rsplit(":", 1)[1])
                self.pids = [int(p) for p in m.group(3).split(",")]
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.01)   # a start takes ~0.3 s, and the suite starts some 450 brokers: look often
        self.kill()
        raise RuntimeError(f"broker not ready in {timeout}s:\n{self.log()}")

    def group(self) -> list[psutil.Process]:
        """Every live process of the broker's session (supervisor, workers)."""
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error, PermissionError):
                continue
        return out

    def worker_pids(self) -> list[int]:
        """Live worker processes (their command line says ``broker-worker <index>``: cluster/supervisor/launch.py)."""
        out = []
        for p in self.group():
            try:
                if "broker-worker" in p.cmdline():
                    out.append(p.pid)
            except psutil.Error:   # gone
                pass
        return out

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"broker did not stop within {timeout}s:\n{self.log()}") from None
        return code

    def kill(self) -> None:
        """Kill everything in the broker's session, whatever state it is in."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.group():
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Teardown: stop, then make sure nothing of it is left."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self.stop()
        finally:
            leftovers = wait_gone(self.group, 10)
            self.kill()
            self._log.close()
            assert not leftovers, f"processes left behind: {leftovers}"

    # -- talking to it --------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.ports["ndjson"]

    def http(self, path: str) -> tuple[int, dict]:
        url = f"http://127.0.0.1:{self.ports['monitoring']}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def varz(self) -> dict:
        return self.http("/varz")[1]

    def runtime_dir(self) -> str:
        # the supervisor's own line: "removing stale runtime directory ..." (after a killed broker) names another
        m = re.search(r"broker\.supervisor: runtime directory (\S+)", self.log())
        return m.group(1) if m else ""


def wait_gone(list_fn, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    left = list_fn()
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = list_fn()
    return left


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Raw:
    """A raw TCP client for byte-exact protocol tests."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 5.0, source: str | None = None) -> None:
        """``source``: the address to connect from (another one of 127.0.0.0/8, to be another client address)."""
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.timeout = timeout

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self, timeout: float | None = None) -> bytes:
        """The next line, with its terminator."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while (got := ndjson.first_line(self.buf)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete line; have {self.buf[:200]!r}")
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"closed; have {self.buf[:200]!r}")
            self.buf += data
        line, self.buf = got
        return line

    def json(self, timeout: float | None = None) -> dict:
        return json.loads(self.line(timeout))

    def request(self, obj: dict) -> dict:
        self.send(json.dumps(obj).encode() + b"\n")
        return self.json()

    def nothing(self, wait: float = 0.3) -> bool:
        """True if nothing arrives within ``wait`` seconds."""
        if self.buf:
            return False
        self.sock.settimeout(wait)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return True
        self.buf += data
        return False

    def closed(self, timeout: float = 5.0) -> bool:
        """True once the server has closed the connection (reading and discarding anything before it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
            if not data:
                return True
            self.buf += data
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NatsFrames:
    """MSG and HMSG frames off a raw NATS socket, in order: (the reply subject's last token, headers, payload).
    Other lines are skipped (the server's PING answered)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""
        self.raw: list[bytes] = []   # each frame taken, whole

    def take(self, count: int) -> list[tuple[str, bytes, bytes]]:
        out: list[tuple[str, bytes, bytes]] = []
        while len(out) < count:
            items, _ = nats.parse(self.buf, controls=True)
            if not items:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise ConnectionError(f"closed; have {self.buf[:200]!r}")
                self.buf += chunk
                continue
            pos = 0
            for item in items:   # up to the count: the rest stays in the buffer for the next take
                if len(out) == count:
                    break
                size = nats.frame_size(self.buf, pos, item)
                if type(item) is bytes:   # PING, +OK, ...
                    if item == b"PING":   # the server's (its first comes 2 s after CONNECT)
                        self.sock.sendall(nats.PONG)
                else:
                    subject, _, headers, payload = item
                    out.append((subject.rsplit(b".", 1)[1].decode(), headers, payload))
                    self.raw.append(self.buf[pos:pos + size])
                pos += size
            self.buf = self.buf[pos:]
        return out

    def by_token(self, count: int) -> dict[str, tuple[bytes, bytes]]:
        """The next ``count`` frames, each to a reply subject of its own: last token -> (headers, payload)."""
        return {token: (headers, payload) for token, headers, payload in self.take(count)}


def landed(connect: Callable[[], T], worker_of: Callable[[T], int | None], worker: int, tries: int = 32) -> T:
    """The first of up to ``tries`` connections (``connect()``) that landed on ``worker`` (``worker_of`` tells
    where one did); the others are kept open meanwhile, since the acceptor balances by live connections, and
    closed at the end."""
    others = []
    try:
        for _ in range(tries):
            conn = connect()
            if worker_of(conn) == worker:
                return conn
            others.append(conn)
        raise AssertionError(f"no connection landed on worker {worker}")
    finally:
        for conn in others:
            conn.close()


def on_worker(port: int, worker: int, user: str | None = None, password: str | None = None,
              tries: int = 32) -> Raw:
    """An NDJSON connection that landed on ``worker``, logged in as ``user`` if given (``info`` needs
    authentication then, so each try logs in)."""
    def connect() -> Raw:
        conn = Raw(port)
        if user is not None:
            assert conn.request({"op": "auth", "user": user, "pass": password}) == {"ok": True}
        return conn

    return landed(connect, lambda conn: conn.request({"op": "info"})["info"]["worker"], worker, tries)


def nats_ready(port: int, commands: bytes, timeout: float | None = 30) -> socket.socket:
    """A raw NATS socket (headers on, not verbose, no Nagle delay) that sent ``commands`` after its CONNECT and has
    read the PONG of a PING after them: what they asked for (its subscriptions above all) is in place."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(nats.connect({"verbose": False, "headers": True}) + commands + nats.PING)
    seen = b""
    while nats.PONG not in seen:
        seen += s.recv(1 << 16)
    return s


def nats_on_worker(broker: Broker, worker: int, inbox: str) -> socket.socket:
    """A raw NATS connection subscribed to ``<inbox>.*`` (sid 1) that landed on ``worker`` (/connz by its port)."""
    def connect() -> socket.socket:
        return nats_ready(broker.ports["nats"], nats.sub(f"{inbox}.*", 1))

    def worker_of(s: socket.socket) -> int | None:
        port = s.getsockname()[1]
        return next((c["worker"] for c in broker.http("/connz?limit=1000")[1]["connections"] if c["port"] == port),
                    None)

    return landed(connect, worker_of, worker)


@contextlib.contextmanager
def measured_broker(prefix: str, workers: int = 1):
    """A broker in a directory of its own, for a script's measurement: -> (the broker, a function giving the CPU
    seconds its workers and acceptor have used so far)."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    broker = Broker(Path(tmp), workers=workers).start()
    try:
        processes = psutil.Process(broker.proc.pid).children(recursive=True)
        yield broker, lambda: sum(sum(p.cpu_times()[:2]) for p in processes)
    finally:
        broker.close()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def small_disk(size_kib: int, mount: bool = True):
    """-> (a directory, whether it is a tmpfs of ``size_kib`` KiB).  Mounting needs root; where it fails (or with
    ``mount`` False) the directory is a plain one, and the caller limits the workers' file size instead
    (``prlimit --fsize``: EFBIG where a tmpfs gives ENOSPC)."""
    path = tempfile.mkdtemp(prefix="small-disk-")
    mounted = mount and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", path],
                                       capture_output=True).returncode == 0
    try:
        yield path, mounted
    finally:
        if mounted:
            subprocess.run(["umount", path], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def free_space(broker: Broker, path: str, mounted: bool, size_kib: int) -> None:
    """Give the full ``small_disk`` room again: a tmpfs four times larger, or no file size limit on the workers."""
    if mounted:
        subprocess.run(["mount", "-o", f"remount,size={size_kib * 4}k", path], check=True)
    else:
        for pid in broker.worker_pids():
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
