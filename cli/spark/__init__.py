"""The broker as a Spark source and sink (docs/spark.md): PySpark 4.3's Python Data Source API, format
``shardbroker``, found by PySpark itself through the ``pyspark_shardbroker`` module this package installs.

- ``source``: the data source (options, schema, which reader and writer);
- ``options``: the options, checked before the query starts;
- ``queue_reader``: a work queue, at-least-once with exact replay while the leases live (attempt ids);
- ``subject_reader``: pub/sub subjects, at-most-once (no replay: NATS core has none);
- ``sink``: queues (each row stored once, by dedup ids) and subjects (at-least-once).
"""
