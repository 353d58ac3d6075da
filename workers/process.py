"""A worker process: one event loop, its share of the connections, its shard of the subjects.

Forked by the fork server (``workers.forkserver``), or started by the supervisor as a fresh interpreter
(``cluster.supervisor.launch``); either way ``workers.entry`` calls ``main``, and nothing of the supervisor's loop
is inherited.  Its life:

1. boot: event loop, hub, fabric; hello to every other worker.  Any failure here is reported to the supervisor
   (``boot_error``) and the process exits with ``EXIT_BOOT_FAILED``, which stops the supervisor instead of making
   it respawn forever.
2. ready: adopt the client sockets the supervisor hands over, heartbeat from inside the loop (four beats per
   ``workers.heartbeat_timeout``, at most one a second: a blocked loop stops them and gets the worker replaced;
   a loop that merely lagged says so in the log).
3. stop (``stop`` order or SIGTERM): stop reading, send what is already queued to clients, close, exit 0 within the
   grace period.  A worker runs in a process group of its own (cluster.supervisor.launch), so a terminal's Ctrl-C
   reaches the supervisor alone, which orchestrates the shutdown; SIGINT is ignored besides (a group-wide kill of it).
4. orphaned (the control socket reads EOF: the supervisor is gone, even by SIGKILL): close every connection the
   way the kernel closes a killed server's sockets (a FIN, so clients read EOF and reconnect quietly; a reset
   only where output is being dropped), remove the runtime directory, exit within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import logging
import os
import signal
import socket
import sys
import time

from shardbroker.cluster import control, runtime
from shardbroker.cluster.config import Config, from_document, protocols
from shardbroker.cluster.logs import flush_floods, setup_logging
from shardbroker.cluster.monitoring import connz
from shardbroker.router.fabric import Fabric
from shardbroker.workers import eventloop, reconfigure, workqueues
from shardbroker.workers.auth import Authenticator
from shardbroker.workers.hub import Hub
from shardbroker.workers.lameduck import LameDuck
from shardbroker.workers.looplag import LoopLag
from shardbroker.workers.tls import WorkerTls

log = logging.getLogger("broker.worker")

EXIT_BOOT_FAILED = 3
ORPHAN_CLOSE_WAIT = 0.2  # seconds an orphaned worker gives its closes to reach the kernel before it exits



def main(index: int, epoch: int, workers: int, config: Config, runtime_dir: str, ctl_sock: socket.socket,
         security_state: tuple[list[dict], str], server_info: dict, tls_material: dict | None = None) -> None:
    """Entry point of the spawned process."""
    # Signals for the supervisor that reach the whole process group or unit (a terminal's Ctrl-C; `systemctl kill
    # -s HUP|USR2` without --kill-whom=main, `pkill -f brokerctl`): reload and lame duck are the supervisor's to
    # run, and their default action would kill the worker, in lame duck every client at once.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    # A worker whose loop is stuck is sent SIGABRT by the supervisor (and a crash in C code raises one of the
    # fatal signals): faulthandler writes every thread's stack to stderr, the log, before the process dies.
    faulthandler.enable()
    _die_with_parent()
    setup_logging(config.logging, f"worker {index}")
    worker = Worker(index, epoch, workers, config, runtime_dir, ctl_sock,
                    Authenticator(config.security, security_state), server_info, tls_material or {})
    try:
        code = eventloop.run(worker.run(), config.workers.event_loop)
    except Exception:
        log.exception("worker %d crashed", index)
        code = 1
    flush_floods()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _arriving(conn, state: dict):
    """``conn``, told what it brings from the worker it left (``Connection.arrived``)."""
    conn.arriving = state
    return conn


def _greeted(conn):
    """``conn``, told that the supervisor's acceptor greeted its client (cluster.supervisor.handoff)."""
    conn.acceptor_greeted()
    return conn




def _die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the supervisor dies: a backstop for a loop too busy to read the EOF."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Worker:
    def __init__(self, index: int, epoch: int, workers: int, config: Config, runtime_dir: str,
                 ctl_sock: socket.socket, auth: Authenticator, server_info: dict,
                 tls_material: dict | None = None) -> None:
        self.index = index
        self.auth = auth
        self.server_info = server_info
        self._requests: dict[int, asyncio.Future] = {}
        self._next_req = 0
        self.epoch = epoch
        self.workers = workers
        self.config = config
        self.runtime_dir = runtime_dir
        self.ctl_sock = ctl_sock
        self.parent = os.getppid()
        self.hub: Hub | None = None
        self.ctl: control.Channel | None = None
        self._done: asyncio.Future | None = None
        self._exit_code = 0
        self._stopping = False
        self._orphaned = False   # the supervisor is gone (_on_control_closed)
        self._finished = False
        self.lame_duck: LameDuck | None = None
        self.loop_lag = LoopLag()
        self._tls_material = tls_material or {}   # the certificates the supervisor read (cluster.security.tls)
        self.tls: WorkerTls | None = None
        self._closed_cids: list[int] = []   # closed in this turn, not yet reported to the supervisor

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self.ctl = control.Channel(self.ctl_sock, self._on_control, self._on_control_closed)
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        boot = asyncio.ensure_future(self._boot())
        await asyncio.wait([boot, self._done], return_when=asyncio.FIRST_COMPLETED)
        if self._done.done():  # stopped (or orphaned) while booting
            boot.cancel()
            return self._done.result()
        if boot.exception() is not None:  # anything: the supervisor must hear why, then halt
            exc = boot.exception()
            log.error("boot failed: %s", exc)
            self.ctl.send({"k": "boot_error", "error": f"{type(exc).__name__}: {exc}"})
            await asyncio.sleep(0.1)  # let the report leave
            return EXIT_BOOT_FAILED
        self.ctl.send({"k": "ready", "pid": os.getpid()})
        heartbeat = asyncio.ensure_future(self._heartbeat())
        self.loop_lag.start()
        code = await self._done
        heartbeat.cancel()
        self.loop_lag.stop()
        return code

    async def _boot(self) -> None:
        cfg = self.config
        self.tls = WorkerTls(cfg, self._tls_material)
        self.hub = Hub(self.index, self.workers, cfg, self.auth)
        self.hub.server_info = self.server_info
        self.hub.supervisor_request = self._request
        self.hub.auth_failed = lambda address: self.ctl.send({"k": "auth_fail", "ip": address})
        self.auth.begin = self._may_check
        self.auth.end = lambda address, failed: self.ctl.send({"k": "auth_end", "ip": address, "failed": failed})
        self.hub.report_closed = self._report_closed
        self.hub.hand_over = lambda message, sock: self.ctl.send(message, sock=sock)
        self.hub.queue_service = workqueues.start(self.index, cfg, self.runtime_dir, self.hub)
        # The session of each listener that is on (cluster/config/protocols.py), imported only then: a worker's imports
        # are most of its start-up.
        self.sessions = {p.name: protocols.session_class(p) for p in protocols.enabled(cfg)}
        self.hub.fabric = Fabric(self.index, self.workers, self.epoch, self.runtime_dir, self.hub,
                                 hwm=cfg.fabric.hwm, window_bytes=cfg.fabric.window_bytes,
                                 stall_timeout=cfg.fabric.stall_timeout)
        await self.hub.fabric.join(cfg.workers.boot_timeout)
        self._leafnodes(cfg)

    def _leafnodes(self, cfg: Config) -> None:
        """Join the NATS deployments ``cfg`` names as their leaf (docs/leafnodes.md); imported only then."""
        if self.hub.leafnodes is not None:
            self.hub.leafnodes.apply(cfg)
        elif cfg.leafnodes.remotes:
            from shardbroker.workers.protocols.leaf.leafnodes import Leafnodes
            Leafnodes(self.hub, cfg, self.server_info["server_id"])

    async def _heartbeat(self) -> None:
        while True:
            # Four beats per timeout (at most one a second): one late beat must not look like a dead loop.
            interval = min(1.0, self.config.workers.heartbeat_timeout / 4)   # read each time: a reload may change it
            asked = time.monotonic()
            await asyncio.sleep(interval)
            lag = time.monotonic() - asked - interval
            if lag > 0.25:  # something held the event loop: say so, it is what operators need to know first
                log.warning("event loop lagged %.2fs behind", lag)
            hub = self.hub
            hub.tick()
            self.ctl.send({"k": "hb", "conns": len(hub.conns)})

    def _report_closed(self, cid: int) -> None:
        """Closed connections reach the supervisor's counts (cluster.supervisor.admission) at the end of the turn they
        closed in, so that a client at its per-address limit may reconnect at once."""
        if not self._closed_cids:
            asyncio.get_running_loop().call_soon(self._send_closed)
        self._closed_cids.append(cid)

    def _send_closed(self) -> None:
        cids, self._closed_cids = self._closed_cids, []
        if cids and self.ctl is not None:
            self.ctl.send({"k": "closed", "cids": cids})

    # -- control --------------------------------------------------------------------------------------------
    def _on_control(self, msg: dict, fds: list[int]) -> None:
        kind = msg.get("k")
        if kind == "conn":
            if not fds:   # lost on the way (MSG_CTRUNC: out of descriptors here): the client sees it closed
                log.error("connection handoff without a file descriptor (out of file descriptors?)")
                self._report_closed(int(msg.get("cid", 0)))
                return
            asyncio.get_running_loop().create_task(self._adopt(msg, fds[0]))
        elif kind == "stop":
            self._stop(float(msg.get("grace", self.config.shutdown.grace_period)))
        elif kind == "peer_down":
            if self.hub is not None and self.hub.fabric is not None:
                self.hub.fabric.peer_down(int(msg["w"]), int(msg["epoch"]))
        elif kind == "stats":
            self.ctl.send({"k": "reply", "req": msg["req"], "data": self._stats(msg)})
        elif kind == "users":
            gone = self.auth.registry.apply(msg["change"])
            if self.hub is not None:
                self.hub.users_changed(gone)
            self.ctl.send({"k": "users_ack", "v": msg["v"]})
        elif kind == "block":
            self.auth.block(str(msg["ip"]), float(msg["seconds"]))
        elif kind == "config":   # a reload (cluster.supervisor.reload): only keys that may change at run time differ
            self.config = from_document(msg["doc"])
            reconfigure.apply(self.config, self.hub, self.auth)
            if self.hub is not None and self.hub.fabric is not None:
                self._leafnodes(self.config)
            self._tls_material = msg.get("tls", self._tls_material)
            error = self.tls.apply(self.config, self._tls_material) if self.tls is not None else None
            self.ctl.send({"k": "reply", "req": msg["req"], "data": {"worker": self.index, "ok": not error,
                                                                     "error": error}})
        elif kind == "lameduck":
            self._lame_duck(float(msg["grace"]), float(msg["window"]), int(msg["total"]))
        elif kind == "reply":
            fut = self._requests.pop(msg.get("req"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg.get("data") or {})
        else:
            log.error("unknown control message %r", kind)
        for fd in fds[1:]:
            os.close(fd)

    def _lame_duck(self, grace: float, window: float, total: int) -> None:
        done = lambda: self.ctl.send({"k": "ldm_done"})  # noqa: E731
        if self.hub is None or self._stopping:   # booting (no client yet) or already stopping: nothing to close
            done()
            return
        self.lame_duck = LameDuck(self.hub, grace, window, total, done)
        self.lame_duck.start()

    async def _may_check(self, address: str) -> bool:
        """The supervisor's leave to check a password from ``address`` (cluster.security.attempts), which may wait."""
        return bool((await self._request({"k": "auth_begin", "ip": address})).get("ok"))

    async def _request(self, message: dict, timeout: float = 30.0) -> dict:
        """Ask the supervisor and wait for its reply."""
        self._next_req += 1
        req = self._next_req
        fut = asyncio.get_running_loop().create_future()
        self._requests[req] = fut
        self.ctl.send({**message, "req": req})
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._requests.pop(req, None)

    async def _adopt(self, msg: dict, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        if not control.RECV_FLAGS:
            sock.set_inheritable(False)
        session = self.sessions.get(msg.get("p"))
        hub = self.hub
        cid = int(msg["cid"])
        if session is None or self._stopping or hub is None:
            sock.close()
            self._report_closed(cid)
            return
        moved = msg.get("moved")
        try:
            # from another worker (workers/protocols/ndjson/moves.py): plain TCP, its client greeted
            if moved is not None:
                hub.moved_in += 1
                loop = asyncio.get_running_loop()
                await loop.connect_accepted_socket(lambda: _arriving(session(hub, cid), moved), sock)
            elif msg.get("greeted") is True:   # plain TCP
                await asyncio.get_running_loop().connect_accepted_socket(lambda: _greeted(session(hub, cid)), sock)
            elif not await self.tls.adopt(msg.get("p"), sock, lambda: session(hub, cid)):   # TLS: workers/tls.py
                self._report_closed(cid)
        except OSError as exc:
            log.debug("could not adopt connection %d: %s", cid, exc)
            sock.close()
            self._report_closed(cid)

    def _stats(self, msg: dict) -> dict:
        hub = self.hub
        data = hub.stats()
        data["pid"] = os.getpid()
        if self.tls is not None:
            data.update(self.tls.stats())
        data["loop_lag"] = self.loop_lag.stats()
        what = msg.get("what")
        if what == "conns":
            # sorted here and cut to what the page can use (cluster/monitoring/connz.py): /connz?sort=...&limit=...
            conns = hub.conns.values()
            if msg.get("cid") is not None:
                conns = [c for c in conns if c.cid == msg["cid"]]
            conns = connz.top(conns, msg.get("sort") or "cid", msg.get("limit"), lambda c, f: c.sort_field(f),
                              lambda c: c.cid)
            data["conns"] = [c.info() | {"subscriptions_list": c.subjects()} if msg.get("subs") else c.info()
                             for c in conns]
        elif what == "subjects":
            data["subjects"] = hub.owned.top(int(msg.get("limit", 100)), msg.get("subject"))
        elif what == "queues" and hub.queue_service is not None:
            data["queues"] = hub.queue_service.shard.stats(msg.get("queue"))
        elif what == "leafz":
            data["leafz"] = hub.leafnodes.leafz(bool(msg.get("subs"))) if hub.leafnodes is not None else []
        return data

    def _on_control_closed(self) -> None:
        if self._orphaned:
            return
        # The supervisor is gone.  Nobody will hand us work or stop us: leave now, and clean up after it.  This
        # wins over a graceful stop under way: the kernel's death signal (SIGTERM) can arrive while getppid()
        # still names the dying supervisor, and read as a stop it began a graceful one that waited the whole
        # grace period for the other workers' end of traffic (they left by this path, sending none), holding
        # every client's connection open meanwhile.
        self._orphaned = True
        log.warning("supervisor is gone; exiting")
        self._stopping = True
        self._close_all_now()
        runtime.remove(self.runtime_dir)
        asyncio.ensure_future(self._exit_when_closed(time.monotonic() + ORPHAN_CLOSE_WAIT))

    def _close_all_now(self) -> None:
        """Close every connection at once, as the kernel closes the sockets of a server that was killed: a FIN
        after what the kernel already holds, so that clients read EOF, not a reset.  A connection with output
        still queued here is aborted (RST): that output is being dropped, and the client should not take what
        reached it for the whole.  Nothing waits for clients (``Connection.close`` would linger for them)."""
        hub = self.hub
        if hub is None:
            return
        hub.stopping = True
        for conn in list(hub.conns.values()):
            transport = conn.transport
            if transport is None or transport.is_closing():
                continue
            if not conn.closed:
                hub.settle(conn)  # deliveries batched for it count as queued output
            if conn.out or transport.get_write_buffer_size():
                conn.abort()
            else:
                conn.closed = True
                transport.close()

    async def _exit_when_closed(self, deadline: float) -> None:
        """Let the event loop hand the closes to the kernel (and call connection_lost), briefly, then exit."""
        hub = self.hub
        while hub is not None and hub.conns and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self._finish(0)

    def _on_sigterm(self) -> None:
        if os.getppid() != self.parent:  # the death signal from the kernel: the supervisor died
            self._on_control_closed()
        else:
            self._stop(self.config.shutdown.grace_period)

    # -- stopping -------------------------------------------------------------------------------------------
    def _stop(self, grace: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        asyncio.ensure_future(self._graceful(grace))

    async def _graceful(self, grace: float) -> None:
        hub = self.hub
        hub.stopping = True
        deadline = time.monotonic() + grace
        conns = list(hub.conns.values())
        for conn in conns:
            if conn.transport is not None and not conn.closed:
                conn.transport.pause_reading()
        hub.flush_now()  # messages already queued for clients and other workers go out
        await hub.drain_fabric(deadline)  # and those other workers still send to our clients arrive
        hub.flush_now()
        for conn in conns:
            conn.close()
        while hub.conns and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if hub.conns:
            log.warning("grace period over: dropping %d connection(s) with unsent data", len(hub.conns))
            self._abort_all()
        self._finish(0)

    def _abort_all(self) -> None:
        if self.hub is None:
            return
        for conn in list(self.hub.conns.values()):
            conn.abort()

    def _finish(self, code: int) -> None:
        if self._finished:   # a graceful stop the supervisor's death overtook (_on_control_closed) ends too
            return
        self._finished = True
        if self.hub is not None and self.hub.leafnodes is not None:
            self.hub.leafnodes.close()
        if self.hub is not None and self.hub.queue_service is not None:
            self.hub.queue_service.close(graceful=not code)
        if self.hub is not None and self.hub.fabric is not None:
            self.hub.fabric.close()
        self.auth.close()
        if self._done is not None and not self._done.done():
            self._done.set_result(code)
