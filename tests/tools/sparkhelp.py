"""What the Spark data source's tests share (test_spark_connector.py, test_spark_driver.py): the broker's side of
a run (pushes, stats, drains), a wait, and a driver of its own run as a subprocess (spark_driver.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.harness import Raw

DRIVER = Path(__file__).with_name("spark_driver.py")   # run as a script, in a session of its own
SESSION_START_S = 90     # a driver's own session starts in ~5-15 s on a loaded 2-core box


def own_driver(test):
    """A test with a driver of its own: ``spark`` by hand (it uses no ``spark`` fixture), and time for two Spark
    sessions to start on a loaded box."""
    return pytest.mark.spark(pytest.mark.timeout(300)(test))


class Driver:
    """spark_driver.py run as a Spark driver in a session of its own; ``kill()`` is a crash of the driver's machine:
    SIGKILL to every process of the session (the JVM, its Python workers: the pyspark daemon makes a process group
    of its own, not a session)."""

    def __init__(self, tmp: Path, spec: dict, name: str) -> None:
        self.spec = dict(spec, timings=str(tmp / f"{name}.timings.json"))
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), json.dumps(self.spec)], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, stdin=subprocess.DEVNULL,
                                     cwd=DRIVER.resolve().parents[2])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait(self, timeout: float) -> dict:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the driver did not finish in {timeout}s:\n{self.log()}") from None
        self._reap()
        assert code == 0, f"the driver failed ({code}):\n{self.log()}"
        return json.loads(Path(self.spec["timings"]).read_text())

    def group(self) -> list:
        import psutil

        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return out

    def kill(self) -> None:
        for p in self.group():
            try:
                p.send_signal(signal.SIGKILL)
            except psutil_error():
                pass
        self.proc.wait(10)
        self._reap()

    def _reap(self) -> None:
        deadline = time.monotonic() + 15
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in self.group():
            p.kill()
        self._log.close()


def psutil_error() -> type[Exception]:
    import psutil

    return psutil.Error


def push_ids(broker, queue: str, n: int, chunk: int = 1000) -> list[str]:
    """``n`` unique messages (data ``m<i>``) in NDJSON batch pushes of ``chunk``; their ids."""
    ids: list[str] = []
    with Raw(broker.port, timeout=30) as c:
        for lo in range(0, n, chunk):
            reply = c.request({"op": "qpush", "queue": queue,
                               "messages": [{"data": f"m{i}"} for i in range(lo, min(n, lo + chunk))]})
            assert reply["ok"], reply
            ids += reply["ids"]
    assert len(set(ids)) == n
    return ids


def qstat(broker, queue: str) -> dict:
    with Raw(broker.port, timeout=30) as c:
        return c.request({"op": "qstat", "queue": queue})["stat"]


def drain(broker, queue: str) -> list[str]:
    """Every message's data in ``queue`` (received and acked)."""
    out: list[str] = []
    with Raw(broker.port, timeout=30) as c:
        while True:
            got = c.request({"op": "qrecv", "queue": queue, "max": 1000, "visibility_ms": 60000})["messages"]
            if not got:
                return out
            out += [m["data"] for m in got]
            c.request({"op": "qack", "queue": queue, "receipts": [m["receipt"] for m in got]})


def recorded(record: Path, tag: str) -> dict[int, list[str]]:
    """The ids each source batch read in run ``tag`` (the last attempt of each partition)."""
    latest: dict[tuple[int, int], tuple[int, list[str]]] = {}
    for f in record.glob(f"{tag}-b*-p*-a*.json"):
        b, p, a = (int(x[1:]) for x in f.stem.split("-")[1:])
        if (b, p) not in latest or latest[b, p][0] < a:
            latest[b, p] = (a, json.loads(f.read_text()))
    out: dict[int, list[str]] = {}
    for (b, _), (_, ids) in sorted(latest.items()):
        out.setdefault(b, []).extend(ids)
    return out


def stream_spec(tmp: Path, broker, **kw) -> dict:
    record = tmp / "record"
    record.mkdir(exist_ok=True)
    return {"job": "stream", "port": broker.port, "queue": "jobs", "checkpoint": str(tmp / "ck"),
            "out": str(tmp / "out"), "result": str(tmp / "result.json"), "record": str(record), **kw}
