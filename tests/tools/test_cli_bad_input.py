"""No brokerctl command prints a Python traceback for anything a user typed (docs-walk T6-T11, M5): every command
is run with an unknown option, a non-UTF-8 argument, a value of the wrong kind and no broker to reach, and gets a
usage error (exit 2) or one line (exit 1)."""

import concurrent.futures
import os
import subprocess
import sys

import click
import pytest
from test_cli import free_port

from shardbroker.cli.main import cli

from support.harness import REPO

NOT_UTF8 = os.fsdecode(b"\xff\xfe")


def _commands(cmd: click.Command = cli, path: tuple = ()) -> list[tuple]:
    if isinstance(cmd, click.Group):
        return [p for name, sub in sorted(cmd.commands.items()) for p in _commands(sub, path + (name,))]
    return [path]


def _run(args: list[str], env: dict, stdin: bytes = b"") -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BROKER")}
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", *args], input=stdin, capture_output=True, cwd=REPO,
                          timeout=60, env={**base, **env})


def _cases(path: tuple, port: int) -> list[tuple[list[str], dict, bytes]]:
    closed = {"BROKER_URL": f"127.0.0.1:{port}", "BROKER_PASSWORD": "x", "BROKER_ADMIN_PASSWORD": "x"}
    args = list(path)
    cases = [
        (args + ["--no-such-option"], closed, b""),
        (args + [NOT_UTF8], closed, b""),
        (args + ["-p", NOT_UTF8], closed, b""),
        (args + ["--host", NOT_UTF8], closed, b""),
        (args, {**closed, "BROKER_PASSWORD": NOT_UTF8, "BROKER_ADMIN_PASSWORD": NOT_UTF8}, b""),
        (args + ["-p", "0"], closed, b""),
        (args + ["-n", "-1", "a"], closed, b""),
        (args + ["a", "b", "c"], closed, b"pw\n"),
        (args + ["a", "b"], {**closed, "BROKER_URL": "nonsense://x"}, b""),
        (args + ["x"], closed, b"\xff\xfe\n"),   # a password on stdin that is not text
    ]
    if path == ("start",):   # it would start a broker: only what it refuses
        cases = [c for c in cases if c[0][1:2] in (["--no-such-option"], [NOT_UTF8])]
        cases.append((args + ["--workers", "x", "--port", "0", "--nats-port", "0", "--monitor-port", "0"], {}, b""))
    return cases


@pytest.mark.slow
def test_no_command_prints_a_traceback_for_bad_input():
    port = free_port()
    jobs = [(path, case) for path in _commands() for case in _cases(path, port)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: (job, _run(*job[1])), jobs))
    bad = []
    for (_path, (args, _, _)), res in results:
        err = res.stderr.decode("utf-8", "replace")
        if "Traceback" in err or res.returncode not in (0, 1, 2) or (res.returncode and not err.strip()):
            bad.append((ascii(args), res.returncode, err[-400:]))
    assert not bad, f"{len(bad)} of {len(results)} runs: {bad[:5]}"
    assert len(results) > 150


def test_the_errors_name_what_was_wrong():
    port = free_port()
    closed = {"BROKER_URL": f"127.0.0.1:{port}"}
    res = _run(["pub", "t", NOT_UTF8], closed)
    assert res.returncode == 2 and b"argument 3 ('\\xff\\xfe') is not valid UTF-8" in res.stderr
    res = _run(["pub", "-u", NOT_UTF8, "t", "x"], {**closed, "BROKER_PASSWORD": "x"})
    assert res.returncode == 2 and b"the value of -u ('\\xff\\xfe')" in res.stderr
    res = _run(["pub", "-u", "bob", "t", "x"], {**closed, "BROKER_PASSWORD": NOT_UTF8})
    assert res.returncode == 2 and b"$BROKER_PASSWORD is not valid UTF-8" in res.stderr
    res = _run(["hash-password", "--iterations", "1000"], {}, b"\xff\xfe\n")
    assert res.returncode == 2 and b"the password on standard input is not valid UTF-8" in res.stderr
    for n in ("0", "-1"):   # M5: sub -n 0 ran forever, -n -1 was taken
        res = _run(["sub", "-n", n, "t"], closed)
        assert res.returncode == 2 and b"is not in the range x>=1" in res.stderr, res.stderr
