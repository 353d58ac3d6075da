"""A run's charts (PNG and SVG under charts/) and report.html, one self-contained page: inline SVG, no script.

Charts are drawn on bare `Figure`s with the Agg canvas, never pyplot, so nothing global is touched and no display
is needed.  Everything is drawn from summary.json alone, so a report can be rebuilt from an old run's summary.
"""

from __future__ import annotations

import html
import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from shardbroker.cli.loadtest.summary import dense_spectrum, flag_notes, fmt_rate, fmt_us, render_text

CHARTS = ("throughput", "latency", "spectrum", "tasks")
_PHASE_SHADE = {"warmup": "#fde68a", "drain": "#e5e7eb"}
_SENDING = ("publisher", "producer")
_ROLE_COLORS = {"publisher": "#2b6cb0", "producer": "#2b6cb0", "subscriber": "#38a169", "consumer": "#38a169"}
_METRIC_STYLE = {"e2e_corrected": "-", "e2e_raw": "--", "e2e_cross": "-.", "send_lag": ":", "ack_corrected": "-",
                 "ack_raw": "--"}
_MAX_PANELS = 8


def figure(rows: int, height: float = 3.2):
    """A figure of `rows` stacked full-width axes, and the axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, max(height * rows, 3.0)), layout="constrained")
    axes = fig.subplots(max(rows, 1), 1, squeeze=False)
    return fig, [row[0] for row in axes]


def _save(fig, charts_dir: str, name: str) -> dict[str, str]:
    paths = {"png": os.path.join(charts_dir, f"{name}.png"), "svg": os.path.join(charts_dir, f"{name}.svg")}
    svg = save(fig, paths["png"])
    with open(paths["svg"], "w", encoding="utf-8") as fh:
        fh.write(svg)
    return paths


def save(fig, png_path: str) -> str:
    """Write the figure as PNG and return it as an SVG document."""
    import matplotlib

    fig.savefig(png_path, dpi=110)
    # The layout is settled by the first save; running it again for the SVG would double the drawing time.
    fig.set_layout_engine("none")
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: smaller, no glyph ids to collide
        fig.savefig(buf, format="svg")
    return buf.getvalue()


def strip_prolog(svg: str) -> str:
    """SVG markup ready to inline in HTML: the XML prolog and doctype dropped."""
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else svg


def _panels(summary: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    workloads = list(summary.get("workloads", {}).items())
    if not workloads:
        return [("total", summary.get("total", {}))]
    return workloads[:_MAX_PANELS]


def _shade_phases(ax, series: Sequence[Mapping[str, Any]], interval_s: float) -> None:
    for point in series:
        color = _PHASE_SHADE.get(point.get("phase", ""))
        if color:
            ax.axvspan(point["t_s"], point["t_s"] + interval_s, color=color, alpha=0.5, lw=0)


def _interval_s(summary: Mapping[str, Any]) -> float:
    return float(summary.get("run", {}).get("interval_s") or 1.0)


def plot_steps(ax, points: Sequence[tuple[float, float]], interval_s: float, *fmt: str, **style) -> None:
    """One value per interval drawn across its whole interval, the last one included."""
    if not points:
        return
    xs = [t for t, _ in points] + [points[-1][0] + interval_s]
    ys = [v for _, v in points] + [points[-1][1]]
    ax.plot(xs, ys, *fmt, drawstyle="steps-post", **style)


def throughput_chart(summary: Mapping[str, Any]):
    """Messages per second per interval: planned (target), sent, acked and received; warmup and drain shaded."""
    panels = _panels(summary)
    interval_s = _interval_s(summary)
    fig, axes = figure(len(panels))
    for ax, (name, sec) in zip(axes, panels):
        series = sec.get("series", [])
        _shade_phases(ax, series, interval_s)
        for key, style in (("target", ":"), ("sent", "-"), ("acked", "--"), ("received", "-")):
            points = [(p["t_s"], p[key] / interval_s) for p in series]
            if any(v for _, v in points):
                plot_steps(ax, points, interval_s, style, label=f"{key}/s")
        ax.set_title(f"{name}: throughput (shaded: warmup, drain)")
        ax.set_ylabel("msg/s")
        ax.set_xlabel("seconds since agreed start")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="lower right", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no intervals", ha="center", va="center", transform=ax.transAxes)
    return fig


def latency_chart(summary: Mapping[str, Any]):
    """e2e_corrected p50/p99/p99.9/max per interval (merged across tasks), with e2e_raw and send_lag p99."""
    panels = _panels(summary)
    interval_s = _interval_s(summary)
    fig, axes = figure(len(panels))
    lines = (("e2e_corrected_p50", "e2e p50", "-"), ("e2e_corrected_p99", "e2e p99", "-"),
             ("e2e_corrected_p99_9", "e2e p99.9", "-"), ("e2e_corrected_max", "e2e max", "-"),
             ("e2e_raw_p99", "e2e raw p99", "--"), ("send_lag_p99", "send lag p99", ":"))
    for ax, (name, sec) in zip(axes, panels):
        series = sec.get("series", [])
        _shade_phases(ax, series, interval_s)
        for key, label, style in lines:
            points = [(p["t_s"], p[key] / 1000) for p in series if p.get(key) is not None]
            if points:
                plot_steps(ax, points, interval_s, style, label=label)
        ax.set_title(f"{name}: latency per interval (all tasks merged)")
        ax.set_ylabel("ms")
        ax.set_xlabel("seconds since agreed start")
        ax.grid(alpha=0.3, which="both")
        if ax.lines:
            ax.set_yscale("log")
            ax.legend(loc="upper right", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no latency samples", ha="center", va="center", transform=ax.transAxes)
    return fig


def spectrum_points(entry: Mapping[str, Any], fallback: Sequence[Sequence[float]] = ()) -> list[list[float]]:
    """Percentile spectrum points for a summary latency entry: dense from its histogram when it has one."""
    if entry.get("hdr"):
        return dense_spectrum(entry["hdr"])
    return [list(p) for p in fallback]


def plot_spectrum(ax, points: Sequence[Sequence[float]], count: int, **style) -> None:
    """One percentile-spectrum line: x is 1/(1-q) on a log axis (as HdrHistogram plots), the max at the far end."""
    xs, ys = [], []
    for pct, value in points:
        if pct >= 100:
            x = max(float(count), (xs[-1] * 2) if xs else 2.0)
        else:
            x = 1 / (1 - pct / 100)
        xs.append(x)
        ys.append(value / 1000)
    if xs:
        ax.plot(xs, ys, drawstyle="steps-post", **style)


def label_spectrum_axis(ax, count: int) -> None:
    ax.set_xscale("log")
    decades = max(1, min(6, math.ceil(math.log10(max(count, 10)))))
    ticks = [10 ** k for k in range(decades + 1)]
    ax.set_xticks(ticks)
    ax.set_xticklabels(["0%"] + [f"{100 - 100 / t:g}%" for t in ticks[1:]])
    ax.set_xlabel("percentile")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3, which="both")


def spectrum_chart(summary: Mapping[str, Any]):
    """Measure-phase percentile spectrum of every latency metric with samples."""
    panels = _panels(summary)
    fig, axes = figure(len(panels), height=3.6)
    for ax, (name, sec) in zip(axes, panels):
        latency = sec.get("latency", {})
        top = 10
        for metric, entry in latency.items():
            points = spectrum_points(entry, sec.get("spectrum", {}).get(metric, ()))
            plot_spectrum(ax, points, entry["count"], label=metric, linestyle=_METRIC_STYLE.get(metric, "-"))
            top = max(top, entry["count"])
        label_spectrum_axis(ax, top)
        ax.set_title(f"{name}: latency by percentile (measure phase)")
        if ax.lines:
            ax.set_yscale("log")
            ax.legend(loc="upper left", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no latency samples", ha="center", va="center", transform=ax.transAxes)
    return fig


def tasks_chart(summary: Mapping[str, Any]):
    """Per task: achieved rate over target, and peak CPU; a lagging generator or a hot host stands out here."""
    tasks = summary.get("total", {}).get("imbalance", {}).get("tasks", [])
    fig, (ax_rate, ax_cpu) = figure(2, height=2.8)
    labels = [str(t["task"]) for t in tasks]
    colors = [_ROLE_COLORS.get(t["role"], "#718096") for t in tasks]
    ratios = [(t["achieved_over_target"] or 0) for t in tasks]
    ax_rate.bar(labels, ratios, color=colors)
    ax_rate.axhline(1.0, color="#e53e3e", lw=1, ls="--")
    ax_rate.set_title("per task: achieved rate / target (blue: sending, green: receiving)")
    ax_rate.set_ylabel("achieved / target")
    ax_cpu.bar(labels, [t["cpu_peak_pct"] for t in tasks], color=colors)
    ax_cpu.set_title("per task: peak CPU")
    ax_cpu.set_ylabel("% of one core")
    ax_cpu.set_xlabel("task")
    for ax in (ax_rate, ax_cpu):
        ax.grid(alpha=0.3, axis="y")
        if not tasks:
            ax.text(0.5, 0.5, "no tasks", ha="center", va="center", transform=ax.transAxes)
        elif len(tasks) > 40:
            ax.tick_params(axis="x", labelsize=6, rotation=90)
    return fig


_BUILDERS = {"throughput": throughput_chart, "latency": latency_chart, "spectrum": spectrum_chart,
             "tasks": tasks_chart}


def write_charts(summary: Mapping[str, Any], out_dir: str) -> dict[str, dict[str, str]]:
    """The four charts under <out_dir>/charts/ as PNG and SVG; {name: {"png": path, "svg": path}}."""
    charts_dir = os.path.join(out_dir, "charts")
    os.makedirs(charts_dir, exist_ok=True)
    return {name: _save(_BUILDERS[name](summary), charts_dir, name) for name in CHARTS}


def write_report(summary: Mapping[str, Any], out_dir: str, charts: Mapping[str, Mapping[str, str]]) -> str:
    """<out_dir>/report.html from the summary and the charts' SVG files; returns its path."""
    svgs = {}
    for name, paths in charts.items():
        with open(paths["svg"], encoding="utf-8") as fh:
            svgs[name] = strip_prolog(fh.read())
    path = os.path.join(out_dir, "report.html")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_html(summary, svgs))
    return path


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#1a202c;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #e2e8f0}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:.2em .6em;border:1px solid #e2e8f0;text-align:right}
th{background:#f7fafc}td.l,th.l{text-align:left}.pass{color:#276749;font-weight:600}
.fail{color:#c53030;font-weight:600}.verdict{font-size:1.3em;padding:.3em .8em;display:inline-block}
.vpass{background:#c6f6d5}.vfail{background:#fed7d7}svg{max-width:100%;height:auto}pre{background:#f7fafc;
padding:.8em;overflow:auto}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    head = "".join(f"<th class='l'>{_e(h)}</th>" if i < left else f"<th>{_e(h)}</th>" for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td class='l'>{_e(c)}</td>" if i < left else f"<td>{_e(c)}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(summary: Mapping[str, Any], svgs: Mapping[str, str]) -> str:
    run = summary.get("run", {})
    sections = [*summary.get("workloads", {}).items(), ("total", summary.get("total", {}))]
    passed = summary.get("passed")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>loadtest {_e(run.get('name'))}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>loadtest {_e(run.get('name'))}</h1>",
             f"<p class='verdict {'vpass' if passed else 'vfail'}'>{_e(str(summary.get('status', '')).upper())}</p>"]

    info = [("run id", run.get("run_id")), ("started", run.get("started_at")),
            ("protocols", ", ".join(run.get("protocols") or [])),
            ("broker", f"{run.get('broker_version', '')} "
                       + " ".join(f"{k}={v}" for k, v in (run.get("broker_urls") or {}).items())),
            ("brokerctl", f"{run.get('brokerctl_version', '')} ({run.get('git_sha', '')})"),
            ("spark", f"{run.get('spark_version', '')} on {run.get('spark_master', '')}, {run.get('tasks', '')} tasks"),
            ("phases", f"warmup {run.get('warmup_s')} s, measure {run.get('duration_s')} s, "
                       f"interval {run.get('interval_s')} s"),
            ("scenario", f"sha256 {run.get('scenario_sha256', '')}, seed {run.get('seed', '')}")]
    parts.append(_table(["", ""], info, left=2))

    parts.append("<h2>Throughput (measure phase)</h2>")
    parts.append(_table(["workload", "load model", "target/s", "sent/s", "acked/s", "received/s", "measured s"],
                        [[name, s.get("model", "") if name != "total" else "",
                          fmt_rate(s.get("rates", {}).get("target")), fmt_rate(s.get("rates", {}).get("sent")),
                          fmt_rate(s.get("rates", {}).get("acked")), fmt_rate(s.get("rates", {}).get("received")),
                          s.get("measure_s")] for name, s in sections], left=2))

    parts.append("<h2>Latency (measure phase, merged histograms)</h2>")
    parts.append(_table(["workload", "metric", "count", "min", "mean", "p50", "p90", "p99", "p99.9", "p99.99", "max"],
                        [[name, metric, f"{e['count']:,}", *(fmt_us(e.get(k)) for k in
                          ("min", "mean", "p50", "p90", "p99", "p99_9", "p99_99", "max"))]
                         for name, s in sections for metric, e in s.get("latency", {}).items()], left=2))

    parts.append("<h2>Delivery accounting</h2>")
    keys = ("published", "received", "unique", "lost", "duplicates", "redeliveries", "reordered",
            "max_reorder_distance", "early", "unacked", "unconfirmed")
    parts.append(_table(["workload", *keys],
                        [[name, *(f"{s.get('accounting', {}).get(k, 0):,}" for k in keys)] for name, s in sections]))

    thresholds = summary.get("thresholds", [])
    parts.append("<h2>Thresholds</h2>")
    if thresholds:
        rows = []
        for t in thresholds:
            actual = fmt_us(t["actual"]) if t["unit"] == "us" and t["actual"] is not None else t["actual"]
            rows.append([t["expr"], actual, "PASS" if t["passed"] else "FAIL", t.get("note", "")])
        table = _table(["threshold", "actual", "", "note"], rows, left=1)
        table = table.replace("<td>PASS</td>", "<td class='pass'>PASS</td>").replace(
            "<td>FAIL</td>", "<td class='fail'>FAIL</td>")
        parts.append(table)
    else:
        parts.append("<p>none set</p>")

    parts.append("<h2>Flags and notes</h2>")
    flags = summary.get("flags", [])
    parts.append(f"<p>flags: {_e(', '.join(flags)) if flags else 'none'}; clamped values "
                 f"{summary.get('clamped', 0):,}; negative e2e {summary.get('negative_e2e', 0):,}</p>")
    notes = [*flag_notes(summary), *summary.get("notes", [])]
    if notes:
        parts.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    if summary.get("clock"):
        parts.append("<h2>Clock offsets between hosts (measured through the broker)</h2>")
        parts.append(_table(["publisher host", "subscriber host", "offset", "± bound", "drift ns/s", "probes"],
                            [[c.get("pub_host"), c.get("sub_host"), fmt_us(c.get("offset_ns", 0) / 1000),
                              fmt_us(c.get("bound_ns", 0) / 1000), f"{c.get('drift_ns_per_s', 0):+.0f}",
                              c.get("probes")] for c in summary["clock"]], left=2))

    parts.append("<h2>Load balance</h2>")
    imbalance = summary.get("total", {}).get("imbalance", {})
    parts.append(_table(["role", "tasks", "min/s", "avg/s", "max/s", "stddev/s"],
                        [[role, r["tasks"], fmt_rate(r["min"]), fmt_rate(r["avg"]), fmt_rate(r["max"]),
                          fmt_rate(r["stddev"])] for role, r in imbalance.get("roles", {}).items()]))
    parts.append(_table(["task", "workload", "role", "host", "target/s", "achieved/s", "achieved/target",
                         "CPU peak %", "start skew µs", "send lag p99", "generator bound", "reconnects", "errors"],
                        [[t["task"], t["workload"], t["role"], t["host"], fmt_rate(t["target_rate"]),
                          fmt_rate(t["achieved_rate"]), t["achieved_over_target"], f"{t['cpu_peak_pct']:.0f}",
                          t["start_skew_us"], fmt_us(t.get("send_lag_p99_us")) if t["role"] in _SENDING else "",
                          "yes" if t["generator_bound"] else "", t["reconnects"], "; ".join(t["errors"])]
                         for t in imbalance.get("tasks", [])], left=4))

    for name in CHARTS:
        if name in svgs:
            parts.append(f"<h2>{_e(name.capitalize())}</h2>{svgs[name]}")

    parts.append("<h2>Terminal summary</h2><pre>" + _e(render_text(summary)) + "</pre>")
    if run.get("scenario_text"):
        parts.append("<details><summary>Scenario</summary><pre>" + _e(run["scenario_text"]) + "</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)
