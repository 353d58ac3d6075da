"""A Spark driver of its own, run as a script by tests/tools/test_spark_driver.py (``python spark_driver.py
SPEC``): what needs task retries (``local[2,2]``) or a driver killed with SIGKILL and started again on the same
checkpoint.  It records, from the executors, which message ids each (run, source batch, partition, task
attempt) read: ``record/<tag>-b<batch>-p<partition>-a<attempt>.json``, so that a replay can be compared with
the first read."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

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
