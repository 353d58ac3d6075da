"""The connection options every client command of ``brokerctl`` takes, and the connection they make.

An option may be given where a user types it: on a group (``brokerctl user -p 9000 add carol``) or on its command
(``brokerctl user add -p 9000 carol``); the command's wins.  What is not given comes from the environment
(``$BROKER_URL``, ``$BROKER_USER``), then the defaults, so scripts need not repeat them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from .client import BlockingClient

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
URL_ENV = "BROKER_URL"
_GIVEN = "brokerctl.given"  # ctx.meta (shared by a group's context and its command's): the options given


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    # Groups parse before their commands, so a command's value replaces its group's.
    if value is not None and value is not False:
        ctx.meta.setdefault(_GIVEN, {})[param.name] = value


def shared_option(*decls: str, **attrs: Any):
    """A click option that may sit on a group and on its commands alike; read it with ``given(name)``."""
    return click.option(*decls, callback=_remember, expose_value=False, **attrs)


def given(name: str, default: Any = None) -> Any:
    return click.get_current_context().meta.get(_GIVEN, {}).get(name, default)


_HOST = shared_option("--host", help=f"Broker address [default: {DEFAULT_HOST}, or ${URL_ENV}'s].")
_PORT = shared_option("-p", "--port", type=click.IntRange(1, 65535),
                      help=f"Broker NDJSON port [default: {DEFAULT_PORT}, or ${URL_ENV}'s].")


def connection_options(fn):
    """--host, -p/--port and -u/--user, for a command or a group of them."""
    fn = shared_option("-u", "--user", help="Authenticate as USER [default: $BROKER_USER; none]; the password "
                                            "comes from $BROKER_PASSWORD or a prompt.")(fn)
    return _HOST(_PORT(fn))


def admin_connection_options(fn):
    """--host, -p/--port and --admin (the administrator to act as), for ``brokerctl user`` and its commands."""
    fn = shared_option("--admin", "admin_user", help="Administrator to authenticate as [default: "
                                                     "$BROKER_ADMIN_USER, or admin]; the password comes from "
                                                     "$BROKER_ADMIN_PASSWORD or a prompt.")(fn)
    return _HOST(_PORT(fn))


def parse_url(text: str) -> tuple[str, int]:
    """``[ndjson://]HOST[:PORT]`` (an IPv6 address in brackets), as ``$BROKER_URL`` holds it."""
    rest = text.strip()
    if "://" in rest:
        scheme, _, rest = rest.partition("://")
        if scheme.lower() not in ("ndjson", "tcp"):
            raise ValueError(f"{scheme}:// is not ndjson:// (brokerctl speaks NDJSON: give the NDJSON port)")
    rest = rest.rstrip("/")
    if not rest or "/" in rest or "@" in rest:
        raise ValueError("expected [ndjson://]HOST[:PORT] (users go in --user, passwords in the environment)")
    port: str | None = None
    if rest.startswith("["):
        host, closed, tail = rest[1:].partition("]")
        if not closed or (tail and not tail.startswith(":")):
            raise ValueError("expected [IPV6]:PORT")
        port = tail[1:] if tail else None
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host = rest  # a name, an IPv4 address or a bare IPv6 address
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not 1-65535")
    return host or DEFAULT_HOST, int(port) if port else DEFAULT_PORT


def target() -> tuple[str, int]:
    """(host, port): the options given, else ``$BROKER_URL``'s, else the defaults."""
    host, port = DEFAULT_HOST, DEFAULT_PORT
    url = os.environ.get(URL_ENV)
    if url:
        try:
            host, port = parse_url(url)
        except ValueError as exc:
            raise click.UsageError(f"${URL_ENV}={url!r}: {exc}") from None
    return given("host", host), given("port", port)


def parse_data(data: str, as_json: bool):
    """A command's DATA argument: JSON with ``--json``, else the string itself."""
    if not as_json:
        return data
    import orjson

    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="DATA") from None


def connect(as_admin: bool = False) -> "BlockingClient":
    """A connection to the broker the options name, authenticated as the user they name (if any): with
    ``as_admin``, the administrator's (``--admin``)."""
    # imported here: `brokerctl start` is on the broker's start-up path and needs none of it
    from . import secrets
    from .client import BlockingClient, BrokerError

    host, port = target()
    if as_admin:
        user = given("admin_user") or os.environ.get("BROKER_ADMIN_USER") or "admin"
        password_env = "BROKER_ADMIN_PASSWORD"
    else:
        user = given("user") or os.environ.get("BROKER_USER") or None
        password_env = "BROKER_PASSWORD"
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
