"""Pub/sub subjects as a Spark stream: **at-most-once**, as Spark's own socket source is not fault-tolerant.

NATS core keeps no message for anyone, so nothing can be read twice: the stream reader (which lives in one
long-lived Python process on the driver) subscribes and keeps what arrives in memory, bounded (``BUFFER``; past
it the oldest go, and are counted in the log); a batch carries its rows to the executors in its partition.  What
the driver holds when it stops or crashes is lost, and so is what is published while no query runs.  For
at-least-once, publish into a work queue and read that (docs/spark.md).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from shardbroker.cli.spark.options import Options
from shardbroker.cli.spark.rows import connect

log = logging.getLogger("shardbroker.spark")

BUFFER = 100_000   # messages the driver keeps between batches


@dataclass(frozen=True)
class SubjectPartition(InputPartition):
    rows: tuple
    include_headers: bool


class SubjectStreamReader(DataSourceStreamReader):
    def __init__(self, options: Options) -> None:
        self.options = options
        self._client = None
        self._buffer: collections.deque = collections.deque()
        self._first = 0      # the sequence number of the buffer's first message
        self._dropped = 0

    def _poll(self) -> None:
        if self._client is None or self._client.closed:
            self._client = connect(self.options)
            self._client.sub(self.options.subject)
        while True:
            try:
                delivery = self._client.next_message(timeout=0.001)
            except TimeoutError:
                return
            self._buffer.append((delivery.topic, _bytes(delivery.data), delivery.extra.get("reply"),
                                 time.time()))
            if len(self._buffer) > BUFFER:
                self._buffer.popleft()
                self._first += 1
                self._dropped += 1
                if self._dropped % 10_000 == 1:
                    log.warning("subject %s: %d message(s) dropped, the query reads slower than they come",
                                self.options.subject, self._dropped)

    def initialOffset(self) -> dict:
        return {"seq": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        most = self.options.max_per_trigger
        return ReadMaxRows(most) if most is not None else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        self._poll()
        end = self._first + len(self._buffer)
        if isinstance(limit, ReadMaxRows):
            end = min(end, max(start["seq"], self._first) + limit.max_rows)
        return {"seq": end}

    def partitions(self, start: dict, end: dict) -> list[SubjectPartition]:
        lo = max(start["seq"], self._first) - self._first
        hi = end["seq"] - self._first
        rows = tuple(self._buffer[i] for i in range(lo, max(lo, min(hi, len(self._buffer)))))
        return [SubjectPartition(rows, self.options.include_headers)] if rows else []

    def commit(self, end: dict) -> None:
        while self._buffer and self._first < end["seq"]:
            self._buffer.popleft()
            self._first += 1

    def read(self, partition: SubjectPartition) -> Iterator[tuple]:
        for subject, data, reply, at in partition.rows:
            row = (subject, data, reply, _timestamp(at))
            yield row + ({},) if partition.include_headers else row

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()


def _bytes(data) -> bytes:
    import orjson

    return data.encode() if isinstance(data, str) else orjson.dumps(data)


def _timestamp(seconds: float):
    import datetime

    return datetime.datetime.fromtimestamp(seconds, datetime.UTC)
