"""``python -m shardbroker.cli.loadtest`` and ``spark-submit .../cli/loadtest/__main__.py``: the same command as
``brokerctl loadtest``.  Absolute imports, because spark-submit runs this file as a script."""

from shardbroker.cli.loadtest.command import main

if __name__ == "__main__":
    main()
