#!/usr/bin/env python3
"""Rows a second through the Spark source and sink (docs/spark.md), against the cost floor of a Python data source
on this machine, in the same run: the same queries on an in-memory Python source and into a no-op Python sink.

    .venv/bin/python scripts/measure/spark_connector.py                    # 200,000 rows, 100 B, local[2]
    .venv/bin/python scripts/measure/spark_connector.py --rows 500000 --per-trigger 50000

Source: ``readStream`` with ``Trigger.AvailableNow`` and ``maxMessagesPerTrigger`` into Spark's ``noop`` sink,
from a queue of the broker (2 workers, the journal on) and from an in-memory source yielding the same rows as
Arrow batches.  Sink: ``df.write`` of the same rows into a queue (``writeId``: dedup ids on) and into a Python
writer that drops them (an Arrow writer, as the sink is: the cheapest Python sink there is).  Each figure is the
wall time of the query alone (the session is started before).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from shardbroker.cli.bench import servers
from shardbroker.cli.client import BlockingClient
from shardbroker.cli.loadtest.job import session


class _Floor(DataSource):
    """N rows of ``size`` bytes in batches, made in memory: what any Python source costs, and nothing else."""

    @classmethod
    def name(cls) -> str:
        return "floor"

    def schema(self) -> str:
        return "id string, data binary"

    def streamReader(self, schema):
        return _FloorReader(int(self.options["rows"]), int(self.options["size"]))

    def writer(self, schema, overwrite):
        return _Drop()


class _FloorReader(DataSourceStreamReader):
    def __init__(self, rows: int, size: int) -> None:
        self.rows, self.size = rows, size

    def initialOffset(self) -> dict:
        return {"n": 0}

    def latestOffset(self, start: dict, limit) -> dict:
        most = limit.max_rows if isinstance(limit, ReadMaxRows) else self.rows
        return {"n": min(self.rows, start["n"] + most)}

    def getDefaultReadLimit(self):
        return ReadAllAvailable()

    def partitions(self, start: dict, end: dict) -> list:
        mid = (start["n"] + end["n"]) // 2
        return [InputPartition((start["n"], mid)), InputPartition((mid, end["n"]))]

    def read(self, partition):
        import pyarrow as pa

        lo, hi = partition.value
        yield pa.RecordBatch.from_arrays([pa.array([str(i) for i in range(lo, hi)]),
                                          pa.array([b"x" * self.size] * (hi - lo), pa.binary())], ["id", "data"])


class _Drop(DataSourceArrowWriter):
    def write(self, iterator) -> WriterCommitMessage:
        for _ in iterator:
            pass
        return WriterCommitMessage()


def _drain(spark, reader, per_trigger: int, where: str) -> float:
    t0 = time.perf_counter()
    query = (reader.option("maxMessagesPerTrigger", str(per_trigger)).load().writeStream.format("noop")
             .option("checkpointLocation", tempfile.mkdtemp(prefix=f"spark-{where}-")).trigger(availableNow=True)
             .start())
    query.awaitTermination()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100, help="bytes a row's data")
    ap.add_argument("--per-trigger", type=int, default=50_000)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"queues": {"max_messages": args.rows * 2, "max_bytes": 1 << 34}}, fh)
    server = servers.start_broker(2, config=fh.name)
    os.unlink(fh.name)
    broker = f"127.0.0.1:{server.ports['ndjson']}"
    spark = session(args.master, 2, timeout_s=600)
    try:
        spark.dataSource.register(_Floor)
        with BlockingClient.connect("127.0.0.1", server.ports["ndjson"]) as c:
            data = "x" * args.size
            for start in range(0, args.rows, 1000):
                c.request("qpush", queue="spark.in", messages=[{"data": data}] * min(1000, args.rows - start))
        floor_in = _drain(spark, spark.readStream.format("floor").option("rows", str(args.rows))
                          .option("size", str(args.size)).option("maxMessagesPerTrigger", str(args.per_trigger)),
                          args.per_trigger, "floor")
        ours_in = _drain(spark, spark.readStream.format("shardbroker").option("broker", broker)
                         .option("queue", "spark.in").option("consumer", "measure"), args.per_trigger, "queue")
        rows = spark.createDataFrame([(str(i), "x" * args.size) for i in range(args.rows)], "id string, data string")
        rows = rows.repartition(2).cache()
        rows.count()
        t0 = time.perf_counter()
        rows.select("data").write.format("floor").mode("append").option("rows", "0").option("size", "0").save()
        floor_out = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows.select("data").write.format("shardbroker").mode("append").option("broker", broker) \
            .option("queue", "spark.out").option("writeId", "measure").save()
        ours_out = time.perf_counter() - t0
        with BlockingClient.connect("127.0.0.1", server.ports["ndjson"]) as c:
            stored = c.request("qstat", queue="spark.out")["stat"]["messages"]
            left = c.request("qstat", queue="spark.in")["stat"]
        n = args.rows
        print(f"{n:,} rows of {args.size} B, {args.master}, {args.per_trigger:,} a trigger")
        print(f"source: queue {n / ours_in:,.0f} rows/s, in-memory floor {n / floor_in:,.0f} rows/s: "
              f"{floor_in / ours_in:.2f}x (left in the queue: visible {left['visible']}, in flight "
              f"{left['in_flight']})")
        print(f"sink:   queue {n / ours_out:,.0f} rows/s, no-op floor {n / floor_out:,.0f} rows/s: "
              f"{floor_out / ours_out:.2f}x (stored {stored:,})")
    finally:
        spark.stop()
        server.stop()


if __name__ == "__main__":
    main()
