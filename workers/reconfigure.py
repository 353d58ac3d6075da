"""A configuration reload, on a worker (the supervisor's half is cluster.supervisor.reload): the keys that may change
at run time, applied to what this worker holds.

The supervisor sends only configurations whose other keys are unchanged.  Limits kept per connection are updated on
the open connections where that is safe (the pending-bytes bound, and with it the backpressure threshold); the
line and subject length limits, read when a connection opens, hold for connections opened from now on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shardbroker.cluster.config import Config

if TYPE_CHECKING:
    from shardbroker.workers.auth import Authenticator
    from shardbroker.workers.hub import Hub

log = logging.getLogger("broker.worker")


def apply(config: Config, hub: Hub | None, auth: Authenticator) -> None:
    logging.getLogger().setLevel(config.logging.level.upper())
    auth.config = config.security   # failure limits, auth timeout, no_auth_user, iterations (security.enabled stays)
    if hub is None:   # still booting: the rest is read from the config when it is built
        return
    hub.config = config
    hub.limits = config.limits
    hub.owned.limit = config.limits.max_tracked_subjects
    hub.stall_bytes = max(1024, config.limits.max_pending_bytes // 4)
    for conn in list(hub.conns.values()):
        conn.max_pending = config.limits.max_pending_bytes
        conn.flush_at = min(256 * 1024, conn.max_pending // 4)
        if conn.transport is not None and not conn.closed:
            conn.transport.set_write_buffer_limits(high=hub.stall_bytes, low=hub.stall_bytes // 2)
