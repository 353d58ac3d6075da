"""The broker as a Spark sink (docs/spark.md): into a work queue, each row stored once; to a subject,
at-least-once.

- Rows go in pushes of up to 1,000 (one request each), in the order the partition yields them.  Each push carries
  a dedup id made of the query's id (which survives restarts), the batch, the partition and the push's position:
  a task retried, or a batch replayed after a restart, pushes the same rows under the same ids, and the broker
  stores nothing twice within ``queues.dedup_window`` (docs/queues.md).  A row's own ``dedup_id`` column takes
  over: then rows are pushed one at a time under their ids.  ``df.write`` (a batch job has no query id) dedups
  only with the option ``writeId``, a name the user gives the job and gives again when running it again.
- Columns: ``data`` (binary or string, UTF-8 text: the NDJSON protocol carries JSON text), and optional
  ``queue``/``subject`` (the option wins), ``dedup_id``, ``priority``.
- Publishing to a subject is at-least-once: NATS core has no dedup, so a retried task publishes its rows again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

from shardbroker.cli.spark.options import OptionError, Options
from shardbroker.cli.spark.rows import connect

PUSH = 1000   # rows a push carries (the broker's MAX_BATCH)
COLUMNS = {"data", "queue", "subject", "dedup_id", "priority"}


@dataclass
class Written(WriterCommitMessage):
    rows: int
    pushes: int


def check_columns(options: Options, schema) -> None:
    names = set(schema.names) if schema is not None else set()
    if "data" not in names:
        raise OptionError("the sink needs a column data (binary or string)")
    if options.queue is None and options.subject is None and not names & {"queue", "subject"}:
        raise OptionError("the sink needs the option queue or subject, or a queue or subject column")
    other = sorted(names - COLUMNS)
    if other:
        raise OptionError(f"the sink takes the columns data, queue, subject, dedup_id, priority; got {other[0]!r}")


def _text(value) -> str:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            raise ValueError("a data value is not UTF-8 text: the sink carries JSON text (encode binary data, "
                             "e.g. base64, first)") from None
    if value is None:
        raise ValueError("a data value is null")
    return str(value)


def _target(options: Options, fields: dict) -> tuple[str | None, str | None]:
    """(queue, subject) of a row: the option's, else the row's own column (as Kafka's topic option and column)."""
    if options.queue is not None or options.subject is not None:
        return options.queue, options.subject
    if fields.get("queue"):
        return fields["queue"], None
    if fields.get("subject"):
        return None, fields["subject"]
    raise ValueError("a row names no queue and no subject (and the sink has neither option)")


def write_rows(options: Options, batches: Iterator, prefix: str | None) -> Written:
    """Push (or publish) the rows of one partition, Arrow record batches as Spark hands them over (no Row object
    is made: most of a Python sink's cost); ``prefix``: what makes their dedup ids (None: none)."""
    count = pushes = 0
    pending: list[dict] = []
    with connect(options) as client:
        def flush(final: bool) -> None:
            nonlocal pushes, pending
            while len(pending) >= PUSH or final and pending:
                chunk, pending = pending[:PUSH], pending[PUSH:]
                dedup = {"dedup_id": f"{prefix}:{pushes}"} if prefix is not None else {}
                client.request("qpush", queue=options.queue, messages=chunk, **dedup)
                pushes += 1

        for batch in batches:
            cols = batch.to_pydict()
            n = batch.num_rows
            if options.queue is not None and set(cols) <= {"data", "priority"}:   # the common case, column-wise
                datas = [_text(d) for d in cols["data"]]
                priorities = cols.get("priority")
                if priorities is None or all(p is None for p in priorities):
                    pending += [{"data": d} for d in datas]
                else:
                    pending += [{"data": d} if p is None else {"data": d, "priority": p}
                                for d, p in zip(datas, priorities)]
                count += n
                flush(False)
                continue
            names = list(cols)
            for i in range(n):
                fields = {name: cols[name][i] for name in names}
                count += 1
                data = _text(fields["data"])
                queue, subject = _target(options, fields)
                if subject is not None:
                    client.pub(subject, data, wait=False)
                    continue
                own = fields.get("dedup_id")
                priority = fields.get("priority")
                item = {"data": data, **({"priority": priority} if priority is not None else {})}
                if own is not None or queue != options.queue:
                    dedup = {"dedup_id": own} if own is not None else \
                        {"dedup_id": f"{prefix}:r{count}"} if prefix is not None else {}
                    client.request("qpush", queue=queue, **item, **dedup)
                    continue
                pending.append(item)
                flush(False)
        flush(True)
        client.ping()   # the pipelined publishes answered: an error in one is raised here
    return Written(count, pushes)


def _task() -> tuple[str | None, str | None, int]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return (ctx.getLocalProperty("sql.streaming.queryId"), ctx.getLocalProperty("streaming.sql.batchId"),
            ctx.partitionId())


class StreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: Options) -> None:
        self.options = options

    def write(self, iterator: Iterator) -> Written:
        query, batch, partition = _task()
        return write_rows(self.options, iterator, f"{query}:{batch}:{partition}")

    def commit(self, messages: list, batchId: int) -> None:
        pass   # every push is stored and acknowledged in write(); the dedup ids make a replay store nothing

    def abort(self, messages: list, batchId: int) -> None:
        pass   # what a failed batch pushed stays: its replay is answered as duplicates


class BatchWriter(DataSourceArrowWriter):
    def __init__(self, options: Options) -> None:
        self.options = options

    def write(self, iterator: Iterator) -> Written:
        _, _, partition = _task()
        prefix = f"{self.options.write_id}:{partition}" if self.options.write_id else None
        return write_rows(self.options, iterator, prefix)
