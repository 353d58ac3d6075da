"""A worker process's entry point: the fresh interpreter ``cluster.supervisor.launch`` starts runs ``main``.

The command line is ``<python> <flags> -S -c <boot> broker-worker <index> <boot fd> <control fd>``.  The worker's
modules are imported first, while the supervisor gets ready and writes the arguments (pickled) to the boot pipe;
then they are read, and ``workers.process.main`` runs the worker until it exits.  Nothing here imports what only
the supervisor needs, and the supervisor imports nothing of this package.
"""

from __future__ import annotations

import pickle
import socket
import sys


def main() -> None:
    _marker, _index, boot_fd, ctl_fd = sys.argv[1:5]
    from shardbroker.workers.process import (
        main as worker_main,  # the bulk of the start-up: asyncio, uvloop, zmq, the hub
    )

    with open(int(boot_fd), "rb") as fh:
        data = fh.read()
    if not data:  # the supervisor failed (or was killed) before it could use this worker
        sys.exit(0)
    args = pickle.loads(data)
    ctl_sock = socket.socket(fileno=int(ctl_fd))
    ctl_sock.set_inheritable(False)
    worker_main(*args[:5], ctl_sock, *args[5:])
