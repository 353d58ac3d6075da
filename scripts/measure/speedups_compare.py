#!/usr/bin/env python3
"""Per-message cost of each hot-path function (workers/purepath.py), on every implementation at hand.

    .venv/bin/python scripts/measure/speedups_compare.py                      # the pure reference and workers._speedups
    .venv/bin/python scripts/measure/speedups_compare.py pp_cython pp_mypyc   # and modules built from copies of
    purepath.py

How the compiled path was chosen (docs/architecture.md): copies of workers/purepath.py built by
``cythonize -3 -i pp_cython.py`` and ``mypyc pp_mypyc.py`` (mypyc wants three variables of ``ndjson_runs`` typed),
in a scratch directory on ``sys.path``, timed against the reference and the C extension on the same inputs.
Neither Cython nor mypy is a dependency of the project.
"""

from __future__ import annotations

import importlib
import os
import sys
import timeit

sys.path.insert(0, os.getcwd())

from shardbroker.workers import purepath  # noqa: E402


def main() -> None:
    impls = {"pure (workers/purepath.py)": purepath}
    try:
        from shardbroker.workers import _speedups
        impls["C (workers/_speedups.c)"] = _speedups
    except ImportError as exc:
        print(f"workers._speedups not built: {exc}")
    for name in sys.argv[1:]:
        impls[name] = importlib.import_module(name)
    payload = b"x" * 128
    frame = b"PUB hot.path 128\r\n" + payload + b"\r\n"
    per_read = 65536 // len(frame)
    buf = frame * per_read
    lines = [b'{"op":"pub","topic":"hot.path","data":"' + payload + b'"}'] * 450
    payloads = [payload] * 450

    def per_message(fn, count: int) -> float:
        return min(timeit.repeat(fn, number=50, repeat=5)) / 50 / count * 1e9

    print("| implementation | scan_pubs | msg_tails | ndjson_runs |  (ns per message, 128 B payloads)")
    print("|---|---|---|---|")
    for name, m in impls.items():
        print(f"| {name} | {per_message(lambda: m.scan_pubs(buf, 0, 4096, 1 << 20), per_read):.0f} "
              f"| {per_message(lambda: m.msg_tails(payloads, None), 450):.0f} "
              f"| {per_message(lambda: m.ndjson_runs(lines), 450):.0f} |")


if __name__ == "__main__":
    main()
