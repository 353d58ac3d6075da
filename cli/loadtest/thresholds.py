"""A scenario's [thresholds]: parsed once, up front, so a typo fails before the run rather than after it.

Keys are `[workload.]metric`; values are `"OP VALUE"` strings such as `"< 5ms"` or `"== 0"`.  Latency limits are
held in microseconds, the unit of the histograms.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ACCOUNTING = ("published", "received", "unique", "lost", "duplicates", "redeliveries", "reordered", "early",
              "unacked", "unconfirmed")
RATES = ("sent", "acked", "received", "target")
LATENCY = ("e2e_corrected", "e2e_raw", "e2e_cross", "send_lag", "ack_corrected", "ack_raw")
ALIASES = {"e2e": "e2e_corrected", "ack": "ack_corrected"}
LATENCY_STATS = ("mean", "max", "min", "count")

OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
}
_UNITS_US = {"ns": 0.001, "us": 1.0, "µs": 1.0, "μs": 1.0, "ms": 1000.0, "s": 1_000_000.0}
_VALUE = re.compile(r"\s*(==|!=|<=|>=|<|>)\s*(\S.*?)\s*$")
_NUMBER = re.compile(r"([-+]?(?:\d[\d_]*)?\.?\d+(?:[eE][-+]?\d+)?)\s*(\S*)$")


@dataclass(frozen=True)
class Threshold:
    key: str            # as written in the scenario
    text: str           # the value as written, e.g. "< 5ms"
    scope: str | None   # a workload's name, or None for all workloads together
    kind: str           # "count", "bool", "rate" or "latency"
    metric: str         # canonical: "lost", "generator_bound", "rate.sent", "e2e_corrected.p99.9", ...
    op: str
    limit: float | bool

    @property
    def expr(self) -> str:
        return f"{self.key} {self.text}"


def parse(table: Mapping[str, Any], workloads: list[str]) -> list[Threshold]:
    """Thresholds from a scenario's [thresholds] table.  ValueError, naming the key, for anything not understood.

    TOML turns an unquoted `fanout.lost = "== 0"` into a nested table, so nested tables are joined back with dots.
    """
    out = []
    for key, value in _flatten(table):
        out.append(_parse_one(key, value, workloads))
    return out


def _flatten(table: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in table.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            items.extend(_flatten(value, full + "."))
        else:
            items.append((full, value))
    return items


def _parse_one(key: str, value: Any, workloads: list[str]) -> Threshold:
    scope, name = _split_scope(key, workloads)
    kind, metric = _metric(key, name)
    if isinstance(value, bool) and kind == "bool":
        return Threshold(key, f"== {str(value).lower()}", scope, kind, metric, "==", value)
    if not isinstance(value, str):
        raise ValueError(f"threshold {key!r}: value {value!r} must be a string such as \"== 0\" or \"< 5ms\"")
    m = _VALUE.match(value)
    if not m:
        raise ValueError(f"threshold {key!r}: {value!r} does not start with one of {' '.join(OPS)}")
    op, rest = m.groups()
    if kind == "bool":
        if op not in ("==", "!="):
            raise ValueError(f"threshold {key!r}: {metric} takes only == or !=, not {op}")
        if rest.lower() not in ("true", "false"):
            raise ValueError(f"threshold {key!r}: {rest!r} is not true or false")
        return Threshold(key, value.strip(), scope, kind, metric, op, rest.lower() == "true")
    number = _NUMBER.match(rest)
    if not number:
        raise ValueError(f"threshold {key!r}: {rest!r} is not a number")
    limit, unit = float(number.group(1).replace("_", "")), number.group(2)
    if kind == "latency" and not metric.endswith(".count"):
        if unit and unit not in _UNITS_US:
            raise ValueError(f"threshold {key!r}: unknown unit {unit!r} (use ns, us, µs, ms or s)")
        limit *= _UNITS_US[unit] if unit else 1.0
    elif kind == "rate":
        if unit not in ("", "/s", "msg/s"):
            raise ValueError(f"threshold {key!r}: unknown unit {unit!r} (a rate is in msg/s)")
    elif unit:
        raise ValueError(f"threshold {key!r}: {metric} is a count and takes no unit, not {unit!r}")
    return Threshold(key, value.strip(), scope, kind, metric, op, limit)


def _split_scope(key: str, workloads: list[str]) -> tuple[str | None, str]:
    # Longest name first, so workloads "a" and "a.b" both work; "total." names the default scope explicitly.
    for name in sorted(workloads, key=len, reverse=True):
        if key.startswith(name + "."):
            return name, key[len(name) + 1:]
    if key.startswith("total.") and "total" not in workloads:
        return None, key[len("total."):]
    return None, key


def _metric(key: str, name: str) -> tuple[str, str]:
    if name in ACCOUNTING:
        return "count", name
    if name == "generator_bound":
        return "bool", name
    head, _, stat = name.partition(".")
    if head == "rate":
        if stat not in RATES:
            raise ValueError(f"threshold {key!r}: unknown rate {stat!r} (use rate.{', rate.'.join(RATES)})")
        return "rate", name
    metric = ALIASES.get(head, head)
    if metric not in LATENCY:
        raise ValueError(f"threshold {key!r}: unknown metric {head!r}")
    if not stat:
        raise ValueError(f"threshold {key!r}: {head} needs a statistic, e.g. {head}.p99")
    if stat in LATENCY_STATS:
        return "latency", f"{metric}.{stat}"
    return "latency", f"{metric}.p{_format_pct(parse_percentile(key, stat))}"


def parse_percentile(key: str, stat: str) -> float:
    """`p99` -> 99, `p99.9`/`p99_9`/`p999` -> 99.9, `p9999` -> 99.99, `p995` -> 99.5; ValueError naming `key`
    otherwise."""
    digits = stat[1:].replace("_", ".") if stat.startswith("p") else ""
    if not re.fullmatch(r"\d+(\.\d+)?", digits):
        raise ValueError(f"threshold {key!r}: {stat!r} is not a statistic "
                         f"(use p<number>, {', '.join(LATENCY_STATS)})")
    if "." not in digits and len(digits) > 2 and digits.startswith("99"):
        digits = f"99.{digits[2:]}"  # the p999 shorthand: the digits after "99" are decimals
    pct = float(digits)
    if not 0 <= pct <= 100:
        raise ValueError(f"threshold {key!r}: percentile {pct:g} is not between 0 and 100")
    return pct


def _format_pct(pct: float) -> str:
    return f"{pct:g}"


def evaluate(thresholds: list[Threshold], summary: Mapping[str, Any]) -> list[dict]:
    """One result per threshold: {expr, scope, metric, op, limit, unit, actual, passed, note}.

    A latency statistic with no samples fails with actual None: an empty histogram says nothing about latency, and
    passing it would hide a workload that never ran.
    """
    results = []
    for t in thresholds:
        actual, note = _actual(t, summary)
        passed = actual is not None and OPS[t.op](actual, t.limit)
        unit = {"latency": "us", "rate": "msg/s", "bool": "", "count": ""}[t.kind]
        if t.metric.endswith(".count"):
            unit = ""
        results.append({"expr": t.expr, "scope": t.scope or "total", "metric": t.metric, "op": t.op,
                        "limit": t.limit, "unit": unit, "actual": actual, "passed": passed, "note": note})
    return results


def _actual(t: Threshold, summary: Mapping[str, Any]) -> tuple[Any, str]:
    section = summary.get("total") if t.scope is None else summary.get("workloads", {}).get(t.scope)
    if section is None:
        return None, f"no results for workload {t.scope or 'total'}"
    if t.kind == "bool":
        return bool(section.get("generator_bound", False)), ""
    if t.kind == "count":
        return section.get("accounting", {}).get(t.metric, 0), ""
    if t.kind == "rate":
        value = section.get("rates", {}).get(t.metric.split(".", 1)[1])
        return value, "" if value is not None else "no measure-phase intervals"
    metric, stat = t.metric.split(".", 1)
    entry = section.get("latency", {}).get(metric)
    if stat == "count":
        return (entry or {}).get("count", 0), ""
    if not entry or not entry.get("count"):
        return None, f"{metric} has no samples in {t.scope or 'total'}; fails rather than passing vacuously"
    if stat in entry:
        return entry[stat], ""
    pct = float(stat[1:])
    key = "p" + _format_pct(pct).replace(".", "_")
    if key in entry:
        return entry[key], ""
    if entry.get("hdr"):
        from hdrh.histogram import HdrHistogram  # only for percentiles the summary did not precompute

        return HdrHistogram.decode(entry["hdr"]).get_value_at_percentile(pct), ""
    return None, f"{metric} p{_format_pct(pct)} is not in the summary"
