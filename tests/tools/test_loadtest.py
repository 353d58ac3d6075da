"""`brokerctl loadtest`: real Spark local jobs against the real broker, and the numbers checked against what
happened.  One Spark session serves every job (conftest's `spark` fixture)."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from shardbroker.cli.bench import servers
from shardbroker.cli.loadtest import job, plan, scenario
from shardbroker.cli.loadtest.accounting import GroupMember, OrderedTracker, merge_group
from shardbroker.cli.loadtest.schedule import Schedule

from support.harness import REPO, Raw

pytestmark = pytest.mark.slow


def endpoints(broker) -> dict[str, str]:
    return {"ndjson": f"127.0.0.1:{broker.ports['ndjson']}", "nats": f"127.0.0.1:{broker.ports['nats']}"}


def scenario_of(text: str) -> scenario.Scenario:
    return scenario.loads(text, "test")


def read_table(spark, out, name) -> list[dict]:
    return [r.asDict(recursive=True) for r in spark.read.parquet(os.path.join(out, "tables", name)).collect()]


MIXED = """
name = "mixed"
clock_probes = "always"      # probe clocks on one host too: the offsets must come out as 0 within their bounds
warmup = "1s"
duration = "2s"
drain_timeout = "5s"

[[workload]]
name = "fanout"
protocol = "ndjson"
producers_per_topic = 2
subscriptions_per_topic = 2
rate = 2000

[[workload]]
name = "group"
protocol = "nats"
subscriptions_per_topic = 1
consumers_per_subscription = 2
rate = 2000

[[workload]]
name = "jobs"
protocol = "queue"
consumers_per_subscription = 2
rate = 500

[thresholds]
lost = "== 0"
duplicates = "== 0"
reordered = "== 0"
"""


@pytest.mark.exclusive   # all 40 clock probes answered before their deadline
def test_clean_run_counts_every_message_exactly_and_writes_every_output(spark, broker, tmp_path):
    sc = scenario_of(MIXED)
    out = str(tmp_path / "run")
    summary = job.run(sc, endpoints(broker), out, spark=spark, progress=False)
    assert summary["passed"], summary["thresholds"]

    rows = read_table(spark, out, "streams")
    by = {}
    for r in rows:
        by.setdefault(r["workload"], []).append(r)
    # Uniform arrivals: each publisher sends exactly its share of rate x (warmup + duration).
    assert {r["published"] for r in by["fanout"]} == {1000 * 3}
    assert len(by["fanout"]) == 2 * 2          # two subscriptions, each a stream per publisher
    assert [r["mode"] for r in by["group"]] == ["group"] and by["group"][0]["published"] == 6000
    assert [r["mode"] for r in by["jobs"]] == ["queue"] and by["jobs"][0]["published"] == 1500
    for r in rows:
        assert (r["lost"], r["duplicates"], r["reordered"], r["unconfirmed"]) == (0, 0, 0, 0), r
        assert r["unique"] == r["published"], r
    # Competing consumers: the union is everything, and no message went to both members of the group.
    assert by["group"][0]["received"] == 6000
    assert by["jobs"][0]["redeliveries"] == 0 and by["jobs"][0]["unacked"] == 0

    tasks = read_table(spark, out, "tasks")
    assert sorted(t["role"] for t in tasks) == sorted(["publisher", "subscriber"] * 2 + ["producer", "consumer"])
    assert all(t["attempt"] == 0 and not t["errors"] for t in tasks), tasks
    intervals = read_table(spark, out, "intervals")
    phases = {r["phase"] for r in intervals}
    assert {"warmup", "measure", "drain"} <= phases
    sent = sum(r["sent"] for r in intervals if r["workload"] == "fanout")
    assert sent == 6000
    clock = read_table(spark, out, "clock")
    assert len(clock) == 3, clock              # each receiving task probed its workload's publisher task
    for c in clock:
        assert abs(c["offset_ns"]) <= c["bound_ns"] and c["probes"] == 40, c
    run = read_table(spark, out, "runs")[0]
    assert run["scenario_sha256"] == sc.sha256 and run["tasks"] == 6

    s = summary["workloads"]["fanout"]
    assert s["latency"]["e2e_corrected"]["count"] == 2 * 6000 - sum(
        r["received"] for r in intervals if r["workload"] == "fanout" and r["phase"] != "measure")
    assert s["latency"]["e2e_corrected"]["p50"] >= s["latency"]["e2e_raw"]["p50"] * 0.5
    for chart in ("throughput", "latency", "spectrum", "tasks"):
        assert os.path.getsize(os.path.join(out, "charts", f"{chart}.png")) > 5000
    html = open(os.path.join(out, "report.html")).read()
    assert "<svg" in html and "fanout" in html


def test_a_late_subscriber_expects_only_what_was_published_after_it_joined(spark, broker, tmp_path):
    sc = scenario_of("""
name = "late"
warmup = "1s"
duration = "3s"
drain_timeout = "5s"
[[workload]]
name = "late"
protocol = "nats"
subscriptions_per_topic = 2
late_subscribers = 1
late_after = "1s"
rate = 2000
""")
    out = str(tmp_path / "run")
    summary = job.run(sc, endpoints(broker), out, spark=spark, progress=False)
    rows = sorted(read_table(spark, out, "streams"), key=lambda r: r["sub_conn"])
    late, on_time = rows      # the plan makes the first subscriptions the late ones
    assert on_time["published"] == 8000 and on_time["unique"] == 8000 and on_time["lost"] == 0
    # It joined 2 s into the run (1 s warm-up + 1 s): about half of the run was published after that.
    assert 3000 < late["published"] < 5000, late
    assert late["lost"] == 0 and late["duplicates"] == 0
    assert late["unique"] == late["published"]
    assert late["received"] == late["published"] + late["early"]
    assert summary["workloads"]["late"]["accounting"]["lost"] == 0


def test_expired_leases_are_counted_as_redeliveries_exactly_as_the_broker_did_them(spark, broker, tmp_path):
    sc = scenario_of("""
name = "leases"
warmup = "1s"
duration = "2s"
drain_timeout = "6s"
[[workload]]
name = "jobs"
protocol = "queue"
consumers_per_subscription = 2
rate = 1000
[workload.queue]
visibility = "1s"
abandon = 0.05
wait = "500ms"
""")
    out = str(tmp_path / "run")
    run_id = "1eased0000000000000000000000000a"
    job.run(sc, endpoints(broker), out, spark=spark, progress=False, run_id=run_id)
    row = read_table(spark, out, "streams")[0]
    # Which first deliveries the consumers abandon is a fixed function of (publisher, sequence number).
    pub_id = row["pub_id"]
    abandoned = sum((pub_id * 1_000_003 + seq * 7919) % 1_000_000 < 50_000 for seq in range(3000))
    assert row["published"] == 3000 and row["lost"] == 0 and row["duplicates"] == 0 and row["unacked"] == 0
    assert row["redeliveries"] >= abandoned > 0
    with Raw(broker.port) as c:
        stat = c.request({"op": "qstat", "queue": plan.subject(run_id, sc.workloads[0], 0)})["stat"]
    assert stat["redelivered"] == row["redeliveries"]
    assert stat["acked"] == 3000 and stat["messages"] == 0


def test_a_worker_killed_mid_run_loses_no_acknowledged_push(spark, start_broker, tmp_path):
    broker = start_broker(workers=2)
    sc = scenario_of("""
name = "kill"
warmup = "1s"
duration = "4s"
drain_timeout = "8s"
[[workload]]
name = "jobs"
protocol = "queue"
producers_per_topic = 2
consumers_per_subscription = 2
rate = 1000
[workload.queue]
visibility = "2s"
wait = "500ms"
""")
    run_id = "4111ed00000000000000000000000000"
    queue = plan.subject(run_id, sc.workloads[0], 0)
    from shardbroker.cli.bench.qload import owner

    victim_index = owner(queue, 2)
    # the owner's pid (closed one by one, probes need not land on every worker: the acceptor balances by load)
    victim = next(w["pid"] for w in broker.varz()["workers"] if w["worker"] == victim_index)

    def kill_later():
        # Once a third of the pushes went in (mid-run, whatever Spark's start took), kill the queue's owner.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with Raw(broker.port) as c:
                stat = c.request({"op": "qstat", "queue": queue}).get("stat") or {}
            if stat.get("pushed", 0) >= 800:
                os.kill(victim, 9)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_later)
    killer.start()
    out = str(tmp_path / "run")
    job.run(sc, endpoints(broker), out, spark=spark, progress=False, run_id=run_id)
    killer.join()
    assert victim not in broker.worker_pids()
    rows = read_table(spark, out, "streams")
    for row in rows:
        # Every push the broker acknowledged was delivered and acked once; pushes cut off without a reply are
        # 'unconfirmed', and the consumers' leases on the dead worker came back as redeliveries.
        assert row["lost"] == 0 and row["duplicates"] == 0, row
        assert row["published"] + row["unconfirmed"] == 2500
        assert row["unacked"] == 0, row
    tasks = read_table(spark, out, "tasks")
    assert any(t["reconnects"] or t["errors"] for t in tasks), "nobody noticed the kill"


def test_nats_workload_runs_unchanged_against_nats_server(spark, tmp_path):
    nats = servers.start_nats()
    if nats is None:
        pytest.skip("nats-server is not installed")
    try:
        sc = scenario_of("""
name = "peer"
warmup = "1s"
duration = "2s"
[[workload]]
name = "n"
protocol = "nats"
subscriptions_per_topic = 2
rate = 3000
[thresholds]
lost = "== 0"
""")
        summary = job.run(sc, {"nats": f"127.0.0.1:{nats.ports['nats']}"}, str(tmp_path / "r"), spark=spark,
                          progress=False, broker_version="nats-server")
        assert summary["passed"]
        assert summary["workloads"]["n"]["accounting"]["received"] == 2 * 9000
    finally:
        nats.stop()


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", "loadtest", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.spark   # brokerctl loadtest: a JVM of its own
def test_thresholds_set_the_exit_code(broker, tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("""
name = "gate"
warmup = "1s"
duration = "1s"
[[workload]]
name = "w"
protocol = "ndjson"
rate = 1000
[[workload]]
name = "max"          # closed loop beside it: its latency is not corrected, and the results must say so
protocol = "ndjson"
model = "closed"
window = 4
[thresholds]
lost = "== 0"
"w.e2e.p99" = "< 1us"
""")
    r = _cli(str(path), "--broker", f"ndjson://127.0.0.1:{broker.port}", "--no-progress", "-o",
             str(tmp_path / "out"))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "FAIL" in r.stdout and "e2e" in r.stdout
    assert "closed_loop: max ran closed loop" in r.stdout and "NOT corrected" in r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] is False
    assert [t["passed"] for t in summary["thresholds"]] == [True, False]
    closed, open_ = summary["workloads"]["max"], summary["workloads"]["w"]
    assert (closed["model"], open_["model"]) == ("closed", "open") and "closed_loop" in summary["flags"]
    assert closed["rates"]["target"] == 0 and closed["rates"]["sent"] > 0
    assert closed["accounting"]["lost"] == 0 and closed["accounting"]["unique"] == closed["accounting"]["published"]


def test_bad_input_gets_one_line_and_its_exit_code(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[workload]]\nprotocol = "mqtt"\n')
    r = _cli(str(bad))
    assert r.returncode == 2 and "workload[0].protocol" in r.stderr
    bad.write_text('[[workload]]\nprotocol = "ndjson"\n[thresholds]\n"e2e.p99" = "< 5 parsecs"\n')
    r = _cli(str(bad))
    assert r.returncode == 2 and "thresholds" in r.stderr
    ok = tmp_path / "ok.toml"
    ok.write_text('[[workload]]\nprotocol = "ndjson"\n')
    port = servers.free_port()
    r = _cli(str(ok), "--broker", f"ndjson://127.0.0.1:{port}")
    assert r.returncode == 3 and "unreachable" in r.stderr and "Traceback" not in r.stderr
    r = _cli(str(ok), "--broker", "mqtt://127.0.0.1:1")
    assert r.returncode == 2 and "--broker" in r.stderr


def test_a_scenario_cannot_loosen_the_settings_that_keep_the_load_from_running_twice():
    base = '[[workload]]\nprotocol = "ndjson"\n[spark]\nconf = { %s }\n'
    with pytest.raises(scenario.ScenarioError, match="spark.task.maxFailures must stay 1"):
        scenario_of(base % '"spark.task.maxFailures" = "4"')
    with pytest.raises(scenario.ScenarioError, match="spark.speculation"):
        scenario_of(base % '"spark.speculation" = "true"')
    assert scenario_of(base % '"spark.executor.memory" = "2g", "spark.speculation" = "false"').spark_conf


def test_task_failures_are_one_line_naming_the_cause():
    java = "\n\tat org.apache.spark.scheduler.Task.run(Task.scala:147)"
    aborted = ("An error occurred while calling o80.collectToPython.\n: org.apache.spark.SparkException: Job "
               "aborted due to stage failure: Stage failed because barrier task ResultTask(0, 1) finished "
               "unsuccessfully.\norg.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
               '  File "task.py", line 21, in <module>\n%s' + java)
    text = job._failure(Exception(aborted % "ModuleNotFoundError: No module named 'orjson'"), 2)
    assert "cannot import orjson" in text and "Running on a cluster" in text
    assert "cannot import this package" in job._failure(Exception(aborted % "ModuleNotFoundError: No module "
                                                                             "named 'cli.loadtest'"), 2)
    assert job._failure(Exception(aborted % "OSError: [Errno 24] Too many open files"), 2) == \
        "OSError: [Errno 24] Too many open files"
    assert job._failure(Exception(aborted % "RuntimeError: load test setup failed: task 1: refused"), 2) == \
        "load test setup failed: task 1: refused"


def test_the_progress_line_adds_up_one_interval_across_tasks():
    p = job.Progress("127.0.0.1", enabled=False)
    try:
        p.tasks = 2
        p.record({"task": 1, "i": 0, "sent": 0, "acked": 0, "received": 900, "p99": 1500})
        p.record({"task": 1, "i": 1, "sent": 0, "acked": 0, "received": 1000, "p99": 2500})
        assert p.line(time.monotonic()) is None       # the publisher has not reported second 0 yet
        p.record({"task": 0, "i": 0, "sent": 1000, "acked": 990, "received": 0, "p99": 0})
        assert p.line(time.monotonic()) == ("  t+   1s  sent     1,000/s  received       900/s  acked       990/s  "
                                            "e2e p99 (worst task) 1.50 ms")
        assert p.line(time.monotonic()) is None       # shown once
        # A task that finished never reports again: the interval is shown anyway, a moment later.
        assert "received     1,000/s" in p.line(time.monotonic() + 2)
    finally:
        p.stop()


def test_negative_and_out_of_range_latencies_are_counted_never_dropped():
    from hdrh.histogram import HdrHistogram

    from shardbroker.cli.loadtest.recorder import HIGHEST_US, Recorder

    rec = Recorder("r", "w", 0, 1.0, 0.0, 1.0)
    rec.cur.e2e_cross.extend([-5, -1, 10, 20, HIGHEST_US + 1])     # cross-host skew below 0, a stall beyond 60 s
    row = rec.roll(0.0)
    h = HdrHistogram.decode(row["e2e_cross_hdr"])
    assert h.get_total_count() == 5 and h.get_min_value() == 0 and h.get_max_value() >= HIGHEST_US
    assert (row["negative_e2e"], row["clamped"]) == (2, 1)


def test_ordered_tracker_counts_injected_faults_exactly():
    # Drop every 97th, duplicate every 199th, swap neighbours every 301st: the counts must be exact.
    seqs = []
    dropped = dup = swaps = 0
    for s in range(20000):
        if s % 97 == 5:
            dropped += 1
            continue
        seqs.append(s)
        if s % 199 == 7:
            seqs.append(s)
            dup += 1
    for i in range(0, len(seqs) - 1, 301):
        if seqs[i] < seqs[i + 1]:
            seqs[i], seqs[i + 1] = seqs[i + 1], seqs[i]
            swaps += 1
    t = OrderedTracker()
    for s in seqs:
        t.add(s)
    r = t.result(20000)
    assert (r["lost"], r["duplicates"], r["reordered"]) == (dropped, dup, swaps)
    assert r["unique"] == 20000 - dropped
    # A subscription that began at 10000: what came before is early, not expected.
    r = t.result(20000, first=10000)
    assert r["published"] == 10000 and r["early"] + r["unique"] == 20000 - dropped
    assert r["lost"] == sum(1 for s in range(10000, 20000) if s % 97 == 5)


@pytest.mark.parametrize("share", [1.0, 0.5, 1 / 3, 1 / 7])
def test_uniform_schedule_sends_exactly_the_planned_count_wherever_the_clock_starts(share):
    # Summed float gaps once drifted across a stage boundary and sent one message more or less (CI saw 9001 of 9000).
    rng = random.Random(7)
    stages = [(1.0, 3000.0), (2.0, 3000.0), (0.5, 0.0), (1.0, 1000.0)]
    expected = sum(math.ceil(d * r * share - 1e-6) for d, r in stages if r)
    for _ in range(300):
        t0 = rng.randrange(10**9, 10**15)
        s = Schedule(t0, stages, share, poisson=False, seed=1)
        times = []
        while s.next is not None:
            times.append(s.pop())
        assert len(times) == expected
        assert times == sorted(times) and times[0] == t0 and times[-1] < s.end


def test_group_merge_tells_redeliveries_from_duplicates():
    a, b = GroupMember(), GroupMember()
    for s in range(100):
        (a if s % 2 else b).seen.set(s)
        (a if s % 2 else b).deliveries += 1
        (a if s % 2 else b).acked.set(s)
        (a if s % 2 else b).acks_ok += 1
    b.seen.set(1)           # message 1 redelivered to b after its lease with a ended: b's ack was refused
    b.deliveries += 1
    a.seen.set(2)           # message 2 handed to a after b acked it, and a's ack succeeded too: a duplicate
    a.deliveries += 1
    a.acks_ok += 1
    confirmed = GroupMember()
    for s in range(101):    # push 100 was acknowledged but never delivered
        confirmed.seen.set(s)
    r = merge_group([a.row(), b.row()], 102, confirmed.seen.encode())
    assert (r["published"], r["unique"], r["lost"], r["unconfirmed"]) == (101, 100, 1, 1)
    assert (r["duplicates"], r["redeliveries"], r["unacked"]) == (1, 1, 0)


def test_scenario_examples_in_deploy_parse():
    folder = REPO / "deploy" / "loadtest"
    files = sorted(folder.glob("*.toml"))
    assert files
    for f in files:
        scenario.load(str(f))


@pytest.mark.spark   # brokerctl loadtest: a JVM of its own
def test_too_few_spark_slots_is_one_clear_line(broker, tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[[workload]]\nprotocol = "ndjson"\n')    # a publisher task and a subscriber task
    r = _cli(str(path), "--broker", f"ndjson://127.0.0.1:{broker.port}", "--master", "local[1]", "--no-progress",
             "-o", str(tmp_path / "out"))
    assert r.returncode == 3, r.stderr[-2000:]
    assert "fewer task slots than the plan's 2 tasks" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.spark   # brokerctl loadtest: a JVM of its own
def test_ctrl_c_during_the_measurement_is_one_line_and_exit_130(broker, tmp_path):
    """T12: Ctrl-C during the measure phase printed four py4j/KeyboardInterrupt tracebacks and the executors'
    errors.  Now the job is cancelled, the run says so in one line, and everything it started is stopped."""
    path = tmp_path / "s.toml"
    path.write_text('name = "stop"\nwarmup = "1s"\nduration = "60s"\n[[workload]]\nname = "w"\n'
                    'protocol = "ndjson"\nrate = 500\n')
    proc = subprocess.Popen([sys.executable, "-m", "shardbroker.cli", "loadtest", str(path), "--broker",
                             f"ndjson://127.0.0.1:{broker.port}", "-o", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, start_new_session=True)
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    seen = b""
    deadline = time.monotonic() + 120
    while b"tasks on" not in seen and time.monotonic() < deadline:   # the job has begun
        if sel.select(timeout=1):
            seen += proc.stderr.read1(65536)
    time.sleep(4)   # into the measurement
    os.killpg(proc.pid, signal.SIGINT)   # as a terminal's Ctrl-C: the whole foreground process group
    out, err = proc.communicate(timeout=120)
    err = (seen + err).decode("utf-8", "replace")
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "ERROR Executor" not in err, err[-3000:]
    assert "interrupted: the load test was stopped" in err
