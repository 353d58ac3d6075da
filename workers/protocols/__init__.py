"""One folder per client protocol: its sans-I/O ``codec``, its ``session`` (a ``workers.connection.Connection``)
and, where it speaks work queues, its ``queue_verbs``.  ``cluster.config.protocols`` lists them: adding one is a
folder here and one line there."""
