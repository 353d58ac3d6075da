"""The connection options every client command of ``brokerctl`` takes, and the connection they make."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from .client import BlockingClient


def connection_options(fn):
    fn = click.option("--host", default="127.0.0.1", show_default=True, help="Broker address.")(fn)
    fn = click.option("-p", "--port", default=8080, show_default=True, help="Broker NDJSON port.")(fn)
    fn = click.option("-u", "--user", help="Authenticate as USER (password from $BROKER_PASSWORD or a prompt).")(fn)
    return fn


def parse_data(data: str, as_json: bool):
    """A command's DATA argument: JSON with ``--json``, else the string itself."""
    if not as_json:
        return data
    import orjson

    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="DATA") from None


def connect(host: str, port: int, user: str | None = None, password_env: str = "BROKER_PASSWORD") -> "BlockingClient":
    # imported here: `brokerctl start` is on the broker's start-up path and needs none of it
    from . import secrets
    from .client import BlockingClient, BrokerError

    password = secrets.from_env_or_prompt(password_env, f"password for {user}: ") if user else None
    try:
        client = BlockingClient.connect(host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    if user:
        try:
            client.auth(user, password)
        except BrokerError as exc:
            client.close()
            raise click.ClickException(f"authentication failed: {exc.reason}") from None
    return client
