"""What the kernel says about the broker's processes (RSS, CPU, open files), read by the supervisor with psutil.

Read from /proc/<pid>/{stat,statm,fd} only, which ``ProtectProc=invisible`` leaves readable for the service's own
processes; nothing reads /proc/stat or /proc/meminfo, which ``ProcSubset=pid`` hides (prometheus_client's
ProcessCollector reads /proc/stat and silently exports nothing there: docs/operations.md).  Start times come from
the supervisor's own clock for the same reason.

Counting open files lists /proc/<pid>/fd: about 4 ms for 5,000 connections.  ``sample_all`` is meant to run on a
thread (it holds no event loop up while the kernel lists them), one caller at a time.
"""

from __future__ import annotations

import resource
import threading
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessSample:
    rss: int              # bytes
    cpu_seconds: float    # user + system since the process started
    cpu_percent: float    # since the previous sample of this process (0.0 at the first)
    open_fds: int


def max_fds() -> int:
    """The open-files limit: the supervisor's, which every worker inherits."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ProcessTable:
    """psutil.Process objects kept by pid between samples: ``cpu_percent`` is measured since the previous one."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()

    def sample_all(self, pids: list[int]) -> dict[int, ProcessSample]:
        """Samples of the processes ``pids`` that still exist; the others are forgotten."""
        with self._lock:
            for pid in [p for p in self._procs if p not in pids]:
                del self._procs[pid]
            samples = {pid: self.sample(pid) for pid in pids}
        return {pid: sample for pid, sample in samples.items() if sample is not None}

    def sample(self, pid: int) -> ProcessSample | None:
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            with proc.oneshot():
                times = proc.cpu_times()
                return ProcessSample(proc.memory_info().rss, times.user + times.system, proc.cpu_percent(None),
                                     proc.num_fds())
        except psutil.Error:
            self._procs.pop(pid, None)
            return None
