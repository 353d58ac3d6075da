"""A crash loop stops the broker as docs/operations.md says: one error line, a `stopped` line, exit 1, nothing left."""

import os
import signal
import time

from support.harness import Broker, pid_alive, wait_gone


def _replacement(b: Broker, dead: int, boots: int) -> int:
    """The pid of worker 0 once it is back and ready, as /varz sees it (the supervisor's "is back" line may be
    held back: a flood).  /varz is asked once the worker has logged its boot (a new process, so never held back):
    asked earlier, it waits up to 2 s for a worker that cannot answer yet."""
    deadline = time.monotonic() + 10
    while b.log().count("[worker 0] INFO broker.queues: worker 0: replayed") < boots:
        assert time.monotonic() < deadline, b.log()
        time.sleep(0.02)
    while time.monotonic() < deadline:
        try:
            w = b.varz()["workers"][0]
        except (OSError, ValueError, KeyError, IndexError):
            w = {}
        if w.get("pid") not in (None, dead) and w.get("state") == "ready":
            return w["pid"]
        time.sleep(0.02)
    raise AssertionError(b.log())


def test_a_crash_loop_stops_cleanly_with_one_error_line_and_exit_1(tmp_path):
    b = Broker(tmp_path, workers=1).start()
    try:
        runtime_dir = b.runtime_dir()
        assert os.path.isdir(runtime_dir)
        worker = b.pids[0]
        for kill in range(1, 12):   # more than 10 deaths within 60 s, each of a worker that was ready
            os.kill(worker, signal.SIGKILL)
            if kill < 11:
                worker = _replacement(b, worker, kill)   # the first boot replays nothing
        assert b.proc.wait(20) == 1, b.log()
        log = b.log()
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if " ERROR " in line]
        # one line per replaced death, and one that says why the last is not replaced and the broker stops
        assert len(errors) == 11, log
        assert all(line.endswith("(signal SIGKILL); replacing it") for line in errors[:10]), log
        assert errors[10].endswith(f"worker 0 (pid {worker}) died (signal SIGKILL): 11 worker deaths in 60s, "
                                   f"a crash loop; stopping"), log
        # ten kills in a few seconds are a flood of "is back" lines (logging.flood_burst): the count of those
        # held back is written before `stopped`, which is the last line
        assert "is back" in log and "more like it" in log, log
        assert log.rstrip().endswith("broker.supervisor: stopped"), log
        assert not os.path.exists(runtime_dir)
        assert not wait_gone(b.group, 5)
        assert not pid_alive(worker)
    finally:
        b.kill()
        b._log.close()
