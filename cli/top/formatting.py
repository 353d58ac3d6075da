"""How ``brokerctl top``'s rows are written out: ``--once``'s JSON and CSV, and the console's cells (human units,
and every control character escaped, since names and subjects are the clients' choice).

Apart from the data model (cli/top/model.py), which computes the rows and never writes them, and from the console
(cli/top/app.py), so that ``--once`` loads no terminal code.
"""

from __future__ import annotations

import csv
import io
import re
from typing import TYPE_CHECKING, Any

import orjson

from shardbroker.cli.top.views import LEAFS, QUEUES, SUBJECTS, WORKERS, View, sort_rows

if TYPE_CHECKING:
    from shardbroker.cli.top.model import Snapshot


# -- --once -----------------------------------------------------------------------------------------------------

def snapshot_json(snap: Snapshot, sorts: dict[str, str], limit: int) -> bytes:
    out: dict[str, Any] = {"server": snap.summary, "now": snap.varz.get("now"),
                           "workers": sort_rows(snap.workers, WORKERS, sorts.get("workers", "worker"))}
    if snap.subjects is not None:
        out["subjects"] = sort_rows(snap.subjects, SUBJECTS, sorts.get("subjects", "msgs_rate"))[:limit]
    if snap.queues is not None:
        out["queues"] = sort_rows(snap.queues, QUEUES, sorts.get("queues", "visible"))
    if snap.connections is not None:
        out["connections"] = snap.connections
        out["connections_total"] = snap.connections_total
    if snap.leafs is not None:
        out["leafs"] = sort_rows(snap.leafs, LEAFS, sorts.get("leafs", "worker"))
    return orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n"


def snapshot_csv(snap: Snapshot, view: View, sort: str, limit: int) -> str:
    rows = {"workers": snap.workers, "subjects": snap.subjects, "queues": snap.queues,
            "connections": snap.connections, "leafs": snap.leafs}[view.name] or []
    if view.name != "connections":
        rows = sort_rows(rows, view, sort)
    if view.name == "subjects":
        rows = rows[:limit]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([c.key for c in view.columns])
    for row in rows:
        writer.writerow(["" if row.get(c.key) is None else _csv_value(row[c.key]) for c in view.columns])
    return buf.getvalue()


def _csv_value(v: Any) -> Any:
    if isinstance(v, str):
        return printable(v)
    return round(v, 3) if isinstance(v, float) else v


# C0 and C1 controls, DEL included: what a terminal would act on (ESC starts CSI and OSC sequences; OSC 52 writes
# the clipboard).  Client names and subjects may hold them (nats-server allows any non-space byte in a subject).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character written as ``\\xNN``: what clients chose (names, subjects, queue
    names) reaches a terminal as text, never as commands to it."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# -- formatting, for the console --------------------------------------------------------------------------------

def human(v: Any, kind: str, raw: bool = False) -> str:
    if v is None:
        return "-"
    if kind == "str":
        return printable(str(v))
    if raw:
        return f"{v:.1f}" if isinstance(v, float) else str(v)
    if kind == "pct":
        return f"{v:.1f}"
    if kind == "secs":
        if v < 1:
            return f"{v * 1000:.1f}ms"
        if v < 120:
            return f"{v:.1f}s"
        return f"{v / 60:.0f}m" if v < 7200 else f"{v / 3600:.0f}h"
    if v == 0:
        return "0"
    if kind in ("bytes", "byterate"):
        return _scale(v, 1024, ("B", "K", "M", "G", "T"))
    if kind == "rate":
        return _scale(v, 1000, ("", "k", "M", "G"))
    return str(v)


def _scale(v: float, base: int, units: tuple[str, ...]) -> str:
    for unit in units:
        if abs(v) < base or unit == units[-1]:
            if unit == units[0]:
                return f"{v:.0f}{unit}" if isinstance(v, int) or v >= 10 or v == 0 else f"{v:.1f}{unit}"
            return f"{v:.1f}{unit}"
        v /= base
    return str(v)  # pragma: no cover
