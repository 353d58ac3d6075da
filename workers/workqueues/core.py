"""Which of the work queues' per-message loops this process runs: the compiled ones
(``workers/workqueues/_qcore.c``) where they were built, else the pure Python reference
(``workers.workqueues.purecore``), chosen as the publishing hot path is (``workers.speedups``, whose
``SHARDBROKER_NO_EXTENSIONS`` rules both out).  Both give identical results; the compiled ones are faster."""

from __future__ import annotations

from shardbroker.workers import speedups
from shardbroker.workers.workqueues import purecore

_impl, MISSING = speedups.load("shardbroker.workers.workqueues._qcore", purecore)
IMPLEMENTATION = "pure" if _impl is purecore else "compiled"
b64url_chunks = _impl.b64url_chunks
grant = _impl.grant
delivered = _impl.delivered
ack_run = _impl.ack_run
render_deliveries = _impl.render_deliveries
flat_dumps = _impl.flat_dumps
snapshot_pushes = _impl.snapshot_pushes
store_run = _impl.store_run
store_put = _impl.store_put
