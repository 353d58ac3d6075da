"""brokerctl bench works: one tiny scenario, against the peers when they are installed (CI installs them)."""

import json
import subprocess
import sys

import pytest

from shardbroker.cli.bench.servers import find_binary

from support.benchtag import servers_left, tagged
from support.harness import REPO


def test_tiny_bench_runs_and_reports(tmp_path):
    env, tag = tagged()
    peers = [p for p, binary in (("nats", "nats-server"), ("redis", "redis-server")) if find_binary(binary)]
    res = subprocess.run(
        [sys.executable, "-m", "shardbroker.cli", "bench", "-s", "fanout1", "--rounds", "1", "--duration", "0.5",
         "--peers", ",".join(peers) or "none", "--workers", "2", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fan-out 1→1" in res.stdout and "msg/s" in res.stdout
    result = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    rows = {row["target"]: row for row in result["summary"]}
    assert {"shardbroker/nats", "shardbroker/ndjson"} <= set(rows)
    for row in rows.values():
        assert row["msgs_per_sec"] > 0 and row["loss"] == 0, row
        assert row["cpu_us_per_msg"] > 0, row   # the server's CPU time over the run, per message delivered
        assert row["gen_cpu_us_per_msg"] > 0, row   # and the load generators'
    assert "cpu µs/msg" in res.stdout
    if "nats" in peers:
        assert rows["nats-server"]["vs_nats"] == 1.0 and rows["shardbroker/nats"]["vs_nats"] > 0
        assert "goal" in rows["shardbroker/nats"]
    png = next(tmp_path.glob("bench-*.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not servers_left(tag), "the bench left servers running"


def test_generator_check():
    res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "bench", "--generator-check", "--duration", "0.3"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line.split() for line in res.stdout.splitlines()]
    assert {(line[0], line[1]) for line in lines} == {(w, r) for w in ("nats", "ndjson", "redis")
                                                      for r in ("publish", "subscribe")}
    assert all(int(line[2].replace(",", "")) > 0 for line in lines)


def test_tiny_queue_bench(tmp_path):
    """The work-queue scenarios: this broker with and without its journal, and Redis Streams (with and without its
    append-only file) and nats-server JetStream when installed; every acknowledged push stored or acked exactly
    once."""
    env, tag = tagged()
    peers = [p for p, binary in (("nats", "nats-server"), ("redis", "redis-server")) if find_binary(binary)]
    res = subprocess.run(
        [sys.executable, "-m", "shardbroker.cli", "bench", "-s", "qpush,qwork1,qwork8,qlatency", "--rounds", "1",
         "--duration", "0.3", "--peers", ",".join(peers) or "none", "--workers", "2", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "queue push" in res.stdout and "queue latency" in res.stdout
    result = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    targets = {"shardbroker/ndjson", "shardbroker/ndjson-nojournal"} \
        | ({"redis", "redis-aof"} if "redis" in peers else set()) \
        | ({"nats-server/jetstream"} if "nats" in peers else set())
    rows = {(row["scenario"], row["target"]): row for row in result["summary"]}
    assert set(rows) == {(s, t) for s in ("qpush", "qwork1", "qwork8", "qlatency") for t in targets}
    for row in rows.values():
        assert row["msgs_per_sec"] > 0 and row["expected"] > 0 and row["loss"] == 0, row
        assert row["duplicates"] == 0 and row["refused"] == 0, row
        assert row["cpu_us_per_msg"] > 0 and row["gen_cpu_us_per_msg"] > 0, row
    assert rows["qlatency", "shardbroker/ndjson"]["latency_us"]["samples"] > 0
    for run in result["runs"]:
        if run["target"].startswith("shardbroker") and run["scenario"] != "qpush":
            # consumers on another worker than the queue's owner, the producer on it
            assert run["owner"] not in run["consumer_workers"] and run["producer_workers"] == [run["owner"]], run
        if run["scenario"] != "qpush":
            assert run["left"]["pending"] == 0 and run["delivered"] == run["expected"], run
    if "redis" in peers:
        # every row has its ratio to Redis with nothing on disk; the goals pair them like for like
        assert all(rows[s, t]["vs_redis"] > 0 for s, t in rows)
        for scenario in ("qwork1", "qwork8"):
            assert rows[scenario, "shardbroker/ndjson"]["goal"]["vs"] == "redis-aof"
            assert rows[scenario, "shardbroker/ndjson-nojournal"]["goal"]["vs"] == "redis"
        assert "goal" not in rows["qpush", "shardbroker/ndjson"]   # the goal is receive+ack's
        assert "≥1.0x redis-aof: " in res.stdout and "≥1.0x redis: " in res.stdout
    if "nats" in peers:   # queue rows are compared with JetStream's
        assert rows["qwork1", "shardbroker/ndjson"]["vs_nats"] > 0
        assert rows["qlatency", "nats-server/jetstream"]["latency_us"]["samples"] > 0
    assert not servers_left(tag), "the bench left servers running"


def test_tiny_bench_with_tls(tmp_path):
    """--tls: the same broker (and nats-server, when installed) with TLS on the client ports, nothing lost."""
    env, tag = tagged()
    peers = "nats" if find_binary("nats-server") else "none"
    res = subprocess.run(
        [sys.executable, "-m", "shardbroker.cli", "bench", "-s", "fanout10", "--rounds", "1", "--duration", "0.5", "--tls",
         "--peers", peers, "--workers", "2", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {row["target"]: row for row in json.loads(next(tmp_path.glob("bench-*.json")).read_text())["summary"]}
    expected = {"shardbroker/nats-tls", "shardbroker/ndjson-tls"} | ({"nats-server-tls"} if peers == "nats" else set())
    assert expected <= set(rows)
    for label in expected:
        assert rows[label]["msgs_per_sec"] > 0 and rows[label]["loss"] == 0, rows[label]
    assert not servers_left(tag), "the bench left servers running"


def test_tiny_leaf_bench(tmp_path):
    """-s leafin,leafout: a hub nats-server (the newest installed, 2.10 at least), this broker as its leaf and a
    nats-server leaf of it, the same traffic through each; the ratio of the two leaves, and nothing lost."""
    from shardbroker.cli.bench.servers import NATS_LEAF_NAME, newest_nats_server

    binary, version, found = newest_nats_server()
    if binary is None:
        pytest.skip(f"the leaf scenarios need nats-server >= 2.10; found {found or 'none'}")
    env, tag = tagged()
    res = subprocess.run(
        [sys.executable, "-m", "shardbroker.cli", "bench", "-s", "leafin,leafout", "--rounds", "1", "--duration", "0.3",
         "--peers", "nats", "--workers", "2", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "hub → leaf" in res.stdout and "leaf → hub" in res.stdout
    assert "≥0.8x nats-server/leaf, 0 lost: " in res.stdout and f"hub nats-server {version}" in res.stdout
    result = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    rows = {(row["scenario"], row["target"]): row for row in result["summary"]}
    assert set(rows) == {(s, t) for s in ("leafin", "leafout") for t in ("shardbroker/leaf", "nats-server/leaf")}
    for row in rows.values():
        assert row["msgs_per_sec"] > 0 and row["expected"] > 0, row
        assert row["loss"] == 0, f"{row['scenario']} on {row['target']}: {row['loss']:,} of {row['expected']:,} lost"
        assert row["cpu_us_per_msg"] > 0, row
    for scenario in ("leafin", "leafout"):
        ours = rows[scenario, "shardbroker/leaf"]
        assert rows[scenario, "nats-server/leaf"]["vs_nats"] == 1.0 and ours["vs_nats"] > 0
        assert ours["goal"]["vs"] == "nats-server/leaf" and ours["goal"]["target"] == 0.8 and ours["goal"]["lossless"]
    setup = result["leaf"]
    assert setup["hub"]["binary"] == binary and setup["broker_links"] == 2
    assert setup["compression"][NATS_LEAF_NAME] == "off"   # like for like: this broker's link has no compression
    assert set(result["servers"]) == {"nats-hub", "shardbroker-leaf", "nats-server-leaf"}   # the leaf runs' alone
    assert not servers_left(tag), "the bench left servers running"


class _CountingSocket:
    """A socket whose ``send`` calls are counted (everything else is the socket's)."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.sends = 0

    def send(self, data) -> int:
        self.sends += 1
        return self._sock.send(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.exclusive   # a publisher paced at 1 ms ticks
def test_a_paced_publisher_writes_once_a_tick_whatever_answers_its_publishes(start_broker):
    """The latency scenario's publisher sends what is due on a 1 ms grid.  NDJSON answers each publish with an
    ``ok``, which wakes the generator's loop: it used to send at each wake, one message per write (20,000 writes a
    second instead of 1,000, five times the CPU of the broker and of itself on the cores they share)."""
    import time

    from shardbroker.cli.bench.loadgen import Generator

    broker = start_broker(workers=1)
    gen = Generator()
    gen.connect("127.0.0.1", broker.port, "ndjson", pubs=1, subs=1, ids=False)
    try:
        gen.subscribe([["paced"]])
        counting = gen.pubs[0] = _CountingSocket(gen.pubs[0])
        rate, duration = 20_000, 0.5
        out = gen.run(["paced"], 128, time.monotonic() + 0.05, duration, rate=rate, latency=True)
    finally:
        gen.close()
    assert out["sent"] == [out["received"][0]] and rate * duration * 0.9 <= out["sent"][0] <= rate * duration
    assert len(out["latencies"]) == out["sent"][0]
    assert counting.sends <= duration / 0.001 * 1.2, counting.sends   # one write a tick (a few split writes aside)
