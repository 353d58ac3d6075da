"""Which hot path this process runs: the compiled one (``workers/_speedups.c``) where it was built, else the pure
Python reference (``workers.purepath``).  Both give byte-identical results; the compiled one is faster.

``SHARDBROKER_NO_EXTENSIONS=1`` forces the pure path (as aiohttp's ``AIOHTTP_NO_EXTENSIONS``): to compare the two,
or to rule the extension out when something looks wrong.  A worker logs which path it runs when it starts, and
``/varz`` shows it (``hot_path``).
"""

from __future__ import annotations

import os

from . import purepath

FORCED_PURE = os.environ.get("SHARDBROKER_NO_EXTENSIONS", "") not in ("", "0")
MISSING = ""   # why the compiled path is not in use, when it is not

if FORCED_PURE:
    _impl = purepath
    MISSING = "SHARDBROKER_NO_EXTENSIONS is set"
else:
    try:
        from . import _speedups as _impl  # type: ignore[no-redef]
    except ImportError as exc:
        _impl = purepath
        MISSING = f"the compiled extension is not built ({exc}); `pip install .` with a C compiler builds it"

IMPLEMENTATION = "pure" if _impl is purepath else "compiled"
scan_pubs = _impl.scan_pubs
msg_tails = _impl.msg_tails
ndjson_runs = _impl.ndjson_runs


def describe() -> str:
    """One line for the log: which path, and why not the compiled one."""
    if IMPLEMENTATION == "compiled":
        return "hot path: compiled (workers._speedups)"
    return f"hot path: pure Python ({MISSING})"
