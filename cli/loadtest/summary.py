"""summary.json from the collected tables, and its text for the terminal.

Latency is merged exactly: every interval blob is decoded once and added into the histograms it belongs to (its
workload's interval, the all-workloads interval, and, in the measure phase, both run-long aggregates), and every
percentile is read off a merged histogram.  Percentiles are never averaged.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hdrh.histogram import HdrHistogram

from shardbroker.cli.loadtest import thresholds as thresholds_mod

# Latency metrics, each an intervals column <metric>_hdr holding HdrHistogram(1, 60_000_000, 3).encode() or "".
HDR_METRICS: tuple[str, ...] = thresholds_mod.LATENCY
LOWEST, HIGHEST, DIGITS = 1, 60_000_000, 3  # the producers' HdrHistogram(1, 60_000_000, 3), in µs
SPECTRUM_PCTS = (0, 50, 75, 90, 95, 99, 99.5, 99.9, 99.95, 99.99, 99.999, 100)
_SUMMARY_PCTS = (50, 90, 99, 99.9, 99.99)
_COUNTERS = ("target", "sent", "acked", "send_errors", "received", "redelivered", "bytes_out", "bytes_in")
_ACCOUNTING_SUMS = ("published", "received", "unique", "lost", "duplicates", "redeliveries", "reordered", "early",
                    "unacked", "unconfirmed", "gap_count")
_SEND_ROLES = ("publisher", "producer")

# Called with (workload, metric, interval index, interval start ms since the agreed start, interval ms, histogram)
# for each workload's per-interval merge that holds samples; the histogram is only lent, and must not be changed
# beyond its timestamps.
IntervalSink = Callable[[str, str, int, int, int, HdrHistogram], None]


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST, HIGHEST, DIGITS)


def pct_key(pct: float) -> str:
    """50 -> "p50", 99.9 -> "p99_9": the summary's key for a percentile."""
    return "p" + f"{pct:g}".replace(".", "_")


def histogram_stats(hist: HdrHistogram, with_blob: bool = True) -> dict[str, Any]:
    """count, min, mean, p50 ... p99_99, max in µs, and the merged histogram itself (base64) for what else is asked."""
    values = hist.get_percentile_to_value_dict(list(_SUMMARY_PCTS))
    stats: dict[str, Any] = {"count": hist.get_total_count(), "min": hist.get_min_value(),
                             "mean": round(hist.get_mean_value(), 3)}
    stats.update({pct_key(p): values.get(p) for p in _SUMMARY_PCTS})
    stats["max"] = hist.get_max_value()
    if with_blob:
        stats["hdr"] = hist.encode().decode("ascii")
    return stats


def spectrum(hist: HdrHistogram, pcts: Iterable[float] = SPECTRUM_PCTS) -> list[list[float]]:
    """[percentile, µs] pairs, keeping only the percentiles the sample count can tell apart from the max."""
    count = hist.get_total_count()
    wanted = [p for p in pcts if p == 100 or count * (100 - p) / 100 >= 1]
    values = hist.get_percentile_to_value_dict(wanted)
    return [[p, values[p]] for p in wanted if p in values]


def dense_spectrum(blob: str, ticks_per_decade: int = 10) -> list[list[float]]:
    """A smooth percentile spectrum from a summary's histogram blob, for charts: percentiles 1 - 10^(-k/ticks)."""
    hist = HdrHistogram.decode(blob)
    count = hist.get_total_count()
    if not count:
        return []
    top = math.log10(max(count, 10))
    pcts = [100 * (1 - 10 ** (-k / ticks_per_decade)) for k in range(int(top * ticks_per_decade) + 1)]
    return spectrum(hist, pcts + [100])


def build(tables: Mapping[str, list[dict]], thresholds: Iterable[thresholds_mod.Threshold] = (),
          meta: Mapping[str, Any] | None = None, on_interval: IntervalSink | None = None) -> dict[str, Any]:
    """The summary (see the module doc of results.py for the layout) of one run's collected tables."""
    notes: list[str] = list((meta or {}).get("notes", []))
    runs = tables.get("runs") or []
    if len(runs) != 1:
        notes.append(f"expected 1 runs row, got {len(runs)}")
    run = dict(runs[0]) if runs else {}
    tasks = _latest_attempts(tables.get("tasks") or [], notes)
    intervals = tables.get("intervals") or []
    streams = tables.get("streams") or []
    interval_s = float(run.get("interval_s") or 0) or _infer_interval_s(intervals, notes)

    names = sorted({r["workload"] for r in (*tasks, *intervals, *streams)})
    sections = {name: _Section() for name in names}
    total = _Section()
    for row in tasks:
        sections[row["workload"]].tasks.append(row)
        total.tasks.append(row)
    for row in streams:
        sections[row["workload"]].streams.append(row)
        total.streams.append(row)
    _merge_intervals(intervals, sections, total, interval_s, on_interval, notes)

    summary: dict[str, Any] = {
        "format": 1,
        "run": _json_safe(run),
        "meta": _json_safe(dict(meta or {})),
        "workloads": {name: sections[name].finish(interval_s) for name in names},
        "total": total.finish(interval_s),
        "clock": [_json_safe(dict(row)) for row in tables.get("clock") or []],
        "clamped": sum(int(r.get("clamped") or 0) for r in intervals),
        "negative_e2e": sum(int(r.get("negative_e2e") or 0) for r in intervals),
    }
    summary["flags"] = _flags(summary, tasks, intervals, run)
    results = thresholds_mod.evaluate(list(thresholds), summary)
    summary["thresholds"] = results
    status = str(run.get("status") or "passed")
    # A run its producer already judged failed stays failed even with every threshold met.
    summary["passed"] = all(r["passed"] for r in results) and status not in ("error", "failed")
    summary["status"] = "error" if status == "error" else ("passed" if summary["passed"] else "failed")
    summary["run"]["status"] = summary["status"]
    summary["run"]["flags"] = summary["flags"]
    if not intervals:
        notes.append("no intervals rows: rates, latency and series are empty")
    summary["notes"] = notes
    return summary


class _Section:
    """What one workload (or all of them) accumulates while the interval rows stream past."""

    def __init__(self) -> None:
        self.tasks: list[dict] = []
        self.streams: list[dict] = []
        self.counters: Counter[str] = Counter()     # measure phase only
        self.measure_intervals: set[int] = set()
        self.latency: dict[str, HdrHistogram] = {}  # measure phase only
        self.series: list[dict] = []

    def finish(self, interval_s: float) -> dict[str, Any]:
        measure_s = len(self.measure_intervals) * interval_s
        rates: dict[str, float | None] = {
            name: (round(self.counters[name] / measure_s, 3) if measure_s else None) for name in _COUNTERS
            if name != "send_errors" and name != "redelivered"}
        latency = {metric: histogram_stats(hist) for metric, hist in self.latency.items() if hist.get_total_count()}
        return {
            "tasks": len(self.tasks),
            "roles": dict(Counter(t["role"] for t in self.tasks)),
            "measure_s": measure_s,
            "rates": rates,
            "counts": {name: self.counters[name] for name in _COUNTERS},
            "accounting": self._accounting(),
            "latency": latency,
            "series": sorted(self.series, key=lambda point: point["interval"]),
            "spectrum": {metric: spectrum(self.latency[metric]) for metric in latency},
            "imbalance": _imbalance(self.tasks),
            "generator_bound": any(t.get("generator_bound") for t in self.tasks),
            # A closed-loop workload has no schedule to be late against: its latency is not corrected for
            # coordinated omission, and every view of it must say so.
            "model": "closed" if any(t.get("model") == "closed" for t in self.tasks) else "open",
        }

    def _accounting(self) -> dict[str, int]:
        acc = {name: sum(int(s.get(name) or 0) for s in self.streams) for name in _ACCOUNTING_SUMS}
        acc["max_reorder_distance"] = max((int(s.get("max_reorder_distance") or 0) for s in self.streams), default=0)
        acc["streams"] = len(self.streams)
        return acc


def _merge_intervals(intervals: list[dict], sections: dict[str, _Section], total: _Section, interval_s: float,
                     on_interval: IntervalSink | None, notes: list[str]) -> None:
    by_index: dict[int, list[dict]] = defaultdict(list)
    for row in intervals:
        by_index[int(row["interval"])].append(row)
    interval_ms = round(interval_s * 1000)
    bad_blobs = 0
    for index in sorted(by_index):
        rows = by_index[index]
        start_ms = _start_ms(rows, index, interval_s)
        phase = _phase(rows, index, notes)
        totals: dict[str, HdrHistogram] = {}
        by_workload: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            by_workload[row["workload"]].append(row)
        for name, wrows in sorted(by_workload.items()):
            section = sections[name]
            merged: dict[str, HdrHistogram] = {}
            for metric in HDR_METRICS:
                # Rows are split by their own phase so a stray warmup row can't leak into the measure aggregate.
                measure, other = None, None
                for row in wrows:
                    blob = row.get(f"{metric}_hdr")
                    if not blob:
                        continue
                    try:
                        decoded = HdrHistogram.decode(blob)
                    except Exception:  # noqa: BLE001 - one corrupt blob must not cost the whole report
                        bad_blobs += 1
                        continue
                    # Not merely skippable: hdrh's add() takes an empty histogram's min as 0 and keeps it.
                    if not decoded.get_total_count():
                        continue
                    in_measure = row.get("phase") == "measure"
                    hist = measure if in_measure else other
                    if hist is None:
                        hist = new_histogram()
                    hist.add(decoded)
                    if in_measure:
                        measure = hist
                    else:
                        other = hist
                if measure is not None:
                    for target in (section, total):
                        target.latency.setdefault(metric, new_histogram()).add(measure)
                if measure is not None and other is not None:
                    measure.add(other)
                interval_hist = measure if measure is not None else other
                if interval_hist is None:
                    continue
                merged[metric] = interval_hist
                totals.setdefault(metric, new_histogram()).add(interval_hist)
                if on_interval is not None:
                    on_interval(name, metric, index, start_ms, interval_ms, interval_hist)
            section.series.append(_point(index, start_ms, phase, wrows, merged))
            for row in wrows:
                if row.get("phase") == "measure":
                    section.measure_intervals.add(index)
                    section.counters.update({c: int(row.get(c) or 0) for c in _COUNTERS})
        total.series.append(_point(index, start_ms, phase, rows, totals))
        for row in rows:
            if row.get("phase") == "measure":
                total.measure_intervals.add(index)
                total.counters.update({c: int(row.get(c) or 0) for c in _COUNTERS})
    if bad_blobs:
        notes.append(f"{bad_blobs} histogram blob(s) could not be decoded and were left out")


def _point(index: int, start_ms: int, phase: str, rows: list[dict], hists: dict[str, HdrHistogram]) -> dict:
    point: dict[str, Any] = {"interval": index, "t_s": start_ms / 1000, "phase": phase}
    for name in ("target", "sent", "acked", "received"):
        point[name] = sum(int(r.get(name) or 0) for r in rows)
    e2e = hists.get("e2e_corrected")
    values = e2e.get_percentile_to_value_dict([50, 99, 99.9]) if e2e is not None else {}
    point["e2e_corrected_count"] = e2e.get_total_count() if e2e is not None else 0
    point["e2e_corrected_p50"] = values.get(50)
    point["e2e_corrected_p99"] = values.get(99)
    point["e2e_corrected_p99_9"] = values.get(99.9)
    point["e2e_corrected_max"] = e2e.get_max_value() if e2e is not None else None
    for metric in ("e2e_raw", "send_lag"):
        hist = hists.get(metric)
        point[f"{metric}_p99"] = hist.get_value_at_percentile(99) if hist is not None else None
    return point


def _start_ms(rows: list[dict], index: int, interval_s: float) -> int:
    stamps = [int(r["interval_start_ms"]) for r in rows if r.get("interval_start_ms") is not None]
    return min(stamps) if stamps else round(index * interval_s * 1000)


def _phase(rows: list[dict], index: int, notes: list[str]) -> str:
    phases = Counter(str(r.get("phase") or "") for r in rows)
    if len(phases) > 1:
        notes.append(f"interval {index} has rows in several phases ({', '.join(sorted(phases))}); "
                     "each row was counted in its own phase")
    return phases.most_common(1)[0][0]


def _infer_interval_s(intervals: list[dict], notes: list[str]) -> float:
    for row in intervals:
        if int(row["interval"]) > 0 and row.get("interval_start_ms"):
            return int(row["interval_start_ms"]) / int(row["interval"]) / 1000
    notes.append("interval_s unknown; 1 s assumed")
    return 1.0


def _latest_attempts(tasks: list[dict], notes: list[str]) -> list[dict]:
    # A barrier stage retries every task together; only the last attempt's numbers describe the run.
    latest: dict[int, dict] = {}
    for row in tasks:
        task = int(row["task"])
        if task not in latest or int(row.get("attempt") or 0) > int(latest[task].get("attempt") or 0):
            latest[task] = row
    if len(latest) < len(tasks):
        notes.append(f"{len(tasks) - len(latest)} earlier task attempt(s) left out")
    return [latest[task] for task in sorted(latest)]


def _imbalance(tasks: list[dict]) -> dict[str, Any]:
    roles: dict[str, Any] = {}
    for role in sorted({t["role"] for t in tasks}):
        rates = [float(t.get("achieved_rate") or 0) for t in tasks if t["role"] == role]
        roles[role] = {"tasks": len(rates), "min": min(rates), "avg": statistics.fmean(rates), "max": max(rates),
                       "stddev": statistics.pstdev(rates)}
    per_task = []
    for t in tasks:
        target = float(t.get("target_rate") or 0)
        achieved = float(t.get("achieved_rate") or 0)
        per_task.append({
            "task": int(t["task"]), "workload": t["workload"], "role": t["role"], "host": t.get("host") or "",
            "target_rate": target, "achieved_rate": achieved,
            "achieved_over_target": round(achieved / target, 4) if target else None,
            "cpu_peak_pct": float(t.get("cpu_peak_pct") or 0), "start_skew_us": int(t.get("start_skew_us") or 0),
            "send_lag_p99_us": int(t.get("send_lag_p99_us") or 0),
            "generator_bound": bool(t.get("generator_bound")), "reconnects": int(t.get("reconnects") or 0),
            "errors": list(t.get("errors") or []),
        })
    return {"roles": roles, "tasks": per_task}


def _flags(summary: dict, tasks: list[dict], intervals: list[dict], run: Mapping[str, Any]) -> list[str]:
    flags: list[str] = []
    if any(t.get("generator_bound") for t in tasks):
        flags.append("generator_bound")
    if any(t.get("model") == "closed" for t in tasks):
        flags.append("closed_loop")
    if summary["clamped"]:
        flags.append("clamped")
    if summary["negative_e2e"]:
        flags.append("negative_e2e")
    if any(t.get("reconnects") for t in tasks):
        flags.append("reconnects")
    if any(t.get("errors") for t in tasks):
        flags.append("task_errors")
    if any(r.get("send_errors") for r in intervals):
        flags.append("send_errors")
    flags.extend(str(f) for f in run.get("flags") or [])
    return list(dict.fromkeys(flags))


def _json_safe(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).isoformat()
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return value.decode("ascii", "replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ---- text for the terminal ----

def fmt_us(value: float | None) -> str:
    """A latency in µs as people read it: 850µs, 1.23ms, 2.50s."""
    if value is None:
        return "-"
    if value < 1000:
        return f"{value:.0f}µs"
    if value < 1_000_000:
        return f"{value / 1000:.3g}ms" if value < 100_000 else f"{value / 1000:.0f}ms"
    return f"{value / 1_000_000:.3g}s"


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def flag_notes(summary: Mapping[str, Any]) -> list[str]:
    """What the flags that change how the numbers read mean for this run, one line each (terminal and report)."""
    flags = summary.get("flags") or []
    workloads = summary.get("workloads", {})
    lines = []
    if "generator_bound" in flags:
        behind = [t for t in summary.get("total", {}).get("imbalance", {}).get("tasks", []) if t.get("generator_bound")]
        which = ", ".join(f"task {t['task']} ({t['workload']}: send lag p99 {fmt_us(t.get('send_lag_p99_us'))}, "
                          f"CPU peak {t.get('cpu_peak_pct', 0):.0f}%)" for t in behind)
        lines.append(f"generator_bound: {which or 'a publisher task'} fell behind (send lag p99 over "
                     "max(5 ticks, 2ms), or CPU over 85% of a core): the latency of "
                     f"{', '.join(sorted({t['workload'] for t in behind})) or 'that workload'} measures the load "
                     "generator as much as the broker; add publisher_tasks or lower the rate")
    if "closed_loop" in flags:
        closed = sorted(name for name, sec in workloads.items() if sec.get("model") == "closed")
        lines.append(f"closed_loop: {', '.join(closed)} ran closed loop (window messages in flight): throughput "
                     "is the most the broker took, latency is NOT corrected for coordinated omission (no target)")
    if "negative_e2e" in flags:
        lines.append(f"negative_e2e: {summary.get('negative_e2e', 0):,} latency values came out below 0 (clocks of "
                     "two hosts, within the offset's bound) and were recorded as 0, not dropped")
    if "clamped" in flags:
        lines.append(f"clamped: {summary.get('clamped', 0):,} latency values over 60s were recorded as 60s")
    return lines


def render_text(summary: Mapping[str, Any]) -> str:
    """The terminal's view: rates, latency, accounting per workload, then flags, thresholds, notes and the verdict."""
    run = summary.get("run", {})
    lines = [f"run {run.get('name', '')} ({run.get('run_id', '')}) started {run.get('started_at', '')}: "
             f"{', '.join(run.get('protocols') or [])} against broker {run.get('broker_version', '')}, "
             f"{run.get('tasks', '')} tasks on {run.get('spark_master', '')}, seed {run.get('seed', '')}"]
    sections = [*summary.get("workloads", {}).items()]
    if len(sections) != 1:
        sections.append(("total", summary.get("total", {})))
    width = max([8] + [len(name) for name, _ in sections])

    lines += ["", f"{'workload':{width}} {'target/s':>12} {'sent/s':>12} {'acked/s':>12} {'received/s':>12} "
              f"{'measure':>8}"]
    for name, sec in sections:
        r = sec.get("rates", {})
        lines.append(f"{name:{width}} {fmt_rate(r.get('target')):>12} {fmt_rate(r.get('sent')):>12} "
                     f"{fmt_rate(r.get('acked')):>12} {fmt_rate(r.get('received')):>12} "
                     f"{sec.get('measure_s', 0):>7g}s")

    lines += ["", f"{'workload':{width}} {'latency':14} {'count':>10} {'p50':>8} {'p90':>8} {'p99':>8} "
              f"{'p99.9':>8} {'p99.99':>8} {'max':>8}"]
    for name, sec in sections:
        for metric, s in sec.get("latency", {}).items():
            lines.append(f"{name:{width}} {metric:14} {s['count']:>10,} "
                         + " ".join(f"{fmt_us(s.get(k)):>8}" for k in ("p50", "p90", "p99", "p99_9", "p99_99", "max")))

    lines += ["", f"{'workload':{width}} {'published':>12} {'received':>12} {'lost':>8} {'dup':>8} {'reordered':>9} "
              f"{'redeliv':>8} {'early':>8} {'unacked':>8} {'unconf':>8}"]
    for name, sec in sections:
        a = sec.get("accounting", {})
        lines.append(f"{name:{width}} {a.get('published', 0):>12,} {a.get('received', 0):>12,} {a.get('lost', 0):>8,} "
                     f"{a.get('duplicates', 0):>8,} {a.get('reordered', 0):>9,} {a.get('redeliveries', 0):>8,} "
                     f"{a.get('early', 0):>8,} {a.get('unacked', 0):>8,} {a.get('unconfirmed', 0):>8,}")

    if summary.get("flags"):
        lines += ["", "flags: " + ", ".join(summary["flags"])]
        lines += [f"  {line}" for line in flag_notes(summary)]
    for c in summary.get("clock") or []:
        lines.append(f"clock: {c.get('pub_host')} -> {c.get('sub_host')} offset {c.get('offset_ns', 0) / 1000:+.1f}µs "
                     f"± {c.get('bound_ns', 0) / 1000:.1f}µs, drift {c.get('drift_ns_per_s', 0):+.0f} ns/s, "
                     f"{c.get('probes', 0)} probes")
    if summary.get("thresholds"):
        lines += ["", "thresholds:"]
        for t in summary["thresholds"]:
            actual = t["actual"]
            shown = fmt_us(actual) if t["unit"] == "us" and actual is not None else actual
            note = f"  ({t['note']})" if t.get("note") else ""
            lines.append(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['expr']}  actual {shown}{note}")
    for note in summary.get("notes", []):
        lines.append(f"note: {note}")
    lines += ["", f"result: {str(summary.get('status', '')).upper()}"]
    return "\n".join(lines)
