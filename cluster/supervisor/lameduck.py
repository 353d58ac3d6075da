"""Lame duck mode, the supervisor's half (SIGUSR2, ``brokerctl lameduck``): take the broker out of service without
cutting every client at once, as nats-server's lame duck mode does.

1. Stop accepting: the listeners are closed.  (Under socket activation systemd keeps its copy of each: new
   connections wait in the backlog for the next instance instead of being refused.)
2. ``STOPPING=1``, and a status line counting the clients left; stop-timeout extensions while they fall.
3. Every worker is told the schedule (workers.lameduck): NATS clients get ``INFO {"ldm":true}`` at once, and after
   ``shutdown.lame_duck_grace_period`` every client is closed, spread over what is left of
   ``shutdown.lame_duck_duration`` (at most a second apart over the whole broker, as nats-server).
4. Once every worker has no client left, the usual graceful stop; the process exits 0.

SIGTERM does not cut it short (so the unit's stop may be SIGUSR2, or follow one); SIGQUIT or a second SIGINT do.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from shardbroker.cluster.config import Config

log = logging.getLogger("broker.lameduck")

_SLACK = 3.0   # past the duration: the last closes linger (LINGER, 2 s) before the workers say they are done


class Cluster(Protocol):
    """What lame duck mode needs of the supervisor (cluster.supervisor.core.Supervisor), named here: it imports this."""

    config: Config
    acceptor: Any       # acceptor.Acceptor or None
    status: Any         # service_status.ServiceStatus

    def live_slots(self) -> list[Any]: ...


class LameDuck:
    def __init__(self, cluster: Cluster) -> None:
        self.sup = cluster
        self.started = 0.0
        self.deadline = 0.0

    def begin(self, origin: str) -> dict:
        sd = self.sup.config.shutdown
        self.started = time.monotonic()
        self.deadline = self.started + sd.lame_duck_duration + _SLACK
        if self.sup.acceptor is not None:
            self.sup.acceptor.close()
        slots = self.sup.live_slots()
        total = sum(s.live for s in slots)
        window = sd.lame_duck_duration - sd.lame_duck_grace_period
        log.info("%s: entering lame duck mode: no new connections; %d client(s) to close over %gs, the first after "
                 "%gs", origin, total, window, sd.lame_duck_grace_period)
        for slot in slots:
            slot.channel.send({"k": "lameduck", "grace": sd.lame_duck_grace_period, "window": window,
                               "total": total})
        self.sup.status.drain("lame duck", self._left, self.deadline + self.sup.config.shutdown.grace_period,
                              quiet_until=self.started + sd.lame_duck_grace_period + 1.0)
        return {"clients": total, "grace": sd.lame_duck_grace_period, "duration": sd.lame_duck_duration}

    def clients_left(self) -> int:
        return sum(s.live for s in self.sup.live_slots())

    def _left(self) -> tuple[int, str]:
        n = self.clients_left()
        return n, f"{n} client{'s' if n != 1 else ''} left"

    def finished(self) -> bool:
        """Every worker closed its clients (or the time is up)."""
        if time.monotonic() > self.deadline:
            log.warning("lame duck: %d client(s) still open after the duration; stopping", self.clients_left())
            return True
        return all(s.ldm_done for s in self.sup.live_slots())
