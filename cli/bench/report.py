"""A benchmark's results for people: a table on the terminal, a JSON file of everything, a PNG chart."""

from __future__ import annotations

import json
import os


def table(result: dict) -> str:
    lines = []
    width = max([20] + [len(row["target"]) for row in result["summary"]])
    header = (f"{'scenario':34} {'target':{width}} {'result':>28} {'loss':>8} {'cpu µs/msg':>10} {'gen µs/msg':>10} "
              f"{'vs nats':>8} {'vs redis':>8}  goal")
    lines.append(header)
    lines.append("-" * len(header) + "-" * 30)
    for row in result["summary"]:
        if row["kind"] == "connections":
            value = f"{row['seconds']:.2f} s, {row['rss_per_conn'] / 1024:.1f} KiB/conn"
            loss = ""
        elif row["kind"] == "latency":
            lat = row["latency_us"]
            value = f"p50 {lat['p50']:.0f} p99 {lat['p99']:.0f} max {lat['max']:.0f} µs"
            loss = f"{row['loss']:,}"
        else:
            value = f"{row['msgs_per_sec']:,.0f} msg/s"
            loss = f"{row['loss']:,}"
        if row.get("duplicates"):
            loss += f" +{row['duplicates']:,} dup"
        if row.get("hub_slow_consumers"):   # the leaf scenarios: the hub found the leaf's link too slow
            loss += f" {row['hub_slow_consumers']:,} slow"
        if row.get("links_cut"):
            loss += f" {row['links_cut']:,} cut"
        if row.get("refused"):   # pushes the server turned down (queue_full): the rate is not the push rate
            loss += f" {row['refused']:,} refused"
        ratio = lambda key: f"{row[key]:.2f}x" if row.get(key) is not None else ""  # noqa: E731
        goal = ""
        if "goal" in row:
            g = row["goal"]
            sign = "≤" if row["kind"] == "latency" else "≥"
            lossless = ", 0 lost" if g.get("lossless") else ""   # the leaf scenarios' goal: nothing lost as well
            goal = f"{sign}{g['target']}x {g['vs']}{lossless}: {'met' if g['met'] else 'MISSED'}"
        cpu, gen = (f"{row[key]:.2f}" if row.get(key) is not None else "" for key in ("cpu_us_per_msg",
                                                                                       "gen_cpu_us_per_msg"))
        lines.append(f"{row['title'][:34]:34} {row['target']:{width}} {value:>28} {loss:>8} {cpu:>10} {gen:>10} "
                     f"{ratio('vs_nats'):>8} {ratio('vs_redis'):>8}  {goal}")
    servers = ", ".join(f"{k} {v}" for k, v in result["servers"].items()) or "none started"
    m = result["machine"]
    lines.append("")
    lines.append(f"servers: {servers}; machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}; "
                 f"payload {result['options']['payload']} B, {result['options']['rounds']} round(s) of "
                 f"{result['options']['duration']} s, medians shown; cpu µs/msg: the server's CPU time (all its "
                 f"processes and threads) over a run, per message delivered; gen µs/msg: the load generators' the "
                 f"same way")
    setup = result.get("leaf")   # only with the leaf scenarios
    if setup:
        hub = setup["hub"]
        links = ", ".join(f"{name} {c or '?'}" for name, c in setup["compression"].items())
        theirs = ("the nats-server leaf the same binary, compression off on its link, as this broker has none; "
                  "vs nats: shardbroker/leaf over nats-server/leaf; " if setup.get("nats_leaf") else "")
        lines.append(f"leaf scenarios: hub nats-server {hub['version']} ({hub['binary']}); this broker with one leaf "
                     f"connection per worker ({setup['broker_links']}); {theirs}the hub's /leafz compression: {links}; "
                     f"cpu µs/msg: the leaf's")
    for name, why in result.get("skipped", {}).items():   # scenarios the machine cannot hold (cli/bench/scale.py)
        lines.append(f"skipped: {name}: {why}")
    writes = result.get("writes")   # older results have none
    if writes:
        lines.append("written to: " + ", ".join(f"{name} {w['dir']} ({w['filesystem'] or 'unknown'})"
                                                for name, w in writes.items()))
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)


def chart(result: dict, path: str) -> bool:
    """Throughput bars per scenario and server, latency percentiles per server.  False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["summary"]
    through = [r for r in rows if r["kind"] == "throughput"]
    latencies = [[r for r in rows if r["kind"] == "latency" and r["scenario"] == name]
                 for name in dict.fromkeys(r["scenario"] for r in rows if r["kind"] == "latency")]
    # a panel per connection scenario (``connections``, ``conn50k``), as for latency
    conns = [[r for r in rows if r["kind"] == "connections" and r["scenario"] == name]
             for name in dict.fromkeys(r["scenario"] for r in rows if r["kind"] == "connections")]
    panels = [p for p in (through, *latencies, *conns) if p]
    if not panels:   # every scenario skipped: a chart that says so, where the table's lines say why
        fig, ax = plt.subplots(figsize=(11, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "nothing ran: skipped " + ", ".join(result.get("skipped", {})), ha="center", va="center")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4 * len(panels)), squeeze=False)
    axes = [a[0] for a in axes]
    targets = sorted({r["target"] for r in rows})
    colors = {t: c for t, c in zip(targets, ["#2b6cb0", "#63b3ed", "#38a169", "#e53e3e", "#805ad5"])}
    ax_iter = iter(axes)
    if through:
        ax = next(ax_iter)
        titles = list(dict.fromkeys(r["title"] for r in through))
        _bars(ax, titles, targets, colors, {(r["title"], r["target"]): r["msgs_per_sec"] for r in through})
        ax.set_ylabel("messages / s (delivered; queues: pushed, acked)")
        ax.set_title("Throughput (higher is better)")
    for latency in latencies:
        ax = next(ax_iter)
        keys = ["p50", "p99", "p99.9"]
        _bars(ax, keys, targets, colors, {(k, r["target"]): r["latency_us"][k] for r in latency for k in keys})
        ax.set_ylabel("µs")
        ax.set_title(f"{latency[0]['title']}: latency percentiles (lower is better)")
    for conn in conns:
        ax = next(ax_iter)
        _bars(ax, ["seconds to connect and subscribe", "RSS per connection (KiB)"], targets, colors,
              {**{("seconds to connect and subscribe", r["target"]): r["seconds"] for r in conn},
               **{("RSS per connection (KiB)", r["target"]): r["rss_per_conn"] / 1024 for r in conn}})
        ax.set_title(conn[0]["title"])
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _bars(ax, groups: list[str], targets: list[str], colors: dict, values: dict) -> None:
    width = 0.8 / max(1, len(targets))
    for i, target in enumerate(targets):
        xs = [g + i * width for g in range(len(groups))]
        ys = [values.get((group, target), 0) for group in groups]
        ax.bar(xs, ys, width, label=target, color=colors.get(target))
    ax.set_xticks([g + width * (len(targets) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels(groups, rotation=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
