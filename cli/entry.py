"""``brokerctl``'s entry point: as little as possible before a Ctrl-C is handled.

``brokerctl start`` notes Ctrl-C and SIGTERM from its first line of Python on (``cli.stops.STOPS``) and hands them
to the supervisor once its loop runs: a stop while the broker is still starting is a stop like any other (exit 0, no
traceback).  What comes before (the interpreter's own start, ~20 ms) is Python's.  Then it starts the fork server
(cluster.supervisor.forkserver), whose imports of the workers' modules run while the CLI and the supervisor import
theirs.
"""

from __future__ import annotations

import signal
import sys

from shardbroker.cli.stops import STOPS


def main() -> None:
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command == "start":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: STOPS.append(signum))
        if "--help" not in sys.argv:
            from shardbroker.cluster.supervisor import forkserver

            forkserver.prestart()  # the workers' imports, in the fork server, while the supervisor does its own
    from shardbroker.cli.main import main as run  # click and every command's options: the bulk of the start-up

    run()
