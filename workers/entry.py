"""A worker process's entry point, however the worker was started (``cluster.supervisor.launch``).

A worker is either forked by the fork server (``workers.forkserver``), which imported the worker's modules once
for every worker, or, where there is none, a fresh interpreter whose command line is
``<python> <flags> -S -c <boot> broker-worker <index> <boot fd> <control fd>`` and which runs ``main``: it imports
the worker's modules first, while the supervisor gets ready and writes the arguments (pickled) to the boot pipe.
Both then ``run``: read the arguments, and run ``workers.process.main`` until the worker exits.  Nothing here
imports what only the supervisor needs; the supervisor imports ``MARKER`` alone, which costs it nothing.
"""

from __future__ import annotations

import pickle
import socket
import sys

# A worker's command line carries `broker-worker <index>` (`ps`, and the tests, find workers and their index by it).
MARKER = "broker-worker"


def main() -> None:
    """The fresh interpreter's entry (``sys.argv``: ``-c broker-worker <index> <boot fd> <control fd>``)."""
    _marker, _index, boot_fd, ctl_fd = sys.argv[1:5]
    import shardbroker.workers.process  # noqa: F401  the bulk of the start-up: asyncio, uvloop, zmq, the hub

    run(int(boot_fd), int(ctl_fd))


def run(boot_fd: int, ctl_fd: int) -> None:
    """Read the arguments the supervisor writes to the boot pipe, then be the worker (this exits the process)."""
    from shardbroker.workers.process import main as worker_main

    with open(boot_fd, "rb") as fh:
        data = fh.read()
    if not data:  # the supervisor failed (or was killed) before it could use this worker
        sys.exit(0)
    args = pickle.loads(data)
    ctl_sock = socket.socket(fileno=ctl_fd)
    ctl_sock.set_inheritable(False)
    worker_main(*args[:5], ctl_sock, *args[5:])
