"""Logs: journald-aware lines, JSON lines, per-connection lifecycle at debug, floods aggregated.

The formatters and the flood filter are checked on their own, then on a real broker's stderr."""

import json
import logging
import os
import re
import socket
import time

from shardbroker.cluster.floods import FloodFilter
from shardbroker.cluster.logs import JournalFormatter, JsonFormatter, priority

from support.harness import Broker, Raw


def record(msg: str, *args, level: int = logging.WARNING, name: str = "broker.hub", **extra) -> logging.LogRecord:
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_flood_filter_passes_a_burst_then_one_line_with_the_count():
    clock, out = Clock(), []
    gate = FloodFilter(out.append, interval=10, burst=3, clock=clock)
    passed = [gate.filter(record("slow consumer: cid %d", cid)) for cid in range(1, 101)]
    assert passed == [True] * 3 + [False] * 97 and out == []
    assert gate.filter(record("another template %d", 1))          # counted per template
    assert gate.filter(record("slow consumer: cid %d", 0, level=logging.DEBUG))  # debug is never held back
    clock.now += 10
    assert gate.filter(record("slow consumer: cid %d", 101))      # a new interval: the count of the last one first
    (summary,) = out
    assert summary.getMessage() == "slow consumer: cid 100 (and 97 more like it in the last 10s)"
    assert summary.levelno == logging.WARNING and summary.suppressed == 97
    assert gate.filter(summary)   # the summary itself goes through
    for cid in range(102, 110):
        gate.filter(record("slow consumer: cid %d", cid))
    clock.now += 10
    gate.flush()                  # what the event loop's timer calls at the interval's end
    assert out[-1].getMessage() == "slow consumer: cid 109 (and 6 more like it in the last 10s)"
    gate.flush()
    assert len(out) == 2
    for cid in range(110, 120):
        gate.filter(record("slow consumer: cid %d", cid))
    gate.flush(everything=True)   # at exit, before the interval is over
    assert out[-1].getMessage() == "slow consumer: cid 119 (and 7 more like it in the last 10s)"


def test_flood_filter_can_be_turned_off():
    gate = FloodFilter(lambda r: None, interval=0, burst=1, clock=Clock())
    assert all(gate.filter(record("x %d", i)) for i in range(50))


def test_journal_lines_carry_a_priority_on_every_line_and_no_timestamp():
    fmt = JournalFormatter("worker 3")
    assert fmt.format(record("slow consumer: cid %d", 7)) == "<4>[worker 3] broker.hub: slow consumer: cid 7"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("broker.worker", logging.ERROR, __file__, 1, "crashed", (), sys.exc_info())
    lines = fmt.format(rec).split("\n")
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines)
    assert [priority(level) for level in (50, 40, 30, 20, 10)] == [2, 3, 4, 6, 7]


def test_json_lines_have_the_fields_shippers_index():
    line = JsonFormatter("worker 2").format(record("cid:%d closed", 9, level=logging.INFO, cid=9, reason="eof"))
    obj = json.loads(line)
    assert obj["level"] == "info" and obj["role"] == "worker" and obj["worker"] == 2
    assert obj["msg"] == "cid:9 closed" and obj["cid"] == 9 and obj["reason"] == "eof"
    assert obj["logger"] == "broker.hub" and obj["pid"] == os.getpid() and obj["ts"].endswith("Z")
    sup = json.loads(JsonFormatter("supervisor").format(record("ready")))
    assert sup["role"] == "supervisor" and "worker" not in sup
    assert JsonFormatter("supervisor", journal=True).format(record("ready")).startswith('<4>{"ts":')


def test_under_the_journal_lines_have_priorities_and_no_timestamps(tmp_path, monkeypatch):
    b = Broker(tmp_path, workers=2, config={"logging": {"level": "debug"}})
    b.log_path.write_bytes(b"")   # the file the broker's stderr will be: JOURNAL_STREAM names it
    st = os.stat(b.log_path)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    b.start()
    try:
        with Raw(b.port) as c:
            c.request({"op": "ping"})
        b.wait_log(r"connection closed")
    finally:
        b.close()
    lines = [line for line in b.log().splitlines() if line]
    assert lines and all(re.match(r"<[2-7]>\[(supervisor|worker \d)\] ", line) for line in lines), lines[:5]
    assert not any(re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", line) for line in lines)
    assert any(line.startswith("<6>[supervisor] broker.supervisor: ready: ") for line in lines)
    assert any(line.startswith("<7>[worker ") and "connection created" in line for line in lines)


def test_a_journal_stream_that_is_not_stderr_changes_nothing(start_broker, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")   # inherited from a unit, but stderr goes elsewhere now
    b = start_broker(workers=1)
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[supervisor\] INFO", b.log(), re.M)


def test_json_format_makes_every_line_an_object(start_broker):
    b = start_broker(workers=2, config={"logging": {"format": "json", "level": "debug"}})
    with Raw(b.port) as c:
        cid = c.request({"op": "info"})["info"]["cid"]
    b.wait_log(rf'"cid":{cid},.*"reason":"client closed"')
    objs = [json.loads(line) for line in b.log().splitlines() if line.strip()]
    assert {o["role"] for o in objs} == {"supervisor", "worker"}
    ready = next(o for o in objs if o["msg"].startswith("ready: "))
    assert ready["level"] == "info" and ready["logger"] == "broker.supervisor"
    created = next(o for o in objs if o.get("cid") == cid and "created" in o["msg"])
    assert created["level"] == "debug" and created["protocol"] == "ndjson" and isinstance(created["worker"], int)


def test_connection_lifecycle_at_debug_with_the_reason(start_broker):
    b = start_broker(workers=1, config={"logging": {"level": "debug"}, "nats": {"ping_interval": 60}})
    with Raw(b.port) as c:
        cid = c.request({"op": "info"})["info"]["cid"]
    b.wait_log(rf"cid:{cid} 127\.0\.0\.1:\d+ ndjson connection closed after [\d.]+s: client closed")
    assert re.search(rf"DEBUG broker\.conn: cid:{cid} 127\.0\.0\.1:\d+ ndjson connection created", b.log())
    with socket.create_connection(("127.0.0.1", b.ports["nats"]), timeout=5) as s:
        s.recv(4096)
        s.sendall(b"FOO\r\n")
        assert b"Unknown Protocol Operation" in s.recv(4096)
    b.wait_log(r"nats connection closed after [\d.]+s: Unknown Protocol Operation")


def test_a_flood_of_protocol_errors_is_one_line_per_interval(start_broker):
    b = start_broker(workers=1, config={"logging": {"flood_interval": 1, "flood_burst": 3}})
    for _ in range(40):
        with socket.create_connection(("127.0.0.1", b.ports["nats"]), timeout=5) as s:
            s.recv(4096)
            s.sendall(b"FOO\r\n")
            s.recv(4096)
    deadline = time.monotonic() + 5   # the last interval's count comes at its end, from a timer
    while True:
        lines = [line for line in b.log().splitlines() if "Unknown Protocol Operation" in line]
        summaries = [line for line in lines if "more like it in the last 1s" in line]
        counted = sum(int(re.search(r"and (\d+) more", line).group(1)) for line in summaries)
        if len(lines) - len(summaries) + counted == 40 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) - len(summaries) + counted == 40, lines
    assert summaries and len(lines) <= 3 * 4 + 4, lines   # a few intervals at most: 3 lines and a count each
