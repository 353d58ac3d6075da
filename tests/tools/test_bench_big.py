"""brokerctl bench's big scenarios (wide20k, conn50k; issue 42) at a small size, the source addresses their
connections go out from, and the skip where the machine's open files cannot hold them."""

import json
import os
import resource
import socket
import subprocess
import sys

import pytest

from shardbroker.cli.bench import scale, servers
from shardbroker.cli.bench.loadgen import Generator
from shardbroker.cli.bench.servers import find_binary

from support.benchtag import servers_left, tagged
from support.harness import REPO

PEERS = [p for p, binary in (("nats", "nats-server"), ("redis", "redis-server")) if find_binary(binary)]


def bench(args: list[str], tmp_path, **kwargs) -> tuple[subprocess.CompletedProcess, dict, str]:
    """Run brokerctl bench with a tag every process it starts inherits, so its leftovers are found by it (other
    tests start brokers at the same time) -> (the run, its JSON results, the tag)."""
    env, tag = tagged()
    res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "bench", "--rounds", "1", "--out", str(tmp_path),
                          *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=env, **kwargs)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads(next(tmp_path.glob("bench-*.json")).read_text()), tag


def test_big_scenarios_run_small(tmp_path):
    """-s wide20k,conn50k with their sizes made small (--wide-max, --connections-max): a row each per target,
    nothing lost."""
    res, result, tag = bench(["-s", "wide20k,conn50k", "--wide-max", "60", "--connections-max", "80", "--duration",
                              "0.3", "--workers", "2", "--peers", ",".join(PEERS) or "none"], tmp_path)
    assert "big fan-out to 60 connections" in res.stdout and "big: 80 connections" in res.stdout
    rows = {(row["scenario"], row["target"]): row for row in result["summary"]}
    targets = {"shardbroker/nats", "shardbroker/ndjson"} | ({"nats-server"} if "nats" in PEERS else set()) \
        | ({"redis"} if "redis" in PEERS else set())
    assert set(rows) == {(s, t) for s in ("wide20k", "conn50k") for t in targets}
    for target in targets:
        wide, conns = rows["wide20k", target], rows["conn50k", target]
        assert wide["msgs_per_sec"] > 0 and wide["loss"] == 0 and wide["expected"] == 60 * 200, wide
        assert conns["seconds"] > 0 and "rss_per_conn" in conns, conns
    assert result["options"]["wide_max"] == 60 and result["options"]["connections_max"] == 80
    assert "skipped" not in result
    assert not servers_left(tag), "the bench left servers running"


def test_skipped_where_open_files_are_too_few(tmp_path):
    """A hard limit on open files below what a scenario's connections need: the scenario is skipped, and the
    report says why; no traceback, and no server started for nothing."""
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 2048))

    res, result, tag = bench(["-s", "conn50k", "--connections-max", "5000", "--peers", ",".join(PEERS) or "none"],
                             tmp_path, preexec_fn=low_limit)
    assert "Traceback" not in res.stderr
    why = result["skipped"]["conn50k"]
    assert "6,024 open files" in why and "2,048" in why and "ulimit -Hn" in why
    assert f"skipped: conn50k: {why}" in res.stdout
    assert result["summary"] == [] and result["servers"] == {}
    assert not servers_left(tag)


def test_source_addresses():
    """A new loopback source address every PER_SOURCE connections, the first ones from the kernel's choice."""
    n = scale.PER_SOURCE
    assert scale.source_address(0) is None and scale.source_address(n - 1) is None
    assert scale.source_address(n) == "127.0.0.2" and scale.source_address(2 * n + 5) == "127.0.0.3"
    assert scale.source_address(255 * n) == "127.0.1.0"   # still 127.0.0.0/8, past its first /24
    with pytest.raises(ValueError):
        scale.source_address((1 << 24) * n)


def test_generator_spreads_connections_over_sources(monkeypatch):
    """A generator opens connection ``first + i`` of the run from that connection's source address: with 3 an
    address, a generator whose first is 2 sends its first from 127.0.0.1, the next three from 127.0.0.2, ..."""
    monkeypatch.setattr(scale, "PER_SOURCE", 3)
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:   # the kernel completes the handshakes
        gen = Generator()
        try:
            gen.connect("127.0.0.1", listener.getsockname()[1], "redis", 1, 6, ids=False, first=2)
            sources = [s.getsockname()[0] for s in gen.pubs + gen.subs]
        finally:
            gen.close()
    assert sources == ["127.0.0.1"] + ["127.0.0.2"] * 3 + ["127.0.0.3"] * 3


@pytest.mark.parametrize("server", ["shardbroker"] + [p for p in PEERS])
def test_servers_take_connections_from_other_sources(monkeypatch, server):
    """Every server the bench compares takes the connections from 127.0.0.2 and up, and confirms their
    subscriptions (``scale``, as in conn50k): this broker's bench limits refuse none."""
    monkeypatch.setattr(scale, "PER_SOURCE", 4)
    start = {"shardbroker": lambda: _broker(10), "nats": lambda: servers.start_nats(max_connections=10),
             "redis": lambda: servers.start_redis(maxclients=10)}[server]
    srv = start()
    wire = "redis" if server == "redis" else "nats"
    gen = Generator()
    try:
        gen.scale("127.0.0.1", srv.ports[wire], wire, 10, "bench.test", first=0)
        sources = sorted({s.getsockname()[0] for s in gen.subs})
    finally:
        gen.close()
        srv.stop()
    assert sources == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def _broker(connections: int) -> servers.Server:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"limits": scale.broker_limits(connections)}, fh)
    try:
        return servers.start_broker(2, config=fh.name)
    finally:
        os.unlink(fh.name)
