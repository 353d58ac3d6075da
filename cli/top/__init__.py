"""``brokerctl top``: a live console of a running broker, read from its monitoring endpoints (docs/operations.md).

This module is imported by every ``brokerctl`` command (cli/main.py registers it), so it imports click alone: the
HTTP client (cli/top/endpoint.py), the computations (cli/top/model.py, cli/top/views.py) and the output
(cli/top/formatting.py) load when ``top`` runs, and textual (cli/top/app.py) only for the console, never for
``--once``.
"""

from __future__ import annotations

import sys
import time

import click

VIEW_NAMES = ("workers", "subjects", "queues", "connections", "leafs")


@click.command()
@click.option("-m", "--monitor", metavar="URL",
              help="The monitoring endpoint: http://HOST:PORT, HOST:PORT or PORT (default http://127.0.0.1:8222).")
@click.option("--host", metavar="HOST", help="The monitoring host (the port stays that of --monitor).")
@click.option("-d", "--interval", type=click.FloatRange(0), default=1.0, show_default=True,
              help="Seconds between refreshes (with --once: between the two snapshots rates come from; "
                   "0 takes one snapshot, without rates).")
@click.option("-n", "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True,
              help="Rows of subjects and connections.")
@click.option("--view", type=click.Choice(VIEW_NAMES), default="workers", show_default=True,
              help="The view to open (with --format csv: the table printed).")
@click.option("-s", "--sort", "sort_key", metavar="KEY",
              help="Sort the view by this column (a CSV header name: msgs_in_rate, cpu, msgs_to, ...).")
@click.option("--once", is_flag=True, help="Print one snapshot and exit, for scripts (no console).")
@click.option("-o", "--format", "fmt", type=click.Choice(["json", "csv"]),
              help="--once's output (default json: every view; csv: the --view table). Implies --once.")
def top(monitor: str | None, host: str | None, interval: float, limit: int, view: str, sort_key: str | None,
        once: bool, fmt: str | None) -> None:
    """A live console of the broker: workers, busiest subjects and queues, connections, leaf links to NATS hubs.

    Keys: w/t/u/c/l (or 1-5) views, o/O sort by the next/previous column, r reverse, Enter on a subject its
    subscribers, Esc back, / filter, b raw numbers, p pause, +/- interval, ? help, q quit.
    """
    from shardbroker.cli.top import endpoint, formatting, model, views

    try:
        url = endpoint.monitor_url(monitor, host)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--monitor") from None
    chosen = views.VIEWS[view]
    if sort_key is not None and sort_key not in chosen.sort_keys():
        raise click.BadParameter(f"{sort_key!r} is not a column of the {view} view: "
                                 f"{', '.join(chosen.sort_keys())}", param_hint="--sort")
    sort = sort_key or chosen.default_sort
    once = once or fmt is not None
    if not once and interval < 0.1:
        raise click.BadParameter("at least 0.1 s for the console", param_hint="--interval")
    if not once and not sys.stdout.isatty():
        raise click.UsageError("stdout is not a terminal: use --once --format json|csv for scripts")

    poller = model.Poller(endpoint.Client(url), interval=interval or 1.0, limit=limit)
    want = VIEW_NAMES if once and fmt != "csv" else (view,)
    sorts = {view: sort}
    try:
        first = poller.poll(want, conn_sort=sorts.get("connections", "cid"))
        if not once:
            try:
                from shardbroker.cli.top.app import TopApp  # textual: paid for by the console only
            except ImportError as exc:
                raise click.ClickException(f"the console needs textual ({exc}): pip install 'shardbroker[top]'; "
                                           "--once works without it") from None
            TopApp(poller, view=view, sort=sort, first=first).run()
            return
        snap = first
        if interval > 0:
            time.sleep(interval)
            snap = poller.poll(want, conn_sort=sorts.get("connections", "cid"))
    except endpoint.Unreachable as exc:
        hint = "" if "?" in str(exc) else " (is the broker running, with monitoring on? see --monitor)"
        raise click.ClickException(f"{exc}{hint}") from None
    except endpoint.BadRequest as exc:
        raise click.ClickException(f"{url}: {exc}") from None
    if fmt == "csv":
        click.echo(formatting.snapshot_csv(snap, chosen, sort, limit), nl=False)
    else:
        sys.stdout.buffer.write(formatting.snapshot_json(snap, sorts, limit))
