"""GET /metrics against a real broker: the exposition parses, agrees with /varz and /queuez, negotiates
OpenMetrics and gzip, survives a worker's replacement without a counter going backwards in any other series, and
costs little."""

import gzip
import os
import re
import signal
import statistics
import time
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from support.harness import REPO, Raw


def scrape(b, accept: str | None = None, encoding: str | None = None) -> tuple[str, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{b.ports['monitoring']}/metrics")
    if accept:
        req.add_header("Accept", accept)
    if encoding:
        req.add_header("Accept-Encoding", encoding)
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
        headers = {k.lower(): v for k, v in resp.headers.items()}
    if headers.get("content-encoding") == "gzip":
        body = gzip.decompress(body)
    return body.decode(), headers


def samples(text: str, parser=text_string_to_metric_families) -> dict[str, list]:
    """Sample name -> [(labels, value)]."""
    out: dict[str, list] = {}
    for family in parser(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by_worker(found: dict, name: str) -> dict[str, float]:
    return {labels["worker"]: value for labels, value in found.get(name, [])}


def total(found: dict, name: str) -> float:
    return sum(value for _, value in found.get(name, []))


def test_metrics_agree_with_varz_after_known_traffic(start_broker):
    b = start_broker(workers=2)
    with Raw(b.port) as s, Raw(b.port) as p, Raw(b.port) as q:
        s.request({"op": "sub", "topic": "m.*"})
        for _ in range(5):
            assert p.request({"op": "pub", "topic": "m.a", "data": "hello"}) == {"ok": True}
        for _ in range(5):
            s.json()
        assert q.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"]
        assert q.request({"op": "qpush", "queue": "jobs", "data": 2})["ok"]
        time.sleep(0.3)  # at least one loop-lag sample per worker
        text, headers = scrape(b)
        varz = b.varz()
        queuez = b.http("/queuez")[1]
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    found = samples(text)
    for field, name in [("in_msgs", "shardbroker_in_messages_total"), ("out_msgs", "shardbroker_out_messages_total"),
                        ("in_bytes", "shardbroker_in_bytes_total"), ("out_bytes", "shardbroker_out_bytes_total"),
                        ("connections", "shardbroker_connections"),
                        ("total_connections", "shardbroker_connections_accepted_total"),
                        ("subscriptions", "shardbroker_subscriptions"),
                        ("slow_consumers", "shardbroker_slow_consumers_total"),
                        ("fabric_lost_messages", "shardbroker_fabric_lost_messages_total"),
                        ("fabric_stalls", "shardbroker_fabric_stalls_total")]:
        assert total(found, name) == varz[field], name
    per_worker = {str(w["worker"]): w for w in varz["workers"]}
    assert by_worker(found, "shardbroker_in_messages_total") == \
        {k: w["in_msgs"] for k, w in per_worker.items()}
    assert varz["in_msgs"] == 5 and varz["out_msgs"] == 5   # (queue pushes are counted by the queue)
    assert by_worker(found, "shardbroker_worker_up") == {"0": 1, "1": 1}
    assert by_worker(found, "shardbroker_worker_restarts_total") == {"0": 0, "1": 0}
    assert {labels["pid"] for labels, _ in found["shardbroker_worker_info"]} == {str(p) for p in b.pids}
    assert set(by_worker(found, "process_resident_memory_bytes")) == {"supervisor", "0", "1"}
    assert all(v > 0 for v in by_worker(found, "process_resident_memory_bytes").values())
    assert all(v > 0 for v in by_worker(found, "process_open_fds").values())
    assert by_worker(found, "process_cpu_seconds_total")["supervisor"] >= 0
    counts = by_worker(found, "shardbroker_event_loop_lag_seconds_count")
    assert set(counts) == {"0", "1"} and all(n > 0 for n in counts.values())
    inf = {labels["worker"]: v for labels, v in found["shardbroker_event_loop_lag_seconds_bucket"]
           if labels["le"] == "+Inf"}
    assert inf == counts
    assert [labels for labels, _ in found["shardbroker_build_info"]][0]["version"] == varz["broker"].split()[1]
    links = found["shardbroker_fabric_link_up"]
    assert sorted((labels["worker"], labels["peer"], v) for labels, v in links) == [("0", "1", 1), ("1", "0", 1)]
    (row,) = queuez["queues"]
    queue_series = {labels["queue"]: (labels["worker"], v) for labels, v in found["shardbroker_workqueue_messages"]}
    assert queue_series == {"jobs": (str(row["owner"]), row["messages"])} and row["messages"] == 2
    assert total(found, "shardbroker_workqueue_pushed_messages_total") == row["pushed"] == 2
    assert by_worker(found, "shardbroker_workqueues")[str(row["owner"])] == 1


def test_openmetrics_and_gzip_are_negotiated(start_broker):
    b = start_broker(workers=2)
    text, headers = scrape(b, accept="application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert text.endswith("# EOF\n")
    found = samples(text, parse_openmetrics)
    assert by_worker(found, "shardbroker_worker_up") == {"0": 1, "1": 1}
    assert "# UNIT shardbroker_pending_bytes bytes" in text
    plain, headers = scrape(b, encoding="gzip")
    assert headers["content-encoding"] == "gzip" and "shardbroker_worker_up" in plain
    _, headers = scrape(b, encoding="gzip;q=0")
    assert "content-encoding" not in headers


def test_a_replaced_worker_restarts_only_its_own_series(start_broker):
    """kill -9 a worker: its counters start again from 0 (a reset that rate() handles), its restart is counted,
    and every other counter series only grows."""
    b = start_broker(workers=2)
    with Raw(b.port) as p:
        for _ in range(3):
            p.request({"op": "pub", "topic": "x", "data": 1})
    before = samples(scrape(b)[0])
    victim = before["shardbroker_worker_info"][0][0]
    index, pid = victim["worker"], int(victim["pid"])
    mark = len(b.log())
    os.kill(pid, signal.SIGKILL)
    b.wait_log(rf"worker {index} is back", after=mark)
    after = samples(scrape(b)[0])
    assert by_worker(after, "shardbroker_worker_restarts_total")[index] == 1
    assert by_worker(after, "shardbroker_worker_start_time_seconds")[index] > \
        by_worker(before, "shardbroker_worker_start_time_seconds")[index]
    assert {labels["pid"] for labels, _ in after["shardbroker_worker_info"] if labels["worker"] == index} != {str(pid)}
    for name in before:
        if not name.endswith("_total"):
            continue
        old = {tuple(sorted(labels.items())): v for labels, v in before[name]}
        for labels, value in after.get(name, []):
            key = tuple(sorted(labels.items()))
            if key in old and labels.get("worker") != index:
                assert value >= old[key], (name, labels, old[key], value)


def test_every_series_is_documented_in_operations_md(start_broker):
    b = start_broker(workers=2)
    with Raw(b.port) as q:
        assert q.request({"op": "qpush", "queue": "docs", "data": 1})["ok"]
        text, _ = scrape(b)
    ops = (REPO / "docs" / "operations.md").read_text()
    start = ops.index("## Metrics")
    section = ops[start:ops.index("\n## ", start + 1)]
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    missing = sorted(n for n in names if f"`{n}`" not in section and f"`{n}_total`" not in section)
    assert not missing, f"undocumented in operations.md ## Metrics: {missing}"


def test_scrape_cost_with_hundreds_of_connections(start_broker):
    """A scrape asks every worker once and renders per-worker series, so its cost hardly grows with connections."""
    b = start_broker(workers=2)
    conns = [Raw(b.port) for _ in range(300)]
    try:
        for c in conns[:50]:
            c.request({"op": "sub", "topic": "cost.x"})
        deadline = time.monotonic() + 10
        while b.varz()["connections"] < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            scrape(b)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        print(f"\n/metrics, 300 connections, 2 workers: median {median * 1000:.1f} ms, max {max(times) * 1000:.1f} ms")
        assert median < 0.25, times
    finally:
        for c in conns:
            c.sock.close()
