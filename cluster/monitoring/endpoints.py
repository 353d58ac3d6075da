"""Monitoring endpoints, served by the supervisor and answered by the workers.

Every request asks each worker over its control channel and aggregates the replies, so a worker whose event loop is
stuck shows up as unresponsive instead of looking healthy (the reason not to answer from a side thread).  Field
names follow nats-server's monitoring (``/varz``, ``/connz``, ``/subsz``, ``/leafz``, ``/healthz``) so existing
tooling finds what it expects; see docs/operations.md.  ``/metrics`` renders the same replies for Prometheus
(cluster/monitoring/metrics.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from shardbroker.cluster.config import tls_settings
from shardbroker.cluster.monitoring import connz, leafz
from shardbroker.cluster.monitoring.httpd import Body, HttpServer
from shardbroker.cluster.monitoring.processes import ProcessTable, max_fds
from shardbroker.cluster.security.tls import enabled as tls_enabled
from shardbroker.cluster.security.tls import expiry as tls_expiry

if TYPE_CHECKING:
    from shardbroker.cluster.config import Config


class Cluster(Protocol):
    """What the endpoints read from the supervisor (cluster.supervisor.core.Supervisor), named here rather than
    imported: the supervisor imports this module."""

    config: Config
    nworkers: int
    listeners: list[Any]  # acceptor.Listener
    started: float
    server_id: str
    slots: list[Any]  # supervisor.slots.WorkerSlot | None, by worker index
    tls_contexts: dict[str, Any]   # listener -> ssl.SSLContext (cluster.security.tls)
    tls_material: dict[str, str]   # certificate files as read
    admission: Any    # admission.Admission: its breaches
    acceptor: Any     # acceptor.Acceptor or None: its accept errors

    def server_info(self) -> dict: ...

    async def query(self, message: dict, timeout: float = 2.0) -> list[dict]: ...


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return "".join(f"{v}{u}" for v, u in ((d, "d"), (h, "h"), (m, "m")) if v) + f"{s}s"


class Monitor:
    def __init__(self, supervisor: Cluster) -> None:
        self.sup = supervisor
        self._http = HttpServer(self._route, tls=self._tls)
        self.address: tuple[str, int] = ("", 0)
        self._procs = ProcessTable()

    async def start(self, sock=None) -> None:
        cfg = self.sup.config
        self.address = await self._http.start(cfg.monitoring.bind, cfg.monitoring.port, sock)

    def describe(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"   # as the client listeners write theirs

    def _tls(self) -> tuple[Any, float] | None:
        """HTTPS for the next connection (monitoring.tls), with the contexts of the last reload."""
        ctx = self.sup.tls_contexts.get("monitoring")
        settings = tls_settings(self.sup.config, "monitoring")
        if ctx is None or settings is None:
            return None
        return ctx, settings.handshake_timeout

    def _tls_not_after(self) -> dict[str, float]:
        out = {}
        for s in tls_enabled(self.sup.config):
            ends = tls_expiry(self.sup.tls_material.get(s.cert, ""))
            if ends is not None:
                out[s.listener] = ends
        return out

    def _tls_varz(self, replies: list[dict]) -> dict:
        """nats-server's TLS fields (for the NATS listener), this broker's handshake counts (every listener,
        monitoring's included), and each TLS listener's settings and certificate end."""
        cfg = self.sup.config
        counts = dict(self._http.tls_counts)
        for r in replies:
            for outcome, n in r.get("tls", {}).items():
                counts[outcome] = counts.get(outcome, 0) + n
        nats = tls_settings(cfg, "nats") if cfg.nats.enabled else None
        listeners = {}
        not_after = self._tls_not_after()
        for s in tls_enabled(cfg):
            ends = not_after.get(s.listener)
            listeners[s.listener] = {"min_version": s.min_version, "verify": s.verify or s.verify_and_map,
                                     "verify_and_map": s.verify_and_map, "handshake_first": s.handshake_first,
                                     "handshake_timeout": s.handshake_timeout,
                                     "cert_not_after": _iso(ends) if ends else ""}
        return {
            "tls_required": nats is not None,
            "tls_verify": bool(nats and (nats.verify or nats.verify_and_map)),
            "tls_timeout": nats.handshake_timeout if nats else 0,
            "tls_handshakes": counts.get("ok", 0),
            "tls_handshake_failures": sum(counts.get(k, 0) for k in ("failed", "timeout", "plaintext")),
            "tls_handshake_timeouts": counts.get("timeout", 0),
            "tls_plaintext_refused": counts.get("plaintext", 0),
            "tls_listeners": listeners,
        }

    async def close(self) -> None:
        await self._http.close()

    async def _route(self, path: str, query: dict[str, str], headers: dict[str, str]) -> tuple[int, object]:
        if path.rstrip("/") == "/metrics":
            return await self._metrics(headers.get("accept", ""))
        handler = {
            "/": self._index, "/healthz": self._healthz, "/varz": self._varz, "/connz": self._connz,
            "/subsz": self._subsz, "/leafz": self._leafz, "/topicz": self._topicz, "/queuez": self._queuez,
        }.get(path.rstrip("/") or "/")
        if handler is None:
            return 404, {"error": f"no such endpoint: {path}"}
        return await handler(query)

    async def _index(self, query: dict) -> tuple[int, object]:
        return 200, {"endpoints": ["/healthz", "/varz", "/connz", "/subsz", "/leafz", "/topicz", "/queuez",
                               "/metrics"]}

    async def _healthz(self, query: dict) -> tuple[int, object]:
        if self.sup.state in ("starting", "stopping"):
            ready = sum(1 for s in self.sup.slots if s is not None and s.state == "ready")
            return 503, {"status": "unavailable",
                         "error": f"{self.sup.state}: {ready} of {self.sup.nworkers} worker(s) ready"}
        replies = await self.sup.query({"k": "stats"}, timeout=2.0)
        bad = [r["worker"] for r in replies if r.get("unresponsive")]
        missing = self.sup.nworkers - len(replies)
        if bad or missing:
            return 503, {"status": "unavailable",
                         "error": f"{len(bad)} worker(s) unresponsive, {missing} not running"}
        deaf = self._not_reading(replies)
        if deaf:
            return 503, {"status": "unavailable", "error": "; ".join(deaf)}
        return 200, {"status": "ok"}

    def _not_reading(self, replies: list[dict]) -> list[str]:
        """Workers that answer the supervisor but have stopped taking the others' frames: a peer acknowledges at
        least once a second, so frames left unacknowledged for ``fabric.stall_timeout`` + 2 s mean it is not
        reading them (or is stopped)."""
        limit = self.sup.config.fabric.stall_timeout + 2.0
        found = []
        for r in replies:
            for peer, link in sorted(r.get("fabric", {}).get("links", {}).items()):
                if link.get("up") and link.get("unacked_seconds", 0) > limit:
                    found.append(f"worker {peer} has not acknowledged worker {r['worker']}'s frames for "
                                 f"{link['unacked_seconds']:.1f}s")
        return found

    async def _samples(self, pids: list[int]) -> dict[int, Any]:
        """psutil's figures for the supervisor and the given workers, by pid (absent: the process is gone); read
        on a thread, so that counting thousands of open files holds up no accept."""
        return await asyncio.to_thread(self._procs.sample_all, [os.getpid(), *pids])

    def _worker_entry(self, reply: dict, sample: Any, now: float) -> dict:
        """A worker's /varz entry: its stats reply, its loop lag flattened (the histogram is for /metrics), and
        what the supervisor knows of it (for brokerctl top)."""
        entry = {k: v for k, v in reply.items() if k != "loop_lag"}
        if "loop_lag" in reply:
            entry.update(loop_lag_seconds=reply["loop_lag"]["seconds"],
                         loop_lag_max_seconds=reply["loop_lag"]["max_seconds"])
        slot = self._slot(reply["worker"])
        if slot is not None and slot.pid != reply["pid"]:
            slot = None   # replaced since it answered
        entry["state"] = "unresponsive" if reply.get("unresponsive") else slot.state if slot is not None else "dead"
        if slot is not None:
            mono = time.monotonic()
            entry.update(restarts=slot.restarts, started_by=slot.process.started_by,
                         start=_iso(now - (mono - slot.started)), heartbeat_age=round(mono - slot.last_heartbeat, 3))
        if sample is not None:
            entry.update(rss=sample.rss, cpu=round(sample.cpu_percent, 1), cpu_seconds=round(sample.cpu_seconds, 2),
                         fds=sample.open_fds)
        return entry

    def _slot(self, index: int) -> Any:
        slots = self.sup.slots
        return slots[index] if 0 <= index < len(slots) else None

    async def _varz(self, query: dict) -> tuple[int, object]:
        sup, cfg = self.sup, self.sup.config
        replies = await sup.query({"k": "stats"})
        ok = [r for r in replies if not r.get("unresponsive")]
        total = lambda key: sum(r.get(key, 0) for r in ok)  # noqa: E731
        samples = await self._samples([r["pid"] for r in replies])
        counted = [samples.get(pid) for pid in [os.getpid(), *(r["pid"] for r in ok)]]
        mem = sum(s.rss for s in counted if s is not None)
        cpu = round(sum(s.cpu_percent for s in counted if s is not None), 1)
        now = time.time()
        workers = [self._worker_entry(r, samples.get(r["pid"]), now) for r in replies]
        listeners = {lst.protocol: lst.address for lst in sup.listeners}
        host, port = listeners.get("nats", listeners.get("ndjson", ("", 0)))
        fabric = lambda key: sum(r.get("fabric", {}).get(key, 0) for r in ok)  # noqa: E731
        info = sup.server_info()
        return 200, {
            "server_id": info["server_id"],
            "server_name": info["server_name"],
            "version": info["version"],
            "broker": info["broker"],
            "proto": 1,
            "host": host,
            "port": port,
            "ports": {name: addr[1] for name, addr in listeners.items()},
            "http_host": self.address[0],
            "http_port": self.address[1],
            "auth_required": cfg.security.enabled,
            "max_connections": cfg.limits.max_connections,
            "max_payload": cfg.nats.max_payload,
            "max_control_line": cfg.nats.max_control_line,
            "max_pending": cfg.limits.max_pending_bytes,
            "ping_interval": int(cfg.nats.ping_interval * 1e9),  # nanoseconds, as nats-server reports it
            "ping_max": cfg.nats.ping_max,
            "routes": 0,
            "remotes": 0,
            "leafnodes": leafz.connected(ok),      # leaf connections up now (each worker has its own)
            "leaf": leafz.varz_leaf(cfg.leafnodes),
            "start": _iso(sup.started),
            "state": sup.state,                    # starting, ready, reloading, lame duck, stopping
            "hot_path": ",".join(sorted({r.get("hot_path", "") for r in ok})),   # compiled or pure (speedups)
            "config_load_time": _iso(cfg.loaded or sup.started),   # as nats-server: the last reload that applied
            "config_digest": cfg.digest or "",                     # sha256 of that file (`sha256sum FILE`)
            "config_last_reload": _reload_of(sup.reloader),
            "now": _iso(now),
            "uptime": _uptime(now - sup.started),
            "mem": mem,
            "cpu": cpu,
            "cores": psutil.cpu_count(),
            "connections": total("connections"),
            "total_connections": total("total_connections"),
            "subscriptions": total("subscriptions"),
            "in_msgs": total("in_msgs"),
            "out_msgs": total("out_msgs"),
            "in_bytes": total("in_bytes"),
            "out_bytes": total("out_bytes"),
            "out_wire_bytes": total("out_wire_bytes"),
            "slow_consumers": total("slow_consumers"),
            "callback_errors": total("callback_errors"),
            "breaches": self._breaches(ok),
            "accept_errors": sup.acceptor.accept_errors if sup.acceptor is not None else 0,
            "pending_polls": total("pending_polls"),
            **self._tls_varz(ok),
            "fabric_lost_frames": fabric("lost_frames"),
            "fabric_lost_messages": fabric("lost_messages"),
            "fabric_dropped_messages": fabric("dropped_messages"),
            "fabric_stalls": fabric("stalls"),
            "worker_count": sup.nworkers,
            "workers": workers,
        }

    def _breaches(self, replies: list[dict]) -> dict[str, int]:
        """Limits broken, by limit: the supervisor's (connections) and the workers' summed."""
        out = dict(self.sup.admission.breaches)
        for r in replies:
            for limit, n in r.get("breaches", {}).items():
                out[limit] = out.get(limit, 0) + n
        return out

    async def _connz(self, query: dict) -> tuple[int, object]:
        """nats-server's /connz: ``sort=`` (cluster/monitoring/connz.py), ``offset=``, ``limit=`` (default 1024),
        ``cid=``,
        ``subs=1``.  Each worker sorts its own connections and sends only the first offset + limit."""
        subs = query.get("subs") in ("1", "true", "detail")
        sort = connz.check(query.get("sort"))
        offset = max(0, int(query.get("offset", 0) or 0))
        limit = max(0, int(query.get("limit", 1024) or 1024))
        ask = {"k": "stats", "what": "conns", "subs": subs, "sort": sort, "limit": offset + limit}
        if query.get("cid"):
            ask["cid"] = int(query["cid"])
        replies = await self.sup.query(ask)
        now = time.time()
        rows = [{**c, "worker": r["worker"]} for r in replies for c in r.get("conns", [])]
        page = connz.top(rows, sort, offset + limit, lambda c, f: c.get(f, 0), lambda c: c["cid"])[offset:]
        total = len(rows) if "cid" in ask else sum(r.get("connections", 0) for r in replies)
        for c in page:
            last = c.get("last_activity", c["start"])
            c.update(start=_iso(c["start"]), uptime=_uptime(now - c["start"]), last_activity=_iso(last),
                     idle=_uptime(max(0.0, now - last)))
            if "rtt" in c:
                c["rtt"] = _duration(c["rtt"])
        return 200, {
            "server_id": self.sup.server_id, "now": _iso(now), "num_connections": len(page),
            "total": total, "offset": offset, "limit": limit, "connections": page,
        }

    async def _subsz(self, query: dict) -> tuple[int, object]:
        replies = await self.sup.query({"k": "stats"})
        ok = [r for r in replies if not r.get("unresponsive")]
        return 200, {
            "num_subscriptions": sum(r.get("subscriptions", 0) for r in ok),
            "num_cache": sum(r.get("route_cache", 0) for r in ok),
            "num_patterns": sum(r.get("patterns", 0) for r in ok),
            "workers": [{"worker": r["worker"], "subscriptions": r.get("subscriptions", 0),
                         "patterns": r.get("patterns", 0), "remote_patterns": r.get("remote_patterns", 0)}
                        for r in ok],
        }

    async def _leafz(self, query: dict) -> tuple[int, object]:
        """nats-server's /leafz: every worker's leaf connections (cluster/monitoring/leafz.py); ``subs=1`` adds
        what each advertises to its hub, ``acc=`` keeps one account's."""
        subs = leafz.flag(query, "subs")
        replies = await self.sup.query({"k": "stats", "what": "leafz", "subs": subs})
        rows = leafz.leafs(replies, query.get("acc", ""))
        info = self.sup.server_info()
        return 200, {"server_id": info["server_id"], "server_name": info["server_name"], "now": _iso(time.time()),
                     "leafnodes": len(rows), "leafs": rows}

    async def _topicz(self, query: dict) -> tuple[int, object]:
        limit = max(1, int(query.get("limit", 100) or 100))
        msg = {"k": "stats", "what": "subjects", "limit": limit}
        if query.get("subject"):
            msg["subject"] = query["subject"]
        replies = await self.sup.query(msg)
        rows = []
        for r in replies:
            for row in r.get("subjects", []):
                rows.append({**row, "owner": r["worker"]})
        rows.sort(key=lambda row: row["msgs"], reverse=True)
        return 200, {"subjects": rows[:limit]}

    async def _queuez(self, query: dict) -> tuple[int, object]:
        """Every work queue, as its owner counts it (exact): ``?queue=`` for one."""
        replies = await self.sup.query({"k": "stats", "what": "queues", "queue": query.get("queue")})
        rows = sorted((row for r in replies for row in r.get("queues", [])), key=lambda row: row["queue"])
        return 200, {"queues": rows, "total": len(rows)}

    async def _metrics(self, accept: str) -> tuple[int, object]:
        """Prometheus' exposition of the workers' stats, their processes and their queues
        (cluster/monitoring/metrics.py)."""
        from shardbroker.cluster.monitoring import (
            metrics,  # prometheus_client is imported at the first scrape, not at start-up
        )

        sup, cfg = self.sup, self.sup.config
        replies = {r["worker"]: r for r in await sup.query({"k": "stats", "what": "queues"})}
        slots = [s for s in sup.slots if s is not None]
        samples = await self._samples([s.pid for s in slots if s.state != "dead"])
        wall, mono = time.time(), time.monotonic()
        workers = []
        for slot in slots:
            reply = replies.get(slot.index)
            answered = reply is not None and not reply.get("unresponsive") and reply.get("pid") == slot.pid
            workers.append(metrics.WorkerSample(
                index=slot.index, pid=slot.pid, restarts=slot.restarts,
                start_time=round(wall - (mono - slot.started), 3), heartbeat_age=mono - slot.last_heartbeat,
                stats=reply if answered else None, process=samples.get(slot.pid)))
        queues = [row for w in workers if w.stats is not None for row in w.stats.get("queues", [])]
        scrape = metrics.Scrape(
            workers=workers, supervisor=samples.get(os.getpid()), start_time=sup.started,
            max_fds=max_fds(), version=sup.server_info()["broker"].rpartition(" ")[2],
            nats_protocol=sup.server_info()["version"], max_connections=cfg.limits.max_connections,
            max_pending_bytes=cfg.limits.max_pending_bytes, queues=queues,
            breaches=dict(sup.admission.breaches),
            accept_errors=sup.acceptor.accept_errors if sup.acceptor is not None else 0,
            tls=dict(self._http.tls_counts), tls_not_after=self._tls_not_after(),
            config_loaded=cfg.loaded or sup.started, reloads=dict(sup.reloader.outcomes),
            reload_ok=sup.reloader.last is None or sup.reloader.last.ok)
        data, content_type = metrics.render(scrape, accept)
        return 200, Body(data, content_type)


def _reload_of(reloader) -> dict | None:
    """The last reload's outcome (None before any): a refused one keeps the running configuration, and only its
    log line said so."""
    last = reloader.last
    if last is None:
        return None
    return {"ok": last.ok, "at": _iso(reloader.last_at), "error": last.error, "restart": last.restart}


def _duration(seconds: float) -> str:
    """Go's time.Duration text, as nats-server writes ``rtt``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3f}".rstrip("0").rstrip(".") + "µs"
    if seconds < 1:
        return f"{seconds * 1e3:.6f}".rstrip("0").rstrip(".") + "ms"
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"
