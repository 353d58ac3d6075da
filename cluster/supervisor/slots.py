"""The worker slots: one per worker index, the supervisor's record of the process in it, and what the supervisor
does to a worker that stopped answering.

A slot is replaced, never reused: a new worker for index ``i`` gets a new slot (and a new epoch), so a message or an
exit of the one it replaces can never be taken for the new one's.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from shardbroker.cluster import control

log = logging.getLogger("broker.supervisor")

ABORT_WAIT = 2.0   # seconds an aborted worker gets to write its stack trace and die before SIGKILL


@dataclass(eq=False)
class WorkerSlot:
    index: int
    epoch: int
    process: Any
    channel: control.Channel | None = None
    state: str = "booting"                # booting -> ready -> dead
    pid: int = 0
    live: int = 0                          # connections handed to it and not reported closed
    started: float = field(default_factory=time.monotonic)
    last_heartbeat: float = field(default_factory=time.monotonic)
    boot_error: str | None = None
    aborted: float = 0.0                   # when a stuck worker was sent SIGABRT (0: never)
    ldm_done: bool = False                 # in lame duck mode: it has no client left
    restarts: int = 0                      # times worker `index` was replaced before this one (/metrics)


def murder_unresponsive(slots: list[WorkerSlot | None], timeout: float) -> None:
    """A worker whose loop sent no heartbeat in ``timeout`` seconds is aborted: SIGABRT, which its faulthandler
    turns into a stack trace of every thread in the log (where was it stuck?), then SIGKILL if it is still there."""
    now = time.monotonic()
    for slot in slots:
        if slot is None or slot.state != "ready":
            continue
        if slot.aborted and now - slot.aborted > ABORT_WAIT:
            log.error("worker %d (pid %d) survived SIGABRT; killing it", slot.index, slot.pid)
            kill(slot.pid)
            slot.aborted = 0.0
            slot.last_heartbeat = now  # one kill per timeout, while the exit is being noticed
        elif not slot.aborted and now - slot.last_heartbeat > timeout:
            log.error("worker %d (pid %d) sent no heartbeat for %.1fs; aborting it (its stack trace follows)",
                      slot.index, slot.pid, now - slot.last_heartbeat)
            kill(slot.pid, signal.SIGABRT)
            kill(slot.pid, signal.SIGCONT)   # a stopped process takes its SIGABRT only once it runs
            slot.aborted = now


def left(slots: list[WorkerSlot]) -> tuple[int, str]:
    """What a stop still waits for: its progress, and the words for it (systemd's status line)."""
    running = [s for s in slots if s.state != "dead"]
    conns = sum(s.live for s in running)
    return len(running) + conns, f"{len(running)} worker(s) and {conns} connection(s) left"


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
