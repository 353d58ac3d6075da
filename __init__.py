"""shardbroker: a multiprocess sharded pub/sub and work-queue broker for one machine.

The repository's root is this package (setup.py maps it), so the design's folders stay where they are and, once
installed, live under this one name:

- ``cluster``  the supervisor (``cluster.supervisor``), the configuration and the protocol registry
  (``cluster.config``), security (``cluster.security``) and monitoring (``cluster.monitoring``);
- ``workers``  a worker process: its core (hub, connections, the end of a turn), one folder per protocol
  (``workers.protocols``) and the work-queue engine (``workers.workqueues``);
- ``router``   subjects, the subscription trie, subject owners and the ZeroMQ fabric between workers;
- ``cli``      ``brokerctl`` and the tools that run outside the broker (client library, bench, load test, top).

docs/architecture.md draws the layers; pyproject.toml's [tool.importlinter] states them and the test suite checks
them.
"""
