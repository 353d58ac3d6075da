"""``brokerctl``: start the broker, and talk to it from a shell."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

# Each command imports what it needs: `start` is on the broker's start-up path, and the client (asyncio), orjson
# and the password prompts are not.  (scripts/startup_time.py measures it; see docs/performance.md.)
from .connect import connect as _connect, connection_options as _connection_options, parse_data
from .queue_cmd import queue


def _count(value: str | None) -> Any:
    """'auto' or a number; anything else goes through as is, so the config check names the key."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """A multiprocess sharded pub/sub broker for one machine: Jolt NDJSON, NATS core and Bridge clients."""


@cli.command()
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="JSON config file.")
@click.option("-w", "--workers", help="Worker processes: a number or 'auto' (one per CPU).")
@click.option("--bind", help="Address of the NDJSON listener (network.bind).")
@click.option("-p", "--port", type=int, help="NDJSON port (network.port); 0 picks a free one.")
@click.option("--nats-port", type=int, help="NATS port (nats.port); 0 picks a free one.")
@click.option("--no-nats", is_flag=True, help="Do not listen for NATS clients.")
@click.option("--bridge-port", type=int, help="Bridge port (bridge.port); setting it enables the listener.")
@click.option("--qlite-port", type=int, help="qlite port (qlite.port); setting it enables the listener.")
@click.option("--monitor-port", type=int, help="Monitoring HTTP port (monitoring.port); 0 picks a free one.")
@click.option("--no-monitoring", is_flag=True, help="Do not serve the monitoring endpoints.")
@click.option("--grace", type=float, help="Seconds a graceful stop may take (shutdown.grace_period).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="logging.level")
@click.option("--event-loop", type=click.Choice(["auto", "uvloop", "asyncio"]), help="workers.event_loop")
def start(config_path: str | None, workers: str | None, bind: str | None, port: int | None,
          nats_port: int | None, no_nats: bool, bridge_port: int | None, qlite_port: int | None,
          monitor_port: int | None,
          no_monitoring: bool, grace: float | None, log_level: str | None, event_loop: str | None) -> None:
    """Start the supervisor and its workers; Ctrl-C or SIGTERM stops them cleanly."""
    from cluster.config import ConfigError, load
    from cluster.supervisor import Supervisor

    overrides = {
        "workers.count": _count(workers),
        "network.bind": bind,
        "network.port": port,
        "nats.port": nats_port,
        "nats.enabled": False if no_nats else None,
        "bridge.port": bridge_port,
        "bridge.enabled": True if bridge_port is not None else None,
        "qlite.port": qlite_port,
        "qlite.enabled": True if qlite_port is not None else None,
        "monitoring.port": monitor_port,
        "monitoring.enabled": False if no_monitoring else None,
        "shutdown.grace_period": grace,
        "logging.level": log_level,
        "workers.event_loop": event_loop,
    }
    try:
        config = load(config_path, overrides)
    except ConfigError as exc:
        click.echo(f"brokerctl: configuration error: {exc}", err=True)
        sys.exit(2)
    sys.exit(Supervisor(config).run())


@cli.command()
@_connection_options
@click.option("--json", "as_json", is_flag=True, help="DATA is JSON (default: a string).")
@click.argument("topic")
@click.argument("data")
def pub(host: str, port: int, user: str | None, as_json: bool, topic: str, data: str) -> None:
    """Publish DATA to TOPIC."""
    from .client import BrokerError

    value = parse_data(data, as_json)
    with _connect(host, port, user) as client:
        try:
            client.pub(topic, value)
        except BrokerError as exc:
            raise click.ClickException(f"broker refused: {exc.reason}") from None


@cli.command()
@_connection_options
@click.option("-n", "--count", type=int, help="Exit after this many messages.")
@click.option("--data-only", is_flag=True, help="Print only each message's data.")
@click.argument("topics", nargs=-1, required=True)
def sub(host: str, port: int, user: str | None, count: int | None, data_only: bool, topics: tuple[str, ...]) -> None:
    """Subscribe to TOPICS and print each delivery as a JSON line until Ctrl-C."""
    import orjson

    from .client import BrokerError

    with _connect(host, port, user) as client:
        try:
            for topic in topics:
                client.sub(topic)
        except BrokerError as exc:
            raise click.ClickException(f"broker refused {topic!r}: {exc.reason}") from None
        seen = 0
        try:
            for msg in client.messages():
                out = msg.data if data_only else {"topic": msg.topic, "data": msg.data, **msg.extra}
                sys.stdout.write(orjson.dumps(out).decode() + "\n")
                sys.stdout.flush()
                seen += 1
                if count is not None and seen >= count:
                    return
        except KeyboardInterrupt:
            return
        raise click.ClickException("the broker closed the connection")


@cli.command("hash-password")
@click.option("--iterations", type=click.IntRange(1000, 10_000_000), default=600_000, show_default=True,
              help="PBKDF2 iterations.")
def hash_password(iterations: int) -> None:
    """Print a password_hash for the configuration file.

    The password is prompted for (twice) on a terminal, or read from the first line of standard input.
    """
    from cluster.passwords import hash_password as make_hash

    from . import secrets

    click.echo(make_hash(secrets.new_password("password"), iterations))


@cli.group()
@click.option("--host", default="127.0.0.1", show_default=True, help="Broker address.")
@click.option("-p", "--port", default=8080, show_default=True, help="Broker NDJSON port.")
@click.option("--admin", "admin_user", envvar="BROKER_ADMIN_USER", default="admin", show_default=True,
              help="Administrator to authenticate as ($BROKER_ADMIN_USER).")
@click.pass_context
def user(ctx: click.Context, host: str, port: int, admin_user: str) -> None:
    """Manage users through the admin protocol.

    The administrator's password comes from $BROKER_ADMIN_PASSWORD or a prompt; a new user's password from a
    prompt or, when standard input is not a terminal, its first line.
    """
    ctx.obj = (host, port, admin_user)


def _admin_call(ctx: click.Context, op: str, **fields):
    from .client import BrokerError

    host, port, admin_user = ctx.obj
    with _connect(host, port, admin_user, password_env="BROKER_ADMIN_PASSWORD") as client:
        try:
            return client.request(op, **fields)
        except BrokerError as exc:
            raise click.ClickException(f"{op}: {exc.reason}") from None


def _permissions_of(ctx: click.Context, name: str) -> list[str]:
    for entry in _admin_call(ctx, "admin.list_users")["users"]:
        if entry["user"] == name:
            return entry["permissions"]
    raise click.ClickException(f"no such user: {name}")


@user.command("add")
@click.argument("name")
@click.argument("permissions", nargs=-1)
@click.pass_context
def user_add(ctx: click.Context, name: str, permissions: tuple[str, ...]) -> None:
    """Create user NAME with PERMISSIONS (publish:<topic>, subscribe:<topic>, admin)."""
    from . import secrets

    password = secrets.new_password(f"password for {name}")
    _admin_call(ctx, "admin.create_user", user=name, permissions=list(permissions), **{"pass": password})


@user.command("delete")
@click.argument("name")
@click.pass_context
def user_delete(ctx: click.Context, name: str) -> None:
    """Delete user NAME (its connections are closed)."""
    _admin_call(ctx, "admin.delete_user", user=name)


@user.command("passwd")
@click.argument("name")
@click.pass_context
def user_passwd(ctx: click.Context, name: str) -> None:
    """Set a new password for NAME (its connections stay open)."""
    from . import secrets

    password = secrets.new_password(f"new password for {name}")
    _admin_call(ctx, "admin.set_password", user=name, **{"pass": password})


@user.command("grant")
@click.argument("name")
@click.argument("permissions", nargs=-1, required=True)
@click.pass_context
def user_grant(ctx: click.Context, name: str, permissions: tuple[str, ...]) -> None:
    """Add PERMISSIONS to NAME."""
    current = _permissions_of(ctx, name)
    _admin_call(ctx, "admin.set_permissions", user=name,
                permissions=current + [p for p in permissions if p not in current])


@user.command("revoke")
@click.argument("name")
@click.argument("permissions", nargs=-1, required=True)
@click.pass_context
def user_revoke(ctx: click.Context, name: str, permissions: tuple[str, ...]) -> None:
    """Remove PERMISSIONS from NAME."""
    current = _permissions_of(ctx, name)
    missing = [p for p in permissions if p not in current]
    if missing:
        raise click.ClickException(f"{name} does not have {', '.join(missing)}")
    _admin_call(ctx, "admin.set_permissions", user=name, permissions=[p for p in current if p not in permissions])


@user.command("list")
@click.pass_context
def user_list(ctx: click.Context) -> None:
    """List users and their permissions."""
    for entry in _admin_call(ctx, "admin.list_users")["users"]:
        click.echo(f"{entry['user']}\t{' '.join(entry['permissions'])}")


@cli.command()
@click.option("-s", "--scenarios", default="fanout1,fanout10,fanout100,nn,wide,latency,connections",
              show_default=True, help="Comma-separated: fanout1 fanout10 fanout100 nn wide latency connections; "
                                      "work queues: qpush qwork1 qwork8 qdrain1 qdrain8 qlatency.")
@click.option("--peers", default="nats,redis", show_default=True,
              help="Servers to compare with, started on free loopback ports if installed: nats, redis (or none).")
@click.option("--protocols", default="nats,ndjson", show_default=True, help="This broker's protocols to measure.")
@click.option("--payload", type=click.IntRange(32, 1 << 20), default=128, show_default=True, help="Bytes per message.")
@click.option("--duration", type=click.FloatRange(0.1, 600), default=3.0, show_default=True,
              help="Seconds of publishing per run.")
@click.option("--rounds", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Runs per scenario and server, alternating servers; medians are reported.")
@click.option("--workers", type=int, help="Broker workers (default: one per CPU).")
@click.option("--procs", type=click.IntRange(1, 64), default=2, show_default=True, help="Load-generator processes.")
@click.option("--nn", type=click.IntRange(1, 1000), default=8, show_default=True, help="N for the N→N scenario.")
@click.option("--wide", type=click.IntRange(1, 100_000), default=5000, show_default=True,
              help="Subscribers in the wide fan-out.")
@click.option("--rate", type=click.FloatRange(1, 1e7), default=20000, show_default=True,
              help="Messages per second in the latency scenario.")
@click.option("--connections", type=click.IntRange(1, 1_000_000), default=10000, show_default=True,
              help="Connections in the connection-scale scenario.")
@click.option("--out", default="bench-results", show_default=True, help="Directory for the JSON and PNG files.")
@click.option("--generator-check", is_flag=True,
              help="Only measure the load generator, against a server that discards or streams.")
def bench(scenarios: str, peers: str, protocols: str, payload: int, duration: float, rounds: int,
          workers: int | None, procs: int, nn: int, wide: int, rate: float, connections: int, out: str,
          generator_check: bool) -> None:
    """Measure this broker against nats-server and Redis, side by side, in one run."""
    import time

    from .bench import report
    from .bench.scenarios import Bench, Options, scenarios as catalog

    names = [s for s in scenarios.split(",") if s]
    unknown = [s for s in names if s not in catalog(nn, wide, rate, connections)]
    if unknown:
        raise click.BadParameter(f"unknown scenario(s): {', '.join(unknown)}", param_hint="--scenarios")
    peer_list = [p for p in peers.split(",") if p and p != "none"]
    bad = [p for p in peer_list if p not in ("nats", "redis")]
    if bad:
        raise click.BadParameter(f"unknown peer(s): {', '.join(bad)}", param_hint="--peers")
    opts = Options(scenarios=names, peers=peer_list, protocols=[p for p in protocols.split(",") if p],
                   payload=payload, duration=duration, rounds=rounds, workers=workers, procs=procs, nn=nn,
                   wide=wide, rate=rate, connections=connections)
    runner = Bench(opts, log=lambda msg: click.echo(msg, err=True))
    if generator_check:
        for row in runner.generator_check():
            click.echo(f"{row['wire']:8} {row['role']:10} {row['msgs_per_sec']:>14,} msg/s per generator process")
        return
    result = runner.run()
    click.echo(report.table(result))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = os.path.join(out, f"bench-{stamp}.json")
    report.write_json(result, json_path)
    click.echo(f"\nresults: {json_path}")
    png_path = os.path.join(out, f"bench-{stamp}.png")
    if report.chart(result, png_path):
        click.echo(f"chart:   {png_path}")
    else:
        click.echo("chart:   skipped (pip install matplotlib)")


cli.add_command(queue)


def main() -> None:
    cli(prog_name="brokerctl")


if __name__ == "__main__":
    main()
