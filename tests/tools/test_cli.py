"""brokerctl as a user types it: connection options before or after the subcommand, $BROKER_URL, what `user`
commands say, --version."""

import json
import os
import socket
import subprocess
import sys

import pytest
from test_security import ADMIN, auth, secure_config

from shardbroker.cluster import VERSION

from support.harness import REPO, Raw


def brokerctl(*args, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=60, env={**base, **(env or {})})


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, res.stderr
    return res.stdout


ADMIN_ENV = {"BROKER_ADMIN_USER": ADMIN[0], "BROKER_ADMIN_PASSWORD": ADMIN[1]}


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def secure(start_broker):
    return start_broker(workers=2, config=secure_config())


def test_user_commands_take_connection_options_where_they_are_typed_and_say_what_changed(secure):
    port = str(secure.port)
    # after the subcommand, as a user types it (this was "No such option '-p'")
    assert ok(brokerctl("user", "add", "-p", port, "carol", "subscribe:c.*", stdin="pw-c\n", env=ADMIN_ENV)) == \
        "created user carol: subscribe:c.*\n"
    # before it, on the group, as before
    assert ok(brokerctl("user", "-p", port, "grant", "carol", "publish:c.x", env=ADMIN_ENV)) == \
        "granted publish:c.x to carol: publish:c.x subscribe:c.*\n"
    assert ok(brokerctl("user", "grant", "carol", "publish:c.x", "--port", port, env=ADMIN_ENV)) == \
        "carol has publish:c.x already: nothing changed\n"
    assert ok(brokerctl("user", "revoke", "--host", "127.0.0.1", "-p", port, "carol", "publish:c.x",
                        env=ADMIN_ENV)) == "revoked publish:c.x from carol: subscribe:c.*\n"
    assert ok(brokerctl("user", "passwd", "carol", "-p", port, stdin="pw-c2\n", env=ADMIN_ENV)) == \
        "changed the password of carol\n"
    with Raw(secure.port) as c:
        assert auth(c, "carol", "pw-c2") == {"ok": True}
    # the administrator may be named after the subcommand too, and wins over the environment
    assert "carol\tsubscribe:c.*" in ok(brokerctl("user", "list", "-p", port, "--admin", "admin",
                                                  env={**ADMIN_ENV, "BROKER_ADMIN_USER": "nobody"}))
    # --quiet (-q), on the group or the command: nothing on success
    assert ok(brokerctl("user", "-q", "revoke", "-p", port, "carol", "subscribe:c.*", env=ADMIN_ENV)) == ""
    assert ok(brokerctl("user", "delete", "-q", "-p", port, "carol", env=ADMIN_ENV)) == ""
    bad = brokerctl("user", "delete", "-p", port, "carol", env=ADMIN_ENV)
    assert bad.returncode == 1 and bad.stdout == "" and "unknown_user" in bad.stderr
    refused = brokerctl("user", "add", "-p", port, "eve", "publish:ch*", stdin="pw\n", env=ADMIN_ENV)
    assert refused.returncode == 1 and "invalid_permission" in refused.stderr


def test_the_command_s_option_wins_over_the_group_s(secure):
    nothing = str(free_port())
    assert "admin\tadmin" in ok(brokerctl("user", "-p", nothing, "list", "-p", str(secure.port), env=ADMIN_ENV))
    res = brokerctl("user", "-p", str(secure.port), "list", "-p", nothing, env=ADMIN_ENV)
    assert res.returncode == 1 and f"cannot connect to 127.0.0.1:{nothing}" in res.stderr


def test_broker_url_names_the_broker_for_every_client_command(broker):
    env = {"BROKER_URL": f"127.0.0.1:{broker.port}"}
    ok(brokerctl("pub", "cli.a", "one", env=env))
    ok(brokerctl("pub", "cli.a", "two", env={"BROKER_URL": f"ndjson://127.0.0.1:{broker.port}"}))
    msg_id = ok(brokerctl("queue", "push", "jobs", "x", env=env)).strip()
    got = json.loads(ok(brokerctl("queue", "recv", "--ack", "jobs", env=env)))
    assert got["id"] == msg_id and got["data"] == "x"
    # a flag wins over the environment, on the command or on its group
    stale = {"BROKER_URL": f"127.0.0.1:{free_port()}"}
    ok(brokerctl("pub", "-p", str(broker.port), "cli.a", "three", env=stale))
    ok(brokerctl("queue", "-p", str(broker.port), "push", "jobs", "y", env=stale))
    ok(brokerctl("queue", "recv", "-p", str(broker.port), "jobs", env=stale))
    res = brokerctl("pub", "cli.a", "four", env=stale)
    assert res.returncode == 1 and f"cannot connect to {stale['BROKER_URL']}" in res.stderr


@pytest.mark.parametrize("url,reason", [
    ("127.0.0.1:x", "port 'x' is not 1-65535"),
    ("127.0.0.1:0", "port '0' is not 1-65535"),
    ("nats://127.0.0.1:4222", "nats:// is not ndjson://"),
    ("ndjson://carol@127.0.0.1:8080", "expected [ndjson://]HOST[:PORT] (users go in --user"),
])
def test_a_bad_broker_url_is_a_usage_error_naming_it(url, reason):
    res = brokerctl("pub", "a", "b", env={"BROKER_URL": url})
    assert res.returncode == 2 and f"$BROKER_URL='{url}': {reason}" in res.stderr, res.stderr


def test_parse_url():
    from shardbroker.cli.connect import parse_url
    assert parse_url("h") == ("h", 8080)
    assert parse_url("h:9") == ("h", 9)
    assert parse_url("tcp://h:9/") == ("h", 9)
    assert parse_url("[::1]:9") == ("::1", 9)
    assert parse_url("[::1]") == ("::1", 8080)
    assert parse_url("::1") == ("::1", 8080)
    assert parse_url(":9") == ("127.0.0.1", 9)


def test_version_in_brokerctl_the_ready_line_and_varz(broker):
    assert ok(brokerctl("--version")) == f"brokerctl (shardbroker) {VERSION}\n"
    assert ok(brokerctl("-V")) == ok(brokerctl("--version"))
    assert broker.wait_log(r"ready: .* workers=\d+ pids=[\d,]+ version=(\S+)").group(1) == VERSION
    varz = broker.varz()
    assert varz["broker"] == f"shardbroker {VERSION}"
    assert varz["version"] == "2.10.0"   # the NATS protocol level: clients read features from it
