"""The ``shardbroker`` Spark data source (cli/spark) against a real broker: the queue source's exactness (one
read per message, replays reading the same messages, the idle tick acking the last batch), the sink's dedup, the
read limit, leases, option errors, and the subject source.

Two kinds of test:
- in the shared ``spark`` session (conftest, ``local[6]``, no task retries): what needs no failure;
- in a Spark driver of their own, this file run as a script (``python test_spark_connector.py SPEC``, see
  ``drive``): what needs task retries (``local[2,2]``) or a driver killed with SIGKILL and started again on the same
  checkpoint.  Those are marked ``spark`` by hand, so that under xdist they run alone as the others do.

The driver records, from the executors, which message ids each (run, source batch, partition, task attempt) read:
``record/<tag>-b<batch>-p<partition>-a<attempt>.json``, so that a replay can be compared with the first read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
SESSION_START_S = 90     # a driver's own session starts in ~5-15 s on a loaded 2-core box


# -- the driver of its own (runs in a subprocess) ------------------------------------------------------------------

def _watch(spec: dict):
    """A mapInArrow function that passes the rows through, after recording the ids each task read and, as the spec
    says, failing the first attempt of partition 0 (``fail_read``) or hanging in partition 0 of source batch
    ``hang_batch`` (for the test to SIGKILL the driver)."""
    record, tag = spec.get("record"), spec.get("tag", "run")
    fail_read, hang_batch = spec.get("fail_read", False), spec.get("hang_batch")

    def watch(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        got = list(batches)
        table = pa.Table.from_batches(got) if got else None
        ids = table.column("id").to_pylist() if table is not None else []
        source_batch = table.column("batch")[0].as_py() if ids else -1
        if record and ids:
            name = f"{tag}-b{source_batch}-p{ctx.partitionId()}-a{ctx.attemptNumber()}.json"
            Path(record, name).write_text(json.dumps(ids))
        if fail_read and ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and ids:
            Path(record, f"failed-b{source_batch}").touch()
            raise RuntimeError("injected: the first attempt of partition 0 fails after its read")
        if hang_batch is not None and source_batch == hang_batch and ctx.partitionId() == 0:
            Path(record, "hanging").write_text(str(os.getpid()))
            time.sleep(300)   # the test kills the driver meanwhile
        yield from got

    return watch


def _fail_midway(spec: dict):
    """A mapInArrow function for the sink retry: partition 0's first attempt yields ``fail_after`` rows, waits until
    the broker stored a push of them (so that the retry pushes something again), and fails."""
    port, queue, fail_after = spec["port"], spec["results"], spec["fail_after"]

    def fail_midway(batches):
        from pyspark import TaskContext

        from shardbroker.cli.client import BlockingClient

        ctx = TaskContext.get()
        failing = ctx.partitionId() == 0 and ctx.attemptNumber() == 0
        sent = 0
        for b in batches:
            yield b
            sent += b.num_rows
            if failing and sent >= fail_after:
                stored = 0
                with BlockingClient.connect("127.0.0.1", port) as c:
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        stored = c.request("qstat", queue=queue)["stat"]["messages"]
                        if stored >= 1000:
                            break
                        time.sleep(0.05)
                Path(spec["record"], "failed").write_text(str(stored))
                raise RuntimeError("injected: the first attempt of partition 0 fails after a push")

    return fail_midway


def drive(spec: dict) -> None:
    from pyspark.sql import functions as F

    from shardbroker.cli.loadtest.job import session

    t0 = time.monotonic()
    spark = session(spec.get("master", "local[2]"), 2, timeout_s=300)
    spark.conf.set("spark.sql.shuffle.partitions", "2")
    timings = {"session_s": round(time.monotonic() - t0, 1)}
    broker = f"127.0.0.1:{spec['port']}"
    if spec["job"] == "sink_retry":
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
        pad = "x" * 200   # rows big enough that the map's output leaves its worker's buffer as it is yielded
        df = spark.range(0, spec["n"], 1, 2).select(F.format_string(f"r%d{pad}", "id").alias("data"))
        df = df.mapInArrow(_fail_midway(spec), "data string")
        for _ in range(spec.get("writes", 1)):
            (df.write.format("shardbroker").option("broker", broker).option("queue", spec["results"])
             .option("writeId", "job-1").mode("append").save())
    else:
        reader = (spark.readStream.format("shardbroker").option("broker", broker).option("queue", spec["queue"])
                  .option("consumer", spec.get("consumer", "etl")).option("numPartitions", "2")
                  .option("leaseSeconds", str(spec.get("lease", 60))))
        if spec.get("most"):
            reader = reader.option("maxMessagesPerTrigger", str(spec["most"]))
        df = reader.load()
        df = df.mapInArrow(_watch(spec), df.schema)
        if spec.get("sink") == "queue":
            writer = (df.select(F.col("id").alias("data")).writeStream.format("shardbroker")
                      .option("broker", broker).option("queue", spec["results"]))
        else:
            writer = df.writeStream.format("parquet").option("path", spec["out"])
        q = writer.option("checkpointLocation", spec["checkpoint"]).trigger(availableNow=True).start()
        if not q.awaitTermination(spec.get("timeout", 120)):
            raise SystemExit("the query did not end in time")
        if q.exception() is not None:
            raise SystemExit(f"the query failed: {q.exception()}")
        timings["query_s"] = round(time.monotonic() - t0 - timings["session_s"], 1)
        if spec.get("sink") != "queue":
            rows = spark.read.parquet(spec["out"]).select("id", "delivery_count", "batch").collect()
            Path(spec["result"]).write_text(json.dumps([list(r) for r in rows]))
    Path(spec["timings"]).write_text(json.dumps(timings))
    spark.stop()


if __name__ == "__main__":
    drive(json.loads(sys.argv[1]))
    sys.exit(0)


# -- the tests' side ---------------------------------------------------------------------------------------------

from support.harness import Raw  # noqa: E402  (not needed by the driver above, and not on its path)

pytestmark = pytest.mark.slow


def own_driver(test):
    """A test with a driver of its own: ``spark`` by hand (it uses no ``spark`` fixture), and time for two Spark
    sessions to start on a loaded box."""
    return pytest.mark.spark(pytest.mark.timeout(300)(test))


@pytest.fixture
def driver(tmp_path):
    """driver(spec, name) -> a Driver started; whatever is left of it is killed at teardown."""
    started: list[Driver] = []

    def start(spec: dict, name: str) -> Driver:
        started.append(Driver(tmp_path, spec, name))
        return started[-1]

    yield start
    for d in started:
        d.kill()


class Driver:
    """This file run as a Spark driver in a session of its own; ``kill()`` is a crash of the driver's machine:
    SIGKILL to every process of the session (the JVM, its Python workers: the pyspark daemon makes a process group
    of its own, not a session)."""

    def __init__(self, tmp: Path, spec: dict, name: str) -> None:
        self.spec = dict(spec, timings=str(tmp / f"{name}.timings.json"))
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(HERE), json.dumps(self.spec)], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, stdin=subprocess.DEVNULL,
                                     cwd=HERE.parents[2])

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


def wait_for(what, timeout: float, step: float = 0.05, message: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message or f"not true in {timeout}s")
        time.sleep(step)


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


# -- 2. a task retried after its read -------------------------------------------------------------------------------

@own_driver
def test_a_task_retried_after_its_read_reads_the_same_messages_again(broker, driver, tmp_path):
    n = 4000
    ids = push_ids(broker, "jobs", n)
    spec = stream_spec(tmp_path, broker, master="local[2,2]", most=2000, fail_read=True)
    timings = driver(spec, "retry").wait(SESSION_START_S + 120)
    record = Path(spec["record"])
    failed = sorted(f.name for f in record.glob("failed-b*"))
    assert failed == ["failed-b1", "failed-b2"], failed           # partition 0 of each batch failed once
    first = {f.name: set(json.loads(f.read_text())) for f in record.glob("run-b*-p0-a0.json")}
    again = {f.name.replace("-a1", "-a0"): set(json.loads(f.read_text())) for f in record.glob("run-b*-p0-a1.json")}
    assert first and first == again                               # the retry read what the first attempt read
    rows = json.loads(Path(spec["result"]).read_text())
    got = Counter(r[0] for r in rows)
    assert set(got) == set(ids) and len(rows) == n, (len(rows), len(got))
    assert {r[1] for r in rows} == {1}                            # delivery_count: nothing leased twice
    stat = qstat(broker, "jobs")
    assert (stat["delivered"], stat["redelivered"], stat["in_flight"], stat["visible"]) == (n, 0, 0, 0), stat
    print("timings", timings)


# -- 6. the sink: a write() that fails once --------------------------------------------------------------------------

@own_driver
def test_a_sink_task_retried_after_a_push_stores_each_row_once(broker, driver, tmp_path):
    n = 3000
    record = tmp_path / "record"
    record.mkdir()
    spec = {"job": "sink_retry", "master": "local[2,2]", "port": broker.port, "results": "results", "n": n,
            "fail_after": 1500, "record": str(record)}
    timings = driver(spec, "sink").wait(SESSION_START_S + 120)
    assert int((record / "failed").read_text()) >= 1000   # the failed attempt had stored a push of 1,000
    stat = qstat(broker, "results")
    assert stat["messages"] == stat["visible"] == n, stat
    assert stat["pushed"] == n, stat                       # pushed: the messages stored
    assert stat["duplicate_pushes"] == 1000, stat          # the retry's first push was answered as a duplicate
    data = drain(broker, "results")
    assert len(data) == len(set(data)) == n
    assert {d[:d.index("x")] for d in data} == {f"r{i}" for i in range(n)}
    print("timings", timings)


# -- 3. the driver killed inside batch k, restarted within the lease ----------------------------------------------

@own_driver
def test_a_driver_killed_in_a_batch_replays_it_with_the_same_messages_and_the_sink_stores_each_once(
        broker, driver, tmp_path):
    n, most, k = 10_000, 2000, 3
    ids = push_ids(broker, "jobs", n)
    spec = stream_spec(tmp_path, broker, most=most, lease=60, sink="queue", results="results", tag="run1",
                       hang_batch=k)
    first = driver(spec, "run1")
    record = Path(spec["record"])
    wait_for(lambda: (record / "hanging").exists() or first.proc.poll() is not None, SESSION_START_S + 60,
             message="batch k never started")
    assert first.proc.poll() is None, first.log()
    # partition 1 of batch k pushes its half meanwhile: the replay pushes it again
    wait_for(lambda: qstat(broker, "results")["messages"] >= (k - 1) * most + most // 2, 30,
             message="partition 1 of batch k never pushed")
    first.kill()
    before = recorded(record, "run1")
    assert sorted(before) == list(range(1, k + 1)) and len(before[k]) == most, {b: len(v) for b, v in before.items()}

    timings = driver(dict(spec, tag="run2", hang_batch=None), "run2").wait(SESSION_START_S + 120)
    after = recorded(record, "run2")
    assert min(after) == k, sorted(after)                   # the restart began with batch k again ...
    assert sorted(after[k]) == sorted(before[k])            # ... reading the same messages
    read = [i for b in sorted(set(before) | set(after)) for i in (after.get(b) if b >= k else before[b])]
    assert sorted(read) == sorted(ids)                      # batches < k from run 1, k and on from run 2
    stat = qstat(broker, "results")
    assert stat["messages"] == stat["visible"] == n, stat   # exactly n stored ...
    assert stat["duplicate_pushes"] == most // 2, stat       # ... partition 1 of batch k answered as duplicates
    assert sorted(drain(broker, "results")) == sorted(ids)
    src = qstat(broker, "jobs")
    assert (src["delivered"], src["redelivered"], src["in_flight"], src["visible"]) == (n, 0, 0, 0), src
    print("timings", timings)


# -- 4. restarted after the leases expired -------------------------------------------------------------------------

@own_driver
def test_a_restart_after_the_leases_expired_delivers_the_lost_batch_again(broker, driver, tmp_path):
    n, most, k, lease = 6000, 2000, 2, 4
    ids = push_ids(broker, "jobs", n)
    spec = stream_spec(tmp_path, broker, most=most, lease=lease, tag="run1", hang_batch=k)
    first = driver(spec, "run1")
    record = Path(spec["record"])
    wait_for(lambda: (record / "hanging").exists() or first.proc.poll() is not None, SESSION_START_S + 60,
             message="batch k never started")
    assert first.proc.poll() is None, first.log()
    first.kill()
    lost = recorded(record, "run1")[k]
    assert len(lost) == most
    wait_for(lambda: qstat(broker, "jobs")["in_flight"] == 0, lease + 15, step=0.2,
             message="the leases of batch k never expired")

    timings = driver(dict(spec, tag="run2", hang_batch=None), "run2").wait(SESSION_START_S + 120)
    rows = json.loads(Path(spec["result"]).read_text())
    counts: dict[str, list[int]] = {}
    for id_, deliveries, _ in rows:
        counts.setdefault(id_, []).append(deliveries)
    assert set(counts) == set(ids)                                       # every id, none lost
    assert all(min(counts[i]) >= 2 for i in lost), Counter(min(counts[i]) for i in lost)
    # at-least-once: a message read twice shows it by its delivery count
    assert all(sorted(c)[1:] == [] or min(sorted(c)[1:]) >= 2 for c in counts.values())
    stat = qstat(broker, "jobs")
    assert stat["redelivered"] >= most and stat["in_flight"] == stat["visible"] == 0, stat
    print("timings", timings, "copies", Counter(len(c) for c in counts.values()))


# -- in the shared session ------------------------------------------------------------------------------------------

def source(spark, broker, queue: str = "jobs", **options):
    reader = (spark.readStream.format("shardbroker").option("broker", f"127.0.0.1:{broker.port}")
              .option("queue", queue).option("consumer", options.pop("consumer", "etl")))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def rows_read(q) -> int:
    return sum(p["numInputRows"] for p in q.recentProgress)


# 1. exact count, and the idle tick acking the last batch
def test_a_stream_reads_every_message_once_and_acks_the_last_batch_within_a_trigger(spark, broker, tmp_path):
    n, most, trigger = 10_000, 2000, 1.0
    ids = push_ids(broker, "jobs", n)
    out, ck = tmp_path / "out", tmp_path / "ck"
    df = source(spark, broker, maxMessagesPerTrigger=most, numPartitions=2)
    q = (df.writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(ck))
         .trigger(processingTime=f"{trigger} seconds").start())
    try:
        wait_for(lambda: rows_read(q) >= n or q.exception(), 90, step=0.05, message="the stream never read n")
        done = time.monotonic()
        assert q.exception() is None, q.exception()
        wait_for(lambda: qstat(broker, "jobs")["in_flight"] == 0, 2 * trigger + 5, step=0.1,
                 message=f"the last batch was not acked: {qstat(broker, 'jobs')}")
        acked_after = time.monotonic() - done
    finally:
        q.stop()
    rows = spark.read.parquet(str(out)).select("id", "delivery_count", "batch").collect()
    got = Counter(r.id for r in rows)
    assert len(rows) == n and set(got) == set(ids), (len(rows), len(got))   # the set, no duplicates
    assert {r.delivery_count for r in rows} == {1}
    assert max(Counter(r.batch for r in rows).values()) <= most
    stat = qstat(broker, "jobs")
    assert (stat["delivered"], stat["redelivered"], stat["acked"], stat["in_flight"]) == (n, 0, n, 0), stat
    assert acked_after <= 2 * trigger + 1.5, f"the idle tick acked the last batch {acked_after:.1f} s after it"
    print(f"last batch acked {acked_after:.2f} s after its rows were read")


# 7. the read limit, and Trigger.AvailableNow draining and stopping
def test_available_now_drains_the_queue_in_batches_within_the_limit_and_stops(spark, broker, tmp_path):
    n, most = 3500, 1000
    ids = push_ids(broker, "jobs", n, chunk=500)
    out, ck = tmp_path / "out", tmp_path / "ck"
    df = source(spark, broker, maxMessagesPerTrigger=most, numPartitions=3)
    q = (df.writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(ck))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(90), "AvailableNow did not stop"
    assert q.exception() is None, q.exception()
    rows = spark.read.parquet(str(out)).select("id", "batch", "partition").collect()
    sizes = Counter(r.batch for r in rows)
    assert sorted(sizes.values(), reverse=True) == [1000, 1000, 1000, 500], sizes
    assert sorted(r.id for r in rows) == sorted(ids)
    assert {r.partition for r in rows} == {0, 1, 2}
    stat = qstat(broker, "jobs")
    assert (stat["visible"], stat["in_flight"], stat["acked"]) == (0, 0, n), stat   # the tick acked the last


# 8. a batch slower than the lease (the leases kept by the reader's thread: latestOffset is not called while a
# batch runs, and the extension from there, before 9260c49, lost them all).  Exclusive: a thread that extends a
# 2 s lease every 0.67 s must get a CPU in time, which a loaded machine does not promise.
@pytest.mark.exclusive
def test_a_batch_slower_than_twice_the_lease_keeps_its_leases(spark, broker, tmp_path):
    n, most, lease = 2000, 1000, 2
    ids = push_ids(broker, "jobs", n)
    seen: list[tuple[int, str, int]] = []

    def slow(batch_df, batch_id):
        rows = batch_df.select("id", "delivery_count").collect()   # the read: the leases start here
        seen.extend((batch_id, r.id, r.delivery_count) for r in rows)
        if rows:
            time.sleep(2.5 * lease)

    df = source(spark, broker, maxMessagesPerTrigger=most, numPartitions=2, leaseSeconds=lease)
    q = (df.writeStream.foreachBatch(slow).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(90), "AvailableNow did not stop"
    assert q.exception() is None, q.exception()
    stat = qstat(broker, "jobs")
    copies = Counter(i for _, i, _ in seen)
    summary = (f"read {len(seen)} rows, {len(copies)} distinct of {n}, delivery counts "
               f"{dict(Counter(d for _, _, d in seen))}; qstat redelivered={stat['redelivered']} "
               f"expired={stat['expired']} visible={stat['visible']} in_flight={stat['in_flight']}")
    assert {d for _, _, d in seen} == {1} and stat["redelivered"] == stat["expired"] == 0, summary
    assert sorted(copies) == sorted(ids) and set(copies.values()) == {1}, summary
    assert stat["visible"] == stat["in_flight"] == 0, summary


# a clean stop between batches, and a restart
def test_a_restart_after_a_clean_stop_acks_the_last_batch(spark, broker, tmp_path):
    # The lease is long enough for a restart on a loaded machine: the test is that the restart acks the batch,
    # not that the lease runs out (were it not acked, it would still be in flight, then read again).
    n, lease = 1000, 30
    ids = push_ids(broker, "jobs", n)
    out, ck = tmp_path / "out", tmp_path / "ck"

    def start(trigger: dict):
        df = source(spark, broker, numPartitions=2, leaseSeconds=lease)
        return (df.writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(ck))
                .trigger(**trigger).start())

    q = start({"processingTime": "60 seconds"})   # batch 0 at once, the next trigger (the tick) a minute later
    wait_for(lambda: rows_read(q) >= n or q.exception(), 60, message="the first batch never ran")
    q.stop()                                       # between batches: Spark committed the batch, the broker not
    assert qstat(broker, "jobs")["in_flight"] == n
    q = start({"availableNow": True})              # Spark commits the last batch of the run before, on the source
    assert q.awaitTermination(60) and q.exception() is None
    stat = qstat(broker, "jobs")
    assert (stat["in_flight"], stat["acked"], stat["expired"], stat["visible"]) == (0, n, 0, 0), (
        f"after the restart the batch committed before the stop was not acked: {stat}")
    rows = spark.read.parquet(str(out)).select("id", "delivery_count").collect()
    assert len(rows) == n and {r.id for r in rows} == set(ids)


# the sink, df.write twice under one writeId
def test_a_batch_write_sent_twice_under_its_write_id_stores_each_row_once(spark, broker):
    n = 2500
    df = spark.createDataFrame([(f"r{i}",) for i in range(n)], "data string").repartition(1)
    for _ in range(2):
        (df.write.format("shardbroker").option("broker", f"127.0.0.1:{broker.port}").option("queue", "results")
         .option("writeId", "w1").mode("append").save())
    stat = qstat(broker, "results")
    assert (stat["messages"], stat["pushed"], stat["duplicate_pushes"]) == (n, n, n), stat
    assert sorted(drain(broker, "results")) == sorted(f"r{i}" for i in range(n))


# 9. bad options
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("options, message", [
    ({"consumer": "c"}, "give exactly one of the options queue"),
    ({"queue": "jobs", "subject": "events", "consumer": "c"}, "give exactly one of the options queue"),
    ({"queu": "jobs", "consumer": "c"}, "unknown option 'queu'"),
    ({"queue": "jobs"}, "consumer: a queue source needs a consumer name"),
    ({"queue": "jobs", "consumer": "c", "leaseSeconds": "soon"}, "leaseSeconds: 'soon' must be an integer"),
    ({"queue": "jobs", "consumer": "c", "broker": "nowhere"}, "broker: 'nowhere' is not host:port"),
], ids=["neither", "both", "misspelt", "no-consumer", "bad-lease", "bad-broker"])
def test_a_bad_option_is_one_clear_error_at_load(spark, options, message):
    reader = spark.readStream.format("shardbroker")
    for key, value in options.items():
        reader = reader.option(key, value)
    with pytest.raises(Exception) as err:
        reader.load()
    assert message in str(err.value), str(err.value)[:3000]


def test_the_sink_without_a_data_column_is_one_clear_error_at_start(spark, tmp_path):
    df = spark.readStream.format("rate").load()
    with pytest.raises(Exception) as err:
        (df.writeStream.format("shardbroker").option("queue", "results")
         .option("checkpointLocation", str(tmp_path / "ck")).start().awaitTermination(30))
    assert "the sink needs a column data" in str(err.value), str(err.value)[:3000]


def test_a_broker_that_is_down_is_one_clear_error(spark, tmp_path):
    """At load(), before any query starts: the source checks that its broker answers."""
    port = free_port()
    with pytest.raises(Exception) as err:
        (spark.readStream.format("shardbroker").option("broker", f"127.0.0.1:{port}").option("queue", "jobs")
         .option("consumer", "c").load())
    text = str(err.value)
    assert f"cannot reach the broker at 127.0.0.1:{port}" in text and "Connection refused" in text, text[:3000]
    rows = spark.createDataFrame([("x",)], "data string")
    with pytest.raises(Exception) as err:   # and the sink, at start()
        rows.write.format("shardbroker").option("broker", f"127.0.0.1:{port}").option("queue", "q").mode(
            "append").save()
    assert f"cannot reach the broker at 127.0.0.1:{port}" in str(err.value), str(err.value)[:3000]


# the subject source: at-most-once
def test_a_subject_stream_gets_what_is_published_while_it_runs(spark, broker, tmp_path):
    df = (spark.readStream.format("shardbroker").option("broker", f"127.0.0.1:{broker.port}")
          .option("subject", "events").load())
    q = (df.writeStream.format("memory").queryName("subject_rows")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="0.5 seconds").start())
    try:
        wait_for(lambda: q.lastProgress is not None or q.exception(), 60, message="no first trigger")
        assert q.exception() is None, q.exception()        # subscribed at the first trigger
        sent = [f"e{i}" for i in range(200)]
        with Raw(broker.port) as c:
            for s in sent:
                assert c.request({"op": "pub", "topic": "events", "data": s})["ok"]
        wait_for(lambda: rows_read(q) >= len(sent) or q.exception(), 30, step=0.1,
                 message=f"only {rows_read(q)} of {len(sent)} rows arrived")
    finally:
        q.stop()
    rows = spark.table("subject_rows").collect()
    data = [bytes(r.data).decode() for r in rows]
    assert set(data) <= set(sent) and len(data) >= 1, data[:10]
    assert {r.subject for r in rows} == {"events"}
    print(f"{len(set(data))} of {len(sent)} published arrived, {len(data) - len(set(data))} twice")


# a crash between Spark's offset log entry for batch k+1 and its commit(k) on the source
def test_a_restart_that_replays_batch_k_plus_1_acks_batch_k_too(spark, broker, tmp_path):
    """Spark writes ``offsets/<k+1>`` and then calls ``commit(end of k)`` on the source (the broker's ack of batch
    k): a driver that dies between the two leaves batch k committed in Spark's commit log but not acked, and the
    restart replays k+1 without ever calling ``commit(k)``.  The checkpoint such a crash leaves is made here by
    hand: batch k run and committed (a clean stop before the next trigger), then ``offsets/<k+1>`` written as Spark
    writes it."""
    n, most = 2000, 1000
    ids = push_ids(broker, "jobs", n)
    out, ck = tmp_path / "out", tmp_path / "ck"

    def start(trigger: dict):
        df = source(spark, broker, numPartitions=2, maxMessagesPerTrigger=most)
        return (df.writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(ck))
                .trigger(**trigger).start())

    q = start({"processingTime": "60 seconds"})
    wait_for(lambda: rows_read(q) >= most or q.exception(), 60, message="the first batch never ran")
    q.stop()
    assert [f.name for f in (ck / "commits").glob("[0-9]*")] == ["0"] and qstat(broker, "jobs")["in_flight"] == most
    lines = (ck / "offsets" / "0").read_text().splitlines()
    assert json.loads(lines[-1]) == {"batch": 1, "size": most, "tick": 0}, lines
    (ck / "offsets" / "1").write_text("\n".join(lines[:-1] + [json.dumps({"batch": 2, "size": most, "tick": 0})]))

    q = start({"availableNow": True})
    assert q.awaitTermination(60) and q.exception() is None, q.exception()
    stat = qstat(broker, "jobs")
    rows = spark.read.parquet(str(out)).select("id").collect()
    assert sorted(r.id for r in rows) == sorted(ids)      # batch k+1 replayed: every message read once
    assert stat["in_flight"] == 0, (f"batch k, committed in Spark's log before the crash, was never acked: "
                                    f"{stat['in_flight']} leases left to expire and be delivered again")
