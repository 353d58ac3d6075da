"""The generic part of the loader: a walker that reads a JSON document into the dataclasses of
``cluster.config.sections``, key by key, from their type hints and metadata.

It knows no section by name: an unknown key, a value of the wrong type or out of its range is one ``ConfigError``
line naming the key and what it expected, whichever section it is in (and the value, unless the field's metadata
says ``secret``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import orjson


class ConfigError(Exception):
    """One line: which key is wrong and why."""


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(orjson.dumps(a).decode() for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}s"
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def _fail(path: str, tp: Any, value: Any) -> typing.NoReturn:
    shown = orjson.dumps(value).decode() if _jsonable(value) else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise ConfigError(f"{path}: expected {_describe(tp)}, got {shown}")


def _jsonable(value: Any) -> bool:
    try:
        orjson.dumps(value)
        return True
    except TypeError:
        return False


def _convert(tp: Any, value: Any, path: str, meta: dict) -> Any:
    if meta.get("secret"):   # a password, a token, a URL with credentials: the error is the key's, not the value's
        try:
            return _convert(tp, value, path, {k: v for k, v in meta.items() if k != "secret"})
        except ConfigError:
            raise ConfigError(f"{path}: expected {_describe(tp)} (the value is not shown: it may be a secret)") \
                from None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _convert(option, value, path, meta)
            except ConfigError as exc:
                if "must be" in str(exc):  # right type, wrong range: that is the error to report
                    raise
                if dataclasses.is_dataclass(option) and isinstance(value, dict):   # an object: its own key's error
                    raise
        _fail(path, tp, value)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        _fail(path, tp, value)
    if origin is list:
        if not isinstance(value, list):
            _fail(path, tp, value)
        (item_tp,) = typing.get_args(tp)
        return [_convert(item_tp, v, f"{path}[{i}]", {}) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(path, tp, value)
        return build(tp, value, path + ".")
    if tp is type(None):
        if value is not None:
            _fail(path, tp, value)
        return None
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, tp, value)
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, tp, value)
        if tp is int and isinstance(value, float):
            if not value.is_integer():
                _fail(path, tp, value)
            value = int(value)
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ConfigError(f"{path}: must be between {lo:g} and {hi:g}, got {value}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, tp, value)
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def build(cls: type, doc: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = [k for k in doc if k not in fields]
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known here: {known})")
    kwargs = {name: _convert(hints[name], doc[name], prefix + name, dict(fields[name].metadata))
              for name in fields if name in doc}
    return cls(**kwargs)
