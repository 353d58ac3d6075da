"""PySpark looks for installed top-level modules named ``pyspark_*`` holding a ``DefaultSource`` and registers it
(pyspark/sql/worker/lookup_data_sources.py): with this package installed, ``format("shardbroker")`` works in any
session, no ``spark.dataSource.register`` needed.  The code is ``shardbroker.cli.spark``."""

from shardbroker.cli.spark.source import ShardbrokerDataSource as DefaultSource

__all__ = ["DefaultSource"]
