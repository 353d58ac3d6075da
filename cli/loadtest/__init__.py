"""``brokerctl loadtest``: load tests run as one Spark barrier stage (docs/loadtest.md)."""
