"""What the configuration loader refuses before anything starts: directories the broker could not use, permission
strings that look like wildcards and are not; and that the documented file and ranges are the real ones."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing

import pytest

from shardbroker.cluster import config as cfgmod
from shardbroker.cluster.config.paths import directory_keys

from support.harness import REPO


def start(tmp_path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", "start", "--workers", "1", "--port", "0", "--nats-port", "0",
                           "--monitor-port", "0", "--config", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=30)


def one_line_exit_2(res: subprocess.CompletedProcess, message: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("brokerctl: configuration error: ") and message in lines[0], lines[0]


# -- directories ------------------------------------------------------------------------------------------------

def test_a_missing_runtime_dir_is_one_line_naming_the_key_and_exit_2(tmp_path):
    one_line_exit_2(start(tmp_path, {"runtime": {"dir": "/nonexistent/x"}}),
                    "runtime.dir: '/nonexistent/x' does not exist")


def bad_directories(tmp_path) -> list[tuple[dict, str]]:
    a_file = tmp_path / "file"
    a_file.write_text("")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)   # chmod: the umask would take the bits away
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    return [
        ({"runtime": {"dir": "/nonexistent/x"}}, "runtime.dir: '/nonexistent/x' does not exist"),
        ({"runtime": {"dir": str(a_file)}}, f"runtime.dir: '{a_file}' is not a directory"),
        ({"runtime": {"dir": ""}}, "runtime.dir: '' is not a directory"),
        ({"runtime": {"dir": str(open_dir)}}, "is writable by every user without the sticky bit (mode 0777)"),
        ({"queues": {"data_dir": str(a_file)}}, f"queues.data_dir: '{a_file}' is not a directory"),
        ({"queues": {"data_dir": str(a_file / "q")}}, f"cannot be created: {a_file} is not a directory"),
        ({"queues": {"data_dir": str(sticky)}}, "is writable by every user (mode 1777)"),
    ]


def test_every_directory_key_is_checked_at_load(tmp_path):
    for config, message in bad_directories(tmp_path):
        with pytest.raises(cfgmod.ConfigError) as err:
            cfgmod.load(None, {f"{s}.{k}": v for s, keys in config.items() for k, v in keys.items()})
        assert message in str(err.value), (config, str(err.value))
    sticky = tmp_path / "sticky"
    fine = [{"runtime.dir": str(sticky)},                              # /tmp's kind: the sticky bit protects
            {"queues.data_dir": str(tmp_path / "new" / "queues")},     # made at start
            {"queues.data_dir": str(tmp_path / "file"), "queues.journal": False}]   # not used
    for overrides in fine:
        cfgmod.load(None, overrides)
    # The keys are found by their metadata: a new directory key is checked without another line of code.
    unchecked = cfgmod.load(None, {"runtime.dir": "/x", "queues.data_dir": "/y"}, check_paths=False)
    found = [key for key, _, _ in directory_keys(unchecked, "")]
    assert sorted(found) == ["queues.data_dir", "runtime.dir"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_runtime_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(cfgmod.ConfigError, match="runtime.dir: .* is not writable by this user"):
        cfgmod.load(None, {"runtime.dir": str(locked)})


def test_a_directory_no_one_may_write_in_is_refused_even_for_root():
    """sysfs refuses a new directory to every user, root included, whom the mode bits let through: the check
    makes one, as the start would, and the start is not a traceback."""
    with pytest.raises(cfgmod.ConfigError, match="runtime.dir: '/sys' is not writable by this user"):
        cfgmod.load(None, {"runtime.dir": "/sys"})
    with pytest.raises(cfgmod.ConfigError, match="queues.data_dir: '/sys/q' cannot be created: /sys is not writable"):
        cfgmod.load(None, {"queues.data_dir": "/sys/q"})


def test_a_bad_data_dir_stops_the_start_with_exit_2(tmp_path):
    config, message = bad_directories(tmp_path)[5]
    one_line_exit_2(start(tmp_path, config), message)


# -- permission strings -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("perm", ["publish:ch*", "subscribe:chat.room*", "publish:a.*b.c", "subscribe:>x",
                                  "publish:a.b>"])
def test_a_wildcard_inside_a_token_is_refused_at_load(perm):
    with pytest.raises(cfgmod.ConfigError, match=re.escape(f"security.users[0].permissions: '{perm}'")):
        cfgmod.load(None, {"security.users": [{"username": "u", "password": "p", "permissions": [perm]}]})


def test_publish_ch_star_stops_the_start_with_exit_2(tmp_path):
    config = {"security": {"enabled": True, "iterations": 1000,
                           "admin_user": {"username": "admin", "password": "a", "permissions": ["admin"]},
                           "users": [{"username": "u", "password": "p", "permissions": ["publish:ch*"]}]}}
    one_line_exit_2(start(tmp_path, config), "security.users[0].permissions: 'publish:ch*'")


@pytest.mark.parametrize("key", ["password", "qlite_secret"])
def test_a_secret_of_the_wrong_type_is_reported_without_its_value(key):
    with pytest.raises(cfgmod.ConfigError) as err:
        cfgmod.load(None, {"security.users": [{"username": "u", key: 9876543210}]})
    assert str(err.value).startswith(f"security.users[0].{key}: expected a string or null")
    assert "9876543210" not in str(err.value)


# -- the configuration and users modules ------------------------------------------------------------------------

def test_config_does_not_import_the_user_registry():
    """cluster.security.users builds on cluster.config, never the other way round (no import cycle, even a deferred
    one)."""
    code = ("import sys, shardbroker.cluster.config as c; c.load(None, {'security.users': "
            "[{'username': 'u', 'password': 'p', 'permissions': ['admin']}]}); "
            "assert 'shardbroker.cluster.security.users' not in sys.modules, 'config imported users'; "
            "import shardbroker.cluster.security.users")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


# -- what docs/configuration.md and deploy/ say ------------------------------------------------------------------

def _as_document(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _as_document(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.metadata.get("internal")}
    if isinstance(obj, list):
        return [_as_document(v) for v in obj]
    return obj


def test_deploy_example_config_is_every_default_spelled_out():
    """Every key, at its default, except the one the systemd unit needs: the journals in its StateDirectory."""
    example = json.loads((REPO / "deploy" / "config.example.json").read_text())
    defaults = _as_document(cfgmod.load(None))
    assert example["queues"].pop("data_dir") == "/var/lib/shardbroker/queues"
    defaults["queues"].pop("data_dir")
    assert example == defaults
    cfgmod.load(str(REPO / "deploy" / "config.example.json"), check_paths=False)


def _ranged_keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _ranged_keys(tp, f"{prefix}{f.name}.")
        elif f.metadata.get("min") is not None:
            yield prefix + f.name, f.metadata["min"], f.metadata["max"]


def doc_number(value) -> str:
    """How docs/configuration.md writes a limit: whole KiB in the largest binary unit, large numbers with commas.
    (A configured queue's keys, ``queues.queues[]``, have the ranges of the defaults they replace.)"""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:g}"
    value = int(value)
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value and value % size == 0:
            return f"{value // size} {unit}"
    return f"{value:,}" if value >= 100_000 else str(value)


def test_every_numeric_range_the_loader_enforces_is_documented():
    doc = (REPO / "docs" / "configuration.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_.\[\]]+)` \|.*$", doc, re.M)}
    missing = []
    for key, lo, hi in _ranged_keys(cfgmod.Config):
        expected = f"{doc_number(lo)}–{doc_number(hi)}"
        if key not in rows or expected not in rows[key]:
            missing.append(f"{key}: {expected}")
    assert not missing, f"ranges missing from docs/configuration.md: {missing}"


def test_a_wrong_value_in_the_file_is_reported_though_a_flag_overrides_it(tmp_path):
    """U2: with --port 0, a file's "port": "8080" (a string) started without a word, and the next start without
    the flag failed on it."""
    from shardbroker.cluster.config import ConfigError, load

    for doc, overrides, key in (({"network": {"port": "8080"}}, {"network.port": 0}, "network.port"),
                                ({"workers": {"count": "AUTO"}}, {"workers.count": 2}, "workers.count"),
                                ({"monitoring": {"port": "x"}}, {"monitoring.port": 0}, "monitoring.port")):
        path = tmp_path / "c.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(ConfigError) as refused:
            load(str(path), overrides)
        assert str(refused.value).startswith(key) and "whatever the command line overrides" in str(refused.value)
    path.write_text(json.dumps({"network": {"port": 9000}}))
    assert load(str(path), {"network.port": 0}).network.port == 0   # a right value is overridden as before
