"""The configured users: what the file may say about them, the rules it must keep, and the configuration with their
plaintext dropped once it is hashed.

cluster.security.users builds the registry from these entries; this module builds on nothing of it.
"""

from __future__ import annotations

import dataclasses
import re

from shardbroker.cluster.config import passwords
from shardbroker.cluster.config.permissions import PermissionFormatError, Permissions
from shardbroker.cluster.config.schema import ConfigError
from shardbroker.cluster.config.sections import Config, SecurityConfig, UserConfig

_USER_NAME = re.compile(r"^[^\s\x00-\x1f\x7f]{1,128}$")


def valid_name(name: object) -> bool:
    """A user name: 1-128 characters, no whitespace or control characters (the configuration's and the admin
    protocol's rule)."""
    return isinstance(name, str) and bool(_USER_NAME.match(name))


def configured_users(security: SecurityConfig) -> list[tuple[str, UserConfig, bool]]:
    """(config key, user, is the admin_user) for every user the configuration defines."""
    out = []
    if security.admin_user.username:
        out.append(("security.admin_user", security.admin_user, True))
    out += [(f"security.users[{i}]", u, False) for i, u in enumerate(security.users)]
    return out


def check_users(sec: SecurityConfig) -> None:
    seen: set[str] = set()
    for where, user, _ in configured_users(sec):
        if not valid_name(user.username):
            raise ConfigError(f"{where}.username: must be 1-128 characters without spaces or control characters")
        if user.username in seen:
            raise ConfigError(f"{where}.username: {user.username!r} is defined twice")
        seen.add(user.username)
        if user.password is not None and user.password_hash is not None:
            raise ConfigError(f"{where}: give password or password_hash, not both")
        if sec.enabled and not user.password and user.password_hash is None and not user.cert_names:
            raise ConfigError(f"{where}: needs a non-empty password or a password_hash (or, to log in by "
                              f"certificate alone, cert_names)")
        try:
            Permissions(user.permissions)
        except PermissionFormatError as exc:
            raise ConfigError(f"{where}.permissions: {exc}") from None
        if user.password_hash is not None:
            try:
                passwords.parse(user.password_hash)
            except passwords.HashFormatError as exc:
                raise ConfigError(f"{where}.password_hash: {exc}") from None
        secret = user.qlite_secret
        if secret is not None:
            size = len(secret.encode())
            if not secret or "\0" in secret:
                raise ConfigError(f"{where}.qlite_secret: must be a non-empty string without NUL characters")
            if size > 56:
                raise ConfigError(f"{where}.qlite_secret: must be at most 56 bytes (UTF-8), got {size}: qlite "
                                  f"hashes secret and challenge within bcrypt's 72 bytes, so a longer secret leaves "
                                  f"challenge bytes out and a captured login could be replayed")


def has_plaintext_passwords(config: Config) -> bool:
    return any(u.password for _, u, _ in configured_users(config.security))


def has_qlite_secrets(config: Config) -> bool:
    """Whether any user has a ``qlite_secret``: plaintext the server must keep (docs/qlite.md)."""
    return any(u.qlite_secret for _, u, _ in configured_users(config.security))


def without_plaintext_passwords(config: Config) -> Config:
    """The same configuration, its plaintext passwords dropped once the registry holds their hashes (and the
    qlite secrets, which the registry carries)."""
    sec = config.security
    strip = lambda u: dataclasses.replace(u, password=None, qlite_secret=None)  # noqa: E731
    return dataclasses.replace(config, security=dataclasses.replace(
        sec, admin_user=strip(sec.admin_user), users=[strip(u) for u in sec.users]))
