"""The shipped unit files: systemd-analyze's checks (where the tool is installed), the sandbox's score, and the
broker running under an emulation of that sandbox (CI has no systemd as PID 1 to run the unit itself)."""

import re
import shutil
import subprocess
import sys

import pytest

from support.harness import REPO, Broker, Raw

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "shardbroker.service"
MAX_EXPOSURE = 2.0

analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")


def _systemd_version() -> int:
    out = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout
    return int(re.match(r"systemd (\d+)", out).group(1))


def _installed_copy(tmp_path):
    """The units as installed, with ExecStart= and ExecReload= pointing at this checkout's brokerctl (verify
    checks that the binaries exist)."""
    brokerctl = str(REPO / ".venv" / "bin" / "brokerctl")
    if not (REPO / ".venv" / "bin" / "brokerctl").exists():
        brokerctl = shutil.which("brokerctl") or sys.executable
    for name in ("shardbroker.service", "shardbroker.socket"):
        text = (DEPLOY / name).read_text().replace("/opt/shardbroker/bin/brokerctl", brokerctl)
        (tmp_path / name).write_text(text)
    return tmp_path / "shardbroker.service", tmp_path / "shardbroker.socket"


@analyze
def test_units_verify(tmp_path):
    service, sock = _installed_copy(tmp_path)
    res = subprocess.run(["systemd-analyze", "verify", str(service), str(sock)], capture_output=True, text=True)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr


@analyze
def test_unit_security_exposure_is_at_most_2(tmp_path):
    res = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)], capture_output=True,
                         text=True)
    m = re.search(r"Overall exposure level for shardbroker\.service: (\d+\.\d+)", res.stdout)
    assert m, res.stdout + res.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, res.stdout


def _directives(path) -> list[tuple[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.append((key, value))
    return out


def test_unit_leaves_out_the_filters_that_break_libzmq_and_psutil():
    lines = _directives(UNIT)
    filters = [v for k, v in lines if k == "SystemCallFilter"]
    assert "@system-service" in filters and "~@privileged" in filters
    assert not any("@resources" in f for f in filters)   # libzmq's I/O thread aborts without sched_setscheduler
    assert ("ProcSubset", "pid") not in lines              # psutil needs /proc/stat and /proc/meminfo
    assert ("SystemCallErrorNumber", "EPERM") in lines     # a denied call fails, it does not kill (SIGSYS)
    assert ("Type", "notify") in lines and ("NotifyAccess", "main") in lines
    assert ("ExecReload", "/opt/shardbroker/bin/brokerctl reload --pid $MAINPID") in lines
    assert ("WatchdogSec", "10s") in lines


def test_notify_reload_dropin():
    lines = _directives(DEPLOY / "systemd-dropins" / "notify-reload.conf")
    assert lines == [("Type", "notify-reload"), ("ReloadSignal", "SIGHUP"), ("ExecReload", "")]


@analyze
def test_notify_reload_dropin_verifies_where_systemd_has_it(tmp_path):
    if _systemd_version() < 253:
        pytest.skip("Type=notify-reload needs systemd >= 253")
    service, _ = _installed_copy(tmp_path)
    (tmp_path / "shardbroker.service.d").mkdir()
    shutil.copy(DEPLOY / "systemd-dropins" / "notify-reload.conf", tmp_path / "shardbroker.service.d")
    res = subprocess.run(["systemd-analyze", "verify", str(service)], capture_output=True, text=True)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr


@pytest.fixture
def sandboxed(tmp_path):
    """Broker() arguments that run it under the unit's sandbox, as tests/support/sandbox_exec.py emulates it."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("needs systemd-analyze (to expand the system call groups)")
    try:
        import ctypes

        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        pytest.skip("needs libseccomp")

    def prefix(unit=UNIT) -> list[str]:
        return [sys.executable, str(REPO / "tests" / "support" / "sandbox_exec.py"), str(unit), "--"]
    return prefix


def test_the_broker_works_under_the_units_sandbox(tmp_path, sandboxed):
    """Pub/sub across workers on both protocols, monitoring (psutil), a reload, and a clean stop."""
    config = {"security": {"enabled": False}}
    b = Broker(tmp_path, workers=2, config=config, prefix=sandboxed()).start()
    try:
        with Raw(b.port) as s, Raw(b.port) as p:
            assert s.request({"op": "info"})["info"]["worker"] != p.request({"op": "info"})["info"]["worker"]
            s.request({"op": "sub", "topic": "sandbox.>"})
            for i in range(100):
                p.request({"op": "pub", "topic": "sandbox.t", "data": i})
            assert [s.json()["data"] for _ in range(100)] == list(range(100))
        status, varz = b.http("/varz")
        assert status == 200 and varz["mem"] > 0 and varz["cpu"] >= 0
        res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "reload", "--pid", str(b.proc.pid)], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0 and "configuration reloaded" in res.stdout, res.stderr
        assert b.stop() == 0
        assert "ERROR" not in b.log(), b.log()
    finally:
        b.close()


def test_the_sandbox_emulation_catches_the_filter_that_breaks_libzmq(tmp_path, sandboxed):
    """The same emulation with nats-server's and redis's ~@resources: the workers abort (libzmq), as measured
    (../shared/reference/operations.md).  Proof that the test above would catch a filter too many."""
    bad = tmp_path / "bad.service"
    bad.write_text(UNIT.read_text() + "SystemCallFilter=~@resources\n")
    res = subprocess.run([*sandboxed(bad), sys.executable, "-m", "shardbroker.cli", "start", "--workers", "1", "--port", "0",
                          "--nats-port", "0", "--monitor-port", "0"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 3, res.stderr
    # libzmq's assertion aborts; with faulthandler dumping the stack first, the death is sometimes seen as SIGSEGV
    assert re.search(r"failed to boot: signal SIG(ABRT|SEGV)", res.stderr), res.stderr
