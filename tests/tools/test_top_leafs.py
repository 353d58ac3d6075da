"""brokerctl top's leaf view (cli/top): each worker's leaf links with their rates, as a table, CSV and JSON, from
canned /varz and /leafz answers; and no /leafz asked of a broker without leaf remotes.  The view against a real
hub: tests/leaf/test_leaf_monitoring.py."""

from __future__ import annotations

import csv
import io
import json

import pytest

from shardbroker.cli.top import formatting, model, views


class LeafClient:
    """Canned /varz and /leafz of a broker with one leaf remote (two workers: one link each), or none."""

    base = "http://127.0.0.1:1"

    def __init__(self, remotes: bool) -> None:
        self.remotes = remotes
        self.asked: list[str] = []
        self.requests = 0
        self.in_msgs = 0

    def get(self, path: str, **query) -> dict:
        self.asked.append(path)
        self.requests += 1
        leaf = {"connections": 1, "remotes": 1}
        if path == "/varz":
            return {"now": "2026-01-01T00:00:00Z", "leafnodes": 1 if self.remotes else 0,
                    "leaf": {"remotes": [{"local_account": "$G", "urls": ["h:7422"]}]} if self.remotes else {},
                    "workers": [{"worker": 0, "pid": 0, **({"leafnodes": leaf} if self.remotes else {})},
                                {"worker": 1, "pid": 0, **({"leafnodes": leaf} if self.remotes else {})}]}
        if path == "/leafz":
            self.in_msgs += 50
            return {"now": f"2026-01-01T00:00:0{len(self.asked) // 2}Z", "leafnodes": 2, "leafs": [
                {"worker": 1, "name": "sb-w1", "state": "waiting", "url": "nats-leaf://h:7422", "rtt": "0s",
                 "in_msgs": 0, "out_msgs": 0, "last_error": "connection refused", "reconnects": 3},
                {"worker": 0, "name": "sb-w0", "state": "connected", "url": "nats-leaf://h:7422", "hub": "hub",
                 "rtt": "1.5ms", "in_msgs": self.in_msgs, "out_msgs": 0, "last_error": "", "reconnects": 0}]}
        raise AssertionError(path)


def test_the_leaf_view_lists_each_workers_links_with_rates_and_is_not_fetched_without_remotes():
    client = LeafClient(remotes=True)
    poller = model.Poller(client, local=False)
    poller.poll(("leafs",))
    snap = poller.poll(("leafs",))
    assert [(r["key"], r["name"], r["state"]) for r in snap.leafs] == \
        [("0.0", "sb-w0", "connected"), ("1.0", "sb-w1", "waiting")]
    assert snap.leafs[0]["msgs_in_rate"] == pytest.approx(50.0) and snap.leafs[0]["rtt_seconds"] == 0.0015
    assert snap.leafs[1]["last_error"] == "connection refused" and snap.leafs[1]["reconnects"] == 3
    assert (snap.summary["leafnodes"], snap.summary["leafnode_links"]) == (1, 2)
    assert [r["name"] for r in views.sort_rows(snap.leafs, views.LEAFS, "rtt")] == ["sb-w0", "sb-w1"]
    out = formatting.snapshot_csv(snap, views.LEAFS, "worker", 50)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == [c.key for c in views.LEAFS.columns]
    assert [(r["name"], r["url"], r["last_error"]) for r in rows] == \
        [("sb-w0", "nats-leaf://h:7422", ""), ("sb-w1", "nats-leaf://h:7422", "connection refused")]
    assert [r["name"] for r in json.loads(formatting.snapshot_json(snap, {}, 50))["leafs"]] == ["sb-w0", "sb-w1"]

    client = LeafClient(remotes=False)
    snap = model.Poller(client, local=False).poll(("leafs",))
    assert snap.leafs == [] and client.asked == ["/varz"] and snap.summary["leafnode_links"] == 0
