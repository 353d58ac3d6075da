"""The load test's driver-side results: thresholds, exact histogram merges, the results directory, compare."""

from __future__ import annotations

import datetime as dt
import json
import os
import random

import pytest
from hdrh.histogram import HdrHistogram
from hdrh.log import HistogramLogReader

from shardbroker.cli.loadtest import thresholds
from shardbroker.cli.loadtest.summary import build, render_text

INTERVAL_S = 1.0
PHASES = ["warmup", "warmup", "measure", "measure", "measure", "measure", "drain"]
START_NS = 1_700_000_000_000_000_000


def _hist() -> HdrHistogram:
    return HdrHistogram(1, 60_000_000, 3)


class Run:
    """Synthetic collected tables whose blobs hold real recorded values, with the truth kept beside them."""

    def __init__(self, seed: int = 7, name: str = "smoke", e2e_scale: float = 300.0) -> None:
        rng = random.Random(seed)
        self.truth: dict[tuple, HdrHistogram] = {}  # (workload|"total", metric, interval|"measure") -> histogram
        self.runs = [{
            "run_id": f"r{seed}", "name": name, "started_at": dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC),
            "scenario_text": "[thresholds]\nlost = \"== 0\"\n", "scenario_sha256": "ab" * 32, "seed": seed,
            "protocols": ["ndjson"], "broker_urls": {"ndjson": "tcp://127.0.0.1:8080"}, "broker_version": "0.1.0",
            "brokerctl_version": "0.1.0", "git_sha": "deadbeef", "spark_master": "local[1]", "spark_version": "4.3.0",
            "spark_conf": {"spark.ui.enabled": "false"}, "tasks": 4, "varz_before": "{}", "varz_after": "{}",
            "status": "passed", "flags": [], "agreed_start_wall_ns": START_NS, "warmup_s": 2.0, "duration_s": 4.0,
            "interval_s": INTERVAL_S,
        }]
        self.tasks = [
            self._task(0, "fanout", "publisher", 1000.0, 990.0, rng),
            self._task(1, "fanout", "subscriber", 2000.0, 1980.0, rng),
            self._task(2, "work", "producer", 500.0, 400.0, rng, generator_bound=True),
            self._task(3, "work", "consumer", 500.0, 400.0, rng),
            {**self._task(3, "work", "consumer", 1.0, 1.0, rng), "attempt": -1},  # an older attempt, to be dropped
        ]
        self.intervals = []
        for i, phase in enumerate(PHASES):
            for task, workload, metrics in ((0, "fanout", ("send_lag",)), (1, "fanout", ("e2e_corrected", "e2e_raw")),
                                            (2, "work", ("send_lag", "ack_corrected", "ack_raw")),
                                            (3, "work", ("e2e_corrected", "e2e_raw"))):
                row = {"run_id": self.runs[0]["run_id"], "workload": workload, "task": task, "interval": i,
                       "interval_start_ms": i * 1000, "phase": phase, "cpu_pct": 12.5}
                if metrics[0] == "send_lag":
                    row.update(target=100, sent=100 - (task == 2) * 10, acked=95, bytes_out=6400)
                else:
                    row.update(received=200 if workload == "fanout" else 90, bytes_in=12800)
                for metric in metrics:
                    hist = _hist()
                    for _ in range(rng.randint(50, 400)):
                        value = int(rng.expovariate(1 / e2e_scale)) + 1
                        if metric == "e2e_corrected" and rng.random() < 0.01:
                            value = rng.randint(100_000, 2_000_000)  # a rare stall, so the tail is not the body
                        hist.record_value(value)
                        for key in ((workload, metric, i), ("total", metric, i)):
                            self.truth.setdefault(key, _hist()).record_value(value)
                        if phase == "measure":
                            for key in ((workload, metric, "measure"), ("total", metric, "measure")):
                                self.truth.setdefault(key, _hist()).record_value(value)
                    # Blobs come as hdrh's encode() gives them (bytes) or as text, as a Parquet column holds them.
                    row[f"{metric}_hdr"] = hist.encode() if task == 1 else hist.encode().decode()
                if task == 0:
                    row["ack_raw_hdr"] = _hist().encode()  # an empty histogram: no samples, like ""
                self.intervals.append(row)
        self.streams = [
            {"run_id": "r", "workload": "fanout", "sub_task": 1, "sub_conn": 0, "subject": "s.1", "pub_id": 11,
             "mode": "ordered", "published": 1000, "received": 1000, "unique": 998, "lost": 2, "duplicates": 1,
             "reordered": 3, "max_reorder_distance": 4, "gap_ranges": [{"lo": 5, "hi": 6}], "gap_count": 1},
            {"run_id": "r", "workload": "fanout", "sub_task": 1, "sub_conn": 1, "subject": "s.1", "pub_id": 11,
             "mode": "ordered", "published": 1000, "received": 1000, "unique": 1000, "max_reorder_distance": 9},
            {"run_id": "r", "workload": "work", "group": "q", "pub_id": 12, "mode": "queue", "published": 400,
             "received": 410, "unique": 400, "redeliveries": 10, "unacked": 1, "unconfirmed": 2},
        ]
        self.clock: list[dict] = []

    def _task(self, task, workload, role, target, achieved, rng, generator_bound=False) -> dict:
        return {"run_id": "r", "task": task, "attempt": 0, "workload": workload, "role": role, "host": "h1",
                "pid": 100 + task, "conns": 1, "pub_ids": [10 + task], "target_rate": target,
                "achieved_rate": achieved, "start_skew_us": rng.randint(0, 500), "cpu_peak_pct": 40.0 + task,
                "generator_bound": generator_bound, "reconnects": 0, "errors": []}

    @property
    def tables(self) -> dict[str, list[dict]]:
        return {"runs": self.runs, "tasks": self.tasks, "intervals": self.intervals, "streams": self.streams,
                "clock": self.clock}


def _same(stats: dict, hist: HdrHistogram) -> None:
    assert stats["count"] == hist.get_total_count()
    assert stats["min"] == hist.get_min_value()
    assert stats["max"] == hist.get_max_value()
    assert stats["mean"] == pytest.approx(hist.get_mean_value(), abs=0.001)
    for key, pct in (("p50", 50), ("p90", 90), ("p99", 99), ("p99_9", 99.9), ("p99_99", 99.99)):
        assert stats[key] == hist.get_value_at_percentile(pct), key
    assert HdrHistogram.decode(stats["hdr"]).equals(hist)


# ---- thresholds ----

def test_thresholds_parse_units_percentiles_scopes():
    table = {"lost": "== 0", "e2e.p99": "< 5ms", "e2e_raw.p999": "<= 1.5 s", "send_lag.p99_9": "< 200us",
             "ack.max": "< 800µs", "ack_raw.p50": "< 500ns", "e2e_cross.mean": "<= 250",
             "generator_bound": "== false", "fanout": {"lost": "== 0", "e2e": {"p99.99": "< 1s"}},
             "rate.received": ">= 1_000 msg/s", "total.duplicates": "<= 5", "e2e.count": "> 100"}
    parsed = {t.key: t for t in thresholds.parse(table, ["fanout", "work"])}
    assert parsed["e2e.p99"].metric == "e2e_corrected.p99" and parsed["e2e.p99"].limit == 5000
    assert parsed["e2e_raw.p999"].metric == "e2e_raw.p99.9" and parsed["e2e_raw.p999"].limit == 1_500_000
    assert parsed["send_lag.p99_9"].metric == "send_lag.p99.9" and parsed["send_lag.p99_9"].limit == 200
    assert parsed["ack.max"].metric == "ack_corrected.max" and parsed["ack.max"].limit == 800
    assert parsed["ack_raw.p50"].limit == pytest.approx(0.5)
    assert parsed["e2e_cross.mean"].limit == 250  # a bare number is µs
    assert parsed["generator_bound"].limit is False and parsed["generator_bound"].kind == "bool"
    assert parsed["fanout.lost"].scope == "fanout" and parsed["fanout.lost"].metric == "lost"
    assert parsed["fanout.e2e.p99.99"].scope == "fanout"
    assert parsed["fanout.e2e.p99.99"].metric == "e2e_corrected.p99.99"
    assert parsed["rate.received"].limit == 1000 and parsed["rate.received"].kind == "rate"
    assert parsed["total.duplicates"].scope is None
    assert parsed["e2e.count"].limit == 100
    assert parsed["lost"].scope is None and parsed["lost"].expr == "lost == 0"


@pytest.mark.parametrize("key, value", [
    ("lossed", "== 0"),           # unknown metric
    ("e2e.p99", "=< 5ms"),        # bad operator
    ("e2e.p99", "< 5 minutes"),   # bad unit
    ("e2e.p9x", "< 5ms"),         # a percentile that is not a number
    ("e2e.p101", "< 5ms"),
    ("e2e", "< 5ms"),             # no statistic
    ("lost", "== 0ms"),           # a count with a unit
    ("lost", "== lots"),
    ("lost", 0),                  # no operator
    ("rate.delivered", "> 5"),
    ("generator_bound", "< true"),
    ("nope.lost", "== 0"),        # not a workload, so an unknown metric
])
def test_thresholds_parse_rejects_naming_the_key(key, value):
    with pytest.raises(ValueError) as err:
        thresholds.parse({key: value}, ["fanout"])
    assert repr(key) in str(err.value) and "\n" not in str(err.value)


def test_thresholds_evaluate():
    run = Run()
    summary = build(run.tables)
    e2e = run.truth[("total", "e2e_corrected", "measure")]
    p99 = e2e.get_value_at_percentile(99)
    parsed = thresholds.parse({
        "lost": "== 0", "duplicates": "<= 1", "e2e.p99": f"<= {p99}us", "e2e.p95": "< 1us",
        "fanout.ack.p99": "< 1s", "fanout.ack.count": "== 0", "work.generator_bound": "== false",
        "fanout.generator_bound": "== false", "rate.sent": "> 1", "fanout.reordered": "== 3",
    }, ["fanout", "work"])
    results = {r["expr"].split()[0]: r for r in thresholds.evaluate(parsed, summary)}
    assert results["lost"]["actual"] == 2 and not results["lost"]["passed"]
    assert results["duplicates"]["passed"]
    assert results["e2e.p99"]["actual"] == p99 and results["e2e.p99"]["passed"]
    # p95 is not precomputed: read off the merged histogram kept in the summary, not interpolated.
    assert results["e2e.p95"]["actual"] == e2e.get_value_at_percentile(95) and not results["e2e.p95"]["passed"]
    nothing = results["fanout.ack.p99"]
    assert nothing["actual"] is None and not nothing["passed"] and "no samples" in nothing["note"]
    assert results["fanout.ack.count"]["actual"] == 0 and results["fanout.ack.count"]["passed"]
    assert not results["work.generator_bound"]["passed"] and results["fanout.generator_bound"]["passed"]
    assert results["rate.sent"]["passed"] and results["fanout.reordered"]["passed"]


# ---- summary ----

def test_summary_merges_histograms_exactly():
    run = Run()
    seen: list[tuple] = []

    def sink(workload, metric, index, start_ms, interval_ms, hist):
        assert hist.equals(run.truth[(workload, metric, index)])
        seen.append((workload, metric, index))

    summary = build(run.tables, on_interval=sink)
    assert len(seen) == len(PHASES) * 8  # per interval: fanout send_lag, e2e x2; work send_lag, ack x2, e2e x2
    for scope in ("fanout", "work", "total"):
        sec = summary["total"] if scope == "total" else summary["workloads"][scope]
        metrics = {m for (w, m, i) in run.truth if w == scope and i == "measure"}
        assert set(sec["latency"]) == metrics
        for metric in metrics:
            truth = run.truth[(scope, metric, "measure")]
            _same(sec["latency"][metric], truth)  # warmup and drain samples are not in it
            spectrum = dict(map(tuple, sec["spectrum"][metric]))
            assert spectrum[100] == truth.get_max_value() and spectrum[0] == truth.get_min_value()
            # Only percentiles the count can resolve: 99.99 needs 10,000 samples.
            assert {p for p in spectrum if p < 100} == {
                p for p in (0, 50, 75, 90, 95, 99, 99.5, 99.9, 99.95, 99.99, 99.999)
                if truth.get_total_count() * (100 - p) / 100 >= 1}
            for pct, value in spectrum.items():
                assert value == truth.get_value_at_percentile(pct), pct
        for point in sec["series"]:
            truth = run.truth.get((scope, "e2e_corrected", point["interval"]))
            assert point["e2e_corrected_p99"] == truth.get_value_at_percentile(99)
            assert point["e2e_corrected_p99_9"] == truth.get_value_at_percentile(99.9)
            assert point["e2e_corrected_max"] == truth.get_max_value()
            assert point["send_lag_p99"] == run.truth[(scope, "send_lag", point["interval"])].get_value_at_percentile(99)
            assert point["t_s"] == point["interval"] * INTERVAL_S
            assert point["phase"] == PHASES[point["interval"]]

    fanout, work, total = summary["workloads"]["fanout"], summary["workloads"]["work"], summary["total"]
    assert fanout["measure_s"] == 4.0
    assert fanout["rates"] == {"target": 100.0, "sent": 100.0, "acked": 95.0, "received": 200.0,
                               "bytes_out": 6400.0, "bytes_in": 12800.0}
    assert total["rates"]["sent"] == 190.0 and total["rates"]["received"] == 290.0
    assert fanout["accounting"]["lost"] == 2 and fanout["accounting"]["max_reorder_distance"] == 9
    assert work["accounting"]["redeliveries"] == 10 and total["accounting"]["published"] == 2400
    assert total["accounting"]["unconfirmed"] == 2 and total["accounting"]["unacked"] == 1
    assert work["imbalance"]["roles"]["consumer"]["max"] == 400.0  # attempt -1 left out
    assert total["imbalance"]["roles"]["publisher"]["stddev"] == 0.0
    assert [t["achieved_over_target"] for t in total["imbalance"]["tasks"]] == [0.99, 0.99, 0.8, 0.8]
    assert summary["flags"] == ["generator_bound"] and work["generator_bound"] and not fanout["generator_bound"]
    assert any("attempt" in note for note in summary["notes"])
    assert summary["run"]["started_at"] == "2024-05-01T12:00:00+00:00"
    assert summary["passed"] and summary["status"] == "passed"
    json.dumps(summary, allow_nan=False)
    text = render_text(summary)
    assert "fanout" in text and "result: PASSED" in text


def test_summary_verdict_and_notes():
    run = Run()
    run.runs[0]["status"] = "error"
    run.runs[0]["flags"] = ["clock_unsynced"]
    run.intervals[0]["e2e_corrected_hdr"] = "not a histogram"
    run.intervals[5]["clamped"] = 3
    run.tasks[0]["model"] = run.tasks[1]["model"] = "closed"
    run.tasks[2]["send_lag_p99_us"] = 12_500
    summary = build(run.tables, thresholds.parse({"lost": "<= 10"}, []))
    assert summary["thresholds"][0]["passed"] and not summary["passed"] and summary["status"] == "error"
    assert summary["flags"] == ["generator_bound", "closed_loop", "clamped", "clock_unsynced"]
    assert summary["clamped"] == 3
    assert (summary["workloads"]["fanout"]["model"], summary["workloads"]["work"]["model"]) == ("closed", "open")
    # Each flag that changes how the numbers read is spelled out where they are printed.
    text = render_text(summary)
    assert "generator_bound: task 2 (work: send lag p99 12.5ms, CPU peak 42%)" in text
    assert "closed_loop: fanout ran closed loop" in text and "clamped: 3 latency values" in text
    assert any("could not be decoded" in note for note in summary["notes"])
    assert summary["run"]["status"] == "error"


def test_rows_for_orders_defaults_and_rejects_typos():
    from shardbroker.cli.loadtest.schema import COLUMNS, rows_for

    (row,) = rows_for("streams", [{"run_id": "r", "workload": "w", "pub_id": 3, "mode": "group",
                                   "gap_ranges": [(1, 2), {"lo": 4, "hi": 4}]}])
    by_name = dict(zip(COLUMNS["streams"], row))
    assert by_name["sub_task"] == -1 and by_name["group"] == "" and by_name["lost"] == 0
    assert by_name["gap_ranges"] == [(1, 2), (4, 4)]
    (task,) = rows_for("tasks", [{"run_id": "r", "task": 1, "workload": "w", "role": "publisher",
                                  "target_rate": 5, "pub_ids": [1]}])
    assert dict(zip(COLUMNS["tasks"], task))["target_rate"] == 5.0
    assert isinstance(dict(zip(COLUMNS["tasks"], task))["target_rate"], float)
    with pytest.raises(ValueError, match="recieved"):
        rows_for("intervals", [{"run_id": "r", "workload": "w", "task": 0, "interval": 0, "phase": "measure",
                                "recieved": 4}])
    with pytest.raises(ValueError, match="role"):
        rows_for("tasks", [{"run_id": "r", "task": 1, "workload": "w"}])


# ---- the results directory and compare ----

def _assert_charts(out):
    for name in ("throughput", "latency", "spectrum", "tasks"):
        assert os.path.getsize(out / "charts" / f"{name}.png") > 10_000, name
        assert os.path.getsize(out / "charts" / f"{name}.svg") > 10_000, name
    page = (out / "report.html").read_text()
    assert page.count("<svg") >= 4 and "<script" not in page.lower()
    assert "src=" not in page and "<link" not in page  # self-contained


@pytest.mark.slow
def test_write_results_with_spark(spark, tmp_path):
    from shardbroker.cli.loadtest.results import write_results

    run = Run()
    out = tmp_path / "run"
    table = {"lost": "== 0", "fanout.e2e.p99": "< 60s", "work.ack.max": "< 60s"}
    summary = write_results(spark, str(out), run.tables, thresholds.parse(table, ["fanout", "work"]),
                            {"argv": ["brokerctl", "loadtest"]})
    assert summary["status"] == "failed" and not summary["passed"]  # 2 lost
    assert [r["passed"] for r in summary["thresholds"]] == [False, True, True]

    stored = json.loads((out / "summary.json").read_text())
    assert stored["total"]["latency"]["e2e_corrected"]["p99"] == summary["total"]["latency"]["e2e_corrected"]["p99"]
    assert stored["meta"] == {"argv": ["brokerctl", "loadtest"]} and stored["outputs"]["tables"]
    assert "result: FAILED" in (out / "summary.txt").read_text()

    base = str(out / "tables")
    intervals = spark.read.parquet(f"{base}/intervals")
    assert intervals.count() == len(run.intervals)
    assert dict(intervals.dtypes)["target"] == "bigint" and dict(intervals.dtypes)["cpu_pct"] == "double"
    blobs = [r.e2e_corrected_hdr for r in intervals.where("workload = 'work' and phase = 'measure'").collect()]
    merged = _hist()
    for blob in filter(None, blobs):  # "" where a task recorded nothing (the producer)
        merged.decode_and_add(blob)
    assert merged.equals(run.truth[("work", "e2e_corrected", "measure")])
    (stored_run,) = spark.read.parquet(f"{base}/runs").collect()
    assert stored_run.status == "failed" and stored_run.flags == ["generator_bound"]
    assert stored_run.broker_urls == {"ndjson": "tcp://127.0.0.1:8080"}
    # pyspark hands timestamps back naive, in the Python process's local zone.
    assert stored_run.started_at.timestamp() == run.runs[0]["started_at"].timestamp()
    assert spark.read.parquet(f"{base}/tasks").count() == 5
    streams = spark.read.parquet(f"{base}/streams")
    assert streams.where("mode = 'queue'").first().sub_task == -1
    assert streams.where("lost = 2").first().gap_ranges[0].hi == 6
    assert spark.read.parquet(f"{base}/clock").count() == 0

    reader = HistogramLogReader(str(out / "hlog" / "fanout.e2e_corrected.hlog"), _hist())
    intervals_read = []
    while (hist := reader.get_next_interval_histogram()) is not None:
        intervals_read.append(hist)
    assert len(intervals_read) == len(PHASES)
    assert reader.get_start_time_sec() == pytest.approx(START_NS / 1e9, abs=1e-3)
    assert intervals_read[3].equals(run.truth[("fanout", "e2e_corrected", 3)])
    assert intervals_read[3].get_start_time_stamp() == pytest.approx(START_NS / 1e6 + 3000, abs=1)
    assert sorted(os.listdir(out / "hlog")) == sorted(
        f"{w}.{m}.hlog" for (w, m, i) in run.truth if w != "total" and i == "measure")
    _assert_charts(out)
    page = (out / "report.html").read_text()
    assert "start skew µs" in page and "generator_bound: task 2" in page


@pytest.mark.slow
def test_results_without_spark_and_compare(tmp_path):
    from shardbroker.cli.loadtest.compare import compare
    from shardbroker.cli.loadtest.results import write_results

    dirs = []
    for seed, scale in ((1, 300.0), (2, 900.0)):
        out = tmp_path / f"run{seed}"
        summary = write_results(None, str(out), Run(seed, name=f"run{seed}", e2e_scale=scale).tables, [], {})
        assert any("Parquet" in note for note in summary["notes"]) and summary["outputs"]["tables"] is None
        dirs.append(str(out))
    _assert_charts(tmp_path / "run1")

    text = compare(dirs, None)
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("compare-")]
    assert text.splitlines()[-1] == f"compare.html: {folder / 'compare.html'}"
    assert "run1 (ndjson, 0.1.0)" in text and "run2 (ndjson, 0.1.0)" in text
    assert text.splitlines()[2].endswith("passed (generator_bound)")   # the runs' flags beside their numbers
    for name in ("fanout", "work", "total"):
        assert os.path.getsize(folder / f"throughput-{name}.png") > 10_000
        assert os.path.getsize(folder / f"spectrum-{name}-e2e_corrected.png") > 10_000
    assert not (folder / "spectrum-fanout-ack_corrected.png").exists()  # fanout has no acks
    page = (folder / "compare.html").read_text()
    assert page.count("<svg") == len(list(folder.glob("*.png"))) and "<script" not in page.lower()
