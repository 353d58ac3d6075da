"""A reload (SIGHUP) adds, changes and drops leaf remotes on every worker without a restart: the hubs see the
connections come and go, and local clients keep their connections throughout."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from support.harness import Broker, Raw


def _hup(broker: Broker, config: dict) -> None:
    path = next(broker.tmp.glob("config-*.json"))
    path.write_text(json.dumps(config))
    mark = len(broker.log())
    os.kill(broker.proc.pid, signal.SIGHUP)
    broker.wait_log(r"configuration reloaded", after=mark)


def _leafs(server) -> list[str]:
    return sorted(leaf["name"] for leaf in server.leafz()["leafs"])


def _until(check, broker: Broker, *servers, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            seen = {server.name: _leafs(server) for server in servers}
            raise AssertionError(f"timed out; the hubs show {seen}; broker log:\n{broker.log()[-3000:]}")
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_reload_adds_changes_and_drops_remotes(tmp_path, nats_servers):
    one, two = nats_servers("one"), nats_servers("two")
    base = {"leafnodes": {"name": "sb", "reconnect": 0.2}}
    broker = Broker(tmp_path, workers=2, config=base).start()
    try:
        client = Raw(broker.port)
        assert client.request({"op": "info"})["ok"]
        assert _leafs(one) == [] and _leafs(two) == []

        _hup(broker, {"leafnodes": {**base["leafnodes"], "remotes": [{"urls": [one.leaf_url]}]}})
        _until(lambda: _leafs(one) == ["sb-w0", "sb-w1"], broker, one, two)

        # the same remote pointed elsewhere: the old connections close, the new ones dial
        _hup(broker, {"leafnodes": {**base["leafnodes"], "remotes": [{"urls": [two.leaf_url]}]}})
        _until(lambda: _leafs(two) == ["sb-w0", "sb-w1"] and _leafs(one) == [], broker, one, two)

        # a new instance name redials with it
        _hup(broker, {"leafnodes": {**base["leafnodes"], "name": "renamed", "remotes": [{"urls": [two.leaf_url]}]}})
        _until(lambda: _leafs(two) == ["renamed-w0", "renamed-w1"], broker, one, two)

        _hup(broker, base)
        _until(lambda: _leafs(two) == [] and _leafs(one) == [], broker, one, two)
        assert client.request({"op": "info"})["ok"]   # the local client never noticed
        assert "Traceback" not in broker.log()
    finally:
        broker.close()


@pytest.mark.timeout(60)
def test_a_reload_naming_a_credentials_file_that_cannot_be_read_is_refused(tmp_path, nats_servers):
    hub = nats_servers("one")
    base = {"leafnodes": {"name": "sb", "reconnect": 0.2, "remotes": [{"urls": [hub.leaf_url]}]}}
    broker = Broker(tmp_path, workers=2, config=base).start()
    try:
        _until(lambda: _leafs(hub) == ["sb-w0", "sb-w1"], broker, hub)
        path = next(broker.tmp.glob("config-*.json"))
        missing = tmp_path / "nowhere.creds"
        path.write_text(json.dumps({"leafnodes": {**base["leafnodes"], "remotes": [
            {"urls": [hub.leaf_url], "credentials": str(missing)}]}}))
        mark = len(broker.log())
        os.kill(broker.proc.pid, signal.SIGHUP)
        line = broker.wait_log(r"configuration not reloaded.*", after=mark).group(0)
        assert "leafnodes.remotes[0].credentials" in line and "nowhere.creds" in line, line
        assert _leafs(hub) == ["sb-w0", "sb-w1"]   # the running configuration, and its links, are kept
    finally:
        broker.close()
