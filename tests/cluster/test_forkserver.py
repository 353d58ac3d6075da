"""The fork server (cluster/supervisor/forkserver.py, workers/forkserver.py): workers forked from one process that
imported their modules once, children of the supervisor, replaced the same way; a fork server that dies is
restarted (workers are fresh interpreters meanwhile), and it goes with the broker, however the broker goes."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support.harness import Raw, on_worker, pid_alive, wait_gone

FORKSERVER = "broker-forkserver"


def fork_servers(b) -> list[psutil.Process]:
    out = []
    for p in b.group():
        try:
            if FORKSERVER in p.cmdline():
                out.append(p)
        except psutil.Error:
            pass
    return out


def the_fork_server(b, timeout: float = 10.0) -> psutil.Process:
    """The broker's one fork server, once it is ready (its imports done: it holds no more than stdio and its
    request socket, and waits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        servers = fork_servers(b)
        if len(servers) == 1 and f"fork server (pid {servers[0].pid}) exited" not in b.log():
            return servers[0]
        time.sleep(0.02)
    raise AssertionError(f"not one fork server: {fork_servers(b)}\n{b.log()[-3000:]}")


def sockets(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


def started_by(b) -> dict[int, str]:
    return {w["worker"]: w["started_by"] for w in b.varz()["workers"]}


def assert_forked(b, pid: int) -> None:
    """A worker forked by the fork server: the supervisor's child, named as a worker, holding nothing of the
    fork server's."""
    proc = psutil.Process(pid)
    assert proc.ppid() == b.proc.pid, "not the supervisor's child"
    cmdline = proc.cmdline()
    assert cmdline[1:4] == ["broker-worker", cmdline[2], "forked"] and cmdline[2].isdigit(), cmdline
    server = the_fork_server(b)
    assert not sockets(pid) & sockets(server.pid), "a worker holds the fork server's request socket"


def pubsub(port: int, worker: int, topic: str) -> None:
    with on_worker(port, worker) as s, Raw(port) as p:
        assert s.request({"op": "sub", "topic": topic}) == {"ok": True}
        assert p.request({"op": "pub", "topic": topic, "data": 1}) == {"ok": True}
        assert s.json() == {"topic": topic, "data": 1}


def test_workers_are_forked_children_of_the_supervisor_named_as_workers(start_broker):
    b = start_broker(workers=2)
    assert sorted(b.worker_pids()) == sorted(b.pids)   # the fork server is not taken for a worker
    server = the_fork_server(b)
    assert server.ppid() == b.proc.pid and server.cmdline()[-2] == FORKSERVER
    for pid in b.pids:
        assert_forked(b, pid)
    assert started_by(b) == {0: "forkserver", 1: "forkserver"}
    assert len(server.children()) == 0   # the intermediate children are gone, reaped
    # the supervisor's signals, sent to every process (`systemctl kill -s HUP`): the fork server stays
    for signum in (signal.SIGHUP, signal.SIGUSR2, signal.SIGINT):
        os.kill(server.pid, signum)
    time.sleep(0.2)
    assert pid_alive(server.pid) and "fork server" not in b.log()


def test_a_killed_worker_is_forked_again_and_serves(start_broker):
    b = start_broker(workers=2)
    old = b.pids[0]
    mark = len(b.log())
    os.kill(old, signal.SIGKILL)
    b.wait_log(r"worker 0 \(pid %d\) died \(signal SIGKILL\); replacing it" % old, after=mark)
    new = int(b.wait_log(r"worker 0 is back \(pid (\d+)\)", after=mark).group(1))
    assert_forked(b, new)
    assert started_by(b) == {0: "forkserver", 1: "forkserver"}
    pubsub(b.port, 0, "forked.again")


def test_a_killed_fork_server_is_restarted_and_replacements_go_on(start_broker):
    b = start_broker(workers=2)
    server = the_fork_server(b)
    mark = len(b.log())
    os.kill(server.pid, signal.SIGKILL)
    # a worker killed at once: the fork server may not be back yet, and then it is a fresh interpreter
    os.kill(b.pids[0], signal.SIGKILL)
    b.wait_log(r"fork server \(pid %d\) (exited \(signal SIGKILL\)|failed to fork worker 0 .*); restarting it"
               % server.pid, after=mark)
    first = int(b.wait_log(r"worker 0 is back \(pid (\d+)\)", after=mark).group(1))
    assert psutil.Process(first).ppid() == b.proc.pid
    pubsub(b.port, 0, "after.the.fork.server")
    new_server = the_fork_server(b)
    assert new_server.pid != server.pid and not pid_alive(server.pid)
    mark = len(b.log())
    os.kill(b.pids[1], signal.SIGKILL)   # the restarted fork server forks this one
    second = int(b.wait_log(r"worker 1 is back \(pid (\d+)\)", after=mark).group(1))
    assert_forked(b, second)
    assert started_by(b)[1] == "forkserver"
    pubsub(b.port, 1, "from.the.new.fork.server")
    log = b.log()
    assert log.count("died") == 2, log   # the fork server's exit is never taken for a worker's
    assert "failed to boot" not in log


def test_a_fork_server_that_does_not_answer_is_killed_and_the_worker_started_anyway(start_broker):
    b = start_broker(workers=2)
    server = the_fork_server(b)
    os.kill(server.pid, signal.SIGSTOP)
    mark = len(b.log())
    os.kill(b.pids[0], signal.SIGKILL)
    b.wait_log(r"fork server \(pid %d\) failed to fork worker 0 \(no answer in 2s\); restarting it" % server.pid,
               after=mark)
    b.wait_log(r"worker 0 is back", after=mark)
    assert started_by(b)[0] == "exec" and not pid_alive(server.pid)
    pubsub(b.port, 0, "despite.a.stuck.fork.server")


def test_exited_children_that_are_no_workers_are_reaped():
    """A fork server killed in the middle of a fork leaves the supervisor (a subreaper) its first child, or the
    worker that child forked: reaped, and only those, not a worker whose exit the supervisor has yet to read."""
    from shardbroker.cluster.config import load
    from shardbroker.cluster.supervisor.forkserver import Launcher

    launcher = Launcher(load(None).workers, lambda: False)
    stray = subprocess.Popen([sys.executable, "-c", "pass"])
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher._mine[worker.pid] = worker
    for proc in (stray, worker):
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped
    launcher._reap_strays()   # the stray (then it stops at the worker), or nothing if the worker comes first
    assert os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, "a worker was reaped"
    assert worker.wait() == 0   # the supervisor reads its exit
    launcher._reap_strays()
    with pytest.raises(ChildProcessError):   # reaped
        os.waitid(os.P_PID, stray.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGQUIT"])
def test_a_stop_leaves_no_process_behind_the_fork_server_included(start_broker, how):
    b = start_broker(workers=2)
    server = the_fork_server(b)
    assert b.stop(getattr(signal, how)) == 0
    assert not pid_alive(server.pid)
    assert not b.group()   # the supervisor reaped it before it exited


def test_the_supervisor_killed_takes_the_fork_server_down(start_broker):
    b = start_broker(workers=2)
    server = the_fork_server(b)
    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait(5)
    assert not wait_gone(lambda: [p for p in [server.pid, *b.pids] if pid_alive(p)], 5), "outlived the supervisor"


def test_a_reload_keeps_forking(start_broker, tmp_path):
    b = start_broker(workers=2, config={"limits": {"max_connections": 1000}})
    path = next(tmp_path.glob("config-*.json"))
    path.write_text(json.dumps({"limits": {"max_connections": 2000}}))
    mark = len(b.log())
    b.send_signal(signal.SIGHUP)
    b.wait_log(r"SIGHUP: configuration reloaded .*limits.max_connections", after=mark)
    os.kill(b.pids[1], signal.SIGKILL)
    new = int(b.wait_log(r"worker 1 is back \(pid (\d+)\)", after=mark).group(1))
    assert_forked(b, new)
    assert b.varz()["max_connections"] == 2000
    pubsub(b.port, 1, "after.reload")


def test_fork_server_off_starts_fresh_interpreters(start_broker):
    b = start_broker(workers=2, config={"workers": {"fork_server": False}})
    assert not fork_servers(b)
    assert "workers.fork_server is off: every worker starts as a fresh interpreter" in b.log()
    assert started_by(b) == {0: "exec", 1: "exec"}
    for pid in b.pids:
        assert "-c" in psutil.Process(pid).cmdline()
    os.kill(b.pids[0], signal.SIGKILL)
    b.wait_log(r"worker 0 is back")
    assert started_by(b)[0] == "exec" and not fork_servers(b)
