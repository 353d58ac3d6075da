"""Configuration reload (SIGHUP, brokerctl reload): all or nothing.  What can change at run time is in force on
every worker when the command answers; a file that changes anything else is refused whole, the keys named, and
the running configuration stays."""

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from support.harness import REPO, Raw
from support.systemd_fakes import NotifyReceiver

ADMIN = {"username": "admin", "password": "admin-pw", "permissions": ["admin"]}


def config(*users: dict, **sections) -> dict:
    return {"security": {"enabled": True, "iterations": 1000, "admin_user": ADMIN, "users": list(users)},
            **sections}


def user(name: str, *perms: str) -> dict:
    return {"username": name, "password": f"{name}-pw", "permissions": list(perms) or ["subscribe:>", "publish:>"]}


def auth(c: Raw, name: str) -> dict:
    return c.request({"op": "auth", "user": name, "pass": f"{name}-pw"})


def reload(b, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", "reload", "--pid", str(b.proc.pid), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def notify(tmp_path):
    rx = NotifyReceiver(tmp_path)
    yield rx
    rx.close()


def _file(tmp_path):
    path = next(tmp_path.glob("config-*.json"))
    os.chmod(path, 0o600)
    return path


def _on_each_worker(b, name: str, n: int = 2) -> list[Raw]:
    """One connection per worker (the supervisor hands them out least-loaded first), logged in as ``name``."""
    conns = [Raw(b.port) for _ in range(n)]
    for c in conns:
        assert auth(c, name) == {"ok": True}
    assert {c.request({"op": "info"})["info"]["worker"] for c in conns} == set(range(n))
    return conns


def test_reload_applies_users_and_limits_on_every_worker_before_it_answers(tmp_path, start_broker, notify):
    b = start_broker(workers=2, config=config(user("alice"), user("bob")), env=notify.env())
    path = _file(tmp_path)
    before = b.varz()
    assert before["config_digest"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    olds = _on_each_worker(b, "alice")
    for c in olds:
        assert c.request({"op": "sub", "topic": "a"}) == {"ok": True}
    path.write_text(json.dumps(config(user("bob"), user("carol"), limits={"max_subscriptions": 1},
                                      logging={"level": "debug"})))
    os.chmod(path, 0o600)
    mark = time.monotonic()
    res = reload(b)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("configuration reloaded (sha256:")
    assert "limits.max_subscriptions, logging.level, security.users" in res.stdout
    # in force on both workers when the command returned
    for c in olds:
        assert c.json() == {"ok": False, "error": "user_deleted"}
    news = _on_each_worker(b, "carol")
    for c in news:
        assert c.request({"op": "sub", "topic": "x"}) == {"ok": True}
        assert c.request({"op": "sub", "topic": "y"}) == {"ok": False, "error": "too_many_subscriptions"}
    after = b.varz()
    assert after["config_digest"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert after["config_load_time"] > before["config_load_time"]
    # systemd: RELOADING=1 with the monotonic clock, then READY=1
    t_rel, reloading = notify.wait_for("RELOADING", "1", after=mark)
    now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert 0 < now_usec - int(reloading["MONOTONIC_USEC"]) < 30_000_000
    t_ready, _ = notify.wait_for("READY", "1", after=t_rel)
    assert t_ready >= t_rel
    for c in olds + news:
        c.close()


def test_a_restart_only_key_refuses_the_whole_reload_and_keeps_the_running_config(tmp_path, start_broker, notify):
    b = start_broker(workers=2, config=config(user("alice")), env=notify.env())
    path = _file(tmp_path)
    before = b.varz()
    path.write_text(json.dumps(config(user("alice"), user("dave"), nats={"max_payload": 1000},
                                      fabric={"hwm": 5000})))
    os.chmod(path, 0o600)
    mark = time.monotonic()
    res = reload(b)
    assert res.returncode == 1
    assert res.stderr.strip() == ("Error: configuration not reloaded (the running configuration is kept): fabric.hwm "
                                  "(100000 -> 5000), nats.max_payload (1048576 -> 1000): need a restart")
    b.wait_log(r"ERROR broker.reload: brokerctl reload: configuration not reloaded .*fabric.hwm")
    with Raw(b.port) as c:   # nothing applied: not even the new user
        assert auth(c, "dave") == {"ok": False, "error": "auth_failed"}
        assert auth(c, "alice") == {"ok": True}
    after = b.varz()
    assert (after["max_payload"], after["config_digest"], after["config_load_time"]) == \
        (before["max_payload"], before["config_digest"], before["config_load_time"])
    # and it is visible to monitoring, not only in the log: /varz, and /metrics for an alert
    assert before["config_last_reload"] is None
    last = after["config_last_reload"]
    assert last["ok"] is False and "need a restart" in last["error"] and len(last["restart"]) == 2, last
    with urllib.request.urlopen(f"http://127.0.0.1:{b.ports['monitoring']}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "shardbroker_config_last_reload_successful 0.0" in metrics
    assert 'shardbroker_config_reloads_total{outcome="failed"} 1.0' in metrics
    t_rel, _ = notify.wait_for("RELOADING", "1", after=mark)
    _, status = notify.wait_for("STATUS", after=t_rel + 1e-6)
    assert status["STATUS"].startswith("configuration not reloaded") and "nats.max_payload" in status["STATUS"]
    notify.wait_for("READY", "1", after=t_rel)


def test_an_invalid_file_is_not_applied_and_the_command_says_why(tmp_path, start_broker):
    b = start_broker(workers=1, config=config(user("alice")))
    path = _file(tmp_path)
    path.write_text(json.dumps(config(user("alice"), limits={"max_connections": 0})))
    res = reload(b)
    assert res.returncode == 1
    assert "limits.max_connections: must be between 1 and 1e+07, got 0" in res.stderr
    with Raw(b.port) as c:
        assert auth(c, "alice") == {"ok": True}


def test_reload_of_a_broker_started_without_a_file_and_of_no_broker(start_broker):
    b = start_broker(workers=1)
    res = reload(b)
    assert res.returncode == 1 and "started without --config: there is no file to read" in res.stderr
    gone = subprocess.run([sys.executable, "-m", "shardbroker.cli", "reload", "--pid", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert gone.returncode == 1 and "no running broker with pid 1 found in" in gone.stderr
