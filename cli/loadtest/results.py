"""A load test's results directory, written on the driver from the collected tables.

    <out>/summary.json        the summary (summary.py), also as summary.txt, the terminal's text
    <out>/tables/<table>/     Parquet, one directory per table (runs, tasks, intervals, streams, clock)
    <out>/hlog/<workload>.<metric>.hlog   HdrHistogram interval logs, one histogram per interval, tasks merged
    <out>/charts/<name>.png|svg           throughput, latency, spectrum, tasks
    <out>/report.html         one self-contained page

Rows are checked against the schemas before anything is written, so a producer's typo fails the run loudly; a
failure to write Parquet or draw charts afterwards is caught and recorded in summary["notes"], so the summary
itself, the one thing every later step reads, is always written.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from collections.abc import Mapping
from typing import Any, TextIO

from hdrh.histogram import HdrHistogram
from hdrh.log import HistogramLogWriter

from shardbroker.cli.loadtest import report
from shardbroker.cli.loadtest import summary as summary_mod
from shardbroker.cli.loadtest import thresholds as thresholds_mod
from shardbroker.cli.loadtest.schema import SCHEMAS, TABLES, rows_for


def write_results(spark: Any, out_dir: str, tables: Mapping[str, list[dict]],
                  thresholds: list[thresholds_mod.Threshold] | Mapping[str, Any], meta: Mapping[str, Any],
                  *, tables_uri: str | None = None) -> dict[str, Any]:
    """Write everything under out_dir and return the summary.

    `thresholds` is parse()'s list (a raw [thresholds] table is parsed here).  `meta` is stored as summary["meta"];
    its "notes" (a list of str), if any, start summary["notes"].  `spark` None skips Parquet (noted).  Parquet goes
    to `tables_uri`/<table> when given (a cluster's executors cannot write to the driver's disk), else to
    <out_dir>/tables/<table>.
    """
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"unknown table(s) {', '.join(sorted(unknown))}; tables are {', '.join(TABLES)}")
    for table in TABLES:
        rows_for(table, tables.get(table) or [])  # fail on a typo before anything is written
    if isinstance(thresholds, Mapping):
        names = sorted({r["workload"] for t in ("tasks", "intervals", "streams") for r in tables.get(t) or []})
        thresholds = thresholds_mod.parse(thresholds, names)

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    runs = tables.get("runs") or [{}]
    with _HlogWriter(os.path.join(out_dir, "hlog"), runs[0]) as hlog:
        summary = summary_mod.build(tables, thresholds, meta, on_interval=hlog)
    notes: list[str] = summary["notes"]
    outputs: dict[str, Any] = {"summary": "summary.json", "text": "summary.txt", "hlog": hlog.paths(out_dir)}

    if spark is None:
        notes.append("no Spark session: Parquet tables not written")
        outputs["tables"] = None
    else:
        outputs["tables"] = _write_parquet(spark, tables, summary, out_dir, tables_uri, notes)

    try:
        charts = report.write_charts(summary, out_dir)
        outputs["charts"] = {name: {ext: os.path.relpath(p, out_dir) for ext, p in paths.items()}
                             for name, paths in charts.items()}
        outputs["report"] = os.path.relpath(report.write_report(summary, out_dir, charts), out_dir)
    except Exception as exc:  # noqa: BLE001 - a chart bug must not cost the run its summary
        notes.append(f"charts/report not written: {type(exc).__name__}: {exc}")
    summary["outputs"] = outputs

    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    with open(os.path.join(out_dir, "summary.txt"), "w", encoding="utf-8") as fh:
        fh.write(summary_mod.render_text(summary) + "\n")
    return summary


def _write_parquet(spark: Any, tables: Mapping[str, list[dict]], summary: Mapping[str, Any], out_dir: str,
                   tables_uri: str | None, notes: list[str]) -> str | None:
    base = tables_uri.rstrip("/") if tables_uri else "file://" + os.path.join(out_dir, "tables")
    if tables_uri is None and not str(spark.sparkContext.master).startswith("local"):
        notes.append(f"Parquet written to {base} from a {spark.sparkContext.master} cluster: the executors' "
                     "disks, not necessarily the driver's; pass tables_uri for shared storage")
    try:
        for table in TABLES:
            rows = list(tables.get(table) or [])
            if table == "runs" and rows:
                # The stored run carries the verdict and flags the summary settled on, not the provisional ones.
                rows = [{**rows[0], "status": summary["status"], "flags": summary["flags"]}, *rows[1:]]
            frame = spark.createDataFrame(rows_for(table, rows), SCHEMAS[table])
            # These tables are small next to a partition; one file each keeps the results directory readable.
            frame.coalesce(1).write.mode("overwrite").parquet(f"{base}/{table}")
    except Exception as exc:  # noqa: BLE001 - the summary and report are still worth writing
        notes.append(f"Parquet tables not written: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        return None
    return base


class _HlogWriter:
    """Receives summary.build's per-interval merges and appends each to its workload's and metric's log."""

    def __init__(self, hlog_dir: str, run: Mapping[str, Any]) -> None:
        self.dir = hlog_dir
        self.run_id = str(run.get("run_id", ""))
        self.start_ns = int(run.get("agreed_start_wall_ns") or 0)
        self.files: dict[tuple[str, str], tuple[TextIO, HistogramLogWriter]] = {}

    def __enter__(self) -> _HlogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        for fh, _ in self.files.values():
            fh.close()

    def paths(self, relative_to: str) -> list[str]:
        return [os.path.relpath(fh.name, relative_to) for fh, _ in self.files.values()]

    def __call__(self, workload: str, metric: str, index: int, start_ms: int, interval_ms: int,
                 hist: HdrHistogram) -> None:
        entry = self.files.get((workload, metric))
        if entry is None:
            entry = self.files[(workload, metric)] = self._open(workload, metric)
        # Stamps are ms since the agreed start; the BaseTime line makes them absolute for readers.  The writer's
        # own start-time method is broken in hdrh 0.10 (datetime.iso_format), hence the hand-written header.
        hist.set_start_time_stamp(start_ms)
        hist.set_end_time_stamp(start_ms + interval_ms)
        entry[1].output_interval_histogram(hist, max_value_unit_ratio=1000.0)

    def _open(self, workload: str, metric: str) -> tuple[TextIO, HistogramLogWriter]:
        os.makedirs(self.dir, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", workload)
        fh = open(os.path.join(self.dir, f"{safe}.{metric}.hlog"), "w", encoding="utf-8")  # noqa: SIM115
        writer = HistogramLogWriter(fh)
        writer.output_log_format_version()
        if self.start_ns:
            start_s = self.start_ns / 1e9
            iso = dt.datetime.fromtimestamp(start_s, dt.UTC).isoformat()
            writer.output_comment(f"[StartTime: {start_s:.3f} (seconds since epoch), {iso}]")
            writer.output_base_time(self.start_ns / 1e6)
        writer.output_comment(f"loadtest run {self.run_id} workload {workload} metric {metric}: values in "
                              "microseconds, Interval_Max in milliseconds, tasks merged per interval")
        writer.output_legend()
        return fh, writer
