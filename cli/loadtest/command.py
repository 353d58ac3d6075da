"""``brokerctl loadtest``: run a scenario from Spark executors, or compare results.

Exit codes: 0 every threshold held; 1 a threshold failed; 2 the scenario or the options are wrong; 3 the run could
not happen (Spark, Java, the broker unreachable, a task failed).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import os
import sys

import click

DEFAULT_SCENARIO = """\
# The embedded default: a short mixed run against a broker started for it.
name = "default"
warmup = "1s"
duration = "5s"
drain_timeout = "5s"

[[workload]]
name = "fanout"            # NDJSON pub/sub: 2 publishers, 2 subscriptions each getting both
protocol = "ndjson"
producers_per_topic = 2
subscriptions_per_topic = 2
rate = 4000

[[workload]]
name = "nats"              # NATS: 1 publisher, 2 subscriptions
protocol = "nats"
subscriptions_per_topic = 2
rate = 4000

[[workload]]
name = "jobs"              # a work queue: 1 producer, 2 competing consumers
protocol = "queue"
consumers_per_subscription = 2
rate = 1000

[thresholds]
lost = "== 0"
duplicates = "== 0"
reordered = "== 0"
"""

SCHEMES = {"ndjson": "ndjson", "tcp": "ndjson", "jolt": "ndjson", "nats": "nats", "redis": "redis"}


class _DefaultRun(click.Group):
    """``brokerctl loadtest [SCENARIO]`` runs; ``brokerctl loadtest compare A B`` compares."""

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group("loadtest", cls=_DefaultRun, context_settings={"help_option_names": ["-h", "--help"]})
def loadtest() -> None:
    """Load tests driven from Spark executors: exact loss/duplicate/order accounting and latency measured from
    when each message should have been sent.  See docs/loadtest.md.

    \b
    brokerctl loadtest                       the embedded default: a local broker, Spark local[*], a short mix
    brokerctl loadtest SCENARIO.toml [--master spark://HOST:7077] [--broker nats://HOST:4222 ...]
    brokerctl loadtest compare RESULTS_A RESULTS_B ...
    """


def parse_broker(values: tuple[str, ...]) -> dict[str, str]:
    endpoints = {}
    for v in values:
        scheme, sep, rest = v.partition("://")
        if not sep or scheme not in SCHEMES or not rest:
            raise click.BadParameter(f"{v!r}: expected ndjson://HOST:PORT, nats://HOST:PORT or redis://HOST:PORT",
                                     param_hint="--broker")
        endpoints[SCHEMES[scheme]] = rest.rstrip("/")
    return endpoints


@contextlib.contextmanager
def _started(kind: str | None, workers: int, needed: list[str]):
    """A server started for the run (the embedded default), stopped afterwards; yields (endpoints, monitor, version)."""
    if kind is None:
        yield {}, None, ""
        return
    from shardbroker.cli.bench import servers

    start = {"shardbroker": lambda: servers.start_broker(workers), "nats-server": servers.start_nats,
             "redis": servers.start_redis}[kind]
    server = start()
    if server is None:
        raise click.ClickException(f"{kind} is not installed (see docs/loadtest.md)")
    try:
        endpoints = {k: f"127.0.0.1:{p}" for k, p in server.ports.items() if k in ("ndjson", "nats", "redis")}
        missing = [n for n in needed if n not in endpoints]
        if missing:
            raise click.ClickException(f"{kind} does not speak {', '.join(missing)}, which the scenario needs")
        monitor = f"http://127.0.0.1:{server.monitor_port}" if getattr(server, "monitor_port", None) else None
        yield endpoints, monitor, f"{server.name} {server.version}"
    finally:
        server.stop()


@loadtest.command("run")
@click.argument("scenario_path", metavar="[SCENARIO]", required=False, type=click.Path(dir_okay=False))
@click.option("--master", help="Spark master URL (default: spark-submit's, else local[T] with T = the plan's tasks).")
@click.option("--broker", "brokers", multiple=True, metavar="URL",
              help="A broker endpoint: ndjson://HOST:PORT, nats://HOST:PORT, redis://HOST:PORT (repeatable); "
                   "overrides the scenario's [broker] table.")
@click.option("--start", "start_kind", type=click.Choice(["shardbroker", "nats-server", "redis"]),
              help="Start this server on loopback for the run (default: shardbroker when no endpoint is given).")
@click.option("--workers", type=int, default=2, show_default=True, help="Workers of a started shardbroker.")
@click.option("--monitor", help="The broker's monitoring URL, to record /varz before and after.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Results directory.")
@click.option("--tables", "tables_uri", metavar="URI",
              help="Where the executors write the Parquet tables (a cluster: hdfs://..., s3a://...); "
                   "default: OUT/tables.")
@click.option("--no-progress", is_flag=True, help="No live progress line.")
def run_cmd(scenario_path, master, brokers, start_kind, workers, monitor, out_dir, tables_uri, no_progress) -> None:
    """Run SCENARIO (a TOML file; the embedded default without one) and write its results."""
    from shardbroker.cli.loadtest import scenario as scenario_mod
    from shardbroker.cli.loadtest.scenario import ScenarioError

    try:
        sc = scenario_mod.load(scenario_path) if scenario_path else scenario_mod.loads(DEFAULT_SCENARIO, "default")
    except ScenarioError as exc:
        raise click.UsageError(str(exc)) from None
    endpoints = dict(sc.endpoints)
    endpoints.update(parse_broker(brokers))
    if start_kind is None and not endpoints:
        start_kind = "shardbroker"
    ts = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = out_dir or sc.output.format(name=sc.name, ts=ts)
    missing = [m for m in ("pyspark", "hdrh") if importlib.util.find_spec(m) is None]
    if missing:
        click.echo(f"error: brokerctl loadtest needs its extra ({missing[0]} is missing): "
                   f"{sys.executable} -m pip install 'shardbroker[loadtest]' (make test installs it)", err=True)
        sys.exit(3)
    from shardbroker.cli.loadtest.job import Interrupted, LoadTestError, run
    from shardbroker.cli.loadtest.summary import render_text

    try:
        with _started(start_kind, workers, sc.endpoints_needed()) as (started, started_monitor, version):
            endpoints.update(started)
            summary = run(sc, endpoints, out, master=master, progress=not no_progress,
                          monitor=monitor or started_monitor, broker_version=version, tables_uri=tables_uri)
    except Interrupted as exc:   # Ctrl-C: one line, as promised, and the shell's code for it
        click.echo(str(exc), err=True)
        sys.exit(130)
    except LoadTestError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(3)
    except KeyboardInterrupt:   # before or after the Spark job (starting, writing): nothing half-done is kept
        click.echo("interrupted: no results were written", err=True)
        sys.exit(130)
    click.echo(render_text(summary))
    click.echo(f"results: {os.path.abspath(out)}  (report: {os.path.join(out, 'report.html')})")
    sys.exit(0 if summary.get("passed") else 1)


@loadtest.command("compare")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Where compare.html goes.")
def compare_cmd(dirs, out_dir) -> None:
    """Overlay runs (throughput over time, percentile spectra) and print them side by side."""
    from shardbroker.cli.loadtest.compare import compare

    try:
        click.echo(compare(list(dirs), out_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise click.ClickException(str(exc)) from None


def main() -> None:
    loadtest(prog_name="brokerctl loadtest")
