"""Callbacks that must not stop the loop that runs them.

The fabric's reader, a sync point's waiters, the end of a turn and a queue shard's commit each run many callbacks
for many clients in one go.  An exception escaping one of them used to leave the rest undone: the fabric reader
(whose ZeroMQ descriptor is edge-triggered) then never read from the other workers again, and a commit dropped the
other clients' replies of that turn.  ``call`` runs one callback, and an exception is counted (``errors``, in
/varz and /metrics as ``callback_errors``) and logged with its traceback at most once a minute per place, so a
client that found a way to make one fail cannot fill the log either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("broker.guard")

_QUIET = 60.0   # seconds between two tracebacks from one place
errors = 0      # exceptions caught in this process since it started
_logged: dict[str, float] = {}


def call(where: str, fn: Callable[..., object], *args: object) -> bool:
    """``fn(*args)``; False (counted and logged) if it raised."""
    try:
        fn(*args)
    except Exception:
        failed(where)
        return False
    return True


def failed(where: str) -> None:
    """Count the exception being handled, raised in ``where``, and log it unless that place logged one lately."""
    global errors
    errors += 1
    now = time.monotonic()
    if now - _logged.get(where, -_QUIET) >= _QUIET:
        _logged[where] = now
        log.exception("%s raised; the others go on (%d caught in this process; the next from here is logged in "
                      "a minute at the earliest)", where, errors)
