"""Which hot path this process runs: the compiled one (``workers/_speedups.c``) where it was built, else the pure
Python reference (``workers.purepath``).  Both give byte-identical results; the compiled one is faster.

``SHARDBROKER_NO_EXTENSIONS=1`` forces the pure path (as aiohttp's ``AIOHTTP_NO_EXTENSIONS``): to compare the two,
or to rule the extension out when something looks wrong.  A worker logs which path it runs when it starts, and
``/varz`` shows it (``hot_path``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from shardbroker.workers import purepath

FORCED_PURE = os.environ.get("SHARDBROKER_NO_EXTENSIONS", "") not in ("", "0")


def load(compiled: str, pure: ModuleType) -> tuple[ModuleType, str]:
    """The compiled module named ``compiled`` where it was built and not ruled out, else ``pure``: -> (the module,
    why it is not the compiled one, or "").  The work queues' loops (``workers.workqueues.core``) load the same
    way."""
    if FORCED_PURE:
        return pure, "SHARDBROKER_NO_EXTENSIONS is set"
    try:
        return importlib.import_module(compiled), ""
    except ImportError as exc:
        return pure, f"the compiled extension is not built ({exc}); `pip install .` with a C compiler builds it"


# MISSING: why the compiled path is not in use, if not
_impl, MISSING = load("shardbroker.workers._speedups", purepath)
IMPLEMENTATION = "pure" if _impl is purepath else "compiled"
scan_pubs = _impl.scan_pubs
msg_tails = _impl.msg_tails
ndjson_runs = _impl.ndjson_runs
qpush_batch = _impl.qpush_batch
unplain = _impl.unplain


def describe() -> str:
    """One line for the log: which path, and why not the compiled one."""
    if IMPLEMENTATION == "compiled":
        return "hot path: compiled (workers._speedups)"
    return f"hot path: pure Python ({MISSING})"
