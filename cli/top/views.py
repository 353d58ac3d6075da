"""``brokerctl top``'s views: each table's columns (the row fields, the console headers, how each is written) and
the key that names a row, and how rows are sorted, here or (connections) by the server as nats-server sorts.

Apart from the data model (cli/top/model.py) because the console, ``--once``'s output and the poller each read
these definitions, and none of them needs the others for that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# -- views: their columns, rows and sort keys ------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    key: str          # the row field, the CSV header and the sort key
    title: str        # the console header
    kind: str = "int"  # int, rate, bytes, byterate, pct, secs, str: how the console writes it


@dataclass(frozen=True)
class View:
    name: str
    columns: tuple[Column, ...]
    default_sort: str
    key: str          # which field names the row (stable across refreshes: the cursor follows it)

    def sort_keys(self) -> list[str]:
        return [c.key for c in self.columns]


WORKERS = View("workers", (
    Column("worker", "W"), Column("pid", "PID"), Column("state", "STATE", "str"),
    Column("connections", "CONNS"), Column("subscriptions", "SUBS"),
    Column("msgs_in_rate", "MSG/s IN", "rate"), Column("msgs_out_rate", "MSG/s OUT", "rate"),
    Column("bytes_in_rate", "B/s IN", "byterate"), Column("bytes_out_rate", "B/s OUT", "byterate"),
    Column("pending_bytes", "PENDING", "bytes"), Column("slow_consumers", "SLOW"),
    Column("fabric_stalls", "STALLS"), Column("fabric_lost", "LOST"), Column("owned_subjects", "OWNED"),
    Column("cpu", "CPU%", "pct"), Column("rss", "RSS", "bytes"), Column("fds", "FDS"),
    Column("loop_lag", "LAG", "secs"), Column("loop_lag_max", "LAG max", "secs"),
    Column("heartbeat_age", "HB", "secs"), Column("restarts", "RST"),
), default_sort="worker", key="worker")

SUBJECTS = View("subjects", (
    Column("subject", "SUBJECT", "str"), Column("owner", "OWNER"),
    Column("msgs_rate", "MSG/s", "rate"), Column("bytes_rate", "B/s", "byterate"),
    Column("msgs", "MSGS"), Column("bytes", "BYTES", "bytes"), Column("idle", "IDLE", "secs"),
), default_sort="msgs_rate", key="subject")

QUEUES = View("queues", (
    Column("queue", "QUEUE", "str"), Column("owner", "OWNER"),
    Column("visible", "VISIBLE"), Column("in_flight", "IN FLIGHT"), Column("delayed", "DELAYED"),
    Column("pushed_rate", "PUSH/s", "rate"), Column("delivered_rate", "DLVR/s", "rate"),
    Column("acked_rate", "ACK/s", "rate"), Column("waiters", "WAITERS"),
    Column("oldest_visible_age", "OLDEST", "secs"), Column("bytes", "BYTES", "bytes"),
    Column("redelivered", "REDLVR"), Column("dead_lettered", "DEAD"),
), default_sort="visible", key="key")

CONNECTIONS = View("connections", (
    Column("host", "HOST", "str"), Column("cid", "CID"), Column("worker", "W"), Column("protocol", "PROTO", "str"),
    Column("name", "NAME", "str"), Column("user", "USER", "str"), Column("subs", "SUBS"),
    Column("pending", "PENDING", "bytes"), Column("msgs_to", "MSGS_TO"), Column("msgs_from", "MSGS_FROM"),
    Column("bytes_to", "BYTES_TO", "bytes"), Column("bytes_from", "BYTES_FROM", "bytes"),
    Column("msgs_to_rate", "TO/s", "rate"), Column("msgs_from_rate", "FROM/s", "rate"),
    Column("lang", "LANG", "str"), Column("version", "VERSION", "str"), Column("uptime", "UPTIME", "str"),
    Column("idle", "IDLE", "str"), Column("rtt", "RTT", "str"),
), default_sort="cid", key="cid")

SUBSCRIBERS = View("subscribers", (
    Column("cid", "CID"), Column("worker", "W"), Column("host", "HOST", "str"), Column("protocol", "PROTO", "str"),
    Column("name", "NAME", "str"), Column("user", "USER", "str"), Column("patterns", "MATCHING", "str"),
    Column("pending", "PENDING", "bytes"), Column("msgs_to", "MSGS_TO"), Column("msgs_to_rate", "TO/s", "rate"),
    Column("slow", "", "str"),
), default_sort="msgs_to_rate", key="cid")

LEAFS = View("leafs", (
    Column("worker", "W"), Column("name", "NAME", "str"), Column("state", "STATE", "str"),
    Column("url", "URL", "str"), Column("hub", "HUB", "str"), Column("account", "ACCOUNT", "str"),
    Column("rtt", "RTT", "str"), Column("msgs_in_rate", "MSG/s IN", "rate"),
    Column("msgs_out_rate", "MSG/s OUT", "rate"),
    Column("in_msgs", "MSGS IN"), Column("out_msgs", "MSGS OUT"), Column("subs", "SUBS"),
    Column("hub_subs", "HUB SUBS"), Column("reconnects", "RECONN"), Column("slow_consumers", "SLOW"),
    Column("oversize", "OVERSIZE"), Column("last_error", "LAST ERROR", "str"),
), default_sort="worker", key="key")

VIEWS = {v.name: v for v in (WORKERS, SUBJECTS, QUEUES, CONNECTIONS, LEAFS)}

# nats-server's /connz sort keys (monitor_sort_opts.go) for our columns, and the order nats-server sorts them in.
NATS_CONN_SORT = {"cid": "cid", "subs": "subs", "pending": "pending", "msgs_to": "msgs_to",
                  "msgs_from": "msgs_from", "bytes_to": "bytes_to", "bytes_from": "bytes_from", "uptime": "uptime",
                  "idle": "idle", "rtt": "rtt"}
ASCENDING = {"cid", "worker", "pid", "subject", "queue", "owner", "host", "protocol", "name", "user", "lang",
             "version", "state", "idle", "patterns", "key", "url", "hub", "account", "last_error"}


def sort_rows(rows: list[dict], view: View, key: str, reverse: bool = False) -> list[dict]:
    """Rows sorted as a console user expects: numbers biggest first, names A-Z; missing values last."""
    ascending = key in ASCENDING
    if key == "uptime":    # as nats-server: the newest connection first
        getter: Callable[[dict], Any] = lambda r: r.get("start") or None  # noqa: E731
    elif key == "idle" and view is CONNECTIONS:   # the longest idle first: the oldest activity
        getter = lambda r: r.get("last_activity") or None  # noqa: E731
    elif key == "rtt" and view in (CONNECTIONS, LEAFS):
        getter = lambda r: r.get("rtt_seconds")  # noqa: E731
    else:
        getter = lambda r: r.get(key)  # noqa: E731
    present = [r for r in rows if getter(r) is not None]
    missing = [r for r in rows if getter(r) is None]
    tie = view.key
    present.sort(key=lambda r: (getter(r), _tiekey(r.get(tie))), reverse=(not ascending) != reverse)
    return present + missing


def _tiekey(v: Any) -> tuple:
    return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))
