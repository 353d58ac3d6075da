"""The driver side of a load test: the Spark session, the one barrier stage, live progress, and the rows merged
into the results directory.

The barrier RDD feeds exactly one ``collect()``: a second action, a cache eviction or a retried task would run
the load again, so the job sets ``spark.task.maxFailures=1`` and no speculation, and a failed task fails the run.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import defaultdict

from shardbroker.cli.loadtest import plan as planning
from shardbroker.cli.loadtest.accounting import merge_group
from shardbroker.cli.loadtest.scenario import SAFETY_CONF, Scenario

# Settings a load test cannot run correctly without, and a stage short of slots failing in seconds, not ~10 minutes.
REQUIRED_CONF = {
    **SAFETY_CONF,
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
}


class LoadTestError(Exception):
    """The run could not happen (Spark, the broker, a task); the message says why in a line or two."""


def check_java() -> None:
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return
    raise LoadTestError("Spark needs Java and none was found: install a JRE (17 or newer; Debian/Ubuntu: "
                        "apt-get install openjdk-17-jre-headless) or set JAVA_HOME")


def session(master: str | None, tasks: int, scenario: Scenario | None = None, timeout_s: float = 600.0):
    """A SparkSession with the settings a load test needs.  ``master`` None: whatever spark-submit or the
    environment set, else ``local[T]`` with a slot per task (barrier stages need every task running at once)."""
    check_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(f"brokerctl loadtest {scenario.name if scenario else ''}".strip())
    from pyspark import SparkConf

    preset = SparkConf().get("spark.master")
    local = master is None and preset is None or (master or "").startswith("local")
    if master is not None or preset is None:
        builder = builder.master(master or f"local[{max(2, tasks)}]")
    conf = dict(REQUIRED_CONF)
    conf["spark.barrier.sync.timeout"] = f"{int(timeout_s)}s"
    conf["spark.sql.session.timeZone"] = "UTC"       # the tables' timestamps are UTC
    if local:
        # Never listen beyond loopback for a local run; the UI is of no use for a seconds-long job.
        conf.update({"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                     "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"})
    if scenario:
        conf.update(scenario.spark_conf)
    for k, v in conf.items():
        builder = builder.config(k, v)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM's reasons come as a wall of text; keep its first line
        raise LoadTestError(f"Spark could not start: {str(exc).strip().splitlines()[0]}") from None
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def check_endpoints(endpoints: dict[str, str], needed: list[str]) -> None:
    for name in needed:
        if name not in endpoints:
            raise LoadTestError(f"no {name} endpoint: give --broker {name}://HOST:PORT (or [broker] {name} = "
                                "\"HOST:PORT\" in the scenario)")
        host, port = planning.split_endpoint(endpoints[name])
        try:
            socket.create_connection((host, port), timeout=3).close()
        except OSError as exc:
            raise LoadTestError(f"the broker is unreachable at {name}://{host}:{port}: {exc.strerror or exc}") \
                from None


class Progress:
    """Receives the tasks' per-interval datagrams and prints one live line (stderr) while the job runs.

    A line adds up one interval across the tasks: summing each task's latest datagram would add a subscriber's
    second 3 to a publisher's second 2 (and show "sent 0/s, received 1,000/s" at the start).  An interval is shown
    once every task reported it, or 1.5 s after its first report (a task that already finished never will)."""

    def __init__(self, host: str, enabled: bool) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.settimeout(0.2)
        self.address = (host, self.sock.getsockname()[1])
        self.enabled = enabled
        self.tasks = 0                 # set once the plan is known
        self.interval_s = 1.0
        self.intervals: dict[int, dict[int, dict]] = defaultdict(dict)   # interval -> task -> datagram
        self.first_seen: dict[int, float] = {}
        self.shown = -1
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, name="loadtest-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.record(json.loads(self.sock.recv(65536)))
            except (OSError, ValueError, KeyError, TypeError):
                pass
            line = self.line(time.monotonic())
            if self.enabled and line:
                print(line, end="\r" if sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)

    def record(self, msg: dict) -> None:
        i = int(msg["i"])
        if i > self.shown:
            self.intervals[i][int(msg["task"])] = msg
            self.first_seen.setdefault(i, time.monotonic())

    def line(self, now: float) -> str | None:
        """The newest interval ready to show, if it is newer than the last one shown."""
        ready = [i for i, rows in self.intervals.items()
                 if len(rows) >= self.tasks or now - self.first_seen[i] >= 1.5]
        if not ready:
            return None
        i = max(ready)
        rows = list(self.intervals[i].values())
        for old in [k for k in self.intervals if k <= i]:
            del self.intervals[old], self.first_seen[old]
        self.shown = i
        per_s = 1.0 / self.interval_s
        sent, recv, acked = (round(sum(r[k] for r in rows) * per_s) for k in ("sent", "received", "acked"))
        p99 = max(r["p99"] for r in rows)
        return (f"  t+{(i + 1) * self.interval_s:>4g}s  sent {sent:>9,}/s  received {recv:>9,}/s  "
                f"acked {acked:>9,}/s  e2e p99 (worst task) {p99 / 1000:.2f} ms")

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(2)
        self.sock.close()
        if self.enabled and sys.stderr.isatty():
            print(file=sys.stderr)


def _varz(monitor: str | None) -> str:
    if not monitor or not monitor.startswith(("http://", "https://")):   # never file: or another scheme
        return ""
    try:
        with urllib.request.urlopen(f"{monitor.rstrip('/')}/varz", timeout=3) as r:
            return r.read().decode()
    except OSError:
        return ""


def _git_sha() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except OSError:
        return ""


class Interrupted(LoadTestError):
    """Ctrl-C stopped the run."""


def _cancel_on_interrupt(sctx) -> list[int]:
    """Ctrl-C during the job: cancel it, quietly, and note it (the returned list).  PySpark's own handler raises
    KeyboardInterrupt inside the py4j call the driver is blocked in, which breaks the gateway and prints four
    tracebacks and the executors' errors; here the job is cancelled from another thread, Spark's logging is
    silenced for the rest of the run, and the collect fails as a cancelled job does."""
    noted: list[int] = []

    def on_sigint(signum, frame) -> None:
        if noted:
            return
        noted.append(signum)
        logging.getLogger("py4j").setLevel(logging.CRITICAL)

        def cancel() -> None:
            try:
                sctx.setLogLevel("OFF")
                sctx.cancelAllJobs()
            except Exception:   # the gateway going away already: the collect fails either way
                pass
        threading.Thread(target=cancel, daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)
    return noted


def _failure(exc: Exception, tasks: int) -> str:
    """The first line of a task's error out of Spark's Java stack traces."""
    text = str(exc)
    if "SPARK-24819" in text:
        return (f"Spark has fewer task slots than the plan's {tasks} tasks, and a barrier stage needs them all at "
                "once: give executors x cores >= tasks (or local[N] with N >= tasks), or lower publisher_tasks/"
                "subscriber_tasks")
    if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
        return ("the executors run another Python than the driver: point spark.pyspark.python (or PYSPARK_PYTHON) "
                f"at a Python {sys.version_info.major}.{sys.version_info.minor} that has this package installed")
    missing = re.search(r"No module named '([\w.]+)'", text)
    if missing:
        what = "this package" if missing.group(1).split(".")[0] == "cli" else missing.group(1)
        return (f"the executors' Python ({os.environ.get('PYSPARK_PYTHON', 'python3')}) cannot import {what}: "
                "install shardbroker[loadtest] where they run, or ship it (docs/loadtest.md, 'Running on a cluster')")
    if "load test setup failed:" not in text:
        # A task's own Python exception (a traceback's last line), before Spark's "SparkException: Job aborted".
        raised = re.search(r"^([A-Z]\w*(?:Error|Exception)): (.+)$", text, re.M)
        if raised:
            return f"{raised.group(1)}: {raised.group(2)}".removeprefix("RuntimeError: ")
    for marker in ("load test setup failed:", "RuntimeError:", "Exception:", "Error:"):
        at = text.find(marker)
        if at >= 0:
            return text[at:].splitlines()[0].removeprefix("RuntimeError: ")
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def merge(results: list[dict], run_id: str) -> dict[str, list[dict]]:
    """Task results into the tables: ordered streams as the tasks counted them; group and queue streams by OR-ing
    every member's bitmaps against what the publisher sent (and, for queues, what the broker confirmed)."""
    tables: dict[str, list[dict]] = {"tasks": [], "intervals": [], "streams": [], "clock": []}
    publishers: dict[int, dict] = {}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    modes: dict[str, str] = {}
    for r in results:
        tables["tasks"].append(r["task"])
        tables["intervals"] += r["intervals"]
        tables["streams"] += r["streams"]
        tables["clock"] += r["clock"]
        for p in r["publishers"]:
            publishers[p["pub_id"]] = p
            modes[p["workload"]] = "queue" if p["confirmed"] is not None else "group"
        for m in r["members"]:
            groups[(m["workload"], m["subject"], m["group"], m["pub_id"])].append(m)
    for (workload, subject, group, pub_id), members in sorted(groups.items()):
        p = publishers[pub_id]
        counts = merge_group(members, p["final"], p["confirmed"])
        counts.pop("redelivered_reported")
        tables["streams"].append(dict(counts, run_id=run_id, workload=workload, sub_task=-1, sub_conn=-1,
                                      subject=subject, group=group, pub_id=pub_id, mode=modes[workload],
                                      reordered=0, max_reorder_distance=0, early=0, first_seq=-1, last_seq=-1,
                                      gap_ranges=[], gap_count=0))
    for row in tables["intervals"]:
        row["run_id"] = run_id
    return tables


def run(sc: Scenario, endpoints: dict[str, str], out_dir: str, spark=None, master: str | None = None,
        progress: bool = True, monitor: str | None = None, broker_version: str = "", run_id: str | None = None,
        tables_uri: str | None = None) -> dict:
    """Runs the scenario once against ``endpoints`` ({"ndjson": "host:port", ...}); writes ``out_dir``; returns the
    summary (``summary["passed"]`` says whether every threshold held)."""
    check_endpoints(endpoints, sc.endpoints_needed())
    run_id = run_id or uuid.uuid4().hex
    timeout = sc.setup_timeout * 2 + sc.warmup + sc.duration + sc.drain_timeout + 60
    specs_count = len(planning.build(sc, run_id, endpoints, None))
    own_session = spark is None
    if own_session:
        spark = session(master, specs_count, sc, timeout)
    try:
        return _run(sc, spark, endpoints, out_dir, run_id, progress, monitor, broker_version, tables_uri)
    finally:
        if own_session:
            spark.stop()


def _run(sc: Scenario, spark, endpoints: dict[str, str], out_dir: str, run_id: str, progress: bool,
         monitor: str | None, broker_version: str, tables_uri: str | None) -> dict:
    from shardbroker.cli.loadtest import results as results_mod
    from shardbroker.cli.loadtest.thresholds import parse
    from shardbroker.cluster import VERSION

    sctx = spark.sparkContext
    # A session made elsewhere (a notebook, an earlier getOrCreate) keeps its own settings: refuse to run the load
    # where a retried task would run it again.
    unsafe = [f"{k}={v}" for k, v in SAFETY_CONF.items() if (sctx.getConf().get(k) or "").lower() != v]
    if unsafe or not sctx.getConf().get("spark.barrier.sync.timeout"):
        raise LoadTestError("the Spark session lacks the settings a load test needs (" + ", ".join(
            unsafe or ["spark.barrier.sync.timeout"]) + "): let brokerctl loadtest create it (cli.loadtest.job."
            "session), or set them with --conf")
    driver_host = sctx.getConf().get("spark.driver.host", "127.0.0.1")
    ticker = Progress(driver_host, progress)
    specs = planning.build(sc, run_id, endpoints, ticker.address)
    ticker.tasks, ticker.interval_s = len(specs), sc.interval
    started = dt.datetime.now(dt.UTC)
    varz_before = _varz(monitor)
    if progress:
        print(f"loadtest {sc.name}: {len(specs)} tasks on {sctx.master}, run {run_id[:8]}, "
              f"{sc.warmup:g}s warm-up + {sc.duration:g}s measured", file=sys.stderr)
    interrupted = _cancel_on_interrupt(sctx)
    try:
        from shardbroker.cli.loadtest.task import run_partition

        rdd = sctx.parallelize(specs, len(specs)).barrier().mapPartitions(run_partition)
        collected = rdd.collect()     # the one action of this RDD: see the module's docstring
    except Exception as exc:
        if interrupted:
            raise Interrupted("interrupted: the load test was stopped before its tasks reported, so there are no "
                              "results to keep (the broker it started, and Spark, are stopped)") from None
        raise LoadTestError(f"the load test failed: {_failure(exc, len(specs))}") from None
    finally:
        ticker.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    tables = merge(collected, run_id)
    agreed = collected[0]["t0_wall_ns"] if collected else 0
    tables["runs"] = [{
        "run_id": run_id, "name": sc.name, "started_at": started, "scenario_text": sc.text,
        "scenario_sha256": sc.sha256, "seed": sc.seed, "protocols": sc.protocols, "broker_urls": {
            k: f"{k}://{v}" for k, v in endpoints.items()}, "broker_version": broker_version,
        "brokerctl_version": VERSION, "git_sha": _git_sha(), "spark_master": sctx.master,
        "spark_version": spark.version, "spark_conf": {k: v for k, v in sctx.getConf().getAll()
                                                       if k.startswith("spark.") and "password" not in k.lower()
                                                       and "secret" not in k.lower()},
        "tasks": len(specs), "varz_before": varz_before, "varz_after": _varz(monitor), "status": "",
        "flags": [], "agreed_start_wall_ns": agreed, "warmup_s": sc.warmup, "duration_s": sc.duration,
        "interval_s": sc.interval}]
    thresholds = parse(sc.thresholds, [w.name for w in sc.workloads])
    return results_mod.write_results(spark, out_dir, tables, thresholds, {"scenario": sc.name},
                                     tables_uri=tables_uri)
