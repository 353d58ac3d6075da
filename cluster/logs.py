"""Logging for every process of the broker: one line per record on stderr, tagged with the process's role.

stderr is what systemd's journal and a terminal both collect; the tag says which process spoke
(``supervisor``, ``worker 3``).
"""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s.%(msecs)03d [{role}] %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
