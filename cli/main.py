"""``brokerctl``: start the broker, and talk to it from a shell."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

# Each command imports what it needs: `start` is on the broker's start-up path, and the client (asyncio), orjson
# and the password prompts are not.  (scripts/measure/startup_time.py measures it; see docs/performance-notes.md.)
from shardbroker.cli.connect import admin_connection_options, given, parse_data, shared_option
from shardbroker.cli.connect import connect as _connect
from shardbroker.cli.connect import connection_options as _connection_options
from shardbroker.cli.loadtest.command import loadtest
from shardbroker.cli.queue_cmd import queue
from shardbroker.cli.top import top  # click only: textual is imported when `top` runs its console


def _count(value: str | None) -> Any:
    """'auto' or a number; anything else goes through as is, so the config check names the key."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        return value


def _version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from shardbroker.cluster import VERSION  # looked up only when asked: it costs the start-up path ~15 ms

    click.echo(f"brokerctl (shardbroker) {VERSION}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-V", "--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Print the version and exit.")
def cli() -> None:
    """A multiprocess sharded pub/sub broker for one machine: Jolt NDJSON, NATS core and Bridge clients.

    The client commands (pub, sub, user, queue) reach the broker named by --host/-p, else by $BROKER_URL
    ([ndjson://]HOST[:PORT]), else 127.0.0.1:8080.
    """


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
    from shardbroker.cluster.config import ConfigError, load
    from shardbroker.cluster.supervisor.core import Supervisor

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
        import errno

        from shardbroker.cluster.supervisor.systemd import Notifier

        Notifier(os.environ.get("NOTIFY_SOCKET")).send(STATUS=f"configuration error: {exc}", ERRNO=errno.EINVAL)
        sys.exit(2)
    from shardbroker.cli.stops import STOPS

    sys.exit(Supervisor(config, early_stops=STOPS).run())


# -- the running broker's supervisor, through its command socket (cluster/supervisor/command_socket.py)
# --------------------

def _supervisor_options(fn):
    fn = click.option("--timeout", type=click.FloatRange(0.1, 3600), default=60.0, show_default=True,
                      help="Seconds to wait for the answer.")(fn)
    fn = click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
                      help="The broker's configuration file: its runtime.dir is where to look.")(fn)
    fn = click.option("--runtime-dir", type=click.Path(file_okay=False),
                      help="Where the broker's runtime directory is (default: $XDG_RUNTIME_DIR, else the temp "
                           "directory).")(fn)
    return click.option("--pid", type=int, help="The supervisor's pid ($MAINPID in a unit), if several brokers "
                                                "run there.")(fn)


def _ask_supervisor(request: dict, pid: int | None, runtime_dir: str | None, config_path: str | None,
                    timeout: float) -> dict:
    from shardbroker.cluster import runtime
    from shardbroker.cluster.supervisor import command_socket

    parent = runtime_dir
    if parent is None and config_path is not None:
        from shardbroker.cluster.config import ConfigError, load

        try:
            parent = load(config_path, check_paths=False).runtime.dir
        except ConfigError as exc:
            raise click.ClickException(f"configuration error: {exc}") from None
    try:
        owner, path = command_socket.find(parent or runtime.default_parent(), pid)
        answer = command_socket.request(path, request, timeout)
    except command_socket.NotFound as exc:
        raise click.ClickException(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot reach the broker: {exc}") from None
    answer.setdefault("pid", owner)
    return answer


@cli.command()
@_supervisor_options
def reload(pid: int | None, runtime_dir: str | None, config_path: str | None, timeout: float) -> None:
    """Reload the running broker's configuration file, as SIGHUP does, and say what happened.

    All or nothing: if only keys that can change at run time changed (users, limits, logging.level, shutdown.*,
    tls), they are applied on every worker, and the TLS certificates and keys are read again; if any other key
    changed, or a TLS file no longer loads, nothing is applied, the keys are named, and the exit code is 1.  The
    answer comes once the reload is over (a unit's ExecReload=).
    """
    from shardbroker.cluster.supervisor.reload import Outcome

    answer = _ask_supervisor({"cmd": "reload"}, pid, runtime_dir, config_path, timeout)
    outcome = Outcome(**{k: answer[k] for k in ("ok", "error", "changed", "restart", "digest", "loaded", "tls")
                         if k in answer})
    if not outcome.ok:
        raise click.ClickException(outcome.summary())
    click.echo(outcome.summary())


@cli.command()
@_supervisor_options
@click.option("--wait", is_flag=True, help="Return only once the broker has exited.")
def lameduck(pid: int | None, runtime_dir: str | None, config_path: str | None, timeout: float,
             wait: bool) -> None:
    """Take the running broker out of service gradually, as SIGUSR2 does (lame duck mode).

    It stops accepting, tells NATS clients (INFO ldm), then closes its clients spread over
    shutdown.lame_duck_duration (the first after shutdown.lame_duck_grace_period), and exits once they are gone.
    """
    import time

    answer = _ask_supervisor({"cmd": "lameduck"}, pid, runtime_dir, config_path, timeout)
    if not answer.get("ok"):
        raise click.ClickException(answer.get("error") or "refused")
    click.echo(f"lame duck mode: {answer['clients']} client(s) to close within {answer['duration']:g}s (the first "
               f"after {answer['grace']:g}s); pid {answer['pid']} exits then")
    if not wait:
        return
    import psutil

    deadline = time.monotonic() + answer["duration"] + timeout
    try:
        proc = psutil.Process(answer["pid"])
        while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:   # is_running: not a reused pid
            if time.monotonic() > deadline:
                raise click.ClickException(f"pid {answer['pid']} still runs")
            time.sleep(0.1)
    except psutil.NoSuchProcess:
        pass
    click.echo(f"pid {answer['pid']} exited")


@cli.command()
@_connection_options
@click.option("--json", "as_json", is_flag=True, help="DATA is JSON (default: a string).")
@click.argument("topic")
@click.argument("data")
def pub(as_json: bool, topic: str, data: str) -> None:
    """Publish DATA to TOPIC."""
    from shardbroker.cli.client import BrokerError

    value = parse_data(data, as_json)
    with _connect() as client:
        try:
            client.pub(topic, value)
        except BrokerError as exc:
            raise click.ClickException(f"broker refused: {exc.reason}") from None


@cli.command()
@_connection_options
@click.option("-n", "--count", type=click.IntRange(min=1), help="Exit after this many messages (1 or more).")
@click.option("--data-only", is_flag=True, help="Print only each message's data.")
@click.argument("topics", nargs=-1, required=True)
def sub(count: int | None, data_only: bool, topics: tuple[str, ...]) -> None:
    """Subscribe to TOPICS and print each delivery as a JSON line until Ctrl-C."""
    import orjson

    from shardbroker.cli.client import BrokerError

    with _connect() as client:
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
    from shardbroker.cli import secrets
    from shardbroker.cluster.config.passwords import hash_password as make_hash

    click.echo(make_hash(secrets.new_password("password"), iterations))


_QUIET = shared_option("-q", "--quiet", is_flag=True, default=None, help="Do not say what changed.")


def _user_command(name: str):
    """A ``brokerctl user`` command: it takes the connection options and --quiet too, after its name."""
    def decorate(fn):
        return user.command(name)(admin_connection_options(_QUIET(fn)))
    return decorate


@cli.group()
@admin_connection_options
@_QUIET
def user() -> None:
    """Manage users through the admin protocol.

    The administrator's password comes from $BROKER_ADMIN_PASSWORD or a prompt; a new user's password from a
    prompt or, when standard input is not a terminal, its first line.  Each change is said in one line on
    standard output (-q: nothing).
    """


def _admin_call(op: str, **fields):
    from shardbroker.cli.client import BrokerError

    with _connect(as_admin=True) as client:
        try:
            return client.request(op, **fields)
        except BrokerError as exc:
            raise click.ClickException(f"{op}: {exc.reason}") from None


def _changed(line: str) -> None:
    if not given("quiet"):
        click.echo(line)


def _permissions_of(name: str) -> list[str]:
    for entry in _admin_call("admin.list_users")["users"]:
        if entry["user"] == name:
            return entry["permissions"]
    raise click.ClickException(f"no such user: {name}")


def _listed(permissions: list[str]) -> str:
    return " ".join(sorted(permissions)) or "no permissions"


@_user_command("add")
@click.argument("name")
@click.argument("permissions", nargs=-1)
def user_add(name: str, permissions: tuple[str, ...]) -> None:
    """Create user NAME with PERMISSIONS (publish:<topic>, subscribe:<topic>, admin)."""
    from shardbroker.cli import secrets

    password = secrets.new_password(f"password for {name}")
    _admin_call("admin.create_user", user=name, permissions=list(permissions), **{"pass": password})
    _changed(f"created user {name}: {_listed(list(set(permissions)))}")


@_user_command("delete")
@click.argument("name")
def user_delete(name: str) -> None:
    """Delete user NAME (its connections are closed)."""
    _admin_call("admin.delete_user", user=name)
    _changed(f"deleted user {name}")


@_user_command("passwd")
@click.argument("name")
def user_passwd(name: str) -> None:
    """Set a new password for NAME (its connections stay open)."""
    from shardbroker.cli import secrets

    password = secrets.new_password(f"new password for {name}")
    _admin_call("admin.set_password", user=name, **{"pass": password})
    _changed(f"changed the password of {name}")


@_user_command("grant")
@click.argument("name")
@click.argument("permissions", nargs=-1, required=True)
def user_grant(name: str, permissions: tuple[str, ...]) -> None:
    """Add PERMISSIONS to NAME."""
    current = _permissions_of(name)
    new = [p for p in dict.fromkeys(permissions) if p not in current]
    if not new:
        _changed(f"{name} has {' '.join(permissions)} already: nothing changed")
        return
    _admin_call("admin.set_permissions", user=name, permissions=current + new)
    _changed(f"granted {' '.join(new)} to {name}: {_listed(current + new)}")


@_user_command("revoke")
@click.argument("name")
@click.argument("permissions", nargs=-1, required=True)
def user_revoke(name: str, permissions: tuple[str, ...]) -> None:
    """Remove PERMISSIONS from NAME."""
    current = _permissions_of(name)
    missing = [p for p in permissions if p not in current]
    if missing:
        raise click.ClickException(f"{name} does not have {', '.join(missing)}")
    left = [p for p in current if p not in permissions]
    _admin_call("admin.set_permissions", user=name, permissions=left)
    _changed(f"revoked {' '.join(dict.fromkeys(permissions))} from {name}: {_listed(left)}")


@_user_command("list")
def user_list() -> None:
    """List users and their permissions (one line each: the name, a tab, the permissions)."""
    for entry in _admin_call("admin.list_users")["users"]:
        click.echo(f"{entry['user']}\t{' '.join(entry['permissions'])}")


@cli.command()
@click.option("-s", "--scenarios", default="fanout1,fanout10,fanout100,nn,wide,latency,connections",
              show_default=True, help="Comma-separated: fanout1 fanout10 fanout100 nn wide latency connections; "
                                      "work queues: qpush qwork1 qwork8 qdrain1 qdrain8 qlatency, and with batch "
                                      "producers qpushb qwork1b qwork8b; leaf nodes (nats-server >= 2.10): "
                                      "leafin leafout; big, for a bigger machine: wide20k conn50k.")
@click.option("--peers", default="nats,redis", show_default=True,
              help="Servers to compare with, started on free loopback ports if installed: nats, redis (or none). "
                   "The work-queue scenarios run on Redis Streams and, with nats, on nats-server JetStream.")
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
@click.option("--wide-max", type=click.IntRange(1, 10**6), default=20000, help="Subscribers in wide20k [20000].")
@click.option("--connections-max", type=click.IntRange(1, 10**6), default=50000, help="Connections in conn50k [50000].")
@click.option("--out", default="bench-results", show_default=True, help="Directory for the JSON and PNG files.")
@click.option("--generator-check", is_flag=True,
              help="Only measure the load generator, against a server that discards or streams.")
@click.option("--tls", is_flag=True, help="Also measure with TLS on the client ports: this broker (NATS and NDJSON) "
                                          "and nats-server (with --peers nats), each with a fresh certificate.")
def bench(scenarios: str, peers: str, protocols: str, payload: int, duration: float, rounds: int,
          workers: int | None, procs: int, nn: int, wide: int, rate: float, connections: int, out: str,
          generator_check: bool, tls: bool, wide_max: int, connections_max: int) -> None:
    """Measure this broker against nats-server and Redis, side by side, in one run."""
    import time

    from shardbroker.cli.bench import report
    from shardbroker.cli.bench.runner import Bench, Options
    from shardbroker.cli.bench.scenarios import scenarios as catalog

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
                   wide=wide, rate=rate, connections=connections, tls=tls, wide_max=wide_max,
                   connections_max=connections_max)
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
cli.add_command(loadtest)
cli.add_command(top)


def main() -> None:
    """brokerctl: what a user typed gets a usage error or one line, never a Python traceback (set
    ``BROKERCTL_DEBUG=1`` to see one)."""
    bad = _not_text(sys.argv[1:], os.environ)
    if bad is not None:
        click.echo(f"Usage: brokerctl [OPTIONS] COMMAND [ARGS]...\nTry 'brokerctl -h' for help.\n\nError: {bad} is not "
                   f"valid UTF-8", err=True)
        sys.exit(2)
    try:
        cli(prog_name="brokerctl")
    except Exception as exc:   # click's own errors have been reported, and it exited: this is something else
        if os.environ.get("BROKERCTL_DEBUG"):
            raise
        click.echo(f"Error: {_unexpected(exc)}", err=True)
        sys.exit(1)


def _not_text(args: list[str], env: Any) -> str | None:
    """The first argument (or brokerctl variable) that is not UTF-8 (Python reads it with surrogate escapes,
    which nothing can send or hash), named as a user would find it; None if all are."""
    for i, arg in enumerate(args):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = ascii(os.fsencode(arg))[1:]
            if i and args[i - 1].startswith("-") and "=" not in args[i - 1]:
                return f"the value of {args[i - 1]} ({shown})"
            return f"argument {i + 1} ({shown})"
    for name in sorted(env):
        if name.startswith("BROKER_"):
            try:
                env[name].encode("utf-8")
            except UnicodeEncodeError:
                return f"${name}"
    return None


def _unexpected(exc: Exception) -> str:
    """One line for what went wrong where no command said it better."""
    if isinstance(exc, ConnectionError):
        return f"{exc} (if the listener verifies client certificates, give --cert and --key)" \
            if "closed by the broker" in str(exc) else str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, UnicodeError):
        return f"not a usable name or address: {exc}"
    return f"{type(exc).__name__}: {exc} (BROKERCTL_DEBUG=1 shows where)"


if __name__ == "__main__":
    main()
