"""What the source's rows are (the schema, and messages as Arrow record batches: 1.5-2.8× faster through PySpark
than tuples, ../shared/reference/spark-connector.md §3.1), and the connection every part opens to the broker."""

from __future__ import annotations

import base64

import orjson

from shardbroker.cli.client import BlockingClient
from shardbroker.cli.spark.options import Options

QUEUE_SCHEMA = ("queue string, id string, data binary, enqueued_at timestamp, delivery_count int, priority int, "
                "attempt string, receipt string, batch bigint, partition int")
SUBJECT_SCHEMA = "subject string, data binary, reply string, received_at timestamp"
HEADERS = ", headers map<string,string>"   # includeHeaders: as Kafka's source, the column only when asked for


def schema(options: Options) -> str:
    base = QUEUE_SCHEMA if options.queue is not None else SUBJECT_SCHEMA
    return base + (HEADERS if options.include_headers else "")


def connect(options: Options) -> BlockingClient:
    try:
        return BlockingClient.connect(options.host, options.port, user=options.user, password=options.password(),
                                      timeout=30.0)
    except OSError as exc:
        raise ConnectionError(f"cannot reach the broker at {options.host}:{options.port} (the option broker: its "
                              f"NDJSON listener): {exc.strerror or exc}") from None


def payload(message: dict) -> bytes:
    """A message's data as the bytes a NATS consumer gets: a JSON string's text, base64 undone, any other JSON
    value as its encoding."""
    data = message.get("data")
    if message.get("encoding") == "base64":
        return base64.b64decode(data)
    if isinstance(data, str):
        return data.encode()
    return orjson.dumps(data)


def arrow_batch(messages: list[dict], options: Options, batch: int, partition: int, spark_schema):
    import pyarrow as pa

    n = len(messages)
    columns = [
        pa.array([options.queue] * n, pa.string()),
        pa.array([m["id"] for m in messages], pa.string()),
        pa.array([payload(m) for m in messages], pa.binary()),
        pa.array([m.get("enqueued_at", 0) * 1000 for m in messages], pa.timestamp("us", tz="UTC")),
        pa.array([m.get("deliveries", 1) for m in messages], pa.int32()),
        pa.array([m.get("priority", 0) for m in messages], pa.int32()),
        pa.array([m["attempt"] for m in messages], pa.string()),
        pa.array([m["receipt"] for m in messages], pa.string()),
        pa.array([batch] * n, pa.int64()),
        pa.array([partition] * n, pa.int32()),
    ]
    names = ["queue", "id", "data", "enqueued_at", "delivery_count", "priority", "attempt", "receipt", "batch",
             "partition"]
    if options.include_headers:   # work-queue messages carry no headers: an empty map each
        columns.append(pa.array([[] for _ in messages], pa.map_(pa.string(), pa.string())))
        names.append("headers")
    return pa.RecordBatch.from_arrays(columns, names=names)
