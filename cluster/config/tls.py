"""TLS in the configuration: which listeners have it, with what (the shared ``tls`` section with each listener's
own keys over it), and the rules a start checks about it.

cluster/security/tls.py makes the contexts and reads the files; this module only reads the configuration.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardbroker.cluster.config import certnames
from shardbroker.cluster.config.schema import ConfigError
from shardbroker.cluster.config.sections import TLS_LISTENERS, Config, ListenerTlsConfig, TlsConfig, TlsSettings
from shardbroker.cluster.config.users import configured_users


def tls_settings(config: Config, listener: str) -> TlsSettings | None:
    """The TLS ``listener`` ("ndjson", "nats", ... : ``TLS_LISTENERS``) runs with, or None: plain TCP."""
    section = TLS_LISTENERS[listener]
    own = getattr(config, section).tls
    if own is False:
        return None
    shared = config.tls
    values: dict[str, Any] = {}
    origin: list[tuple[str, str]] = []
    for f in dataclasses.fields(TlsConfig):
        value = getattr(own, f.name, None) if isinstance(own, ListenerTlsConfig) else None
        if value is not None:
            values[f.name] = value
            origin.append((f.name, f"{section}.tls.{f.name}"))
        else:
            values[f.name] = getattr(shared, f.name)
            origin.append((f.name, f"tls.{f.name}"))
    if values["handshake_timeout"] is None:
        values["handshake_timeout"] = config.security.auth_timeout
    first = own.handshake_first if isinstance(own, ListenerTlsConfig) else False
    return TlsSettings(listener=listener, cert=values["cert"] or "", key=values["key"] or "", ca=values["ca"],
                       verify=values["verify"], verify_and_map=values["verify_and_map"],
                       min_version=values["min_version"], handshake_timeout=float(values["handshake_timeout"]),
                       handshake_first=first, origin=tuple(origin))


def check_tls(config: Config) -> None:
    for listener, section in TLS_LISTENERS.items():
        own = getattr(config, section).tls
        if isinstance(own, ListenerTlsConfig) and own.handshake_first is not False and listener != "nats":
            raise ConfigError(f"{section}.tls.handshake_first: only the NATS listener has it (nats.tls)")
        s = tls_settings(config, listener)
        if s is None:
            continue
        for name in ("cert", "key"):
            if not getattr(s, name):
                raise ConfigError(f"{section}.tls: needs a {'certificate' if name == 'cert' else 'private key'}: "
                                  f"set tls.{name} (or {section}.tls.{name})")
        for name in ("verify", "verify_and_map"):
            if getattr(s, name) and not s.ca:
                raise ConfigError(f"{s.key_of(name)}: needs a CA to verify client certificates with: set tls.ca "
                                  f"(or {section}.tls.ca)")
    seen: dict[str, str] = {}
    for where, user, _ in configured_users(config.security):
        for i, name in enumerate(user.cert_names):
            key = f"{where}.cert_names[{i}]"
            if not name.strip():
                raise ConfigError(f"{key}: must not be empty")
            try:
                dn = certnames.canonical_dn(name)
            except certnames.DnError as exc:
                raise ConfigError(f"{key}: {exc}") from None
            for form in {name, dn} - {None}:
                if form in seen and seen[form] != user.username:
                    raise ConfigError(f"{key}: {name!r} already logs in {seen[form]!r}: a certificate name picks one "
                                      f"user")
                seen[form] = user.username
