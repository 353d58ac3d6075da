"""What systemd hears from a real broker: a fake $NOTIFY_SOCKET records every datagram and when it came.

READY=1 with a STATUS= line, STATUS= on changes of state, the watchdog pinged from the supervisor's loop (and not
while that loop is stopped, nor while no worker can come back), STOPPING=1 and EXTEND_TIMEOUT_USEC= during a stop,
STATUS=/ERRNO= on a fatal exit, and none of systemd's variables in a worker's environment.
"""

import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from shardbroker.cluster.supervisor.service_status import ServiceStatus
from shardbroker.cluster.supervisor.systemd import Notifier

from support.harness import REPO, Raw, pid_alive
from support.systemd_fakes import NotifyReceiver

# The broker's own pid as WATCHDOG_PID, as systemd sets it: the shell execs the broker in its place.
WITH_OWN_PID = ["sh", "-c", 'export WATCHDOG_PID=$$; exec "$@"', "sh"]


@pytest.fixture
def notify(tmp_path):
    rx = NotifyReceiver(tmp_path, abstract=True)
    yield rx
    rx.close()


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_ready_status_stopping_and_no_systemd_variables_in_workers(start_broker, notify):
    b = start_broker(workers=2, env={**notify.env(), "WATCHDOG_USEC": "30000000"})
    t_ready, ready = notify.wait_for("READY", "1")
    assert ready["MAINPID"] == str(b.proc.pid)
    status = ready["STATUS"]
    assert status.startswith("ready: 2 workers, ")
    for name, port in b.ports.items():   # ndjson, nats, monitoring: the ready line's addresses
        assert f"{name}=127.0.0.1:{port}" in status
    before = [m for t, m in notify.snapshot() if t < t_ready]
    assert before and before[0] == {"STATUS": "starting 2 workers"}
    assert "READY" not in str(before)
    for pid in b.worker_pids():
        env = _environ(pid)
        assert not [k for k in env if k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
                    or k.startswith("LISTEN_")], env
    mark = time.monotonic()
    assert b.stop() == 0
    t_stop, stopping = notify.wait_for("STOPPING", "1", after=mark)
    assert stopping["STATUS"].startswith("stopping: 2 worker(s)")
    assert not notify.with_key("READY", after=mark)


@pytest.mark.slow
def test_watchdog_pings_at_half_the_interval_from_the_supervisors_loop(start_broker, notify):
    b = start_broker(workers=1, env={**notify.env(), "WATCHDOG_USEC": "1000000"}, prefix=WITH_OWN_PID)
    notify.wait_for("READY", "1")
    time.sleep(1.6)
    pings = [t for t, _ in notify.with_key("WATCHDOG")]
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert len(pings) >= 4 and 0.4 < statistics.median(gaps) < 0.6, gaps
    # The supervisor's loop stops (SIGSTOP): no ping can come, however healthy the workers are.
    os.kill(b.proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    time.sleep(1.5)
    resumed = time.monotonic()
    os.kill(b.proc.pid, signal.SIGCONT)
    time.sleep(1.2)
    during = [t for t, _ in notify.with_key("WATCHDOG", after=stopped + 0.05) if t < resumed]
    assert during == [], during
    after = [t for t, _ in notify.with_key("WATCHDOG", after=resumed)]
    assert after and after[0] - resumed < 0.6 and len(after) >= 2


def test_pings_stop_while_the_event_loop_is_blocked_though_the_process_runs(notify):
    """SIGSTOP (above) stops every thread; here only the loop is stuck, as behind a blocking call: a pinger on a
    thread would go on pinging, the supervisor's must not.  The cluster is a stand-in: a real one cannot be made to
    block its loop from outside."""
    async def query(message, timeout=2.0, slots=None):
        return []

    async def run() -> tuple[float, float]:
        cluster = SimpleNamespace(state="ready", nworkers=1, slots=[SimpleNamespace(state="ready")], query=query)
        status = ServiceStatus(Notifier(notify.address), 400_000, cluster)
        status.start()
        await asyncio.sleep(0.7)
        blocked = time.monotonic()
        time.sleep(1.0)
        resumed = time.monotonic()
        await asyncio.sleep(0.3)
        status.close()
        return blocked, resumed

    blocked, resumed = asyncio.run(run())
    pings = [t for t, _ in notify.with_key("WATCHDOG")]
    assert len([t for t in pings if t < blocked]) >= 3, pings   # every 0.2 s
    assert [t for t in pings if blocked + 0.05 < t < resumed] == [], (blocked, resumed, pings)
    assert [t for t in pings if t >= resumed], pings


def test_watchdog_usec_meant_for_another_pid_is_ignored(start_broker, notify):
    start_broker(workers=1, env={**notify.env(), "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    t_ready, _ = notify.wait_for("READY", "1")
    time.sleep(0.6)
    assert notify.with_key("WATCHDOG") == []


@pytest.mark.slow
@pytest.mark.exclusive   # stops the replacement worker in the ~0.3 s before it boots
def test_watchdog_withheld_only_while_no_worker_can_come_back(start_broker, notify):
    """One stuck worker is the supervisor's to replace; no worker ready for over half the interval is not."""
    # fresh interpreters: a forked replacement boots in ~20 ms, before it can be caught booting
    b = start_broker(workers=1, env={**notify.env(), "WATCHDOG_USEC": "1000000"}, prefix=WITH_OWN_PID,
                     config={"workers": {"fork_server": False}})
    notify.wait_for("READY", "1")
    old = b.pids[0]
    os.kill(old, signal.SIGKILL)
    supervisor = psutil.Process(b.proc.pid)
    deadline = time.monotonic() + 5
    new = None
    while new is None and time.monotonic() < deadline:   # stop the replacement before it can boot
        new = next((p.pid for p in supervisor.children() if p.pid != old), None)
    assert new is not None
    os.kill(new, signal.SIGSTOP)
    stopped = time.monotonic()
    b.wait_log(r"watchdog: no worker ready for .*; withholding pings", timeout=5)
    time.sleep(1.0)
    last = max(t for t, _ in notify.with_key("WATCHDOG"))
    assert time.monotonic() - last > 0.9   # no ping for a while now
    assert last - stopped < 1.2            # the last one came within half an interval (plus a tick) of the stall
    resumed = time.monotonic()
    os.kill(new, signal.SIGCONT)
    b.wait_log(r"worker 0 is back", timeout=10)
    t, _ = notify.wait_for("WATCHDOG", after=resumed, timeout=5)
    assert notify.wait_for("STATUS", "worker 0 is back (pid %d)" % new, after=resumed)


def test_a_stuck_worker_is_aborted_with_its_stack_in_the_log(start_broker, notify):
    b = start_broker(workers=2, config={"workers": {"heartbeat_timeout": 1}}, env=notify.env())
    stuck = b.pids[1]
    mark = len(b.log())
    os.kill(stuck, signal.SIGSTOP)   # its loop stops: no heartbeat; SIGABRT arrives with a SIGCONT
    b.wait_log(r"worker 1 \(pid %d\) sent no heartbeat for .*; aborting it" % stuck, timeout=10, after=mark)
    b.wait_log(r"worker 1 \(pid %d\) died \(signal SIGABRT\); replacing it" % stuck, timeout=10, after=mark)
    b.wait_log(r"worker 1 is back", timeout=10, after=mark)
    trace = b.log()[mark:]
    assert "Fatal Python error: Aborted" in trace
    assert re.search(r'File ".*/(asyncio|uvloop)/', trace) or "File " in trace, trace   # faulthandler's stack
    assert not pid_alive(stuck)
    notify.wait_for("STATUS", "worker 1 died (signal SIGABRT); replacing it")
    with Raw(b.port) as s, Raw(b.port) as p:
        s.request({"op": "sub", "topic": "after.abort"})
        p.request({"op": "pub", "topic": "after.abort", "data": 1})
        assert s.json() == {"topic": "after.abort", "data": 1}


def _start_failing(tmp_path, notify, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", "start", "--workers", "1", "--nats-port", "0",
                           "--monitor-port", "0", *args], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={**os.environ, **notify.env()})


def test_a_fatal_start_says_why_with_an_errno(tmp_path, notify):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        res = _start_failing(tmp_path, notify, "--port", str(port))
    finally:
        taken.close()
    assert res.returncode == 1, res.stderr
    _, msg = notify.wait_for("ERRNO")
    assert msg == {"STATUS": f"cannot listen for ndjson on 127.0.0.1:{port}: Address already in use", "ERRNO": "98"}
    mark = time.monotonic()
    res = _start_failing(tmp_path, notify, "--port", "0", "--workers", "0")
    assert res.returncode == 2
    _, msg = notify.wait_for("ERRNO", after=mark)
    assert msg["ERRNO"] == "22" and msg["STATUS"].startswith("configuration error: workers.count: must be between")


def test_a_worker_that_cannot_boot_ends_the_broker_with_its_reason_as_the_last_status(start_broker, notify):
    # fresh interpreters: a forked replacement boots in ~20 ms, before it can be killed booting
    b = start_broker(workers=1, env=notify.env(), config={"workers": {"fork_server": False}})
    old = b.pids[0]
    os.kill(old, signal.SIGKILL)
    supervisor = psutil.Process(b.proc.pid)
    new, deadline = None, time.monotonic() + 5
    while new is None and time.monotonic() < deadline:   # the replacement, killed while it boots
        new = next((p.pid for p in supervisor.children() if p.pid != old), None)
    os.kill(new, signal.SIGKILL)
    assert b.proc.wait(20) == 3
    last = notify.snapshot()[-1][1]
    assert last == {"STATUS": f"worker 0 (pid {new}) failed to boot: signal SIGKILL", "ERRNO": "5"}, last


@pytest.mark.slow
def test_the_counters_status_line_comes_at_most_every_10s(start_broker, notify):
    b = start_broker(workers=2, env=notify.env())
    t_ready, _ = notify.wait_for("READY", "1")
    with Raw(b.port) as s, Raw(b.port) as p:
        s.request({"op": "sub", "topic": "status.t"})
        for i in range(50):
            p.request({"op": "pub", "topic": "status.t", "data": i})
        t, msg = notify.wait_for("STATUS", timeout=15, after=t_ready + 0.01)
        assert t - t_ready > 9.5, (t - t_ready, msg)
        assert re.fullmatch(r"serving: 2/2 workers ready, 2 connections, \d+ msg/s in, \d+ msg/s out", msg["STATUS"])


@pytest.mark.slow
def test_a_stop_that_drains_extends_the_stop_timeout(start_broker, notify):
    """A client that does not read its last 24 MB holds the stop for the grace period: systemd is told to wait."""
    b = start_broker(workers=1, config={"limits": {"max_pending_bytes": 64 << 20}}, grace=4.5, env=notify.env())
    sub = Raw(b.port)
    sub.request({"op": "sub", "topic": "big"})
    sub.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with Raw(b.port) as p:
        blob = "x" * 100_000
        for _ in range(240):
            p.send(json.dumps({"op": "pub", "topic": "big", "data": blob}).encode() + b"\n")
        p.request({"op": "ping"})
    mark = time.monotonic()
    b.send_signal(signal.SIGTERM)
    assert b.proc.wait(15) == 0
    took = time.monotonic() - mark
    extends = notify.with_key("EXTEND_TIMEOUT_USEC", after=mark)
    assert 4 < took < 9 and extends, (took, notify.snapshot())
    assert all(0 < int(m["EXTEND_TIMEOUT_USEC"]) <= 6_000_000 for _, m in extends)
    assert all(m["STATUS"].startswith("stopping: 1 worker(s)") for _, m in extends)
    sub.close()
