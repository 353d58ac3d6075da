"""Starting, stopping and failing: signals, orphans, the runtime directory, configuration errors."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from support.harness import REPO, Broker, Raw, pid_alive, wait_gone


def test_sigterm_exits_zero_without_orphans_and_removes_runtime_dir(start_broker):
    b = start_broker(workers=3)
    rundir = b.runtime_dir()
    assert os.path.isdir(rundir)
    assert oct(os.stat(rundir).st_mode & 0o777) == "0o700"
    assert sorted(b.worker_pids()) == sorted(b.pids)
    with Raw(b.port) as c:
        c.request({"op": "sub", "topic": "t"})
        assert b.stop(signal.SIGTERM) == 0
        assert c.closed()
    assert not wait_gone(lambda: [p for p in b.pids if pid_alive(p)], 5)
    assert not os.path.exists(rundir)


def test_sigint_is_graceful(start_broker):
    b = start_broker(workers=2)
    assert b.stop(signal.SIGINT) == 0
    assert "SIGINT: stopping gracefully" in b.log()


def test_the_supervisors_signals_sent_to_every_process_leave_the_workers_alive(start_broker):
    """`systemctl kill -s HUP|USR2` without --kill-whom=main, or pkill, signals the workers too: reload and lame
    duck are the supervisor's, and a worker killed by their default action would cut its clients."""
    b = start_broker(workers=1)
    with Raw(b.port) as c:
        c.request({"op": "sub", "topic": "t"})
        for signum in (signal.SIGHUP, signal.SIGUSR2, signal.SIGINT):
            os.kill(b.pids[0], signum)
        assert c.request({"op": "ping"})["ok"] and pid_alive(b.pids[0])
    assert "died" not in b.log()


def test_second_sigint_forces_a_stop_that_is_taking_long(start_broker):
    # A subscriber that never reads, with megabytes queued to it: the graceful stop would wait the whole grace.
    b = start_broker(workers=1, grace=60, config={"limits": {"max_pending_bytes": 1 << 30}})
    with Raw(b.port) as stuck, Raw(b.port) as pub:
        stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.request({"op": "sub", "topic": "big"})
        pub.send(b'{"op":"pub","topic":"big","data":"%s"}\n' % (b"x" * 60000) * 200 + b'{"op":"ping","id":1}\n')
        while pub.json().get("id") != 1:
            pass
        b.send_signal(signal.SIGINT)
        b.wait_log("SIGINT: stopping gracefully")
        time.sleep(0.5)
        assert b.proc.poll() is None, "nothing made the graceful stop wait: this test tests nothing"
        started = time.monotonic()
        b.send_signal(signal.SIGINT)
        assert b.proc.wait(10) == 1
        assert time.monotonic() - started < 5
    assert "second SIGINT: forcing shutdown" in b.log()
    assert not wait_gone(lambda: [p for p in b.pids if pid_alive(p)], 5)


@pytest.mark.parametrize("same_worker", [True, False], ids=["same-worker", "cross-worker"])
def test_graceful_stop_delivers_every_acknowledged_publish(start_broker, same_worker):
    """SIGTERM while a publisher streams: every publish that got its ok reaches the subscriber."""
    # The test's reader may fall behind the broker: a generous bound keeps it from being a slow consumer.
    b = start_broker(workers=2, grace=20, config={"limits": {"max_pending_bytes": 1 << 30}})
    n, payload = 300_000, "p" * 300
    with Raw(b.port) as sub, Raw(b.port) as pub:
        if (sub.request({"op": "info"})["info"]["worker"] == pub.request({"op": "info"})["info"]["worker"]) \
                != same_worker:
            pub.close()
            pub = Raw(b.port)
        sub.request({"op": "sub", "topic": "flush.me"})
        expected = b'{"topic":"flush.me","data":"%s"}\n' % payload.encode()
        delivered = []
        reader = threading.Thread(target=lambda: delivered.append(_count_lines(sub.sock, expected)), daemon=True)
        reader.start()
        stream = b'{"op":"pub","topic":"flush.me","data":"%s"}\n' % payload.encode() * n
        sender = threading.Thread(target=_send_until_closed, args=(pub.sock, stream), daemon=True)
        sender.start()
        acked = 0
        while acked < 2000:
            assert pub.json() == {"ok": True}
            acked += 1
        b.send_signal(signal.SIGTERM)
        acked += _count_lines(pub.sock, b'{"ok":true}\n', pub.buf)
        reader.join(30)
        sender.join(30)
        assert acked < n, "the stop came too late to test anything"
        assert delivered == [acked]
    assert b.stop() == 0


def _send_until_closed(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def _count_lines(sock: socket.socket, expected: bytes, buf: bytes = b"") -> int:
    """Read until the server closes; every line must be ``expected``; return how many there were."""
    sock.settimeout(20)
    data, count = buf, 0
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except (ConnectionError, OSError):
            chunk = b""
        data += chunk
        lines = data.split(b"\n")
        data = lines.pop()
        for line in lines:
            assert line + b"\n" == expected, line[:100]
        count += len(lines)
        if not chunk:
            assert not data, data[:100]
            return count


def test_supervisor_sigkill_takes_the_workers_down(start_broker):
    b = start_broker(workers=3)
    rundir = b.runtime_dir()
    with Raw(b.port) as c:
        c.request({"op": "ping"})
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.wait(5)
        assert not wait_gone(lambda: [p for p in b.pids if pid_alive(p)], 5), "workers outlived the supervisor"
        assert c.closed()
    assert not wait_gone(lambda: os.path.exists(rundir), 5), "runtime directory left behind"


def test_supervisor_sigkill_closes_connections_like_a_killed_server(start_broker):
    """A SIGKILLed nats-server's sockets are closed by the kernel with a FIN: clients read EOF and reconnect
    quietly.  Orphaned workers must do the same, not reset the connections, and still exit at once."""
    b = start_broker(workers=2)
    clients = []
    for proto in ("ndjson", "nats", "nats", "ndjson"):  # both protocols on both workers
        c = Raw(b.ports[proto])
        if proto == "ndjson":
            assert c.request({"op": "ping"}) == {"ok": True}
        else:
            assert c.line().startswith(b"INFO ")
            c.send(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
            assert c.line() == b"PONG\r\n"
        clients.append((proto, c))
    try:
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.wait(5)
        for proto, c in clients:
            c.sock.settimeout(5)
            try:
                rest = c.sock.recv(65536)
            except ConnectionResetError:
                pytest.fail(f"{proto} client: connection reset by the orphaned worker, not closed")
            assert rest == b"", f"{proto} client read {rest!r} instead of EOF"
        gone = wait_gone(lambda: [p for p in b.pids if pid_alive(p)], 3)
        assert not gone, "workers outlived the supervisor"
    finally:
        for _, c in clients:
            c.close()


def test_a_supervisor_killed_while_a_worker_stops_gracefully_still_closes_at_once(start_broker):
    """The kernel's death signal (SIGTERM) can reach a worker while getppid() still names the dying supervisor
    (found by nats.py's own disconnect tests, 3 runs in 48): read as a stop, it began a graceful one that waited
    the whole grace period for the other worker's end of traffic, which never came, holding every client's
    connection for 5 s.  Made certain here: SIGTERM to a worker, then SIGKILL to the supervisor."""
    b = start_broker(workers=2, config={"shutdown": {"grace_period": 8}})
    clients = [Raw(b.port) for _ in range(4)]
    for c in clients:
        assert c.request({"op": "ping"}) == {"ok": True}
    started = time.monotonic()
    os.kill(b.pids[0], signal.SIGTERM)
    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait(5)
    try:
        for c in clients:
            c.sock.settimeout(10)
            try:
                assert c.sock.recv(65536) == b""
            except ConnectionResetError:
                pass
        took = time.monotonic() - started
        assert took < 3, f"clients were held {took:.1f}s after the supervisor died"
        assert not wait_gone(lambda: [p for p in b.pids if pid_alive(p)], 3), "workers outlived the supervisor"
    finally:
        for c in clients:
            c.close()


def test_worker_boot_failure_stops_the_supervisor(tmp_path):
    # A runtime directory too deep for an ipc:// endpoint: the workers cannot bind the fabric.
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    b = Broker(tmp_path, workers=2, config={"runtime": {"dir": str(deep)}})
    b._log = open(b.log_path, "wb")
    b.proc = subprocess.Popen(b.command(), stdout=b._log, stderr=subprocess.STDOUT, cwd=REPO,
                              start_new_session=True)
    try:
        assert b.proc.wait(30) == 3
        log = b.log()
        assert "failed to boot" in log and "ipc" in log
        assert log.count("failed to boot") == 1 and "replacing" not in log
        assert not wait_gone(b.group, 5)
    finally:
        b.kill()
        b._log.close()


def test_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "start", "--workers", "1", "--port", str(port),
                              "--no-monitoring"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    assert f"cannot listen for ndjson on 127.0.0.1:{port}: Address already in use" in res.stderr


def run_start(tmp_path, config=None, args=()):
    cmd = [sys.executable, "-m", "shardbroker.cli", "start"]
    if config is not None:
        path = tmp_path / "c.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        cmd += ["--config", str(path)]
    return subprocess.run(cmd + list(args), cwd=REPO, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("config,args,message", [
    ({"network": {"prot": 8080}}, [], "network.prot: unknown key"),
    ({"nework": {}}, [], "nework: unknown key"),
    ({"network": {"port": "8080"}}, [], 'network.port: expected an integer, got "8080"'),
    ({"network": {"port": 70000}}, [], "network.port: must be between 0 and 65535, got 70000"),
    ({"network": {"port": -1}}, [], "network.port: must be between 0 and 65535, got -1"),
    ({"security": {"enabled": "yes"}}, [], 'security.enabled: expected true/false, got "yes"'),
    ({"security": {"users": [{"username": "u", "pasword": "x"}]}}, [], "security.users[0].pasword: unknown key"),
    ({"workers": {"count": 0}}, [], "workers.count: must be between 1 and 256, got 0"),
    ({"limits": {"max_line_bytes": 1.5}}, [], "limits.max_line_bytes: expected an integer, got 1.5"),
    ({}, ["--workers", "many"], 'workers.count: expected an integer or "auto", got "many"'),
    ({}, ["--port", "99999"], "network.port: must be between 0 and 65535, got 99999"),
    ("{not json", [], "not valid JSON"),
    ("[]", [], "the top level must be a JSON object"),
])
def test_bad_configuration_is_one_clear_line_and_exit_2(tmp_path, config, args, message):
    res = run_start(tmp_path, config, args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert message in lines[0]


def test_missing_config_file(tmp_path):
    res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "start", "--config", str(tmp_path / "nope.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "cannot read" in res.stderr


JOLT_INSECURE = {
    "network": {"bind": "0.0.0.0", "port": 8080},
    "security": {"enabled": False, "admin_user": {"username": "", "password": "", "permissions": []},
                 "users": []},
}


def test_jolt_config_file_is_accepted_as_is_and_flags_override_it(start_broker):
    config = json.loads(json.dumps(JOLT_INSECURE))
    config["network"]["bind"] = "127.0.0.1"  # the tests never listen beyond loopback
    b = start_broker(workers=1, config=config)  # the harness passes --port 0: the flag wins over 8080
    assert b.port != 8080
    with Raw(b.port) as c:
        assert c.request({"op": "ping"}) == {"ok": True}


def test_brokerctl_pub_and_sub(broker):
    sub = subprocess.Popen([sys.executable, "-m", "shardbroker.cli", "sub", "-p", str(broker.port), "-n", "2", "cli.*"],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        # Wait until the subscription is in place (it shows in the monitoring counters).
        while broker.varz()["subscriptions"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for args in (["cli.a", "hello"], ["--json", "cli.b", '{"n": [1, 2]}']):
            res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "pub", "-p", str(broker.port), *args],
                                 cwd=REPO, capture_output=True, text=True, timeout=30)
            assert res.returncode == 0, res.stderr
        out, err = sub.communicate(timeout=10)
    finally:
        sub.kill()
    assert sub.returncode == 0, err
    assert [json.loads(line) for line in out.splitlines()] == [
        {"topic": "cli.a", "data": "hello"}, {"topic": "cli.b", "data": {"n": [1, 2]}}]
    bad = subprocess.run([sys.executable, "-m", "shardbroker.cli", "pub", "-p", str(broker.port), "a..b", "x"],
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "invalid_topic" in bad.stderr


@pytest.mark.slow
@pytest.mark.exclusive   # its Ctrl-Cs are timed against an idle machine's start-up
def test_ctrl_c_at_any_moment_of_a_start_is_a_clean_stop_with_exit_0(tmp_path):
    """T3, M4: a Ctrl-C in the first ~0.4 s of `brokerctl start` printed the workers' KeyboardInterrupt
    tracebacks and exited 1, 3 ("a worker failed to boot") or 0, depending on the moment.  A terminal's Ctrl-C
    is SIGINT to the foreground process group: the supervisor's alone now, which stops everything it started."""
    outcomes = []
    for delay in (0.04, 0.08, 0.15, 0.25, 0.35, 0.5, 0.8):   # Python itself starts in ~20 ms
        broker = Broker(tmp_path, workers=2)
        broker._log = open(broker.log_path, "wb")
        broker.proc = subprocess.Popen(broker.command(), stdout=broker._log, stderr=subprocess.STDOUT, cwd=REPO,
                                       start_new_session=True, stdin=subprocess.DEVNULL,
                                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
        time.sleep(delay)
        os.killpg(broker.proc.pid, signal.SIGINT)
        code = broker.proc.wait(timeout=30)
        log = broker.log()
        outcomes.append((delay, code, "Traceback" in log or "KeyboardInterrupt" in log or "Aborted" in log))
        assert not broker.group(), f"left running after a Ctrl-C at {delay}s"
        broker.close()
    assert all(code == 0 and not traced for _, code, traced in outcomes), outcomes
