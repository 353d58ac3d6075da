"""The monitoring endpoints, after known traffic."""

import os
import signal
import time

from support.harness import Raw


def test_monitoring_after_known_traffic(start_broker):
    b = start_broker(workers=2)
    assert b.http("/healthz") == (200, {"status": "ok"})
    with Raw(b.port) as s, Raw(b.port) as p:
        s.request({"op": "sub", "topic": "mon.*"})
        s.request({"op": "sub", "topic": "mon.a"})
        for _ in range(3):
            assert p.request({"op": "pub", "topic": "mon.a", "data": "abc"}) == {"ok": True}
        for _ in range(3):
            s.json()
        varz = b.varz()
        assert varz["connections"] == 2 and varz["total_connections"] == 2
        assert varz["subscriptions"] == 2
        assert varz["in_msgs"] == 3 and varz["in_bytes"] == 3 * len(b'"abc"')
        assert varz["out_msgs"] == 3  # one delivery per message per connection, however many patterns match
        assert varz["out_bytes"] == 3 * len(b'"abc"')  # payload bytes, as nats-server counts
        assert varz["out_wire_bytes"] >= 3 * len(b'{"topic":"mon.a","data":"abc"}\n') + 2 * len(b'{"ok":true}\n')
        assert varz["slow_consumers"] == 0 and varz["worker_count"] == 2
        assert varz["mem"] > 0 and varz["uptime"].endswith("s")
        assert varz["port"] == b.ports["nats"] and varz["ports"]["ndjson"] == b.port  # NATS tooling reads "port"
        assert varz["server_id"].startswith("N") and varz["proto"] == 1 and varz["http_port"] > 0
        assert sorted(w["pid"] for w in varz["workers"]) == sorted(b.pids)

        status, connz = b.http("/connz?subs=1")
        assert status == 200 and connz["total"] == 2
        by_cid = {c["cid"]: c for c in connz["connections"]}
        sub_info = s.request({"op": "info"})["info"]
        entry = by_cid[sub_info["cid"]]
        assert entry["worker"] == sub_info["worker"]
        assert entry["subscriptions_list"] == ["mon.*", "mon.a"] and entry["subscriptions"] == 2
        assert entry["out_msgs"] == 3 and entry["ip"] == "127.0.0.1" and entry["protocol"] == "ndjson"
        assert entry["kind"] == "Client" and entry["start"].endswith("Z") and entry["uptime"].endswith("s")

        subsz = b.http("/subsz")[1]
        assert subsz["num_subscriptions"] == 2

    assert b.http("/connz?limit=x")[0] == 400
    assert b.http("/nope")[0] == 404


def test_healthz_reports_an_unresponsive_worker(start_broker):
    b = start_broker(workers=2, config={"workers": {"heartbeat_timeout": 30}})
    os.kill(b.pids[0], signal.SIGSTOP)
    try:
        started = time.monotonic()
        status, body = b.http("/healthz")
        assert status == 503 and "1 worker(s) unresponsive" in body["error"]
        assert time.monotonic() - started < 5
        varz = b.varz()
        assert [w.get("unresponsive", False) for w in sorted(varz["workers"], key=lambda w: w["worker"])] == \
            [True, False]
    finally:
        os.kill(b.pids[0], signal.SIGCONT)
    assert b.http("/healthz")[0] == 200


def test_monitoring_stays_on_loopback_when_the_client_listeners_do_not(start_broker):
    """Finding A9: monitoring.bind followed network.bind, so binding the clients elsewhere also served /connz
    (addresses, users, subjects) there, unauthenticated.  It defaults to 127.0.0.1; the ready line brackets an
    IPv6 address as the client listeners' do."""
    b = start_broker(workers=1, args=["--bind", "::1"])
    ready = b.wait_log(r"ready: .*").group(0)
    assert f"ndjson=[::1]:{b.port}" in ready and f"monitoring=127.0.0.1:{b.ports['monitoring']}" in ready
    assert b.http("/healthz")[0] == 200
    ipv6 = start_broker(workers=1, config={"monitoring": {"bind": "::1"}})
    assert f"monitoring=[::1]:{ipv6.ports['monitoring']}" in ipv6.wait_log(r"ready: .*").group(0)
    assert "without TLS client certificates" not in ipv6.log()   # loopback: nothing to warn about


def test_a_monitoring_port_beyond_loopback_without_client_certificates_is_warned_about():
    from shardbroker.cluster.config import load
    from shardbroker.cluster.security import tls

    for bind, warned in (("127.0.0.1", False), ("::1", False), ("0.0.0.0", True), ("192.0.2.7", True)):
        said = tls.warnings(load(None, {"monitoring.bind": bind}), {})
        assert any("monitoring listens on" in line for line in said) is warned, (bind, said)
    assert load(None).monitoring.bind == "127.0.0.1"
