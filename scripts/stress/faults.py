#!/usr/bin/env python3
"""Faults, injected into a real broker under load, and what the broker promises about each (docs/reliability.md).

    .venv/bin/python scripts/stress/faults.py kill9 --kills 100  # kill -9 of a worker: recovery time, no loss elsewhere
    .venv/bin/python scripts/stress/faults.py kill9 --kills 100 --no-fork-server   # replacements: fresh interpreters
    .venv/bin/python scripts/stress/faults.py sigstop            # a worker stopped past fabric.stall_timeout
    .venv/bin/python scripts/stress/faults.py supervisor         # the supervisor killed: no orphan survives
    .venv/bin/python scripts/stress/faults.py fds                # the supervisor out of file descriptors: no busy loop
    .venv/bin/python scripts/stress/faults.py fds-workers        # the whole broker under a low ulimit -n
    .venv/bin/python scripts/stress/faults.py disk               # the queue journal's disk full: pushes fail cleanly
    .venv/bin/python scripts/stress/faults.py all                # each once, quickly (tests/cluster/test_faults.py)

Each prints one JSON object of figures and exits 1 if a promise was broken.  The broker runs from this checkout
(tests/support/harness.py); the load is NDJSON clients with sequence numbers, placed on chosen workers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.harness import Broker, Raw, free_space, on_worker, small_disk  # noqa: E402


# -- clients ---------------------------------------------------------------------------------------------------
class Stream:
    """A publisher on one worker sending numbered messages to a subject at a steady rate, and subscribers on
    other workers counting what they get: gaps and repeats are losses and duplicates."""

    def __init__(self, port: int, subject: str, pub_worker: int, sub_workers: list[int], rate: float) -> None:
        self.subject = subject
        self.rate = rate
        self.subs = {w: on_worker(port, w, tries=64) for w in sub_workers}
        for conn in self.subs.values():
            assert conn.request({"op": "sub", "topic": subject}) == {"ok": True}
        self.pub = on_worker(port, pub_worker, tries=64)
        self.sent = 0
        self.errors: list[str] = []
        self.got = {w: [] for w in sub_workers}
        self.gaps = {w: 0.0 for w in sub_workers}   # the longest silence each subscriber saw
        self._stop = threading.Event()    # the publisher stops
        self._done = threading.Event()    # the subscribers stop reading (what was sent has arrived)
        self._threads = [threading.Thread(target=self._publish, daemon=True)]
        self._threads += [threading.Thread(target=self._read, args=(w,), daemon=True) for w in sub_workers]

    def start(self) -> Stream:
        for t in self._threads:
            t.start()
        return self

    def _publish(self) -> None:
        t0 = time.monotonic()
        try:
            while not self._stop.is_set():
                due = int((time.monotonic() - t0) * self.rate)
                batch = b"".join(b'{"op":"pub","topic":"%s","data":%d}\n' % (self.subject.encode(), n)
                                 for n in range(self.sent, due))
                if batch:
                    self.pub.send(batch)
                    self.sent = due
                time.sleep(0.005)
        except OSError as exc:
            self.errors.append(f"publisher: {exc}")

    def _read(self, worker: int) -> None:
        conn, got = self.subs[worker], self.got[worker]
        last = time.monotonic()
        while not self._done.is_set():
            try:
                line = conn.line(timeout=0.2)
            except TimeoutError:
                if not self._stop.is_set():   # silence while messages are being sent
                    self.gaps[worker] = max(self.gaps[worker], time.monotonic() - last)
                continue
            except (ConnectionError, OSError) as exc:
                self.errors.append(f"subscriber on worker {worker}: {exc}")
                return
            msg = json.loads(line)
            if "topic" in msg:
                now = time.monotonic()
                self.gaps[worker] = max(self.gaps[worker], now - last)
                last = now
                got.append(msg["data"])

    def stop(self, settle: float = 1.0) -> dict:
        """Stop publishing, wait for the rest to arrive, and count."""
        self._stop.set()
        self._threads[0].join()
        deadline = time.monotonic() + settle + 5
        while time.monotonic() < deadline and any(len(set(got)) < self.sent for got in self.got.values()):
            time.sleep(0.05)
        time.sleep(settle)   # and no repeat after the last
        self._done.set()
        for t in self._threads[1:]:
            t.join()
        out = {"sent": self.sent, "errors": self.errors}
        for w, got in self.got.items():
            out[f"worker{w}"] = {"received": len(got), "lost": self.sent - len(set(got)),
                                 "duplicates": len(got) - len(set(got)),
                                 "in_order": got == sorted(got), "longest_gap_s": round(self.gaps[w], 3)}
        for conn in [self.pub, *self.subs.values()]:
            conn.close()
        return out


def _log_time(line_start: str) -> float:
    """The epoch time of a log line's local timestamp (``2026-11-21 10:40:29.436``)."""
    return datetime.datetime.strptime(line_start, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _worker_pid(b: Broker, index: int) -> int:
    """The pid of worker ``index`` now (its command line ends ``broker-worker <index> <fd> <fd>``)."""
    for pid in b.worker_pids():
        with contextlib.suppress(psutil.Error):
            args = psutil.Process(pid).cmdline()
            if args[args.index("broker-worker") + 1] == str(index):
                return pid
    raise RuntimeError(f"no worker {index}")


def _served_by(port: int, worker: int, timeout: float = 10.0) -> float:
    """The epoch time at which a new connection was first answered by ``worker`` (tried every 2 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError), Raw(port, timeout=2) as c:
            if c.request({"op": "info"})["info"]["worker"] == worker:
                return time.time()
        time.sleep(0.002)
    raise RuntimeError(f"no connection served by worker {worker} in {timeout}s")


def _workdir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="faults-")


# -- kill -9 of a worker ---------------------------------------------------------------------------------------
def kill9(kills: int = 100, per_broker: int = 10, rate: float = 500.0, workers: int = 3,
          fork_server: bool = True) -> dict:
    """Kill worker 0 again and again while workers 1 and 2 carry pub/sub traffic between them (and worker 0 its
    own).  A fresh broker every ``per_broker`` kills: more than 10 deaths in 60 s is a crash loop, and stops it.
    ``back_ms``: from the kill to the supervisor's ``is back`` line (the replacement has joined the fabric and gets
    connections); ``serving_ms``: to the first new connection answered by the replacement (a client polls)."""
    back_ms: list[float] = []
    serving_ms: list[float] = []
    streams = []
    ok = True
    started_by = None   # how the last replacement started (/varz): "forkserver", or "exec" (a fresh interpreter)
    with _workdir() as tmp:
        done = 0
        while done < kills:
            # every "is back" line is wanted, with its own time: the log's flood control would sum up the 6th
            # and later ones in a 10 s window
            b = Broker(Path(tmp), workers=workers, config={"logging": {"flood_burst": 100_000},
                                                           "workers": {"fork_server": fork_server}}).start()
            try:
                stream = Stream(b.port, f"survivors.{done}", 1, [1, 2], rate).start()
                victim_load = None
                for _ in range(min(per_broker, kills - done)):
                    with contextlib.suppress(Exception):
                        victim_load = victim_load or Stream(b.port, f"victim.{done}", 0, [0], rate / 5).start()
                    time.sleep(0.3)
                    pid = _worker_pid(b, 0)
                    after = len(b.log())
                    t_kill = time.time()
                    os.kill(pid, signal.SIGKILL)
                    serving_ms.append((_served_by(b.port, 0) - t_kill) * 1000)
                    m = b.wait_log(r"(\S+ \S+) \[supervisor\] INFO broker.supervisor: worker 0 is back", 10, after)
                    back_ms.append((_log_time(m.group(1)) - t_kill) * 1000)
                    done += 1
                    if victim_load is not None:   # its clients went with the worker
                        victim_load._stop.set()
                        victim_load._done.set()
                        victim_load = None
                started_by = b.varz()["workers"][0].get("started_by")
                streams.append(stream.stop())
            finally:
                b.close()
    lost = sum(s[f"worker{w}"]["lost"] + s[f"worker{w}"]["duplicates"] for s in streams for w in (1, 2))
    ok = lost == 0 and all(not s["errors"] for s in streams) and max(back_ms) < 1000 and max(serving_ms) < 1000
    q = statistics.quantiles(back_ms, n=10) if len(back_ms) > 1 else back_ms * 9
    return {"fault": "kill9", "ok": ok, "kills": len(back_ms), "workers": workers, "rate_per_stream": rate,
            "back_ms": {"min": round(min(back_ms)), "median": round(statistics.median(back_ms)),
                        "p90": round(min(q[8], max(back_ms))), "max": round(max(back_ms))},
            "back_ms_all": [round(x) for x in back_ms],
            "serving_ms": {"min": round(min(serving_ms)), "median": round(statistics.median(serving_ms)),
                           "max": round(max(serving_ms))},
            "started_by": started_by,
            "survivor_messages": sum(s["sent"] for s in streams), "survivor_lost_or_duplicated": lost,
            "survivor_longest_gap_s": max(s[f"worker{w}"]["longest_gap_s"] for s in streams for w in (1, 2)),
            "errors": [e for s in streams for e in s["errors"]],
            "rounds_with_loss": [s for s in streams
                                 if any(s[f"worker{w}"]["lost"] or s[f"worker{w}"]["duplicates"] for w in (1, 2))]}


# -- SIGSTOP past the stall timeout ----------------------------------------------------------------------------
def sigstop(stopped: float = 3.0, stall_timeout: float = 0.5, rate: float = 2000.0) -> dict:
    """Stop worker 0 (SIGSTOP) for ``stopped`` seconds while worker 1 publishes to subscribers on all three; the
    window to worker 0 fills, and past ``fabric.stall_timeout`` messages for it are dropped and counted."""
    config = {"fabric": {"stall_timeout": stall_timeout, "window_bytes": 65536}}
    with _workdir() as tmp:
        b = Broker(Path(tmp), workers=3, config=config).start()
        try:
            stream = Stream(b.port, "stall.x", 1, [0, 1, 2], rate).start()
            time.sleep(1.0)
            pid = b.pids[0]
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            time.sleep(stopped / 2)
            varz_t0 = time.monotonic()
            varz = b.varz()   # answers (worker 0 shows as unresponsive after 2 s): nothing hangs
            varz_s = time.monotonic() - varz_t0
            time.sleep(max(0.0, stopped - (time.monotonic() - t0)))
            os.kill(pid, signal.SIGCONT)
            time.sleep(1.5)
            result = stream.stop()
            after = b.varz()
        finally:
            b.close()
    survivors = [result["worker1"], result["worker2"]]
    dropped = after["fabric_dropped_messages"]
    stopped_one = result["worker0"]
    ok = (all(s["lost"] == 0 and s["duplicates"] == 0 for s in survivors) and not result["errors"]
          and dropped > 0 and stopped_one["lost"] <= dropped and varz_s < 5)
    return {"fault": "sigstop", "ok": ok, "stopped_s": stopped, "stall_timeout_s": stall_timeout,
            "messages": result["sent"], "survivors": survivors, "stopped_worker": stopped_one,
            "fabric_dropped_messages": dropped, "fabric_stalls": after["fabric_stalls"],
            "varz_during_stop_s": round(varz_s, 2),
            "unresponsive_in_varz": [w["worker"] for w in varz["workers"] if w.get("unresponsive")],
            "errors": result["errors"]}


# -- the supervisor killed -------------------------------------------------------------------------------------
def supervisor(connections: int = 200) -> dict:
    with _workdir() as tmp:
        b = Broker(Path(tmp), workers=2).start()
        conns = [Raw(b.port) for _ in range(connections)]
        for c in conns[:10]:
            c.request({"op": "ping"})
        runtime = b.runtime_dir()
        workers = b.worker_pids()
        t0 = time.monotonic()
        os.kill(b.proc.pid, signal.SIGKILL)
        left = workers
        while left and time.monotonic() - t0 < 5:
            left = [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
            time.sleep(0.01)
        gone_s = time.monotonic() - t0
        eof = sum(1 for c in conns if c.closed(timeout=2))
        for c in conns:
            c.close()
        orphans = [p.pid for p in b.group()]
        runtime_left = bool(runtime) and os.path.exists(runtime)
        b.kill()
    ok = not left and not orphans and not runtime_left and eof == connections
    return {"fault": "supervisor-kill9", "ok": ok, "workers_gone_s": round(gone_s, 3), "orphans": orphans,
            "runtime_dir_left": runtime_left, "clients_closed": eof, "clients": connections}


# -- out of file descriptors -----------------------------------------------------------------------------------
def _cpu_percent(pids: list[int], seconds: float) -> float:
    procs = [psutil.Process(p) for p in pids]
    before = [p.cpu_times() for p in procs]
    time.sleep(seconds)
    after = [p.cpu_times() for p in procs]
    used = sum((a.user + a.system) - (b.user + b.system) for a, b in zip(after, before))
    return round(100 * used / seconds, 1)


def fds(waiting: int = 20, seconds: float = 3.0) -> dict:
    """The supervisor's open-files limit lowered to what it has open: every accept fails (EMFILE) while clients
    wait in the backlog.  Then the limit comes back and they are served."""
    with _workdir() as tmp:
        b = Broker(Path(tmp), workers=2).start()
        try:
            sup = psutil.Process(b.proc.pid)
            limit = sup.rlimit(psutil.RLIMIT_NOFILE)
            sup.rlimit(psutil.RLIMIT_NOFILE, (sup.num_fds(), limit[1]))
            after = len(b.log())
            clients = [socket.create_connection(("127.0.0.1", b.port), timeout=10) for _ in range(waiting)]
            time.sleep(0.5)
            cpu = _cpu_percent([b.proc.pid], seconds)
            lines = b.log()[after:].count("accept failed")
            sup.rlimit(psutil.RLIMIT_NOFILE, limit)
            served = 0
            for s in clients:
                s.sendall(b'{"op":"ping"}\n')
                with contextlib.suppress(OSError):
                    served += s.recv(100) == b'{"ok":true}\n'
                s.close()
            errors = b.varz()["accept_errors"]
        finally:
            b.close()
    ok = cpu < 20 and served == waiting and lines <= 10 + seconds * 2
    return {"fault": "fd-exhaustion", "ok": ok, "supervisor_cpu_percent": cpu, "seconds": seconds,
            "accept_errors": errors, "log_lines": lines, "waiting_clients_served_after": served}


def fds_workers(connections: int = 400, limit: int = 160) -> dict:
    """The whole broker under ``ulimit -n`` (``limit``): connections past what a worker can hold are closed,
    those before keep working, no process spins."""
    with _workdir() as tmp:
        b = Broker(Path(tmp), workers=2, prefix=["prlimit", f"--nofile={limit}:{limit}", "--"]).start()
        try:
            conns, refused = [], 0
            for _ in range(connections):
                try:
                    conns.append(socket.create_connection(("127.0.0.1", b.port), timeout=5))
                except OSError:
                    refused += 1
            time.sleep(1.0)
            cpu = _cpu_percent([b.proc.pid, *b.worker_pids()], 3.0)
            served = 0
            for s in conns:
                with contextlib.suppress(OSError):
                    s.settimeout(2)
                    s.sendall(b'{"op":"ping"}\n')
                    served += s.recv(100) == b'{"ok":true}\n'
            for s in conns:
                s.close()
            alive = len(b.worker_pids())
            with Raw(b.port) as late:
                still = late.request({"op": "ping"}) == {"ok": True}
        finally:
            b.close()
    ok = cpu < 30 and alive == 2 and still and served > 0
    return {"fault": "fd-exhaustion-workers", "ok": ok, "limit": limit, "connections": connections,
            "served": served, "cpu_percent_all": cpu, "workers_alive": alive, "serves_after": still}


# -- the journal's disk full -----------------------------------------------------------------------------------
def disk(size_kib: int = 256, body: int = 4000) -> dict:
    """Pushes to one queue until the journal's filesystem is full.  What happens: the push that finds the disk
    full is undone and refused at once (``journal_unavailable``, ``retry``), not held; pub/sub on that worker goes
    on; once space is freed (the tmpfs grown, or the workers' RLIMIT_FSIZE raised) the next push is stored; after a
    restart exactly the acknowledged pushes are there, and the journal ends on a record boundary."""
    with small_disk(size_kib) as (path, mounted), _workdir() as tmp:
        data_dir = os.path.join(path, "q")
        config = {"queues": {"data_dir": data_dir, "fsync": "no"}}
        # soft limit only: raised again (space freed) with prlimit on the workers
        prefix = [] if mounted else ["prlimit", f"--fsize={size_kib * 1024}:unlimited", "--"]
        b = Broker(Path(tmp), workers=1, config=config, prefix=prefix).start()
        acked, refused, held, error, refused_in_ms, after_ok, flowing = 0, 0, 0, None, None, False, False
        payload = "x" * body
        try:
            with Raw(b.port) as c, Raw(b.port) as sub, Raw(b.port) as pub:
                assert sub.request({"op": "sub", "topic": "still.flowing"}) == {"ok": True}
                for i in range(4 * size_kib * 1024 // body):
                    t0 = time.monotonic()
                    c.send(json.dumps({"op": "qpush", "queue": "jobs", "data": {"n": i, "pad": payload}}).encode()
                           + b"\n")
                    try:
                        reply = c.json(timeout=2)
                    except TimeoutError:
                        held += 1
                        break
                    if reply.get("ok"):
                        acked += 1
                        continue
                    refused += 1
                    error = reply.get("error")
                    refused_in_ms = round((time.monotonic() - t0) * 1000, 1)
                    break
                flowing = pub.request({"op": "pub", "topic": "still.flowing", "data": 1}) == {"ok": True} and \
                    sub.json(timeout=3).get("data") == 1
                if refused and not held:   # free space: the next push is stored
                    free_space(b, path, mounted, size_kib)
                    with contextlib.suppress(TimeoutError):
                        after_ok = bool(c.request({"op": "qpush", "queue": "jobs", "data": "after"}).get("ok"))
                        acked += after_ok
        finally:
            b.close()
        # a new broker on the same journal: everything acknowledged is there, nothing refused, no torn tail
        b2 = Broker(Path(tmp), workers=1, config=config).start()
        try:
            with Raw(b2.port) as c:
                stat = c.request({"op": "qstat", "queue": "jobs"})
            torn = "truncating" in b2.log()
        finally:
            b2.close()
    kept = stat.get("stat", stat).get("messages", stat.get("visible"))
    ok = flowing and not held and error == "journal_unavailable" and after_ok and kept == acked and not torn
    return {"fault": "disk-full", "ok": ok, "filesystem": f"tmpfs {size_kib} KiB" if mounted else
            f"RLIMIT_FSIZE {size_kib} KiB", "acked": acked, "refused": refused, "refusal": error,
            "refused_answered_in_ms": refused_in_ms, "held_unanswered": held,
            "push_after_space_freed_ok": after_ok, "pubsub_flowing": flowing, "kept_after_restart": kept,
            "journal_torn_tail": torn}


FAULTS = {"kill9": kill9, "sigstop": sigstop, "supervisor": supervisor, "fds": fds, "fds-workers": fds_workers,
          "disk": disk}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fault", choices=[*FAULTS, "all"])
    ap.add_argument("--kills", type=int, default=100, help="kill9: how many kills")
    ap.add_argument("--rate", type=float, default=500.0, help="kill9: messages/s per publisher")
    ap.add_argument("--no-fork-server", action="store_true",
                    help="kill9: workers.fork_server off (replacements are fresh interpreters)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ok = True
    for name in FAULTS if args.fault == "all" else [args.fault]:
        fn = FAULTS[name]
        kwargs = {"kills": args.kills if args.fault == "kill9" else 5, "rate": args.rate,
                  "fork_server": not args.no_fork_server} if name == "kill9" else {}
        result = fn(**kwargs)
        print(json.dumps(result), flush=True)
        ok = ok and result["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
