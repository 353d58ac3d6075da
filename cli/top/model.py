"""What ``brokerctl top`` shows, computed from the monitoring endpoints; no terminal code here.

The console (cli/top/app.py) and ``--once`` both draw on this module: a ``Poller`` fetches only the endpoints the
current view needs (each request asks every worker over its control channel, so asking less is what keeps a 1 Hz
refresh cheap on the broker), and turns successive snapshots into rates.  Counters are cumulative on the broker; a
rate is the difference between two snapshots over the time between them, taken from the server's own ``now``
where the endpoint gives one (nats-top does the same).  A worker that was replaced starts its counters from zero:
its rows are keyed by (worker, pid), so a restart shows as a gap, never as a negative rate.

Fields that the broker may not report yet (per-worker CPU, RSS, pending bytes, event-loop lag, restarts, state)
are looked up under the names listed in ``_ALIASES`` and shown when present.  CPU and RSS fall back to reading
the worker processes with psutil when the monitoring address is on this machine.
"""

from __future__ import annotations

import csv
import http.client
import io
import ipaddress
import re
import socket
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable
from urllib.parse import urlencode, urlsplit

import orjson

DEFAULT_URL = "http://127.0.0.1:8222"

# Subject counters reach their owner once a second, so a 1 s difference jumps between 0 and twice the real rate:
# subject rates are averaged over this many seconds (at least one interval).
SUBJECT_WINDOW = 3.0

DOWN = ("unresponsive", "dead")   # worker states whose counters /varz leaves out


class Unreachable(Exception):
    """The monitoring endpoint did not answer; ``str()`` is one line for the operator."""


class BadRequest(Exception):
    """The endpoint answered 4xx (a query parameter this broker does not know)."""


def monitor_url(monitor: str | None, host: str | None) -> str:
    """``--monitor`` (a URL, HOST:PORT or a port) and ``--host`` (the host alone) as a base URL."""
    url = monitor or DEFAULT_URL
    if url.isdigit():
        url = f"127.0.0.1:{url}"
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http URL: {monitor}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 8222)
    except ValueError:
        raise ValueError(f"bad port in {monitor}") from None
    hostname = host or parts.hostname
    if ":" in hostname:
        hostname = f"[{hostname}]"
    return f"{parts.scheme}://{hostname}:{port}{parts.path.rstrip('/')}"


def is_local(url: str) -> bool:
    """Whether the monitoring address is on this machine (then the worker PIDs it reports are ours to read)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Client:
    """GET JSON from the monitoring port.  No proxy: the monitoring port is an internal address, and an
    ``http_proxy`` set for the outside world would otherwise swallow ``127.0.0.1``."""

    def __init__(self, base: str, timeout: float = 5.0) -> None:
        self.base = base
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.requests = 0

    def get(self, path: str, **query: Any) -> dict:
        q = {k: v for k, v in query.items() if v is not None}
        url = self.base + path + ("?" + urlencode(q) if q else "")
        self.requests += 1
        try:
            with self._opener.open(url, timeout=self.timeout) as resp:
                return orjson.loads(resp.read())
        except urllib.error.HTTPError as err:
            try:
                reason = orjson.loads(err.read()).get("error", "")
            except (orjson.JSONDecodeError, AttributeError):
                reason = ""
            if 400 <= err.code < 500 and err.code != 404:
                raise BadRequest(f"{err.code} {reason}".strip()) from None
            raise Unreachable(f"{self.base}{path} answered HTTP {err.code} {reason}".strip()
                              + ": is it a shardbroker monitoring port?") from None
        except http.client.HTTPException:  # something that does not speak HTTP (a client port, say)
            raise Unreachable(f"{self.base} does not answer HTTP: is it a shardbroker monitoring port?") from None
        except (urllib.error.URLError, OSError, socket.timeout) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, (TimeoutError, socket.timeout)) or isinstance(err, TimeoutError):
                reason = f"no answer within {self.timeout:g}s"
            elif isinstance(reason, OSError):
                reason = reason.strerror or reason
            raise Unreachable(f"cannot reach the monitoring endpoint {self.base}: {reason}") from None
        except orjson.JSONDecodeError:
            raise Unreachable(f"{self.base}{path} did not answer JSON: is it a shardbroker monitoring port?") \
                from None


# -- rates ---------------------------------------------------------------------------------------------------------

class Rates:
    """Per-key counter history; ``rate`` is the change per second over about ``window`` seconds."""

    def __init__(self) -> None:
        self._hist: dict[Any, deque] = {}

    def update(self, key: Any, t: float, values: dict[str, float], window: float) -> dict[str, float | None]:
        hist = self._hist.get(key)
        if hist is None:
            hist = self._hist[key] = deque()
        elif hist and t - hist[-1][0] > max(3 * window, 10.0):
            hist.clear()  # not polled for a while (its view was closed): an average over the gap says little
        # Keep the newest sample at least `window` old as the reference; anything older is dropped.
        while len(hist) > 1 and t - hist[1][0] >= window - 1e-3:
            hist.popleft()
        out: dict[str, float | None] = {}
        if hist:
            t0, old = hist[0]
            dt = t - t0
            for name, v in values.items():
                before = old.get(name)
                out[name] = None if before is None or dt <= 0 or v < before else (v - before) / dt
        else:
            out = dict.fromkeys(values)
        if any(v is not None and hist and v < hist[-1][1].get(k, v) for k, v in values.items()):
            hist.clear()  # a counter went back: the broker side restarted, start over from here
        hist.append((t, values))
        return out

    def forget(self, keep: Iterable[Any]) -> None:
        """Drop the history of keys not seen in the last snapshot (closed connections, idle subjects)."""
        keep = set(keep)
        for key in [k for k in self._hist if k not in keep]:
            del self._hist[key]


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

VIEWS = {v.name: v for v in (WORKERS, SUBJECTS, QUEUES, CONNECTIONS)}

# nats-server's /connz sort keys (monitor_sort_opts.go) for our columns, and the order nats-server sorts them in.
NATS_CONN_SORT = {"cid": "cid", "subs": "subs", "pending": "pending", "msgs_to": "msgs_to",
                  "msgs_from": "msgs_from", "bytes_to": "bytes_to", "bytes_from": "bytes_from", "uptime": "uptime",
                  "idle": "idle", "rtt": "rtt"}
ASCENDING = {"cid", "worker", "pid", "subject", "queue", "owner", "host", "protocol", "name", "user", "lang",
             "version", "state", "idle", "patterns"}


def sort_rows(rows: list[dict], view: View, key: str, reverse: bool = False) -> list[dict]:
    """Rows sorted as a console user expects: numbers biggest first, names A-Z; missing values last."""
    ascending = key in ASCENDING
    if key == "uptime":    # as nats-server: the newest connection first
        getter: Callable[[dict], Any] = lambda r: r.get("start") or None  # noqa: E731
    elif key == "idle" and view is CONNECTIONS:   # the longest idle first: the oldest activity
        getter = lambda r: r.get("last_activity") or None  # noqa: E731
    elif key == "rtt" and view is CONNECTIONS:
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


# -- the fields the broker may or may not report ------------------------------------------------------------

_ALIASES = {
    "pending_bytes": ("pending_bytes", "pending"),
    "cpu": ("cpu", "cpu_percent"),
    "rss": ("rss", "rss_bytes", "mem"),
    "fds": ("fds", "open_fds", "num_fds"),
    "loop_lag": ("loop_lag_seconds", "loop_lag"),
    "loop_lag_max": ("loop_lag_max_seconds", "loop_lag_max"),
    "heartbeat_age": ("heartbeat_age", "heartbeat_age_seconds"),
    "restarts": ("restarts", "restart_count"),
    "state": ("state", "status"),
}


def _field(d: dict, name: str) -> Any:
    for alias in _ALIASES[name]:
        v = d.get(alias)
        if v is not None and not isinstance(v, (dict, list)):
            return v
    return None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|µs|us|ns)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}


def duration(text: Any) -> float | None:
    """Seconds in a duration as nats-server writes them ("1m2.5s", "350µs"), or None."""
    if not isinstance(text, str) or not text:
        return None
    parts = _DURATION.findall(text)
    return sum(float(n) * _UNITS[u] for n, u in parts) if parts else None


def parse_now(value: Any, fallback: float) -> float:
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return fallback


class LocalProcesses:
    """CPU% and RSS of worker processes read here, for brokers whose /varz does not report them per worker."""

    def __init__(self) -> None:
        self._procs: dict[int, Any] = {}
        try:
            import psutil
            self._psutil: Any = psutil
        except ImportError:  # pragma: no cover - psutil is a dependency of the broker
            self._psutil = None

    def read(self, pid: int) -> tuple[float | None, int | None, int | None]:
        """(CPU percent since the last read, RSS bytes, open fds) of a broker worker, or Nones."""
        ps = self._psutil
        if ps is None or not pid:
            return None, None, None
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = ps.Process(pid)
                if "broker-worker" not in proc.cmdline():
                    return None, None, None
                self._procs[pid] = proc
                proc.cpu_percent(None)
                cpu = None
            else:
                cpu = round(proc.cpu_percent(None), 1)
            with proc.oneshot():
                rss = proc.memory_info().rss
                fds = proc.num_fds() if hasattr(proc, "num_fds") else None
            return cpu, rss, fds
        except (ps.Error, OSError):
            self._procs.pop(pid, None)
            return None, None, None


# -- the poller -------------------------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """One refresh: the header, and the rows of whatever was fetched (None: not fetched this time)."""
    t: float
    varz: dict
    summary: dict
    workers: list[dict]
    subjects: list[dict] | None = None
    queues: list[dict] | None = None
    connections: list[dict] | None = None
    connections_total: int | None = None
    connections_sorted_by: str = ""   # "server" or "client"
    connections_sort: str = ""        # the key they were fetched sorted by (server)
    subscribers: list[dict] | None = None
    subject_detail: dict | None = None


class Poller:
    """Fetch and compute.  Not thread-safe: one refresh at a time (the console runs it in a worker thread)."""

    def __init__(self, client: Client, interval: float = 1.0, limit: int = 50, local: bool | None = None) -> None:
        self.client = client
        self.interval = interval
        self.limit = limit
        self.rates = {name: Rates() for name in ("workers", "subjects", "queues", "connections", "subscribers")}
        self.local = LocalProcesses() if (is_local(client.base) if local is None else local) else None
        self.server_sorts: bool | None = None   # does /connz honour sort= (learned once)
        self._bad_sorts: set[str] = set()       # keys this server refused
        self._slow_seen: int | None = None

    # -- endpoints --------------------------------------------------------------------------------------
    def poll(self, want: Iterable[str] = ("workers",), conn_sort: str = "cid", subject: str | None = None) -> Snapshot:
        """One refresh: /varz always, then the views in ``want`` ("subjects", "queues", "connections"), and with
        ``subject`` the subscribers of that subject (/connz?subs=1, filtered here)."""
        want = set(want)
        varz = self.client.get("/varz")
        t = parse_now(varz.get("now"), time.time())
        workers = self._workers(varz, t)
        snap = Snapshot(t=t, varz=varz, summary=self._summary(varz, workers), workers=workers)
        if "subjects" in want:
            snap.subjects = self._subjects()
        if "queues" in want:
            snap.queues = self._queues()
        if "connections" in want:
            pending = self._connections(snap, conn_sort)
            if pending is not None and all(w.get("pending_bytes") is None for w in workers):
                # the broker does not count it per worker, but every connection was fetched: add them up
                for w in workers:
                    if w.get("state") not in DOWN:
                        w["pending_bytes"] = pending.get(w["worker"], 0)
                snap.summary["pending_bytes"] = sum(pending.values())
        if subject is not None:
            self._subscribers(snap, subject)
        return snap

    def _workers(self, varz: dict, t: float) -> list[dict]:
        rows = []
        rates = self.rates["workers"]
        for w in varz.get("workers", []):
            pid = w.get("pid", 0)
            row: dict[str, Any] = {"worker": w.get("worker"), "pid": pid}
            if w.get("unresponsive") or _field(w, "state") in DOWN:
                # the supervisor's own fields only: its counters are left out, as /varz leaves them out of the totals
                row.update(state=_field(w, "state") or "unresponsive", restarts=_field(w, "restarts"),
                           heartbeat_age=_field(w, "heartbeat_age"), rss=_field(w, "rss"), cpu=_field(w, "cpu"))
                rows.append(row)
                continue
            fabric = w.get("fabric") or {}
            row.update({
                "state": _field(w, "state") or "ready",
                "connections": w.get("connections", 0), "subscriptions": w.get("subscriptions", 0),
                "in_msgs": w.get("in_msgs", 0), "out_msgs": w.get("out_msgs", 0),
                "in_bytes": w.get("in_bytes", 0), "out_bytes": w.get("out_bytes", 0),
                "pending_bytes": _field(w, "pending_bytes"), "slow_consumers": w.get("slow_consumers", 0),
                "fabric_stalls": fabric.get("stalls", 0),
                "fabric_lost": fabric.get("lost_messages", 0) + fabric.get("dropped_messages", 0),
                "owned_subjects": w.get("owned_subjects"),
                "cpu": _field(w, "cpu"), "rss": _field(w, "rss"), "fds": _field(w, "fds"),
                "loop_lag": _field(w, "loop_lag"), "loop_lag_max": _field(w, "loop_lag_max"),
                "heartbeat_age": _field(w, "heartbeat_age"), "restarts": _field(w, "restarts"),
            })
            if self.local is not None and (row["cpu"] is None or row["rss"] is None):
                cpu, rss, fds = self.local.read(pid)
                row["cpu"] = row["cpu"] if row["cpu"] is not None else cpu
                row["rss"] = row["rss"] if row["rss"] is not None else rss
                row["fds"] = row["fds"] if row["fds"] is not None else fds
            r = rates.update((row["worker"], pid), t, {k: row[k] for k in ("in_msgs", "out_msgs", "in_bytes",
                                                                           "out_bytes")}, self.interval * 0.9)
            row.update(msgs_in_rate=r["in_msgs"], msgs_out_rate=r["out_msgs"],
                       bytes_in_rate=r["in_bytes"], bytes_out_rate=r["out_bytes"])
            rows.append(row)
        rates.forget((r["worker"], r["pid"]) for r in rows)
        return rows

    def _summary(self, varz: dict, workers: list[dict]) -> dict:
        def total(key: str) -> float | None:
            vals = [w.get(key) for w in workers if w.get(key) is not None]
            return sum(vals) if vals else None
        ready = sum(1 for w in workers if w.get("state") not in DOWN)
        slow = varz.get("slow_consumers", 0)
        slow_delta = 0 if self._slow_seen is None else max(0, slow - self._slow_seen)
        self._slow_seen = slow
        state = varz.get("state")
        if not state:
            ldm = varz.get("lame_duck_mode", varz.get("ldm"))
            state = "lame duck" if ldm else "ready" if ready == len(workers) else "degraded"
        name = varz.get("server_name", "")
        return {
            "server_name": "" if name == varz.get("server_id") else name,
            "version": varz.get("broker") or varz.get("version", ""),
            "uptime": varz.get("uptime", ""), "state": state, "config_load_time": varz.get("config_load_time"),
            "workers_ready": ready, "workers_total": varz.get("worker_count", len(workers)),
            "connections": varz.get("connections", 0), "max_connections": varz.get("max_connections"),
            "total_connections": varz.get("total_connections", 0), "subscriptions": varz.get("subscriptions", 0),
            "in_msgs": varz.get("in_msgs", 0), "out_msgs": varz.get("out_msgs", 0),
            "in_bytes": varz.get("in_bytes", 0), "out_bytes": varz.get("out_bytes", 0),
            "msgs_in_rate": total("msgs_in_rate"), "msgs_out_rate": total("msgs_out_rate"),
            "bytes_in_rate": total("bytes_in_rate"), "bytes_out_rate": total("bytes_out_rate"),
            "slow_consumers": slow, "slow_consumers_new": slow_delta,
            "fabric_lost": varz.get("fabric_lost_messages", 0) + varz.get("fabric_dropped_messages", 0),
            "fabric_stalls": varz.get("fabric_stalls", 0),
            "mem": varz.get("mem", 0), "cpu": varz.get("cpu", 0.0), "cores": varz.get("cores"),
            "pending_bytes": total("pending_bytes"),
        }

    def _subjects(self) -> list[dict]:
        # Rates need the same subjects from one refresh to the next: ask for more than a screenful.
        body = self.client.get("/topicz", limit=max(self.limit, 200))
        t = time.time()
        rates = self.rates["subjects"]
        rows = []
        for s in body.get("subjects", []):
            r = rates.update(s["subject"], t, {"msgs": s.get("msgs", 0), "bytes": s.get("bytes", 0)},
                             max(SUBJECT_WINDOW, self.interval) - 0.1 * self.interval)
            last = s.get("last")
            rows.append({"subject": s["subject"], "owner": s.get("owner"), "msgs": s.get("msgs", 0),
                         "bytes": s.get("bytes", 0), "msgs_rate": r["msgs"], "bytes_rate": r["bytes"],
                         "idle": max(0.0, t - last) if isinstance(last, (int, float)) else None})
        rates.forget(r["subject"] for r in rows)
        return rows

    def _queues(self) -> list[dict]:
        body = self.client.get("/queuez")
        t = time.time()
        rates = self.rates["queues"]
        rows = []
        for q in body.get("queues", []):
            key = f"{q.get('queue')}@{q.get('owner')}"
            counters = {k: q.get(k, 0) for k in ("pushed", "delivered", "acked")}
            r = rates.update(key, t, counters, self.interval * 0.9)
            age = q.get("oldest_visible_age_ms")
            rows.append({"key": key, "queue": q.get("queue"), "owner": q.get("owner"),
                         "visible": q.get("visible", 0), "in_flight": q.get("in_flight", 0),
                         "delayed": q.get("delayed", 0), "waiters": q.get("waiters", 0),
                         "bytes": q.get("bytes", 0), "redelivered": q.get("redelivered", 0),
                         "dead_lettered": q.get("dead_lettered", 0),
                         "oldest_visible_age": age / 1000 if isinstance(age, (int, float)) else None,
                         "pushed_rate": r["pushed"], "delivered_rate": r["delivered"], "acked_rate": r["acked"],
                         **{k: q.get(k, 0) for k in ("pushed", "delivered", "acked", "nacked", "expired")}})
        rates.forget(r["key"] for r in rows)
        return rows

    def _probe_sort(self) -> bool:
        """Whether /connz sorts before its limit (nats-server's ``sort=``).  A server that knows ``sort=`` refuses
        a key it does not know, as nats-server does (400); one that ignores it answers 200."""
        try:
            body = self.client.get("/connz", sort="no-such-key", limit=0)
        except BadRequest:
            return True
        return body.get("sort") not in (None, "")

    def _connections(self, snap: Snapshot, sort: str) -> dict[int, int] | None:
        """Fill ``snap.connections``; return the pending bytes per worker when every connection was fetched."""
        if self.server_sorts is None:
            self.server_sorts = self._probe_sort()
        nats_key = NATS_CONN_SORT.get(sort)
        body = None
        if self.server_sorts and nats_key and nats_key not in self._bad_sorts:
            try:
                body = self.client.get("/connz", sort=nats_key, limit=self.limit)
                snap.connections_sorted_by = "server"
                snap.connections_sort = sort
            except BadRequest:
                self._bad_sorts.add(nats_key)
        if body is None:
            # Sorting here needs every connection; the broker pages by cid, so ask for all of them.
            body = self.client.get("/connz", limit=1_000_000)
            snap.connections_sorted_by = "client"
        t = parse_now(body.get("now"), time.time())
        rows = [self._conn_row(c, t) for c in body.get("connections", [])]
        self.rates["connections"].forget(r["cid"] for r in rows)
        total = body.get("total", len(rows))
        pending: dict[int, int] | None = None
        if len(rows) == total:
            pending = {}
            for r in rows:
                pending[r["worker"]] = pending.get(r["worker"], 0) + (r["pending"] or 0)
        snap.connections = sort_rows(rows, CONNECTIONS, sort)[:self.limit]
        snap.connections_total = total
        return pending

    def _conn_row(self, c: dict, t: float, rates_name: str = "connections") -> dict:
        r = self.rates[rates_name].update(c.get("cid"), t, {"out_msgs": c.get("out_msgs", 0),
                                                            "in_msgs": c.get("in_msgs", 0)}, self.interval * 0.9)
        ip, port = c.get("ip", ""), c.get("port", "")
        return {
            "cid": c.get("cid"), "worker": c.get("worker"), "protocol": c.get("protocol") or c.get("type", ""),
            "host": f"[{ip}]:{port}" if ":" in str(ip) else f"{ip}:{port}",
            "name": c.get("name", ""), "user": c.get("authorized_user", ""),
            "subs": c.get("subscriptions", 0), "pending": c.get("pending_bytes", 0),
            "msgs_to": c.get("out_msgs", 0), "msgs_from": c.get("in_msgs", 0),
            "bytes_to": c.get("out_bytes", 0), "bytes_from": c.get("in_bytes", 0),
            "msgs_to_rate": r["out_msgs"], "msgs_from_rate": r["in_msgs"],
            "lang": c.get("lang", ""), "version": c.get("version", ""),
            "start": c.get("start", ""), "uptime": c.get("uptime", ""),
            "idle": c.get("idle"), "last_activity": c.get("last_activity"), "rtt": c.get("rtt"),
            "rtt_seconds": duration(c.get("rtt")),
        }

    def _subscribers(self, snap: Snapshot, subject: str) -> None:
        """The connections that receive ``subject``: every connection's subscriptions, matched here (the broker
        has no reverse index to ask; only fetched while the drill-down is open)."""
        from shardbroker.router.subjects import covers

        body = self.client.get("/connz", subs=1, limit=1_000_000)
        t = parse_now(body.get("now"), time.time())
        rows = []
        for c in body.get("connections", []):
            patterns = [p for p in c.get("subscriptions_list", []) if covers(p, subject)]
            if patterns:
                row = self._conn_row(c, t, "subscribers")
                row["patterns"] = " ".join(patterns)
                row["slow"] = "!" if row["pending"] and snap.varz.get("max_pending") and \
                    row["pending"] > snap.varz["max_pending"] / 2 else ""
                rows.append(row)
        self.rates["subscribers"].forget(r["cid"] for r in rows)
        snap.subscribers = sort_rows(rows, SUBSCRIBERS, "msgs_to_rate")
        detail = self.client.get("/topicz", subject=subject).get("subjects", [])
        snap.subject_detail = detail[0] if detail else {"subject": subject, "msgs": 0, "bytes": 0}


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
    return orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n"


def snapshot_csv(snap: Snapshot, view: View, sort: str, limit: int) -> str:
    rows = {"workers": snap.workers, "subjects": snap.subjects, "queues": snap.queues,
            "connections": snap.connections}[view.name] or []
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
