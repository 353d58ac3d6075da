"""The ``shardbroker`` data source: options checked on the driver, then the reader or writer for the target."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from shardbroker.cli.spark.options import OptionError, parse
from shardbroker.cli.spark.rows import connect, schema


def reachable(options) -> None:
    """A broker that is down (or a wrong address, or refused credentials) is an error before the query starts."""
    connect(options).close()


class ShardbrokerDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "shardbroker"

    def schema(self) -> str:
        options = parse(self.options, reading=True)
        reachable(options)
        return schema(options)

    def streamReader(self, schema):
        options = parse(self.options, reading=True)
        if options.queue is not None:
            from shardbroker.cli.spark.queue_reader import QueueStreamReader
            return QueueStreamReader(options, schema)
        from shardbroker.cli.spark.subject_reader import SubjectStreamReader
        return SubjectStreamReader(options)

    def reader(self, schema):
        raise OptionError("a batch read of a queue has no commit to acknowledge it at: read it as a stream with "
                          "Trigger.AvailableNow (docs/spark.md)")

    def streamWriter(self, schema, overwrite: bool):
        from shardbroker.cli.spark.sink import StreamWriter, check_columns

        options = parse(self.options, reading=False)
        check_columns(options, schema)
        reachable(options)
        return StreamWriter(options)

    def writer(self, schema, overwrite: bool):
        from shardbroker.cli.spark.sink import BatchWriter, check_columns

        options = parse(self.options, reading=False)
        check_columns(options, schema)
        reachable(options)
        return BatchWriter(options)
