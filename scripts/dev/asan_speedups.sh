#!/usr/bin/env bash
# The compiled hot path (workers/_speedups.c) under AddressSanitizer and UndefinedBehaviorSanitizer: builds a
# sanitized copy in a scratch directory and checks it against workers/purepath.py on random and mutated input.
#   scripts/dev/asan_speedups.sh [inputs] [seed]        (default 200000 inputs, seed 1; a few minutes on 2 cores)
# Any out-of-bounds read or write, use after free or undefined behaviour aborts with a report; a result that
# differs from the reference fails an assertion.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
gcc -shared -fPIC -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
    -I"$inc" workers/_speedups.c -o "$dir/_speedups_asan.so"
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
    "$PY" - "$dir/_speedups_asan.so" "${1:-200000}" "${2:-1}" <<'PYEOF'
import importlib.util, random, sys
sys.path.insert(0, ".")
from workers import purepath as p
spec = importlib.util.spec_from_file_location("workers._speedups", sys.argv[1])
c = importlib.util.module_from_spec(spec)
spec.loader.exec_module(c)
inputs, rng = int(sys.argv[2]), random.Random(int(sys.argv[3]))
pieces = [b"PUB foo 5\r\nhello\r\n", b"pub a r 3\r\nabc\r\n", b"PUB a 0\r\n\r\n", b"PUB  x\t 12 \r\n", b"\r\n", b"\n",
          b"PUB a 1234567890123\r\n", b"PUB a 3\r", b"SUB a 1\r\n", b'{"op":"pub","topic":"a","data":"x"}']
scans = 0
for _ in range(inputs):
    parts = [rng.choice(pieces) if rng.random() < 0.7 else rng.randbytes(rng.randrange(8))
             for _ in range(rng.randrange(12))]
    data = bytearray(b"".join(parts))
    for _ in range(rng.randrange(4)):
        if data:
            data[rng.randrange(len(data))] = rng.randrange(256)
    data = bytes(data)
    max_line, max_payload = rng.randrange(60), rng.randrange(40)
    for pos in range(0, len(data) + 1, max(1, len(data) // 7)):
        assert c.scan_pubs(data, pos, max_line, max_payload) == p.scan_pubs(data, pos, max_line, max_payload)
        scans += 1
    cut = rng.randrange(len(data) + 1)
    assert c.scan_pubs(data[:cut], 0, max_line, max_payload) == p.scan_pubs(data[:cut], 0, max_line, max_payload)
    lines = data.split(b"\n")
    assert c.ndjson_runs(lines) == p.ndjson_runs(lines)
    payloads = [data[:k] for k in range(0, len(data), 5)]
    assert c.msg_tails(payloads, data[:3] or None) == p.msg_tails(payloads, data[:3] or None)
print(f"{inputs:,} inputs, {scans:,} scans: no sanitizer report, the same results as workers/purepath.py")
PYEOF
