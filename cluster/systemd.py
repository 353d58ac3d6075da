"""sd_notify without a dependency: a datagram to $NOTIFY_SOCKET (as gunicorn's systemd.py does).

With ``Type=notify`` in the unit, systemd considers the service started on ``READY=1`` (sent once every worker
is up and the listeners accept) and knows it is stopping on ``STOPPING=1``.  Without $NOTIFY_SOCKET this does
nothing.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False
