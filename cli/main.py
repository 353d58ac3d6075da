"""``brokerctl``: start the broker, and talk to it from a shell."""

from __future__ import annotations

import sys
from typing import Any

import click
import orjson

from .client import BlockingClient, BrokerError


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
    """A multiprocess sharded pub/sub broker: Jolt NDJSON on one machine, many cores."""


@cli.command()
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="JSON config file.")
@click.option("-w", "--workers", help="Worker processes: a number or 'auto' (one per CPU).")
@click.option("--bind", help="Address of the NDJSON listener (network.bind).")
@click.option("-p", "--port", type=int, help="NDJSON port (network.port); 0 picks a free one.")
@click.option("--monitor-port", type=int, help="Monitoring HTTP port (monitoring.port); 0 picks a free one.")
@click.option("--no-monitoring", is_flag=True, help="Do not serve the monitoring endpoints.")
@click.option("--grace", type=float, help="Seconds a graceful stop may take (shutdown.grace_period).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="logging.level")
@click.option("--event-loop", type=click.Choice(["auto", "uvloop", "asyncio"]), help="workers.event_loop")
def start(config_path: str | None, workers: str | None, bind: str | None, port: int | None,
          monitor_port: int | None, no_monitoring: bool, grace: float | None, log_level: str | None,
          event_loop: str | None) -> None:
    """Start the supervisor and its workers; Ctrl-C or SIGTERM stops them cleanly."""
    from cluster.config import ConfigError, load
    from cluster.supervisor import Supervisor

    overrides = {
        "workers.count": _count(workers),
        "network.bind": bind,
        "network.port": port,
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


def _connection_options(fn):
    fn = click.option("--host", default="127.0.0.1", show_default=True, help="Broker address.")(fn)
    fn = click.option("-p", "--port", default=8080, show_default=True, help="Broker NDJSON port.")(fn)
    return fn


def _connect(host: str, port: int) -> BlockingClient:
    try:
        return BlockingClient.connect(host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None


@cli.command()
@_connection_options
@click.option("--json", "as_json", is_flag=True, help="DATA is JSON (default: a string).")
@click.argument("topic")
@click.argument("data")
def pub(host: str, port: int, as_json: bool, topic: str, data: str) -> None:
    """Publish DATA to TOPIC."""
    if as_json:
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="DATA") from None
    else:
        value = data
    with _connect(host, port) as client:
        try:
            client.pub(topic, value)
        except BrokerError as exc:
            raise click.ClickException(f"broker refused: {exc.reason}") from None


@cli.command()
@_connection_options
@click.option("-n", "--count", type=int, help="Exit after this many messages.")
@click.option("--data-only", is_flag=True, help="Print only each message's data.")
@click.argument("topics", nargs=-1, required=True)
def sub(host: str, port: int, count: int | None, data_only: bool, topics: tuple[str, ...]) -> None:
    """Subscribe to TOPICS and print each delivery as a JSON line until Ctrl-C."""
    with _connect(host, port) as client:
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


def main() -> None:
    cli(prog_name="brokerctl")


if __name__ == "__main__":
    main()
