"""The ``shardbroker`` Spark data source (cli/spark) with a Spark driver of its own (spark_driver.py, in a
subprocess): a task retried after its read, a sink task retried after a push, the driver killed in batch k and
restarted within the lease, and after it.  Marked ``spark`` by hand (they use no ``spark`` fixture), so that
under xdist they run alone as the others do."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from sparkhelp import SESSION_START_S, Driver, drain, own_driver, push_ids, qstat, recorded, stream_spec

from support.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def driver(tmp_path):
    """driver(spec, name) -> a Driver started; whatever is left of it is killed at teardown."""
    started: list[Driver] = []

    def start(spec: dict, name: str) -> Driver:
        started.append(Driver(tmp_path, spec, name))
        return started[-1]

    yield start
    for d in started:
        d.kill()


# -- 2. a task retried after its read -------------------------------------------------------------------------------

@own_driver
def test_a_task_retried_after_its_read_reads_the_same_messages_again(broker, driver, tmp_path):
    n = 4000
    ids = push_ids(broker, "jobs", n)
    spec = stream_spec(tmp_path, broker, master="local[2,2]", most=2000, fail_read=True)
    timings = driver(spec, "retry").wait(SESSION_START_S + 120)
    record = Path(spec["record"])
    failed = sorted(f.name for f in record.glob("failed-b*"))
    assert failed == ["failed-b1", "failed-b2"], failed           # partition 0 of each batch failed once
    first = {f.name: set(json.loads(f.read_text())) for f in record.glob("run-b*-p0-a0.json")}
    again = {f.name.replace("-a1", "-a0"): set(json.loads(f.read_text())) for f in record.glob("run-b*-p0-a1.json")}
    assert first and first == again                               # the retry read what the first attempt read
    rows = json.loads(Path(spec["result"]).read_text())
    got = Counter(r[0] for r in rows)
    assert set(got) == set(ids) and len(rows) == n, (len(rows), len(got))
    assert {r[1] for r in rows} == {1}                            # delivery_count: nothing leased twice
    stat = qstat(broker, "jobs")
    assert (stat["delivered"], stat["redelivered"], stat["in_flight"], stat["visible"]) == (n, 0, 0, 0), stat
    print("timings", timings)


# -- 6. the sink: a write() that fails once --------------------------------------------------------------------------

@own_driver
def test_a_sink_task_retried_after_a_push_stores_each_row_once(broker, driver, tmp_path):
    n = 3000
    record = tmp_path / "record"
    record.mkdir()
    spec = {"job": "sink_retry", "master": "local[2,2]", "port": broker.port, "results": "results", "n": n,
            "fail_after": 1500, "record": str(record)}
    timings = driver(spec, "sink").wait(SESSION_START_S + 120)
    assert int((record / "failed").read_text()) >= 1000   # the failed attempt had stored a push of 1,000
    stat = qstat(broker, "results")
    assert stat["messages"] == stat["visible"] == n, stat
    assert stat["pushed"] == n, stat                       # pushed: the messages stored
    assert stat["duplicate_pushes"] == 1000, stat          # the retry's first push was answered as a duplicate
    data = drain(broker, "results")
    assert len(data) == len(set(data)) == n
    assert {d[:d.index("x")] for d in data} == {f"r{i}" for i in range(n)}
    print("timings", timings)


# -- 3. the driver killed inside batch k, restarted within the lease ----------------------------------------------

@own_driver
def test_a_driver_killed_in_a_batch_replays_it_with_the_same_messages_and_the_sink_stores_each_once(
        broker, driver, tmp_path):
    n, most, k = 10_000, 2000, 3
    ids = push_ids(broker, "jobs", n)
    spec = stream_spec(tmp_path, broker, most=most, lease=60, sink="queue", results="results", tag="run1",
                       hang_batch=k)
    first = driver(spec, "run1")
    record = Path(spec["record"])
    wait_for(lambda: (record / "hanging").exists() or first.proc.poll() is not None, SESSION_START_S + 60,
             "batch k to start", step=0.05)
    assert first.proc.poll() is None, first.log()
    # partition 1 of batch k pushes its half meanwhile: the replay pushes it again
    wait_for(lambda: qstat(broker, "results")["messages"] >= (k - 1) * most + most // 2, 30,
             "partition 1 of batch k to push", step=0.05)
    first.kill()
    before = recorded(record, "run1")
    assert sorted(before) == list(range(1, k + 1)) and len(before[k]) == most, {b: len(v) for b, v in before.items()}

    timings = driver(dict(spec, tag="run2", hang_batch=None), "run2").wait(SESSION_START_S + 120)
    after = recorded(record, "run2")
    assert min(after) == k, sorted(after)                   # the restart began with batch k again ...
    assert sorted(after[k]) == sorted(before[k])            # ... reading the same messages
    read = [i for b in sorted(set(before) | set(after)) for i in (after.get(b) if b >= k else before[b])]
    assert sorted(read) == sorted(ids)                      # batches < k from run 1, k and on from run 2
    stat = qstat(broker, "results")
    assert stat["messages"] == stat["visible"] == n, stat   # exactly n stored ...
    assert stat["duplicate_pushes"] == most // 2, stat       # ... partition 1 of batch k answered as duplicates
    assert sorted(drain(broker, "results")) == sorted(ids)
    src = qstat(broker, "jobs")
    assert (src["delivered"], src["redelivered"], src["in_flight"], src["visible"]) == (n, 0, 0, 0), src
    print("timings", timings)


# -- 4. restarted after the leases expired -------------------------------------------------------------------------

@own_driver
def test_a_restart_after_the_leases_expired_delivers_the_lost_batch_again(broker, driver, tmp_path):
    n, most, k, lease = 6000, 2000, 2, 4
    ids = push_ids(broker, "jobs", n)
    spec = stream_spec(tmp_path, broker, most=most, lease=lease, tag="run1", hang_batch=k)
    first = driver(spec, "run1")
    record = Path(spec["record"])
    wait_for(lambda: (record / "hanging").exists() or first.proc.poll() is not None, SESSION_START_S + 60,
             "batch k to start", step=0.05)
    assert first.proc.poll() is None, first.log()
    first.kill()
    lost = recorded(record, "run1")[k]
    assert len(lost) == most
    wait_for(lambda: qstat(broker, "jobs")["in_flight"] == 0, lease + 15,
             "the leases of batch k to expire", step=0.2)

    timings = driver(dict(spec, tag="run2", hang_batch=None), "run2").wait(SESSION_START_S + 120)
    rows = json.loads(Path(spec["result"]).read_text())
    counts: dict[str, list[int]] = {}
    for id_, deliveries, _ in rows:
        counts.setdefault(id_, []).append(deliveries)
    assert set(counts) == set(ids)                                       # every id, none lost
    assert all(min(counts[i]) >= 2 for i in lost), Counter(min(counts[i]) for i in lost)
    # at-least-once: a message read twice shows it by its delivery count
    assert all(sorted(c)[1:] == [] or min(sorted(c)[1:]) >= 2 for c in counts.values())
    stat = qstat(broker, "jobs")
    assert stat["redelivered"] >= most and stat["in_flight"] == stat["visible"] == 0, stat
    print("timings", timings, "copies", Counter(len(c) for c in counts.values()))
