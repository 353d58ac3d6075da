"""Reading secrets for brokerctl: from an environment variable, a prompt, or standard input; never from argv,
where any user of the machine can read them (``ps``, shell history)."""

from __future__ import annotations

import getpass
import os
import sys

import click


def from_env_or_prompt(env: str, prompt: str) -> str:
    """``$env`` if set, else a no-echo prompt on the terminal."""
    value = os.environ.get(env)
    if value is not None:
        return _text(value, f"${env}")
    if not sys.stdin.isatty():
        raise click.UsageError(f"set {env}, or run on a terminal to be prompted")
    return _text(getpass.getpass(prompt), "the password typed")


def new_password(what: str) -> str:
    """A new password: prompted twice on a terminal, else the first line of standard input."""
    if sys.stdin.isatty():
        first = getpass.getpass(f"{what}: ")
        if first != getpass.getpass(f"{what} (again): "):
            raise click.ClickException("the passwords do not match")
        password = first
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise click.ClickException("empty password")
    return _text(password, "the password read" if sys.stdin.isatty() else "the password on standard input")


def _text(value: str, what: str) -> str:
    """``value`` if it is UTF-8 text (what a password is, on the wire and in its hash), else a usage error."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise click.UsageError(f"{what} is not valid UTF-8") from None
    return value
