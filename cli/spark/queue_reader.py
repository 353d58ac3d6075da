"""A work queue as a Spark stream: at-least-once, and a batch read twice reads the same messages while their leases
live (docs/spark.md).

- Offsets are ``{"batch": n, "size": s, "tick": t}``: batch ``n`` receives up to ``s`` messages.  ``latestOffset``
  (on the driver, every trigger, idle or not) asks the queue's depth once and plans the next batch within the read
  limit.  The leases of the batches Spark has not committed are extended every third of ``leaseSeconds`` by a
  thread of the reader's process (a long-lived Python process on the driver), not from ``latestOffset``: Spark
  plans the next batch only once the running one is done, so a batch slower than the lease would lose them.
- Each of ``numPartitions`` partitions receives on an executor, in receives of at most 1,000 messages, each named
  by an attempt id ``<consumer>/<batch>/<partition>/<chunk>`` (docs/queues.md#attempts): a retried task and a
  replay after a restart (Spark replays the unfinished batch with the same offsets) get the same deliveries back.
- ``commit(end)`` acks every lease of the batches up to ``end`` in one request per 1,000 attempt ids.  Spark calls
  it only while planning the next batch, so an idle stream would never commit its last one: ``idleCommit`` moves
  the offset once (``tick``), an empty batch that brings the commit within a trigger.
- Leases that expire anyway (a query stopped longer than ``leaseSeconds``) put their messages back: delivered
  again later, never lost, with ``delivery_count`` saying so.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from shardbroker.cli.spark.options import Options
from shardbroker.cli.spark.rows import arrow_batch, connect

log = logging.getLogger("shardbroker.spark")

CHUNK = 1000   # messages a receive leases at most (the broker's MAX_BATCH)


@dataclass(frozen=True)
class QueuePartition(InputPartition):
    options: Options
    batch: int
    partition: int
    max: int

    def attempts(self) -> list[str]:
        return attempt_ids(self.options.consumer, self.batch, self.partition, self.max)


def attempt_ids(consumer: str, batch: int, partition: int, most: int) -> list[str]:
    return [f"{consumer}/{batch}/{partition}/{c}" for c in range(math.ceil(most / CHUNK))]


def shares(size: int, partitions: int) -> list[int]:
    """``size`` messages over ``partitions``: the first ones take one more where it does not divide."""
    base, extra = divmod(size, partitions)
    return [base + (p < extra) for p in range(partitions)]


class QueueStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: Options, schema) -> None:
        self.options = options
        self.schema = schema
        self._client = None
        self._sizes: dict[int, int] = {}   # batch -> its planned size, for the batches not acked yet
        self._acked = -1                   # the last batch whose leases were acked
        self._available_now: int | None = None
        self._lock = threading.Lock()      # the keeper thread and Spark's calls share _sizes
        self._keeper: threading.Thread | None = None

    def __getstate__(self) -> dict:
        """What travels to the executors (``read`` runs on a copy): no connection, thread or lock."""
        return {"options": self.options, "schema": self.schema}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["options"], state["schema"])

    # -- the driver -----------------------------------------------------------------------------------------
    def _request(self, op: str, **fields):
        if self._client is None or self._client.closed:
            self._client = connect(self.options)
        try:
            return self._client.request(op, queue=self.options.queue, **fields)
        except (OSError, TimeoutError):
            self._client = None
            raise

    def initialOffset(self) -> dict:
        return {"batch": 0, "size": 0, "tick": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        most = self.options.max_per_trigger
        return ReadMaxRows(most) if most is not None else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: what the queue holds now, and no more, is read (in as many batches as the read
        limit makes)."""
        self._available_now = self._request("qstat")["stat"]["visible"]

    def _keep_leases(self) -> None:
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="shardbroker-leases", daemon=True)
            self._keeper.start()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        self._keep_leases()
        visible = self._request("qstat")["stat"]["visible"]
        size = visible
        if isinstance(limit, ReadMaxRows):
            size = min(size, limit.max_rows)
        if self._available_now is not None:
            size = min(size, self._available_now)
        if size > 0:
            if self._available_now is not None:
                self._available_now -= size
            end = {"batch": start["batch"] + 1, "size": size, "tick": 0}
            with self._lock:
                self._sizes[end["batch"]] = size
            return end
        if self.options.idle_commit and start["batch"] > self._acked and start["tick"] == 0 and start["size"]:
            return dict(start, tick=1)   # one empty batch, so that Spark commits the last one now
        return start

    def partitions(self, start: dict, end: dict) -> list[QueuePartition]:
        if end["batch"] == start["batch"] or not end["size"]:
            return []
        self._keep_leases()   # a restart replays its unfinished batch before it plans anything
        with self._lock:   # a replay after a restart plans nothing: the offsets say it
            self._sizes[end["batch"]] = end["size"]
            if start["size"] and start["batch"] > self._acked:
                # Spark writes batch k+1's offsets before it commits batch k: a restart in between replays k+1
                # and never commits k, whose leases must be acked with k+1's
                self._sizes.setdefault(start["batch"], start["size"])
        return [QueuePartition(self.options, end["batch"], p, share)
                for p, share in enumerate(shares(end["size"], self.options.partitions)) if share]

    def commit(self, end: dict) -> None:
        with self._lock:
            if end["size"] and end["batch"] > self._acked:
                # a batch Spark committed just before a restart was never planned by this process: its offset
                # says what it received
                self._sizes.setdefault(end["batch"], end["size"])
            sizes = {n: size for n, size in self._sizes.items() if n <= end["batch"]}
        attempts = self._attempts(sizes)
        for i in range(0, len(attempts), CHUNK):
            result = self._request("qack", attempts=attempts[i:i + CHUNK])
            if result.get("lost"):
                log.warning("queue %s: %d message(s) of batches up to %d had lost their leases before the commit "
                            "(leaseSeconds %d): delivered again later", self.options.queue, result["lost"],
                            end["batch"], self.options.lease_seconds)
        with self._lock:
            for n in sizes:
                self._sizes.pop(n, None)
        self._acked = max(self._acked, end["batch"])

    def _attempts(self, sizes: dict[int, int]) -> list[str]:
        return [a for n, size in sorted(sizes.items()) for p, share in enumerate(shares(size, self.options.partitions))
                for a in attempt_ids(self.options.consumer, n, p, share)]

    def _keep(self) -> None:
        """Every third of the lease, the uncommitted batches' leases run a whole lease again from now (on a
        connection of its own: Spark's calls use the other)."""
        client = None
        while True:
            time.sleep(self.options.lease_seconds / 3)
            with self._lock:
                attempts = self._attempts(dict(self._sizes))
            try:
                if client is None or client.closed:
                    client = connect(self.options)
                for i in range(0, len(attempts), CHUNK):
                    client.request("qextend", queue=self.options.queue, attempts=attempts[i:i + CHUNK],
                                   visibility_ms=self.options.lease_seconds * 1000)
            except Exception as exc:   # the broker away for a moment: the next round tries again
                log.warning("queue %s: extending the leases of uncommitted batches failed: %s", self.options.queue,
                            exc)
                client = None

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- the executors --------------------------------------------------------------------------------------
    def read(self, partition: QueuePartition) -> Iterator:
        options = partition.options
        rows: list[dict] = []
        with connect(options) as client:
            left = partition.max
            for attempt in partition.attempts():
                want = min(CHUNK, left)
                reply = client.request("qrecv", queue=options.queue, max=want, attempt=attempt,
                                       visibility_ms=options.lease_seconds * 1000)
                got = reply["messages"]
                rows.extend(dict(m, attempt=attempt) for m in got)
                left -= want
                if len(got) < want and not reply.get("replayed"):
                    # the queue had no more: the later attempt ids stay unused (their ack finds nothing).  A replay
                    # may come back short (a lease of it ended otherwise) while the later ones still hold theirs.
                    break
        yield arrow_batch(rows, options, partition.batch, partition.partition, self.schema)
