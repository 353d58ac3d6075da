"""``brokerctl queue``: work queues from the command line (docs/queues.md)."""

from __future__ import annotations

import re
import sys

import click

from shardbroker.cli.connect import connect, connection_options, parse_data


def _call(op: str, **fields) -> dict:
    """One request; a refusal is printed as the broker's reason and exits 1."""
    from shardbroker.cli.client import BrokerError

    with connect() as client:
        try:
            return client.request(op, timeout=10.0 + fields.get("wait_ms", 0) / 1000, **fields)
        except BrokerError as exc:
            retry = " (retry later)" if exc.reply.get("retry") else ""
            raise click.ClickException(f"{op}: {exc.reason}{retry}") from None


def _echo(obj) -> None:
    import orjson

    click.echo(orjson.dumps(obj).decode())


@click.group()
@connection_options
def queue() -> None:
    """Work queues: push, receive, ack, inspect (docs/queues.md)."""


@queue.command()
@connection_options
@click.option("--json", "as_json", is_flag=True, help="DATA is JSON (default: a string).")
@click.option("--priority", type=click.IntRange(0, 9), help="0-9, higher first (default 4).")
@click.option("--delay-ms", type=click.IntRange(0), help="Visible only after this many milliseconds.")
@click.option("--dedup-id", help="Stored once however often it is sent within 5 minutes (retries).")
@click.argument("name")
@click.argument("data")
def push(as_json: bool, priority: int | None, delay_ms: int | None, dedup_id: str | None, name: str, data: str
         ) -> None:
    """Push DATA to queue NAME; prints the message id once the broker has stored it."""
    value = parse_data(data, as_json)
    fields = {k: v for k, v in (("priority", priority), ("delay_ms", delay_ms), ("dedup_id", dedup_id))
              if v is not None}
    click.echo(_call("qpush", queue=name, data=value, **fields)["id"])


@queue.command()
@connection_options
@click.option("-n", "--max", "count", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Messages to lease.")
@click.option("--wait-ms", type=click.IntRange(0, 300_000), default=0, show_default=True,
              help="Wait this long for a message if none is visible.")
@click.option("--visibility-ms", type=click.IntRange(0), help="Lease length (default: the queue's).")
@click.option("--ack", is_flag=True, help="Ack each message at once (take it for good).")
@click.argument("name")
def recv(count: int, wait_ms: int, visibility_ms: int | None, ack: bool, name: str) -> None:
    """Lease messages of queue NAME; prints each as a JSON line (with its receipt, for `queue ack`)."""
    fields = {"visibility_ms": visibility_ms} if visibility_ms is not None else {}
    messages = _call("qrecv", queue=name, max=count, wait_ms=wait_ms, **fields)["messages"]
    for m in messages:
        _echo(m)
    if ack and messages:
        _call("qack", queue=name, receipts=[m["receipt"] for m in messages])
    if not messages:
        sys.exit(3)  # nothing to do: scripts can tell an empty queue from an error (1)


class _ReceiptsCommand(click.Command):
    """A receipt is 22 base64url characters and begins with '-' once in 64, which click would read as an option:
    a 22-character word of that alphabet that names no option is taken as a receipt wherever it stands."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        names = {n for p in self.get_params(ctx) for n in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
        end = args.index("--") if "--" in args else len(args)
        # Hidden behind a NUL (no option starts with one) while click parses, so each keeps its place.
        args = ["\0" + a if i < end and a.startswith("-") and _RECEIPT.match(a) and a not in names else a
                for i, a in enumerate(args)]
        rest = super().parse_args(ctx, args)
        ctx.params["receipts"] = tuple(r.removeprefix("\0") for r in ctx.params.get("receipts", ()))
        return rest


_RECEIPT = re.compile(r"^[A-Za-z0-9_-]{22}$")


@queue.command(cls=_ReceiptsCommand)
@connection_options
@click.argument("name")
@click.argument("receipts", nargs=-1, required=True)
def ack(name: str, receipts: tuple[str, ...]) -> None:
    """Ack RECEIPTS of queue NAME; prints one result line each, exits 1 if any failed."""
    results = _call("qack", queue=name, receipts=list(receipts))["results"]
    for receipt, result in zip(receipts, results):
        click.echo(f"{receipt} {'ok' if result['ok'] else result['error']}"
                   f"{' (already acked)' if result.get('already_acked') else ''}")
    if not all(r["ok"] for r in results):
        sys.exit(1)


@queue.command()
@connection_options
@click.argument("name")
def stat(name: str) -> None:
    """Counts of queue NAME (visible, in flight, delayed, ...), as JSON."""
    _echo(_call("qstat", queue=name)["stat"])


@queue.command()
@connection_options
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.argument("name")
def purge(yes: bool, name: str) -> None:
    """Remove every message of queue NAME, in flight too (admin)."""
    if not yes:
        click.confirm(f"purge every message of {name}?", abort=True)
    click.echo(f"purged {_call('qpurge', queue=name)['purged']}")


@queue.command()
@connection_options
@click.option("--to", help="Target queue (default: the one the DLQ belongs to).")
@click.option("--max", "count", type=click.IntRange(1, 1_000_000), help="At most this many (default 1000).")
@click.argument("name")
def redrive(to: str | None, count: int | None, name: str) -> None:
    """Move dead letters from NAME (a <queue>.dlq) back (admin)."""
    fields = {k: v for k, v in (("to", to), ("max", count)) if v is not None}
    click.echo(f"moved {_call('qredrive', queue=name, **fields)['moved']}")
