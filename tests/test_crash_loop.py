"""A crash loop stops the broker as docs/operations.md says: one error line, a `stopped` line, exit 1, nothing left."""

import os
import re
import signal
import time

from harness import Broker, pid_alive, wait_gone

BACK = re.compile(r"worker 0 is back \(pid (\d+)\)")


def test_a_crash_loop_stops_cleanly_with_one_error_line_and_exit_1(tmp_path):
    b = Broker(tmp_path, workers=1).start()
    try:
        runtime_dir = b.runtime_dir()
        assert os.path.isdir(runtime_dir)
        worker = b.pids[0]
        for kill in range(1, 12):   # more than 10 deaths within 60 s
            os.kill(worker, signal.SIGKILL)
            if kill == 11:
                break
            deadline = time.monotonic() + 10
            while len(BACK.findall(b.log())) < kill:   # killed once back, so that each kill is a death
                assert time.monotonic() < deadline, b.log()
                time.sleep(0.02)
            worker = int(BACK.findall(b.log())[-1])
        assert b.proc.wait(20) == 1, b.log()
        log = b.log()
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if " ERROR " in line]
        # one line per replaced death, and one that says why the last is not replaced and the broker stops
        assert len(errors) == 11, log
        assert all(line.endswith("(signal SIGKILL); replacing it") for line in errors[:10]), log
        assert errors[10].endswith(f"worker 0 (pid {worker}) died (signal SIGKILL): 11 worker deaths in 60s, "
                                   f"a crash loop; stopping"), log
        assert log.rstrip().endswith("broker.supervisor: stopped"), log
        assert len(BACK.findall(log)) == 10, "the last death was replaced"
        assert not os.path.exists(runtime_dir)
        assert not wait_gone(b.group, 5)
        assert not pid_alive(worker)
    finally:
        b.kill()
        b._log.close()
