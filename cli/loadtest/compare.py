"""Several runs side by side, from their summary.json files alone: charts overlaid one line per run, and a table.

Only workloads (and latency metrics) every run has are overlaid; the table lists each run's total as well.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from shardbroker.cli.loadtest import report
from shardbroker.cli.loadtest.summary import fmt_rate, fmt_us


def load(result_dir: str) -> dict[str, Any]:
    path = os.path.join(result_dir, "summary.json") if os.path.isdir(result_dir) else result_dir
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def run_label(summary: Mapping[str, Any]) -> str:
    """`name (protocols, broker)`: what tells runs apart in a legend."""
    run = summary.get("run", {})
    broker = run.get("broker_version") or ", ".join(sorted((run.get("broker_urls") or {}).values()))
    what = ", ".join(x for x in ("/".join(run.get("protocols") or []), broker) if x)
    name = run.get("name") or run.get("run_id") or "run"
    return f"{name} ({what})" if what else str(name)


def compare(result_dirs: list[str], out_dir: str | None = None) -> str:
    """Write compare.html and PNGs to out_dir (default: compare-<UTC timestamp> beside the first run's directory)
    and return the terminal's table; its last line names compare.html."""
    if not result_dirs:
        raise ValueError("compare needs at least one results directory")
    runs = [load(d) for d in result_dirs]
    labels = _unique([run_label(s) for s in runs])
    if out_dir is None:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        first = os.path.abspath(result_dirs[0].rstrip("/"))
        out_dir = os.path.join(os.path.dirname(first), f"compare-{stamp}")
    os.makedirs(out_dir, exist_ok=True)

    common = [w for w in runs[0].get("workloads", {}) if all(w in s.get("workloads", {}) for s in runs)]
    sections = [*common, "total"] if len(common) != 1 else common
    charts: list[tuple[str, str]] = []  # (title, inline svg)
    for name in sections:
        secs = [_section(s, name) for s in runs]
        fig = _throughput(name, secs, runs, labels)
        charts.append((f"{name}: throughput", _save(fig, out_dir, f"throughput-{name}")))
        metrics = [m for m in secs[0].get("latency", {}) if all(m in sec.get("latency", {}) for sec in secs)]
        for metric in metrics:
            fig = _spectrum(name, metric, secs, labels)
            charts.append((f"{name}: {metric} by percentile", _save(fig, out_dir, f"spectrum-{name}-{metric}")))

    text = table(runs, labels, sections)
    page = os.path.join(out_dir, "compare.html")
    with open(page, "w", encoding="utf-8") as fh:
        fh.write(_html(text, charts))
    return f"{text}\n\ncompare.html: {page}"


def table(runs: list[Mapping[str, Any]], labels: list[str], sections: list[str]) -> str:
    """Per run and workload: measure-phase rates, e2e_corrected percentiles, and delivery faults."""
    width = max([3] + [len(label) for label in labels])
    wwidth = max([8] + [len(name) for name in sections])
    header = (f"{'run':{width}} {'workload':{wwidth}} {'sent/s':>11} {'acked/s':>11} {'recv/s':>11} {'p50':>8} "
              f"{'p99':>8} {'p99.9':>8} {'max':>8} {'lost':>8} {'dup':>8} {'reord':>8}  status")
    lines = [header, "-" * len(header)]
    for label, summary in zip(labels, runs):
        # A generator-bound or closed-loop run's latency is not the broker's: say so beside its numbers.
        flags = f" ({', '.join(summary['flags'])})" if summary.get("flags") else ""
        for name in sections:
            sec = _section(summary, name)
            r, a = sec.get("rates", {}), sec.get("accounting", {})
            e2e = sec.get("latency", {}).get("e2e_corrected", {})
            lines.append(f"{label:{width}} {name:{wwidth}} {fmt_rate(r.get('sent')):>11} "
                         f"{fmt_rate(r.get('acked')):>11} {fmt_rate(r.get('received')):>11} "
                         + " ".join(f"{fmt_us(e2e.get(k)):>8}" for k in ("p50", "p99", "p99_9", "max"))
                         + f" {a.get('lost', 0):>8,} {a.get('duplicates', 0):>8,} {a.get('reordered', 0):>8,}"
                         f"  {summary.get('status', '')}{flags}")
    return "\n".join(lines)


def _section(summary: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    if name == "total":
        return summary.get("total", {})
    return summary.get("workloads", {}).get(name, {})


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def _throughput(name: str, secs: list[Mapping[str, Any]], runs: list[Mapping[str, Any]], labels: list[str]):
    fig, (ax,) = report.figure(1, height=4.0)
    # One quantity for every run: received where anything was received (pub/sub), else acked (queues), else sent.
    key = next((k for k in ("received", "acked", "sent") if any(p.get(k) for s in secs for p in s.get("series", []))),
               "sent")
    for sec, summary, label in zip(secs, runs, labels):
        interval_s = float(summary.get("run", {}).get("interval_s") or 1.0)
        series = sec.get("series", [])
        report.plot_steps(ax, [(p["t_s"], p[key] / interval_s) for p in series], interval_s, label=label)
    ax.set_title(f"{name}: {key} per second")
    ax.set_xlabel("seconds since agreed start")
    ax.set_ylabel("msg/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return fig


def _spectrum(name: str, metric: str, secs: list[Mapping[str, Any]], labels: list[str]):
    fig, (ax,) = report.figure(1, height=4.0)
    top = 10
    for sec, label in zip(secs, labels):
        entry = sec["latency"][metric]
        points = report.spectrum_points(entry, sec.get("spectrum", {}).get(metric, ()))
        report.plot_spectrum(ax, points, entry["count"], label=label)
        top = max(top, entry["count"])
    report.label_spectrum_axis(ax, top)
    ax.set_yscale("log")
    ax.set_title(f"{name}: {metric} by percentile (measure phase)")
    ax.legend(loc="upper left", fontsize="small")
    return fig


def _save(fig, out_dir: str, stem: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", stem)
    return report.strip_prolog(report.save(fig, os.path.join(out_dir, f"{safe}.png")))


def _html(text: str, charts: list[tuple[str, str]]) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>loadtest comparison</title>"
             f"<style>{report.CSS}</style></head><body><h1>loadtest comparison</h1>",
             f"<pre>{html.escape(text)}</pre>"]
    for title, svg in charts:
        parts.append(f"<h2>{html.escape(title)}</h2>{svg}")
    parts.append("</body></html>")
    return "\n".join(parts)
