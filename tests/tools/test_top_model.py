"""``brokerctl top``'s computations on canned answers, no broker: where the monitoring endpoint is, rates from
counters, sorting and formatting, and the poller's choices (who sorts the connections, the subject drill-down).
The console against a real broker is tests/tools/test_top.py."""

import pytest

from shardbroker.cli.top import endpoint, formatting, model, views


def test_monitor_url_takes_a_url_a_host_port_or_a_port():
    assert endpoint.monitor_url(None, None) == "http://127.0.0.1:8222"
    assert endpoint.monitor_url("9000", None) == "http://127.0.0.1:9000"
    assert endpoint.monitor_url("10.0.0.5:8222", None) == "http://10.0.0.5:8222"
    assert endpoint.monitor_url("http://mon.example/", None) == "http://mon.example:8222"
    assert endpoint.monitor_url(None, "10.1.2.3") == "http://10.1.2.3:8222"
    assert endpoint.monitor_url(None, "::1") == "http://[::1]:8222"
    with pytest.raises(ValueError):
        endpoint.monitor_url("ftp://x", None)
    assert endpoint.is_local("http://127.0.0.1:8222") and endpoint.is_local("http://localhost:1")
    assert not endpoint.is_local("http://10.0.0.5:8222")


def test_rates_restart_from_a_counter_that_went_back_instead_of_going_negative():
    r = model.Rates()
    assert r.update("k", 0.0, {"n": 0}, 0.9) == {"n": None}
    assert r.update("k", 1.0, {"n": 100}, 0.9) == {"n": 100.0}
    assert r.update("k", 2.0, {"n": 5}, 0.9) == {"n": None}       # the worker was replaced: its count restarted
    assert r.update("k", 3.0, {"n": 55}, 0.9) == {"n": 50.0}
    # a 3 s window averages counters that move in steps (subject counts reach their owner once a second)
    r = model.Rates()
    for t, n in ((0, 0), (1, 0), (2, 200), (3, 200), (4, 500)):
        out = r.update("s", float(t), {"n": n}, 2.9)
    assert out == {"n": pytest.approx(500 / 3)}                     # (500 - 0) / (4 - 1): since t=1
    r.forget([])
    assert r.update("s", 5.0, {"n": 600}, 2.9) == {"n": None}


def test_sort_rows_puts_numbers_biggest_first_names_a_to_z_and_missing_values_last():
    rows = [{"cid": 1, "msgs_to": 5, "name": "b"}, {"cid": 2, "msgs_to": None, "name": "a"},
            {"cid": 3, "msgs_to": 9, "name": "c"}]
    view = views.CONNECTIONS
    assert [r["cid"] for r in views.sort_rows(rows, view, "msgs_to")] == [3, 1, 2]
    assert [r["cid"] for r in views.sort_rows(rows, view, "msgs_to", reverse=True)] == [1, 3, 2]
    assert [r["cid"] for r in views.sort_rows(rows, view, "name")] == [2, 1, 3]
    assert [r["cid"] for r in views.sort_rows(rows, view, "cid")] == [1, 2, 3]


def test_human_numbers():
    assert formatting.human(None, "int") == "-"
    assert formatting.human(0, "bytes") == "0"
    assert formatting.human(1536, "bytes") == "1.5K"
    assert formatting.human(2_500_000, "rate") == "2.5M"
    assert formatting.human(0.0042, "secs") == "4.2ms"
    assert formatting.human(1536, "bytes", raw=True) == "1536"


class FakeClient:
    """Canned monitoring answers; records what was asked."""

    base = "http://127.0.0.1:1"

    def __init__(self, sorts: bool) -> None:
        self.sorts = sorts
        self.asked: list[tuple[str, dict]] = []
        self.requests = 0
        self.conns = [{"cid": i, "worker": i % 2, "out_msgs": 10 * i, "in_msgs": 0, "ip": "127.0.0.1", "port": i,
                       "subscriptions": 1, "pending_bytes": 0, "subscriptions_list": [f"a.{i}", "b.>"]}
                      for i in range(1, 6)]

    def get(self, path: str, **query) -> dict:
        self.asked.append((path, query))
        self.requests += 1
        if path == "/varz":
            return {"now": "2026-01-01T00:00:00Z", "workers": [{"worker": 0, "pid": 0}, {"worker": 1, "pid": 0}]}
        if path == "/topicz":
            return {"subjects": [{"subject": "a.1", "owner": 1, "msgs": 7, "bytes": 70}]}
        if path == "/connz":
            sort = query.get("sort")
            if sort is not None and self.sorts:
                if sort not in views.NATS_CONN_SORT.values():
                    raise endpoint.BadRequest("400 invalid sorting option")
                conns = sorted(self.conns, key=lambda c: -c["out_msgs"])
            else:
                conns = self.conns  # a broker that ignores sort= pages by cid
            limit = query.get("limit", 1024)
            return {"now": "2026-01-01T00:00:00Z", "total": len(self.conns), "connections": conns[:limit]}
        raise AssertionError(path)


def test_connections_are_sorted_by_the_broker_when_it_knows_sort_else_here_over_all_of_them():
    for server_sorts in (True, False):
        client = FakeClient(server_sorts)
        poller = model.Poller(client, limit=2, local=False)
        snap = poller.poll(("connections",), conn_sort="msgs_to")
        assert poller.server_sorts is server_sorts
        assert [c["cid"] for c in snap.connections] == [5, 4] and snap.connections_total == 5
        asked = [q for p, q in client.asked if p == "/connz"][-1]
        if server_sorts:
            assert snap.connections_sorted_by == "server" and asked == {"sort": "msgs_to", "limit": 2}
        else:
            assert snap.connections_sorted_by == "client" and "sort" not in asked and asked["limit"] >= 5


def test_the_drill_down_matches_every_subscription_pattern_of_every_connection():
    client = FakeClient(False)
    snap = model.Poller(client, local=False).poll((), subject="a.1")
    assert [(s["cid"], s["patterns"]) for s in snap.subscribers] == [(1, "a.1")]
    snap = model.Poller(client, local=False).poll((), subject="b.x")
    assert sorted(s["cid"] for s in snap.subscribers) == [1, 2, 3, 4, 5]
    assert snap.subject_detail["msgs"] == 7
