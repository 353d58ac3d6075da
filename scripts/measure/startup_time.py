#!/usr/bin/env python3
"""How long the broker takes to start: from exec to the ready line, and to HTTP 200 on /varz.

    .venv/bin/python scripts/measure/startup_time.py                # N = 1, 2, 4; security off and on; 10 runs each
    .venv/bin/python scripts/measure/startup_time.py --workers 2 --runs 20 --security off
    .venv/bin/python scripts/measure/startup_time.py --nats-server  # nats-server's own start-up, for comparison
    .venv/bin/python scripts/measure/startup_time.py --bytecode     # with compiled bytecode, as an installed package
    .venv/bin/python scripts/measure/startup_time.py --workers 1,4 --security off --fork-server off,on --runs 20

Each run starts ``python -m shardbroker.cli start --workers N --port 0 --nats-port 0 --monitor-port 0`` in its own
session, reads its stderr until the ready line (which names the monitoring port), then polls ``/varz`` until it answers
200.  Times are measured from just before the exec (``subprocess.Popen``), on ``time.perf_counter``.  The broker is
then stopped at once (SIGQUIT), and anything left in its session is killed and reaped, so runs do not overlap.

With ``--security on`` the configuration has security enabled and one plaintext password for the admin user and
one for another user (the default 600,000 PBKDF2 iterations, unless ``--iterations``), which the supervisor has
to hash before any login can succeed.

Where ``PYTHONDONTWRITEBYTECODE`` is set and the sources were never compiled (a checkout with an editable install,
as here), every process compiles the broker's modules at every start.  ``--bytecode`` measures what an installed
package (whose modules pip compiles) does instead: it compiles everything once into a private cache directory
(``PYTHONPYCACHEPREFIX``; nothing is written to the source tree) and runs the broker with it.

A measurement, not a test: the test suite checks that start-up is correct
(a login right after the ready line succeeds), not how fast it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY = re.compile(rb"ready: (.*) workers=(\d+) pids=([\d,]+)")


def http_status(port: int, path: str = "/varz", timeout: float = 2.0) -> int:
    """The status code of a GET, or 0 if the connection failed."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" % path.encode())
            head = b""
            while b"\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
            parts = head.split(b" ", 2)
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    except OSError:
        return 0


def reap(proc: subprocess.Popen) -> None:
    """Stop the broker now, then make sure nothing of its session is left."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGQUIT)
            proc.wait(10)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # workers or a resource tracker still in the session
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    # Wait until the session is empty, so that the next run does not share the CPU with this one's exits.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _session_alive(proc.pid):
        time.sleep(0.01)


def _session_alive(sid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()
        if fields[0] != b"Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            return True
    return False


def one_run(cmd: list[str], env: dict[str, str], timeout: float = 60.0) -> tuple[float, float]:
    """(seconds to the ready line, seconds to HTTP 200 on /varz)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            cwd=REPO, env=env, start_new_session=True)
    try:
        buf = b""
        fd = proc.stderr.fileno()
        deadline = t0 + timeout
        m = None
        while m is None:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RuntimeError(f"not ready in {timeout}s:\n{buf.decode(errors='replace')}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"exited with {proc.wait()}:\n{buf.decode(errors='replace')}")
                buf += chunk
                m = READY.search(buf)
        t_line = time.perf_counter() - t0
        ports = dict(p.split(b"=", 1) for p in m.group(1).split())
        monitor = int(ports[b"monitoring"].rsplit(b":", 1)[1])
        while http_status(monitor) != 200:
            if time.perf_counter() > deadline:
                raise RuntimeError("/varz never answered 200")
            time.sleep(0.001)
        t_varz = time.perf_counter() - t0
        return t_line, t_varz
    finally:
        proc.stderr.close()
        reap(proc)


def nats_run(binary: str) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-m", str(mport)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while http_status(mport) != 200:
            if time.perf_counter() - t0 > 30:
                raise RuntimeError("nats-server did not answer /varz")
            time.sleep(0.001)
        t = time.perf_counter() - t0
        return t, t
    finally:
        reap(proc)


def fmt(samples: list[float]) -> str:
    ms = [s * 1000 for s in samples]
    return f"median {statistics.median(ms):6.0f} ms  min {min(ms):6.0f}  max {max(ms):6.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default 1,2,4)")
    ap.add_argument("--security", default="off,on", help="off, on, or off,on (default)")
    ap.add_argument("--runs", type=int, default=10, help="runs per configuration (default 10)")
    ap.add_argument("--iterations", type=int, default=600_000, help="PBKDF2 iterations with security on")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the broker")
    ap.add_argument("--nats-server", action="store_true", help="also time nats-server (exec to /varz 200)")
    ap.add_argument("--bytecode", action="store_true",
                    help="run with compiled bytecode (a private PYTHONPYCACHEPREFIX), as an installed package")
    ap.add_argument("--json", help="write every sample to this file")
    ap.add_argument("--fork-server", default="on",
                    help="workers.fork_server: on (default), off, or off,on (each with every worker count)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="startup-time-")
    secure = {"security": {"enabled": True, "iterations": args.iterations,
                           "admin_user": {"username": "admin", "password": "admin-secret", "permissions": ["admin"]},
                           "users": [{"username": "alice", "password": "alice-secret",
                                      "permissions": ["publish:*", "subscribe:*"]}]}}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.bytecode:
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # the first (uncounted) run fills the cache
    results = []
    try:
        if args.nats_server:
            binary = shutil.which("nats-server")
            if binary is None:
                print("nats-server: not installed", file=sys.stderr)
            else:
                samples = [nats_run(binary) for _ in range(args.runs)]
                print(f"nats-server                 /varz 200: {fmt([s[1] for s in samples])}")
        counts = [int(w) for w in args.workers.split(",") if w]
        for security, fork in [(s, f) for s in args.security.split(",") if s for f in args.fork_server.split(",") if f]:
            config_path = os.path.join(tmp, f"config-{security}-{fork}.json")
            with open(config_path, "w") as fh:
                json.dump({**(secure if security == "on" else {}), "workers": {"fork_server": fork == "on"}}, fh)
            os.chmod(config_path, 0o600)
            cmds = {}
            for n in counts:
                cmds[n] = [args.python, "-m", "shardbroker.cli", "start", "--workers", str(n), "--port", "0",
                           "--nats-port", "0", "--monitor-port", "0", "--config", config_path]
                one_run(cmds[n], env)  # warm the page cache (and the bytecode cache); not counted
            # The counts alternate, run by run: a change in the machine's load shows in every count alike, and the
            # ratios between them (the fork server's promise: 4 workers within 1.3 times 1 worker) hold within a run.
            samples: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
            for _ in range(args.runs):
                for n in counts:
                    samples[n].append(one_run(cmds[n], env))
            base = statistics.median(s[0] for s in samples[counts[0]])
            for n in counts:
                label = f"workers={n} security={security:3} fork_server={fork:3}"
                ratio = statistics.median(s[0] for s in samples[n]) / base
                print(f"{label}  ready line: {fmt([s[0] for s in samples[n]])}  "
                      f"({ratio:.2f}x workers={counts[0]})", flush=True)
                print(f"{' ' * len(label)}   /varz 200: {fmt([s[1] for s in samples[n]])}", flush=True)
                results.append({"workers": n, "security": security, "fork_server": fork,
                                "ready_line": [s[0] for s in samples[n]],
                                "varz": [s[1] for s in samples[n]]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
