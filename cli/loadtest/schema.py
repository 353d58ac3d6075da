"""The five result tables' Spark schemas, and the one place dict rows from the tasks become rows of those schemas.

Schemas are explicit: inference would type a column from whatever the first rows happen to hold (an all-zero
double becomes a long, an empty array a null type), and a Parquet table's types must not depend on the run.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from shardbroker.cli.loadtest.summary import HDR_METRICS  # the intervals table's *_hdr columns, in order

TABLES: tuple[str, ...] = ("runs", "tasks", "intervals", "streams", "clock")

_S, _L, _I, _D, _B = StringType(), LongType(), IntegerType(), DoubleType(), BooleanType()
_GAP = StructType([StructField("lo", _L), StructField("hi", _L)])


def _struct(*cols: tuple[str, DataType]) -> StructType:
    return StructType([StructField(name, kind, nullable=True) for name, kind in cols])


SCHEMAS: dict[str, StructType] = {
    "runs": _struct(
        ("run_id", _S), ("name", _S), ("started_at", TimestampType()), ("scenario_text", _S),
        ("scenario_sha256", _S), ("seed", _L), ("protocols", ArrayType(_S)), ("broker_urls", MapType(_S, _S)),
        ("broker_version", _S), ("brokerctl_version", _S), ("git_sha", _S), ("spark_master", _S),
        ("spark_version", _S), ("spark_conf", MapType(_S, _S)), ("tasks", _I), ("varz_before", _S),
        ("varz_after", _S), ("status", _S), ("flags", ArrayType(_S)), ("agreed_start_wall_ns", _L),
        ("warmup_s", _D), ("duration_s", _D), ("interval_s", _D),
    ),
    "tasks": _struct(
        ("run_id", _S), ("task", _I), ("attempt", _I), ("workload", _S), ("role", _S), ("model", _S), ("host", _S),
        ("boot_id", _S), ("pid", _I), ("executor_id", _S), ("conns", _I), ("pub_ids", ArrayType(_L)),
        ("target_rate", _D), ("achieved_rate", _D), ("start_skew_us", _L), ("wall_minus_mono_start_ns", _L),
        ("wall_minus_mono_end_ns", _L), ("cpu_user_s", _D), ("cpu_sys_s", _D), ("max_rss_bytes", _L),
        ("cpu_peak_pct", _D), ("send_lag_p99_us", _L), ("generator_bound", _B), ("reconnects", _I),
        ("errors", ArrayType(_S)),
    ),
    "intervals": _struct(
        ("run_id", _S), ("workload", _S), ("task", _I), ("interval", _I), ("interval_start_ms", _L),
        ("phase", _S), ("target", _L), ("sent", _L), ("acked", _L), ("send_errors", _L), ("received", _L),
        ("redelivered", _L), ("bytes_out", _L), ("bytes_in", _L),
        *((f"{metric}_hdr", _S) for metric in HDR_METRICS),
        ("clamped", _L), ("negative_e2e", _L), ("cpu_pct", _D),
    ),
    "streams": _struct(
        ("run_id", _S), ("workload", _S), ("sub_task", _I), ("sub_conn", _I), ("subject", _S), ("group", _S),
        ("pub_id", _L), ("mode", _S), ("published", _L), ("received", _L), ("unique", _L), ("lost", _L),
        ("duplicates", _L), ("redeliveries", _L), ("reordered", _L), ("max_reorder_distance", _L), ("early", _L),
        ("first_seq", _L), ("last_seq", _L), ("gap_ranges", ArrayType(_GAP)), ("gap_count", _L), ("unacked", _L),
        ("unconfirmed", _L),
    ),
    "clock": _struct(
        ("run_id", _S), ("pub_host", _S), ("sub_host", _S), ("offset_ns", _L), ("bound_ns", _L),
        ("drift_ns_per_s", _D), ("probes", _I),
    ),
}

COLUMNS: dict[str, tuple[str, ...]] = {table: tuple(schema.fieldNames()) for table, schema in SCHEMAS.items()}

# Keys a row cannot do without: defaulting these would silently merge rows that belong apart.
REQUIRED: dict[str, frozenset[str]] = {
    "runs": frozenset({"run_id"}),
    "tasks": frozenset({"run_id", "task", "workload", "role"}),
    "intervals": frozenset({"run_id", "workload", "task", "interval", "phase"}),
    "streams": frozenset({"run_id", "workload", "pub_id", "mode"}),
    "clock": frozenset({"run_id", "pub_host", "sub_host"}),
}

# Sub-subscriber rows of group/queue streams have no subscriber task or connection.
_DEFAULTS: dict[str, dict[str, Any]] = {"streams": {"sub_task": -1, "sub_conn": -1}}


def rows_for(table: str, dicts: Iterable[Mapping[str, Any]]) -> list[tuple]:
    """Tuples in SCHEMAS[table]'s column order; absent optional keys take their type's empty value.

    Values are coerced to what Spark's verifier accepts (an int in a double column is refused there, far from its
    producer).  ValueError for an unknown table, unknown keys (a producer's typo), or a missing required key.
    """
    if table not in SCHEMAS:
        raise ValueError(f"unknown table {table!r}; tables are {', '.join(TABLES)}")
    fields = SCHEMAS[table].fields
    known = set(COLUMNS[table])
    required = REQUIRED[table]
    defaults = _DEFAULTS.get(table, {})
    out = []
    for n, row in enumerate(dicts):
        unknown = row.keys() - known
        if unknown:
            raise ValueError(f"{table} row {n}: unknown column(s) {', '.join(sorted(unknown))}")
        missing = required - row.keys()
        if missing:
            raise ValueError(f"{table} row {n}: missing column(s) {', '.join(sorted(missing))}")
        values = []
        for field in fields:
            value = row.get(field.name)
            if value is None:
                value = defaults[field.name] if field.name in defaults else _empty(field.dataType)
            else:
                try:
                    value = _coerce(value, field.dataType)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{table} row {n}: column {field.name}: {exc}") from None
            values.append(value)
        out.append(tuple(values))
    return out


def _empty(kind: DataType) -> Any:
    if isinstance(kind, (LongType, IntegerType)):
        return 0
    if isinstance(kind, DoubleType):
        return 0.0
    if isinstance(kind, StringType):
        return ""
    if isinstance(kind, BooleanType):
        return False
    if isinstance(kind, ArrayType):
        return []
    if isinstance(kind, MapType):
        return {}
    return None  # a timestamp nobody supplied is unknown, not the epoch


def _coerce(value: Any, kind: DataType) -> Any:
    if isinstance(kind, (LongType, IntegerType)):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number")
        return int(value)
    if isinstance(kind, DoubleType):
        return float(value)
    if isinstance(kind, BooleanType):
        if not isinstance(value, (bool, int)):
            raise TypeError(f"{value!r} is not a boolean")
        return bool(value)
    if isinstance(kind, StringType):
        # hdrh's encode() returns bytes; the column holds its base64 text.
        return value.decode("ascii") if isinstance(value, (bytes, bytearray)) else str(value)
    if isinstance(kind, TimestampType):
        return _timestamp(value)
    if isinstance(kind, MapType):
        return {str(k): str(v) for k, v in dict(value).items()}
    if isinstance(kind, ArrayType):
        if isinstance(value, (str, bytes)):
            raise TypeError(f"{value!r} is not a list")
        element = kind.elementType
        if isinstance(element, StructType):
            return [_struct_value(item, element) for item in value]
        return [_coerce(item, element) for item in value]
    return value


def _struct_value(item: Any, kind: StructType) -> tuple:
    names = kind.fieldNames()
    if isinstance(item, Mapping):
        unknown = item.keys() - set(names)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        item = [item.get(name) for name in names]
    item = list(item)
    if len(item) != len(names):
        raise ValueError(f"{item!r} does not have the fields {', '.join(names)}")
    return tuple(None if v is None else _coerce(v, f.dataType) for v, f in zip(item, kind.fields))


def _timestamp(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        stamp = value
    elif isinstance(value, str):
        stamp = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    elif isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(value, dt.UTC)
    else:
        raise TypeError(f"{value!r} is not a datetime")
    # Runs are stamped in UTC; a naive value is taken as UTC rather than the driver's local zone.
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)
