"""The supervisor: binds the listeners, runs the workers, hands them connections, stops everything cleanly.

Modelled on gunicorn's arbiter.  Signal handlers only queue the signal; the main loop dispatches ``handle_<name>``
and then keeps the real set of workers moving toward the wanted one (``_murder_unresponsive``; replacements are
spawned as soon as a worker's exit is seen).

Signals: TERM and INT stop gracefully (a second INT forces), QUIT stops at once, HUP re-reads the users of the
configuration file.  Exit codes: 0 clean stop, 1 forced stop or runtime failure, 2 bad configuration (from the CLI),
3 a worker failed to boot.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from . import control, runtime, systemd
from .acceptor import Acceptor, Listener, bind
from .config import Config, without_plaintext_passwords
from .launch import WorkerProcess
from .logs import setup_logging
from .security import SecurityManager

if TYPE_CHECKING:
    from .monitor import Monitor

# Start-up (docs/performance.md, scripts/startup_time.py): the workers' interpreters are started all at once,
# without importing any of their modules here; what the supervisor needs only once they are up (monitoring, the
# package version) is imported while they import theirs, and the configured passwords are hashed on threads
# meanwhile.

log = logging.getLogger("broker.supervisor")

EXIT_OK, EXIT_FAILED, EXIT_BOOT_FAILED = 0, 1, 3
NATS_PROTOCOL_LEVEL = "2.10.0"
_CRASH_WINDOW, _CRASH_LIMIT = 60.0, 10   # more worker deaths than this within the window: stop, do not loop


@dataclass(eq=False)
class WorkerSlot:
    index: int
    epoch: int
    process: Any
    channel: control.Channel | None = None
    state: str = "booting"                # booting -> ready -> dead
    pid: int = 0
    live: int = 0                          # connections handed to it and not reported closed
    started: float = field(default_factory=time.monotonic)
    last_heartbeat: float = field(default_factory=time.monotonic)
    boot_error: str | None = None


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.nworkers = config.workers.resolved_count()
        self.slots: list[WorkerSlot | None] = [None] * self.nworkers
        self.runtime_dir = ""
        self.listeners: list[Listener] = []
        self.acceptor: Acceptor | None = None
        self.monitor: Monitor | None = None
        self.security: SecurityManager | None = None
        self.started = time.time()
        # Like nats-server's: 56 characters of base32 starting with N, new at every start.
        self.server_id = "N" + base64.b32encode(os.urandom(35)).decode()[:55]
        self._epoch = 0
        self._next_cid = 0
        self._signals: asyncio.Queue[int] | None = None
        self._stop: str | None = None          # None, "graceful" or "fast"
        self._exit_code = EXIT_OK
        self._deaths: list[float] = []
        self._booted: asyncio.Event | None = None
        self._requests: dict[int, tuple[asyncio.Future, dict]] = {}
        self._next_req = 0
        self._version = ""

    # -- entry ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        setup_logging(self.config.logging.level, "supervisor")
        _raise_open_files_limit()
        # Hash the configured passwords (on threads, while everything else starts), then forget the plaintext:
        # workers are spawned with the stripped config, and get the hashes before the broker is ready.
        self.security = SecurityManager(self, self.config)
        self.config = without_plaintext_passwords(self.config)
        try:
            self.listeners = self._bind()
        except OSError as exc:
            log.error("%s", exc)
            return EXIT_FAILED
        try:
            try:
                # runtime.dir was checked at load; this still fails if it changed since (or the default's does)
                self.runtime_dir = runtime.create(self.config.runtime.dir)
            except OSError as exc:
                log.error("cannot create the runtime directory in %s: %s",
                          self.config.runtime.dir or runtime.default_parent(), exc.strerror or exc)
                return EXIT_FAILED
            log.info("runtime directory %s", self.runtime_dir)
            return asyncio.run(self._main())
        finally:
            for lst in self.listeners:
                lst.sock.close()
            if self.runtime_dir:
                runtime.remove(self.runtime_dir)

    def _bind(self) -> list[Listener]:
        cfg = self.config
        wanted = [("ndjson", cfg.network.bind, cfg.network.port, b'{"ok":false,"error":"max_connections"}\n')]
        if cfg.nats.enabled:
            wanted.append(("nats", cfg.bind_for(cfg.nats.bind), cfg.nats.port,
                           b"-ERR 'maximum connections exceeded'\r\n"))
        if cfg.bridge.enabled:
            wanted.append(("bridge", cfg.bind_for(cfg.bridge.bind), cfg.bridge.port, b"F"))
        if cfg.qlite.enabled:
            from workers.workqueues.qlite_codec import REFUSAL   # a small codec: nothing of the workers comes with it

            wanted.append(("qlite", cfg.bind_for(cfg.qlite.bind), cfg.qlite.port, REFUSAL))
        listeners = []
        for proto, host, port, refusal in wanted:
            try:
                listeners.append(Listener(proto, bind(host, port), refusal))
            except OSError as exc:
                for lst in listeners:
                    lst.sock.close()
                raise OSError(exc.errno, f"cannot listen for {proto} on {host}:{port}: {exc.strerror}") from None
        return listeners

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._signals = asyncio.Queue()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        self._booted = asyncio.Event()
        for i in range(self.nworkers):
            self._spawn(i, send_args=False)
        # The workers read their arguments once their own imports are done, which takes longer than this one.
        from . import VERSION

        self._version = VERSION
        for slot in self.slots:
            self._send_args(slot)
        if self.config.monitoring.enabled:  # while the workers boot: needed only once they are up
            from .monitor import Monitor
        if await self._wait_for_boot():
            self.acceptor = Acceptor(self.listeners, self._handoff, self._at_capacity)
            self.acceptor.start()
            if self.config.monitoring.enabled:
                self.monitor = Monitor(self)
                await self.monitor.start()
            self._announce_ready()
            while self._stop is None:
                try:
                    sig = await asyncio.wait_for(self._signals.get(), 1.0)
                except TimeoutError:
                    sig = None
                if sig:  # 0 only wakes the loop
                    getattr(self, f"handle_{signal.Signals(sig).name[3:].lower()}")()
                self._murder_unresponsive()
        await self._shutdown()
        return self._exit_code

    async def _wait_for_boot(self) -> bool:
        """Until every worker has joined the fabric and holds the configured users (whose passwords are hashed
        meanwhile): only then may a client connect, and a login right after the ready line succeed."""
        deadline = time.monotonic() + self.config.workers.boot_timeout + 5
        users = asyncio.ensure_future(self.security.load_configured_users())
        users.add_done_callback(lambda _: self._signals.put_nowait(0))  # wake the wait below
        try:
            while not (self._booted.is_set() and users.done()) and self._stop is None:
                if time.monotonic() > deadline and not self._booted.is_set():
                    slow = [s.index for s in self.slots if s and s.state != "ready"]
                    self._halt(f"worker(s) {slow} did not boot within {self.config.workers.boot_timeout:g}s",
                               EXIT_BOOT_FAILED)
                    break
                try:
                    sig = await asyncio.wait_for(self._signals.get(), 1.0)
                except TimeoutError:
                    continue
                if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                    self._stop = "fast"
        finally:
            if not users.done():
                users.cancel()
        if users.done() and not users.cancelled() and users.exception() is not None:
            self._halt(f"cannot load the configured users: {users.exception()}", EXIT_FAILED)
        return self._booted.is_set() and self._stop is None

    def _announce_ready(self) -> None:
        parts = [f"{lst.protocol}={lst.describe()}" for lst in self.listeners]
        if self.monitor is not None:
            parts.append(f"monitoring={self.monitor.describe()}")
        pids = ",".join(str(s.pid) for s in self.slots if s)
        log.info("ready: %s workers=%d pids=%s version=%s", " ".join(parts), self.nworkers, pids, self._version)
        systemd.notify(f"READY=1\nMAINPID={os.getpid()}")

    # -- signals --------------------------------------------------------------------------------------------
    def handle_term(self) -> None:
        log.info("SIGTERM: stopping gracefully")
        self._stop = "graceful"

    def handle_int(self) -> None:
        log.info("SIGINT: stopping gracefully (again to force)")
        self._stop = "graceful"

    def handle_quit(self) -> None:
        log.info("SIGQUIT: stopping now")
        self._stop = "fast"

    def handle_hup(self) -> None:
        log.info("SIGHUP: re-reading users from the configuration file")
        asyncio.ensure_future(self.security.reload())

    def _halt(self, reason: str, code: int) -> None:
        log.error("%s; stopping", reason)
        self._exit_code = code
        if self._stop is None:
            self._stop = "graceful"
        if self._signals is not None:
            self._signals.put_nowait(0)  # wake the main loop

    # -- workers --------------------------------------------------------------------------------------------
    def _spawn(self, index: int, send_args: bool = True) -> None:
        """Start worker ``index`` (workers.entry, in a fresh interpreter); it reports ``ready`` once it has
        joined the fabric.  Returns at once: all the workers boot at the same time."""
        self._epoch += 1
        loop = asyncio.get_running_loop()
        proc = WorkerProcess(index)
        slot = WorkerSlot(index, self._epoch, proc, pid=proc.pid)
        slot.channel = control.Channel(proc.ctl_sock, partial(self._on_worker_message, slot), lambda: None)
        self.slots[index] = slot
        loop.add_reader(proc.sentinel, self._on_worker_exit, slot)
        if send_args:
            self._send_args(slot)

    def _send_args(self, slot: WorkerSlot) -> None:
        loop = asyncio.get_running_loop()
        slot.process.send_args((slot.index, slot.epoch, self.nworkers, self.config, self.runtime_dir,
                                self.security.worker_state(), self.server_info()), loop.add_writer,
                               loop.remove_writer)

    def server_info(self) -> dict:
        """What NATS clients are told in INFO (each worker adds the client's own fields)."""
        host, port = next(((lst.address) for lst in self.listeners if lst.protocol == "nats"), ("", 0))
        return {
            "server_id": self.server_id,
            "server_name": self.config.nats.server_name or self.server_id,
            # The NATS protocol level implemented: clients (nats.js) enable headers and no-responders by version.
            "version": NATS_PROTOCOL_LEVEL,
            "proto": 1,
            "host": host,
            "port": port,
            "headers": True,
            "max_payload": self.config.nats.max_payload,
            "broker": f"shardbroker {self._version}",
        }

    def _on_worker_message(self, slot: WorkerSlot, msg: dict, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        kind = msg.get("k")
        if kind == "hb":
            slot.last_heartbeat = time.monotonic()
            slot.live = max(0, slot.live - int(msg.get("closed", 0)))
        elif kind == "ready":
            slot.state = "ready"
            slot.last_heartbeat = time.monotonic()
            if self._booted.is_set():
                log.info("worker %d is back (pid %d)", slot.index, slot.pid)
            elif all(s is not None and s.state == "ready" for s in self.slots):
                self._booted.set()
                self._signals.put_nowait(0)  # wake _wait_for_boot now
        elif kind == "boot_error":
            slot.boot_error = str(msg.get("error"))
        elif kind == "reply":
            waiting = self._requests.pop(msg.get("req"), None)
            if waiting is not None and not waiting[0].done():
                waiting[0].set_result(msg.get("data"))
        elif kind == "admin":
            asyncio.ensure_future(self.security.admin(slot, msg))
        elif kind == "users_ack":
            self.security.acknowledged(slot, int(msg.get("v", 0)))
        elif kind == "auth_fail":
            self.security.auth_failure(str(msg.get("ip")))
        else:
            log.error("unknown message %r from worker %d", kind, slot.index)

    def _on_worker_exit(self, slot: WorkerSlot) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(slot.process.sentinel)
        slot.process.join(1)
        code = slot.process.exitcode
        how = f"exit code {code}" if code is not None and code >= 0 else \
            f"signal {signal.Signals(-code).name}" if code is not None else "unknown status"
        was, slot.state = slot.state, "dead"
        if slot.channel is not None:
            slot.channel.close()
        self.security.worker_gone(slot.index)
        if self._stop is not None:
            log.info("worker %d (pid %d) exited: %s", slot.index, slot.pid, how)
            return
        if was == "booting":
            self._halt(f"worker {slot.index} (pid {slot.pid}) failed to boot: {slot.boot_error or how}",
                       EXIT_BOOT_FAILED)
            return
        for other in self.live_slots():  # the dead one is marked dead already
            other.channel.send({"k": "peer_down", "w": slot.index, "epoch": slot.epoch})
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < _CRASH_WINDOW] + [now]
        if len(self._deaths) > _CRASH_LIMIT:  # a crash loop: this death is not replaced, and says why
            self._halt(f"worker {slot.index} (pid {slot.pid}) died ({how}): {len(self._deaths)} worker deaths in "
                       f"{_CRASH_WINDOW:g}s, a crash loop", EXIT_FAILED)
            return
        log.error("worker %d (pid %d) died (%s); replacing it", slot.index, slot.pid, how)
        self._spawn(slot.index)

    def _murder_unresponsive(self) -> None:
        now = time.monotonic()
        timeout = self.config.workers.heartbeat_timeout
        for slot in self.slots:
            if slot is not None and slot.state == "ready" and now - slot.last_heartbeat > timeout:
                log.error("worker %d (pid %d) sent no heartbeat for %.1fs; killing it",
                          slot.index, slot.pid, now - slot.last_heartbeat)
                _kill(slot.pid)
                slot.last_heartbeat = now  # one kill per timeout, while the exit is being noticed

    # -- connections ----------------------------------------------------------------------------------------
    def _handoff(self, lst: Listener, conn) -> bool:
        ready = [s for s in self.slots if s is not None and s.state == "ready"]
        if not ready:
            return False
        slot = min(ready, key=lambda s: s.live)
        self._next_cid += 1
        if not slot.channel.send({"k": "conn", "p": lst.protocol, "cid": self._next_cid}, sock=conn):
            return False
        slot.live += 1
        return True

    def live_slots(self) -> list[WorkerSlot]:
        """The workers that are running (booting or ready)."""
        return [s for s in self.slots if s is not None and s.state != "dead"]

    def _at_capacity(self) -> bool:
        return sum(s.live for s in self.slots if s is not None) >= self.config.limits.max_connections

    async def query(self, message: dict, timeout: float = 2.0) -> list[dict]:
        """Ask every ready worker; a worker that does not answer in time is reported as such."""
        loop = asyncio.get_running_loop()
        waits = []
        for slot in self.slots:
            if slot is None or slot.state != "ready":
                continue
            self._next_req += 1
            fut = loop.create_future()
            self._requests[self._next_req] = (fut, {"worker": slot.index, "pid": slot.pid})
            slot.channel.send({**message, "req": self._next_req})
            waits.append((self._next_req, slot, fut))
        results = []
        for req, slot, fut in waits:
            try:
                results.append(await asyncio.wait_for(fut, max(0.01, timeout)))
            except TimeoutError:
                self._requests.pop(req, None)
                results.append({"worker": slot.index, "pid": slot.pid, "unresponsive": True})
        return results

    # -- stopping -------------------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        systemd.notify("STOPPING=1")
        if self.acceptor is not None:
            self.acceptor.close()
        if self.monitor is not None:
            await self.monitor.close()
        grace = self.config.shutdown.grace_period
        alive = self.live_slots()
        if self._stop == "fast":
            for slot in alive:
                _kill(slot.pid)
        else:
            for slot in alive:
                slot.channel.send({"k": "stop", "grace": grace})
        deadline = time.monotonic() + grace + 2.0
        forced = False
        while any(s.state != "dead" for s in alive):
            if time.monotonic() > deadline and not forced:
                log.error("workers still running after the grace period; killing them")
                forced = True
                for slot in alive:
                    if slot.state != "dead":
                        _kill(slot.pid)
            try:
                sig = await asyncio.wait_for(self._signals.get(), 0.05)
            except TimeoutError:
                continue
            if sig == signal.SIGINT and not forced:
                log.warning("second SIGINT: forcing shutdown")
                forced = True
                self._exit_code = EXIT_FAILED
                for slot in alive:
                    if slot.state != "dead":
                        _kill(slot.pid)
        log.info("stopped")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _raise_open_files_limit() -> None:
    """Thousands of connections need thousands of fds: take the hard limit (workers inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
