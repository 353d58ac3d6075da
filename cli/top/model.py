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

The monitoring endpoint's address and HTTP client are in cli/top/endpoint.py, the views' columns and sorting in
cli/top/views.py, and the writing of rows (``--once``'s JSON and CSV, the console's cells) in cli/top/formatting.py.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shardbroker.cli.top.endpoint import BadRequest, Client, is_local
from shardbroker.cli.top.views import CONNECTIONS, LEAFS, NATS_CONN_SORT, SUBSCRIBERS, sort_rows

# Subject counters reach their owner once a second, so a 1 s difference jumps between 0 and twice the real rate:
# subject rates are averaged over this many seconds (at least one interval).
SUBJECT_WINDOW = 3.0

DOWN = ("unresponsive", "dead")   # worker states whose counters /varz leaves out


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
    leafs: list[dict] | None = None
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
        self.rates = {name: Rates() for name in ("workers", "subjects", "queues", "connections", "subscribers",
                                                 "leafs")}
        self.local = LocalProcesses() if (is_local(client.base) if local is None else local) else None
        self.server_sorts: bool | None = None   # does /connz honour sort= (learned once)
        self._bad_sorts: set[str] = set()       # keys this server refused
        self._slow_seen: int | None = None

    # -- endpoints --------------------------------------------------------------------------------------
    def poll(self, want: Iterable[str] = ("workers",), conn_sort: str = "cid", subject: str | None = None) -> Snapshot:
        """One refresh: /varz always, then the views in ``want`` ("subjects", "queues", "connections", "leafs"),
        and with ``subject`` the subscribers of that subject (/connz?subs=1, filtered here)."""
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
        if "leafs" in want:
            snap.leafs = self._leafs(varz)
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
            # leaf connections to NATS hubs (/varz: up now; each worker's stats: how many it keeps)
            "leafnodes": varz.get("leafnodes", 0),
            "leafnode_links": sum((w.get("leafnodes") or {}).get("remotes", 0) for w in varz.get("workers", [])
                                  if isinstance(w.get("leafnodes"), dict)),
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

    def _leafs(self, varz: dict) -> list[dict]:
        """The workers' leaf connections (/leafz), each keyed by its worker and its place in that worker's list
        (a worker's links all carry one name); not asked of a broker with no leaf remotes configured."""
        if not (varz.get("leaf") or {}).get("remotes"):
            return []
        body = self.client.get("/leafz")
        t = parse_now(body.get("now"), time.time())
        rates = self.rates["leafs"]
        rows = []
        place: dict[Any, int] = {}
        for x in body.get("leafs", []):
            worker = x.get("worker")
            place[worker] = place.get(worker, -1) + 1
            key = f"{worker}.{place[worker]}"
            r = rates.update(key, t, {"in_msgs": x.get("in_msgs", 0), "out_msgs": x.get("out_msgs", 0)},
                             self.interval * 0.9)
            rows.append({"key": key, "worker": worker, "name": x.get("name", ""), "state": x.get("state", ""),
                         "url": x.get("url", ""), "hub": x.get("hub", ""), "account": x.get("account", ""),
                         "rtt": x.get("rtt"), "rtt_seconds": duration(x.get("rtt")),
                         "msgs_in_rate": r["in_msgs"], "msgs_out_rate": r["out_msgs"],
                         "in_msgs": x.get("in_msgs", 0), "out_msgs": x.get("out_msgs", 0),
                         "in_bytes": x.get("in_bytes", 0), "out_bytes": x.get("out_bytes", 0),
                         "subs": x.get("subscriptions", 0), "hub_subs": x.get("hub_subscriptions"),
                         "connects": x.get("connects"), "reconnects": x.get("reconnects"),
                         "failures": x.get("failures"), "slow_consumers": x.get("slow_consumers"),
                         "oversize": x.get("oversize"), "last_error": x.get("last_error", "")})
        rates.forget(r["key"] for r in rows)
        return sort_rows(rows, LEAFS, "worker")

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
