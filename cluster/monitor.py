"""Monitoring endpoints, served by the supervisor and answered by the workers.

Every request asks each worker over its control channel and aggregates the replies, so a worker whose event loop is
stuck shows up as unresponsive instead of looking healthy (the reason not to answer from a side thread).  Field
names follow nats-server's monitoring (``/varz``, ``/connz``, ``/subsz``, ``/healthz``) so existing tooling finds
what it expects; see docs/operations.md.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from .httpd import HttpServer

if TYPE_CHECKING:
    from .config import Config


class Cluster(Protocol):
    """What the endpoints read from the supervisor (cluster.supervisor.Supervisor), named here rather than
    imported: the supervisor imports this module."""

    config: "Config"
    nworkers: int
    listeners: list[Any]  # acceptor.Listener
    started: float
    server_id: str

    def server_info(self) -> dict: ...

    async def query(self, message: dict, timeout: float = 2.0) -> list[dict]: ...


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return "".join(f"{v}{u}" for v, u in ((d, "d"), (h, "h"), (m, "m")) if v) + f"{s}s"


class Monitor:
    def __init__(self, supervisor: Cluster) -> None:
        self.sup = supervisor
        self._http = HttpServer(self._route)
        self.address: tuple[str, int] = ("", 0)
        self._procs: dict[int, psutil.Process] = {}

    async def start(self) -> None:
        cfg = self.sup.config
        self.address = await self._http.start(cfg.bind_for(cfg.monitoring.bind), cfg.monitoring.port)

    def describe(self) -> str:
        host, port = self.address
        return f"{host}:{port}"

    async def close(self) -> None:
        await self._http.close()

    async def _route(self, path: str, query: dict[str, str]) -> tuple[int, object]:
        handler = {
            "/": self._index, "/healthz": self._healthz, "/varz": self._varz, "/connz": self._connz,
            "/subsz": self._subsz, "/topicz": self._topicz, "/queuez": self._queuez,
        }.get(path.rstrip("/") or "/")
        if handler is None:
            return 404, {"error": f"no such endpoint: {path}"}
        return await handler(query)

    async def _index(self, query: dict) -> tuple[int, object]:
        return 200, {"endpoints": ["/healthz", "/varz", "/connz", "/subsz", "/topicz", "/queuez"]}

    async def _healthz(self, query: dict) -> tuple[int, object]:
        replies = await self.sup.query({"k": "stats"}, timeout=2.0)
        bad = [r["worker"] for r in replies if r.get("unresponsive")]
        missing = self.sup.nworkers - len(replies)
        if bad or missing:
            return 503, {"status": "unavailable",
                         "error": f"{len(bad)} worker(s) unresponsive, {missing} not running"}
        return 200, {"status": "ok"}

    def _resources(self, pids: list[int]) -> tuple[int, float]:
        """(RSS bytes, CPU percent) of the supervisor and the given workers."""
        rss, cpu = 0, 0.0
        for pid in [os.getpid()] + pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                rss += proc.memory_info().rss
                cpu += proc.cpu_percent(None)
            except psutil.Error:
                self._procs.pop(pid, None)
        return rss, round(cpu, 1)

    async def _varz(self, query: dict) -> tuple[int, object]:
        sup, cfg = self.sup, self.sup.config
        replies = await sup.query({"k": "stats"})
        ok = [r for r in replies if not r.get("unresponsive")]
        total = lambda key: sum(r.get(key, 0) for r in ok)  # noqa: E731
        mem, cpu = self._resources([r["pid"] for r in ok])
        now = time.time()
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
            "leafnodes": 0,
            "start": _iso(sup.started),
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
            "fabric_lost_frames": fabric("lost_frames"),
            "fabric_lost_messages": fabric("lost_messages"),
            "fabric_dropped_messages": fabric("dropped_messages"),
            "fabric_stalls": fabric("stalls"),
            "worker_count": sup.nworkers,
            "workers": replies,
        }

    async def _connz(self, query: dict) -> tuple[int, object]:
        subs = query.get("subs") in ("1", "true", "detail")
        replies = await self.sup.query({"k": "stats", "what": "conns", "subs": subs})
        now = time.time()
        conns = []
        for r in replies:
            for c in r.get("conns", []):
                conns.append({**c, "worker": r["worker"], "start": _iso(c["start"]),
                              "uptime": _uptime(now - c["start"])})
        conns.sort(key=lambda c: c["cid"])
        offset = max(0, int(query.get("offset", 0) or 0))
        limit = max(0, int(query.get("limit", 1024) or 1024))
        page = conns[offset:offset + limit]
        return 200, {
            "server_id": self.sup.server_id, "now": _iso(now), "num_connections": len(page),
            "total": len(conns), "offset": offset, "limit": limit, "connections": page,
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
