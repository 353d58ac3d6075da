"""The broker's side of its leaf connections, against a real hub: /leafz in nats-server's shape (and as the hub sees
the same connections), /varz ``leafnodes`` and ``leaf``, the /metrics series, and ``brokerctl top``; then the hub
stops (every link says so, with its error) and comes back (every link redials)."""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import io
import shutil
import subprocess
import sys
import time
import urllib.request

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.harness import REPO, Broker, Raw

pytestmark = pytest.mark.timeout(60)


def _until(get, check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if check(value):
            return value
        assert time.monotonic() < deadline, f"timed out; last: {value}"
        time.sleep(0.05)


def _scrape(broker: Broker) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.ports['monitoring']}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _metrics(broker: Broker) -> dict[str, list]:
    text = _scrape(broker)
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _top(broker: Broker, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", "top", "--once", "-m",
                           f"http://127.0.0.1:{broker.ports['monitoring']}", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=30)


def _publish(url: str, subject: str, n: int) -> None:
    async def run():
        nc = await nats.connect(url, allow_reconnect=False)
        for _ in range(n):
            await nc.publish(subject, b"x" * 10)
        await nc.flush()
        await nc.close()

    asyncio.run(run())


async def _hub_receives(broker: Broker, hub, publisher: Raw) -> None:
    nc = await nats.connect(hub.url, allow_reconnect=False)
    try:
        before = [x["hub_subscriptions"] for x in broker.http("/leafz")[1]["leafs"]]
        sub = await nc.subscribe("up.x")
        await nc.flush()
        deadline = time.monotonic() + 10
        while [x["hub_subscriptions"] for x in broker.http("/leafz")[1]["leafs"]] != [n + 1 for n in before]:
            assert time.monotonic() < deadline, "the hub's interest never reached the broker"
            await asyncio.sleep(0.05)
        assert publisher.request({"op": "pub", "topic": "up.x", "data": "hi"}) == {"ok": True}
        assert (await sub.next_msg(timeout=5)).data == b"hi"
    finally:
        await nc.close()


async def _console(broker: Broker) -> None:
    """The console's leaf view (l): a row per worker's link, and the header's count of links up."""
    from textual.widgets import DataTable, Static

    from shardbroker.cli.top import endpoint, model
    from shardbroker.cli.top.app import TopApp

    app = TopApp(model.Poller(endpoint.Client(f"http://127.0.0.1:{broker.ports['monitoring']}"), interval=0.3))
    async with app.run_test(size=(200, 24)) as pilot:
        await pilot.press("l")
        deadline = time.monotonic() + 15
        rows: list[list[str]] = []
        while time.monotonic() < deadline:
            await pilot.pause(0.1)
            table = app.query_one(DataTable)
            rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
            if app.view == "leafs" and len(rows) == 2:
                break
        header = [str(c.label).rstrip("▲▼") for c in app.query_one(DataTable).ordered_columns]
        assert [(r[header.index("NAME")], r[header.index("STATE")]) for r in rows] == \
            [("sb-w0", "connected"), ("sb-w1", "connected")], rows
        assert "leaf links 2/2 up" in str(app.query_one("#header", Static).render())


def test_leafz_varz_metrics_and_top_follow_the_links_through_a_hub_restart(tmp_path, nats_hub):
    hub = nats_hub
    config = {"leafnodes": {"name": "sb", "reconnect": 0.2, "reconnect_max": 0.5,
                            "remotes": [{"urls": [hub.leaf_url]}]}}
    broker = Broker(tmp_path, workers=2, config=config).start()
    try:
        seen = hub.wait_leafs(2)
        assert sorted(leaf["name"] for leaf in seen) == ["sb-w0", "sb-w1"]
        body = _until(lambda: broker.http("/leafz?subs=1")[1],
                      lambda b: [x["state"] for x in b["leafs"]] == ["connected", "connected"])
        assert body["leafnodes"] == 2 and body["server_id"] == broker.varz()["server_id"]
        assert body["now"].endswith("Z")
        leafs = body["leafs"]
        assert [(x["worker"], x["name"]) for x in leafs] == [(0, "sb-w0"), (1, "sb-w1")]
        for x in leafs:
            assert x["account"] == "$G" and x["compression"] == "not supported" and x["is_spoke"] is True
            assert x["ip"] == "127.0.0.1" and x["port"] == hub.leaf_port
            assert x["url"] == hub.leaf_url and x["hub"] == "hub" and x["last_error"] == ""
            assert x["rtt"].endswith("s") and x["connects"] == 1
            assert any(s.startswith("$LDS.") for s in x["subscriptions_list"])
        assert "subscriptions_list" not in broker.http("/leafz")[1]["leafs"][0]
        # a client's subscription reaches the hub from its worker: its /leafz and the hub's list it
        with Raw(broker.port) as c:
            worker = c.request({"op": "info"})["info"]["worker"]
            assert c.request({"op": "sub", "topic": "mon.>"}) == {"ok": True}
            mine = _until(lambda: broker.http("/leafz?subs=true")[1]["leafs"][worker],
                          lambda x: "mon.>" in x["subscriptions_list"])
            theirs = {x["name"]: x for x in hub.leafz()["leafs"]}[mine["name"]]
            assert sorted(theirs["subscriptions_list"]) == sorted(mine["subscriptions_list"])
        assert broker.http("/leafz?acc=$G")[1]["leafnodes"] == 2
        other = broker.http("/leafz?acc=OTHER")[1]
        assert other["leafnodes"] == 0 and other["leafs"] == []
        status, error = broker.http("/leafz?subs=maybe")
        assert status == 400 and "subs" in error["error"]
        assert "/leafz" in broker.http("/")[1]["endpoints"]

        # traffic both ways, counted on the link of the worker that carried it
        with Raw(broker.port) as c, Raw(broker.port) as p:
            worker = c.request({"op": "info"})["info"]["worker"]
            assert c.request({"op": "sub", "topic": "down.x"}) == {"ok": True}
            _until(lambda: hub.leafz()["leafs"], lambda ls: any("down.x" in x["subscriptions_list"] for x in ls))
            _publish(hub.url, "down.x", 3)
            for _ in range(3):
                assert c.json()["topic"] == "down.x"
            x = broker.http("/leafz")[1]["leafs"][worker]
            assert (x["in_msgs"], x["in_bytes"]) == (3, 30)
            found = _metrics(broker)
            assert {(labels["worker"], labels["direction"]): v
                    for labels, v in found["shardbroker_leafnode_messages_total"]}[(str(worker), "in")] == 3
            # and up: a hub client's interest, a broker client's publish
            sender = p.request({"op": "info"})["info"]["worker"]
            asyncio.run(_hub_receives(broker, hub, p))
            x = broker.http("/leafz")[1]["leafs"][sender]
            assert x["out_msgs"] == 1 and x["out_bytes"] > 0
        varz = broker.varz()
        assert sum(w["leafnodes"]["in_msgs"] for w in varz["workers"]) == 3
        assert sum(w["leafnodes"]["out_msgs"] for w in varz["workers"]) == 1

        varz = broker.varz()
        assert varz["leafnodes"] == 2
        assert varz["leaf"] == {"remotes": [{"local_account": "$G", "urls": [f"127.0.0.1:{hub.leaf_port}"]}]}
        assert all(w["leafnodes"]["connections"] == 1 and w["leafnodes"]["remotes"] == 1 for w in varz["workers"])

        found = _metrics(broker)
        by_worker = {labels["worker"]: v for labels, v in found["shardbroker_leafnode_connections"]}
        assert by_worker == {"0": 1, "1": 1}
        assert {labels["worker"]: v for labels, v in found["shardbroker_leafnode_remotes"]} == {"0": 1, "1": 1}
        directions = {(labels["worker"], labels["direction"]) for labels, _ in found["shardbroker_leafnode_messages_total"]}
        assert directions == {("0", "in"), ("0", "out"), ("1", "in"), ("1", "out")}
        for name in ("shardbroker_leafnode_bytes_total", "shardbroker_leafnode_slow_consumers_total",
                     "shardbroker_leafnode_oversize_total", "shardbroker_leafnode_reconnects_total",
                     "shardbroker_leafnode_dropped_messages_total"):
            assert name in found, name

        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=_scrape(broker), capture_output=True,
                                   text=True, timeout=60)
            assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stdout + check.stderr

        res = _top(broker, "-o", "csv", "--view", "leafs", "-d", "0")
        assert res.returncode == 0, res.stderr
        rows = list(csv.DictReader(io.StringIO(res.stdout)))
        assert [(r["worker"], r["name"], r["state"], r["url"]) for r in rows] == \
            [("0", "sb-w0", "connected", hub.leaf_url), ("1", "sb-w1", "connected", hub.leaf_url)]
        if importlib.util.find_spec("textual") is not None:   # the console is an extra (shardbroker[top])
            asyncio.run(_console(broker))

        # the hub goes: every link says so, with why
        hub.stop()
        body = _until(lambda: broker.http("/leafz")[1],
                      lambda b: all(x["state"] != "connected" and x["last_error"] for x in b["leafs"]))
        assert body["leafnodes"] == 2   # listed still, each with its state
        assert broker.varz()["leafnodes"] == 0
        found = _metrics(broker)
        assert {labels["worker"]: v for labels, v in found["shardbroker_leafnode_connections"]} == {"0": 0, "1": 0}

        # and comes back: every link redials
        hub.start()
        hub.wait_leafs(2)
        body = _until(lambda: broker.http("/leafz")[1],
                      lambda b: [x["state"] for x in b["leafs"]] == ["connected", "connected"])
        assert all(x["reconnects"] >= 1 and x["connects"] == 2 for x in body["leafs"])
        assert _until(lambda: broker.varz()["leafnodes"], lambda n: n == 2) == 2
        reconnects = {labels["worker"]: v for labels, v in _metrics(broker)["shardbroker_leafnode_reconnects_total"]}
        assert all(v >= 1 for v in reconnects.values()) and set(reconnects) == {"0", "1"}
        assert "Traceback" not in broker.log()
    finally:
        broker.close()
