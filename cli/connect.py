"""The connection options every client command of ``brokerctl`` takes, and the connection they make.

An option may be given where a user types it: on a group (``brokerctl user -p 9000 add carol``) or on its command
(``brokerctl user add -p 9000 carol``); the command's wins.  What is not given comes from the environment
(``$BROKER_URL``, ``$BROKER_USER``), then the defaults, so scripts need not repeat them.

TLS (docs/security.md#tls): ``--tls`` or ``BROKER_URL=tls://HOST:PORT``; ``--ca`` (``$BROKER_CA``) is the CA that
signed the broker's certificate (default: the system's CAs), ``--cert``/``--key`` (``$BROKER_CERT``,
``$BROKER_KEY``) this client's certificate, where the listener asks for one.  Giving any of them turns TLS on.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from shardbroker.cli.client import BlockingClient

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
_TLS = shared_option("--tls", is_flag=True, default=None,
                     help=f"Connect with TLS [default: when ${URL_ENV} is tls://..., or --ca/--cert is given].")
_FILE = click.Path(dir_okay=False, exists=True)
_CA = shared_option("--ca", type=_FILE, help="CA certificate (PEM) to verify the broker's with [default: $BROKER_CA, "
                                             "or the system's CAs]; implies --tls.")
_CERT = shared_option("--cert", type=_FILE, help="This client's certificate (PEM), for a listener that asks for "
                                                 "one [default: $BROKER_CERT]; implies --tls.")
_KEY = shared_option("--key", type=_FILE, help="The private key of --cert, if not in its file [default: $BROKER_KEY].")


def _endpoint(fn):
    return _HOST(_PORT(_TLS(_CA(_CERT(_KEY(fn))))))


def connection_options(fn):
    """--host, -p/--port, the TLS options and -u/--user, for a command or a group of them."""
    fn = shared_option("-u", "--user", help="Authenticate as USER [default: $BROKER_USER; none]; the password "
                                            "comes from $BROKER_PASSWORD or a prompt.")(fn)
    return _endpoint(fn)


def admin_connection_options(fn):
    """--host, -p/--port, the TLS options and --admin (the administrator to act as), for ``brokerctl user`` and
    its commands."""
    fn = shared_option("--admin", "admin_user", help="Administrator to authenticate as [default: "
                                                     "$BROKER_ADMIN_USER, or admin]; the password comes from "
                                                     "$BROKER_ADMIN_PASSWORD or a prompt.")(fn)
    return _endpoint(fn)


def parse_url(text: str) -> tuple[str, int]:
    """``[ndjson://|tls://]HOST[:PORT]`` (an IPv6 address in brackets), as ``$BROKER_URL`` holds it."""
    return parse_url_tls(text)[:2]


def parse_url_tls(text: str) -> tuple[str, int, bool]:
    """``parse_url``, and whether the URL asks for TLS (``tls://``)."""
    rest = text.strip()
    secure = False
    if "://" in rest:
        scheme, _, rest = rest.partition("://")
        if scheme.lower() not in ("ndjson", "tcp", "tls"):
            raise ValueError(f"{scheme}:// is not ndjson:// or tls:// (brokerctl speaks NDJSON: give the NDJSON "
                             f"port)")
        secure = scheme.lower() == "tls"
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
    return host or DEFAULT_HOST, int(port) if port else DEFAULT_PORT, secure


def target() -> tuple[str, int]:
    """(host, port): the options given, else ``$BROKER_URL``'s, else the defaults."""
    return _target()[:2]


def _target() -> tuple[str, int, bool]:
    host, port, secure = DEFAULT_HOST, DEFAULT_PORT, False
    url = os.environ.get(URL_ENV)
    if url:
        try:
            host, port, secure = parse_url_tls(url)
        except ValueError as exc:
            raise click.UsageError(f"${URL_ENV}={url!r}: {exc}") from None
    return given("host", host), given("port", port), secure


def tls_context():
    """The client TLS context the options and the environment ask for, or None (plain TCP)."""
    ca = given("ca") or os.environ.get("BROKER_CA") or None
    cert = given("cert") or os.environ.get("BROKER_CERT") or None
    key = given("key") or os.environ.get("BROKER_KEY") or None
    if not (given("tls") or _target()[2] or ca or cert):
        return None
    import ssl

    from shardbroker.cli.client import tls_context as make

    try:
        return make(ca, cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise click.ClickException(f"TLS: cannot load {'--cert/--key' if cert else '--ca'}: {exc}") from None


def parse_data(data: str, as_json: bool):
    """A command's DATA argument: JSON with ``--json``, else the string itself."""
    if not as_json:
        return data
    import orjson

    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="DATA") from None


def connect(as_admin: bool = False) -> BlockingClient:
    """A connection to the broker the options name, authenticated as the user they name (if any): with
    ``as_admin``, the administrator's (``--admin``)."""
    # imported here: `brokerctl start` is on the broker's start-up path and needs none of it
    import ssl

    from shardbroker.cli import secrets
    from shardbroker.cli.client import BlockingClient, BrokerError

    host, port = target()
    if as_admin:
        user = given("admin_user") or os.environ.get("BROKER_ADMIN_USER") or "admin"
        password_env = "BROKER_ADMIN_PASSWORD"
    else:
        user = given("user") or os.environ.get("BROKER_USER") or None
        password_env = "BROKER_PASSWORD"
    password = secrets.from_env_or_prompt(password_env, f"password for {user}: ") if user else None
    tls = tls_context()
    try:
        client = BlockingClient.connect(host, port, tls=tls)
    except ssl.SSLError as exc:   # before OSError, which it is: the reason is what the user needs
        raise click.ClickException(f"cannot connect to {host}:{port}: TLS: {exc.reason or exc}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    if user:
        try:
            client.auth(user, password)
        except BrokerError as exc:
            client.close()
            raise click.ClickException(f"authentication failed: {exc.reason}") from None
    return client
