"""/leafz, /varz's leaf fields and the leaf series of /metrics, built from canned worker replies (the real thing,
against a nats-server hub: tests/leaf/test_leaf_monitoring.py)."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardbroker.cluster.config import from_document
from shardbroker.cluster.monitoring import leafz, metrics


def link(name: str, account: str = "$G", **more) -> dict:
    return {"name": name, "is_spoke": True, "account": account, "ip": "127.0.0.1", "port": 7422, "rtt": "1ms",
            "in_msgs": 1, "out_msgs": 2, "in_bytes": 10, "out_bytes": 20, "subscriptions": 3,
            "compression": "not supported", "url": "nats-leaf://127.0.0.1:7422", "state": "connected", **more}


def test_subs_reads_as_nats_server_reads_a_flag():
    for value in ("1", "t", "true", "TRUE", "True", "detail"):
        assert leafz.flag({"subs": value}, "subs") is True
    for value in ("", "0", "f", "false", "False"):
        assert leafz.flag({"subs": value}, "subs") is False
    assert leafz.flag({}, "subs") is False
    with pytest.raises(ValueError) as err:
        leafz.flag({"subs": "maybe"}, "subs")
    assert str(err.value) == "Error decoding boolean for 'subs': strconv.ParseBool: parsing \"maybe\": invalid syntax"


def test_leafs_lists_the_workers_links_in_worker_order_each_with_its_worker_and_filters_by_account():
    replies = [{"worker": 1, "leafz": [link("sb-w1"), link("sb-w1", "A")]},
               {"worker": 0, "leafz": [link("sb-w0"), link("sb-w0", "A")]},
               {"worker": 2, "unresponsive": True}]
    rows = leafz.leafs(replies)
    assert [(r["worker"], r["account"]) for r in rows] == [(0, "$G"), (0, "A"), (1, "$G"), (1, "A")]
    assert [r["worker"] for r in leafz.leafs(replies, "A")] == [0, 1]
    assert leafz.leafs(replies, "nobody") == []
    assert "worker" not in replies[0]["leafz"][0]   # the replies are left as they were


def test_varz_counts_the_links_up_and_shows_the_remotes_as_nats_server_does_without_credentials():
    replies = [{"worker": 0, "leafnodes": {"connections": 2}}, {"worker": 1, "leafnodes": {"connections": 1}},
               {"worker": 2}]
    assert leafz.connected(replies) == 3
    cfg = from_document({"leafnodes": {"remotes": [
        {"urls": ["nats-leaf://u:secret@hub1:7422", "hub2"], "account": "A", "deny_imports": ["x.>"]},
        {"urls": ["tls://[::1]:7000"], "tls": {"timeout": 5}, "deny_exports": ["y"]},
        {"urls": ["nats://hub3:1"], "tls": True}]}})
    leaf = leafz.varz_leaf(cfg.leafnodes)
    assert leaf == {"remotes": [
        {"local_account": "A", "urls": ["hub1:7422", "hub2:7422"], "deny": {"imports": ["x.>"]}},
        {"local_account": "$G", "urls": ["[::1]:7000"], "tls_timeout": 5.0, "deny": {"exports": ["y"]}},
        {"local_account": "$G", "urls": ["hub3:1"], "tls_timeout": 2.0}]}
    assert "secret" not in repr(leaf)
    assert leafz.varz_leaf(from_document({}).leafnodes) == {}


def scrape(*stats: dict | None) -> dict[str, list]:
    workers = [metrics.WorkerSample(index=i, pid=100 + i, restarts=0, start_time=0.0, heartbeat_age=0.0,
                                    stats=s, process=None) for i, s in enumerate(stats)]
    text, _ = metrics.render(metrics.Scrape(workers=workers, supervisor=None, start_time=0.0, max_fds=1024,
                                            version="0", nats_protocol="0", max_connections=1,
                                            max_pending_bytes=1), "")
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_export_each_workers_leaf_counts_and_nothing_for_a_worker_without_leaf_remotes():
    leaf = {"connections": 1, "remotes": 2, "in_msgs": 3, "out_msgs": 4, "in_bytes": 30, "out_bytes": 40,
            "slow_consumers": 5, "oversize": 6, "reconnects": 7, "dropped": 8}
    found = scrape({"leafnodes": leaf}, {}, None)
    one = lambda name: {tuple(sorted(labels.items())): v for labels, v in found.get(name, [])}  # noqa: E731
    assert one("shardbroker_leafnode_connections") == {(("worker", "0"),): 1}
    assert one("shardbroker_leafnode_remotes") == {(("worker", "0"),): 2}
    assert one("shardbroker_leafnode_messages_total") == {(("direction", "in"), ("worker", "0")): 3,
                                                          (("direction", "out"), ("worker", "0")): 4}
    assert one("shardbroker_leafnode_bytes_total") == {(("direction", "in"), ("worker", "0")): 30,
                                                       (("direction", "out"), ("worker", "0")): 40}
    for name, value in (("slow_consumers", 5), ("oversize", 6), ("reconnects", 7), ("dropped_messages", 8)):
        assert one(f"shardbroker_leafnode_{name}_total") == {(("worker", "0"),): value}, name
