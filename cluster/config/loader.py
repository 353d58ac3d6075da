"""The loader: a JSON file (or the embedded defaults) and the command line's dotted-key overrides, read into a
``Config`` and checked, before anything starts; and the configuration as a document and back, for a reload.

The order is the promise: every key is read and checked by itself (``cluster.config.schema``), then the rules that
span keys (here, and the users' and TLS's in their own modules), then the directories against the file system.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import time
from typing import Any

import orjson

from shardbroker.cluster.config.leafnodes import check_leaf_files, check_leafnodes
from shardbroker.cluster.config.paths import check_directories
from shardbroker.cluster.config.schema import ConfigError, build
from shardbroker.cluster.config.sections import QLITE_MAX_HIDDEN, Config, QueueDefinition
from shardbroker.cluster.config.tls import check_tls
from shardbroker.cluster.config.users import check_users, configured_users
from shardbroker.router.subjects import is_valid_literal


def load(path: str | None = None, overrides: dict[str, Any] | None = None, check_paths: bool = True) -> Config:
    """Read ``path`` (JSON; None: embedded defaults), apply dotted-key ``overrides``, validate.

    ``check_paths``: also check the directories the keys name against the file system, as a start must, and that
    the files the leaf remotes name can be read (a SIGHUP, which re-reads the users only, and tools reading a file
    meant for another machine leave it out)."""
    doc: dict[str, Any] = {}
    digest = None
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: the top level must be a JSON object")
        if any(v is not None for v in (overrides or {}).values()):
            # The file's own values are checked too, the ones a command-line option overrides now included: the
            # next start without that option would fail on them, so they are reported now.
            try:
                build(Config, copy.deepcopy(doc), "")
            except ConfigError as exc:
                raise ConfigError(f"{exc} (in {path}, whatever the command line overrides)") from None
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = doc
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: expected an object")
        node[leaf] = value
    config = build(Config, doc, "")
    kept = tuple((k, v) for k, v in (overrides or {}).items() if v is not None)
    config = dataclasses.replace(config, source=os.path.abspath(path) if path else None, overrides=kept,
                                 digest=digest, loaded=time.time())
    _check(config)
    if check_paths:
        check_directories(config)
        check_leaf_files(config.leafnodes)
    return _with_qlite_queue(config)


def _with_qlite_queue(config: Config) -> Config:
    """With qlite on: ``max_hidden_time`` clamped to 12 h, and the qlite queue configured as qlite's (messages up
    to ``max_message_size``, redelivered without end: no dead-lettering), unless ``queues.queues`` names it."""
    ql = config.qlite
    if not ql.enabled:
        return config
    if ql.max_hidden_time > QLITE_MAX_HIDDEN:
        config = dataclasses.replace(config, qlite=dataclasses.replace(ql, max_hidden_time=QLITE_MAX_HIDDEN))
    q = config.queues
    if any(d.name == ql.queue for d in q.queues):
        return config
    own = QueueDefinition(name=ql.queue, max_message_bytes=ql.max_message_size, max_deliveries=0)
    return dataclasses.replace(config, queues=dataclasses.replace(q, queues=[*q.queues, own]))


def _check(config: Config) -> None:
    """Rules that span keys."""
    seen = set()
    for i, q in enumerate(config.queues.queues):
        if not is_valid_literal(q.name, config.limits.max_topic_length):
            raise ConfigError(f"queues.queues[{i}].name: {q.name!r} is not a queue name (a subject without wildcards)")
        if q.name in seen:
            raise ConfigError(f"queues.queues[{i}].name: {q.name!r} is configured twice")
        seen.add(q.name)
    sec = config.security
    if sec.enabled and not sec.admin_user.username:
        raise ConfigError("security.admin_user.username: must be set when security.enabled is true")
    check_users(sec)
    names = {u.username for _, u, _ in configured_users(sec)}
    if sec.no_auth_user and sec.no_auth_user not in names:
        raise ConfigError(f"security.no_auth_user: {sec.no_auth_user!r} is not a configured user (name one of "
                          f"security.users or the security.admin_user)")
    if config.qlite.enabled and not is_valid_literal(config.qlite.queue, config.limits.max_topic_length):
        raise ConfigError(f"qlite.queue: {config.qlite.queue!r} is not a queue name (a subject without wildcards)")
    if sec.enabled and config.bridge.enabled:
        if config.bridge.user not in names:
            raise ConfigError("bridge.user: Bridge clients cannot authenticate; with security on, name the "
                              "configured user whose permissions they get")
    sd = config.shutdown
    if sd.lame_duck_grace_period >= sd.lame_duck_duration:
        raise ConfigError(f"shutdown.lame_duck_grace_period: must be less than shutdown.lame_duck_duration "
                          f"({sd.lame_duck_duration:g}), got {sd.lame_duck_grace_period:g}")
    check_tls(config)
    check_leafnodes(config.leafnodes)


# -- reloads: the configuration as a document, to diff it and to send it to the workers ------------------------

def document(node: Any) -> Any:
    """The configuration as its JSON document (internal fields left out): what ``from_document`` rebuilds."""
    if dataclasses.is_dataclass(node):
        return {f.name: document(getattr(node, f.name)) for f in dataclasses.fields(node)
                if not f.metadata.get("internal")}
    if isinstance(node, list):
        return [document(v) for v in node]
    return node


def from_document(doc: dict[str, Any]) -> Config:
    """A ``document`` back as a Config (checked as a file would be, key by key; cross-key rules were checked
    where it was loaded)."""
    return build(Config, doc, "")
