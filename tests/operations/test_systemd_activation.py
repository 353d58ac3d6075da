"""Socket activation: listeners passed as systemd passes them ($LISTEN_FDS from fd 3, $LISTEN_FDNAMES, $LISTEN_PID)
are adopted instead of bound, and a restart then refuses no connection attempt."""

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from support.harness import REPO, Broker, Raw
from support.systemd_fakes import passing


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="needs systemd-socket-activate")
def test_systemd_socket_activate_starts_the_broker_with_its_listeners(tmp_path):
    ports = [_free_port() for _ in range(3)]
    prefix = ["systemd-socket-activate", *[a for p in ports for a in ("-l", f"127.0.0.1:{p}")],
              "--fdname=ndjson:nats:monitoring"]
    b = Broker(tmp_path, workers=2, prefix=prefix)
    try:
        started = threading.Thread(target=b.start)
        started.start()
        time.sleep(0.3)
        # systemd-socket-activate starts the broker on the first connection, which waits in the backlog meanwhile
        with Raw(ports[0], timeout=30) as first:
            assert first.request({"op": "info"})["ok"] is True
        started.join(30)
        assert b.ports == {"ndjson": ports[0], "nats": ports[1], "monitoring": ports[2]}
        assert b.varz()["ports"] == {"ndjson": ports[0], "nats": ports[1]}
        log = b.log()
        assert "nats: listening on 127.0.0.1:%d, passed by systemd (nats.bind and nats.port are not used)" % ports[1] \
            in log
        with socket.create_connection(("127.0.0.1", ports[1]), timeout=5) as nats:
            assert nats.recv(4096).startswith(b"INFO {")
        for pid in b.worker_pids():   # no worker inherits a listener or the variables
            env = open(f"/proc/{pid}/environ", "rb").read()
            assert b"LISTEN_" not in env
            fds = os.listdir(f"/proc/{pid}/fd")
            assert all(os.readlink(f"/proc/{pid}/fd/{fd}") != os.readlink(f"/proc/{b.proc.pid}/fd/3") for fd in fds)
    finally:
        b.close()


def test_one_socket_unit_with_several_ports_is_matched_by_port(tmp_path):
    """Every fd of one .socket unit has the unit's name: the broker tells them apart by the configured ports."""
    ndjson, nats = _listener(), _listener()
    try:
        b = Broker(tmp_path, workers=1, args=["--port", str(ndjson.getsockname()[1]),
                                               "--nats-port", str(nats.getsockname()[1])],
                   **passing([nats, ndjson], "shardbroker.socket:shardbroker.socket"))
        b.start()
        assert b.ports["ndjson"] == ndjson.getsockname()[1] and b.ports["nats"] == nats.getsockname()[1]
        assert b.log().count("passed by systemd") == 2
        with Raw(b.port) as c:
            assert c.request({"op": "info"})["ok"] is True
        b.close()
    finally:
        ndjson.close(), nats.close()


def test_bridge_and_qlite_listeners_are_adopted_by_name_too(tmp_path):
    """The two names the test above does not pass (systemd-socket-activate there passes ndjson, nats, monitoring)."""
    bridge, qlite = _listener(), _listener()
    b = Broker(tmp_path, workers=1, args=["--bridge-port", "0", "--qlite-port", "0"],
               **passing([qlite, bridge], "qlite:bridge"))
    try:
        b.start()
        wanted = {"bridge": bridge.getsockname()[1], "qlite": qlite.getsockname()[1]}
        assert {k: b.varz()["ports"].get(k) for k in wanted} == wanted
        assert b.log().count("passed by systemd") == 2
    finally:
        b.close()
        bridge.close(), qlite.close()


@pytest.mark.parametrize("names,args,message", [
    ("bridge", [], "socket activation: a bridge listener was passed, but bridge.enabled is false"),
    ("shardbroker.socket", [], "socket activation: the passed listener on port {port} is named "
                               "'shardbroker.socket' and no enabled listener is configured on that port"),
])
def test_a_passed_listener_the_configuration_does_not_expect_stops_the_start(tmp_path, names, args, message):
    sock = _listener()
    try:
        extra = passing([sock], names)
        res = subprocess.run([*extra["prefix"], sys.executable, "-m", "shardbroker.cli", "start", "--workers", "1", "--port", "0",
                              "--nats-port", "0", "--monitor-port", "0", *args], cwd=REPO, capture_output=True,
                             text=True, timeout=30, env={**os.environ, **extra["env"]}, pass_fds=extra["pass_fds"])
    finally:
        port = sock.getsockname()[1]
        sock.close()
    assert res.returncode == 2, res.stderr
    assert message.format(port=port) in res.stderr


@pytest.mark.slow
def test_a_restart_refuses_no_connection_attempt(tmp_path):
    """systemd holds the listeners across a restart (the test does here): connection attempts made while no broker
    runs wait in the backlog and are answered by the next one; none is refused."""
    ndjson = _listener()
    port = ndjson.getsockname()[1]
    attempts: list[tuple[float, str]] = []
    stop = threading.Event()

    def attempt() -> None:
        t = time.monotonic()
        try:
            with Raw(port, timeout=20) as c:
                c.request({"op": "info"})
            attempts.append((t, "answered"))
        except ConnectionRefusedError:
            attempts.append((t, "refused"))
        except (ConnectionError, OSError):
            attempts.append((t, "closed"))   # handed to the old broker, which stopped: a reconnect, no refusal

    def client() -> None:
        while not stop.is_set():
            attempt()
            time.sleep(0.01)

    def broker() -> Broker:
        return Broker(tmp_path, workers=1, args=["--port", str(port)], **passing([ndjson], "ndjson"))

    first = broker().start()
    thread = threading.Thread(target=client)
    thread.start()
    in_between = threading.Thread(target=attempt)
    try:
        time.sleep(0.5)
        gap_from = time.monotonic()
        assert first.stop() == 0
        first.close()
        # One attempt surely made while no broker runs: the client's own may all fall just outside the gap, one
        # begun before it and waiting in the backlog through it, now that a restart takes a few dozen ms.
        in_between.start()
        time.sleep(0.05)
        second = broker().start()
        gap_to = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(30)
        if in_between.is_alive():
            in_between.join(30)
    try:
        kinds = [k for _, k in attempts]
        assert "refused" not in kinds, attempts
        in_gap = [k for t, k in attempts if gap_from < t < gap_to]
        assert in_gap and set(in_gap) <= {"answered", "closed"}, attempts
        assert any(k == "answered" and t > gap_from + 0.2 for t, k in attempts), attempts
    finally:
        second.close()
        ndjson.close()
