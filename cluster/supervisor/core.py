"""The supervisor: binds the listeners, runs the workers, hands them connections, stops everything cleanly.

Modelled on gunicorn's arbiter.  Signal handlers only queue the signal; the main loop dispatches ``handle_<name>``
and then keeps the real set of workers moving toward the wanted one (``slots.murder_unresponsive``; replacements
are spawned as soon as a worker's exit is seen).

Signals: TERM and INT stop gracefully (a second INT forces), QUIT stops at once, HUP reloads the configuration
(cluster.supervisor.reload), USR2 enters lame duck mode (cluster.supervisor.lameduck; TERM does not cut it short).
``brokerctl reload`` and ``brokerctl lameduck`` do the same through the command socket
(cluster.supervisor.command_socket).  systemd hears of all of it (cluster.supervisor.systemd,
cluster.supervisor.service_status), and may pass the listeners (socket activation).  Exit codes: 0 clean stop, 1
forced stop or runtime failure, 2 bad configuration (from the CLI; or listeners passed by systemd that the
configuration does not enable), 3 a worker failed to boot.

The rooms beside this one: the listeners, passed or bound (cluster.supervisor.listeners); the worker slots and the
abort of a stuck worker (cluster.supervisor.slots); which worker gets a connection (cluster.supervisor.handoff);
what the workers say on the control channel, and the questions asked of them (cluster.supervisor.messages).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import faulthandler
import logging
import os
import resource
import signal
import socket
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from shardbroker.cluster import control, runtime
from shardbroker.cluster.config import Config, without_plaintext_passwords
from shardbroker.cluster.logs import flush_floods, setup_logging
from shardbroker.cluster.security import tls
from shardbroker.cluster.security.manager import SecurityManager
from shardbroker.cluster.supervisor import datadir, systemd
from shardbroker.cluster.supervisor.acceptor import Acceptor, Listener
from shardbroker.cluster.supervisor.admission import Admission
from shardbroker.cluster.supervisor.command_socket import CommandServer
from shardbroker.cluster.supervisor.forkserver import Launcher
from shardbroker.cluster.supervisor.handoff import Handoff
from shardbroker.cluster.supervisor.lameduck import LameDuck
from shardbroker.cluster.supervisor.listeners import adopt, open_listeners
from shardbroker.cluster.supervisor.messages import WorkerMessages
from shardbroker.cluster.supervisor.reload import Outcome, Reloader
from shardbroker.cluster.supervisor.service_status import ServiceStatus
from shardbroker.cluster.supervisor.slots import WorkerSlot, kill, left, murder_unresponsive
from shardbroker.workers import eventloop, speedups

if TYPE_CHECKING:
    from shardbroker.cluster.monitoring.endpoints import Monitor

# Start-up (docs/performance-notes.md, scripts/measure/startup_time.py): the workers are forked by the fork server
# (cluster.supervisor.forkserver) and boot all at once; none of their modules is imported here.  What the supervisor
# needs only once they are up (monitoring, the version) comes while they boot; passwords are hashed on threads.

log = logging.getLogger("broker.supervisor")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_BOOT_FAILED = 0, 1, 2, 3
NATS_PROTOCOL_LEVEL = "2.10.0"
_CRASH_WINDOW, _CRASH_LIMIT = 60.0, 10   # more worker deaths than this within the window: stop, do not loop


class Supervisor:
    def __init__(self, config: Config, early_stops: list[int] | None = None) -> None:
        """``early_stops``: signals that asked for a stop before the loop could handle them (and any that arrive
        until it does: the caller's handlers keep appending to the list)."""
        self.config = config
        self._early_stops = early_stops if early_stops is not None else []
        self.nworkers = config.workers.resolved_count()
        self.slots: list[WorkerSlot | None] = [None] * self.nworkers
        self.launcher = Launcher(config.workers, lambda: self._stop is not None)   # starts the workers
        self.runtime_dir = ""
        self._data_dir_lock: int | None = None   # held for the process's life (cluster.supervisor.datadir)
        self.listeners: list[Listener] = []
        self.acceptor: Acceptor | None = None
        self.admission = Admission(lambda: self.config.limits)
        self.handoff = Handoff(self)
        self.messages = WorkerMessages(self)
        self.monitor: Monitor | None = None
        self.security: SecurityManager | None = None
        self.started = time.time()
        # Like nats-server's: 56 characters of base32 starting with N, new at every start.
        self.server_id = "N" + base64.b32encode(os.urandom(35)).decode()[:55]
        self._epoch = 0
        self._signals: asyncio.Queue[int] | None = None
        self._stop: str | None = None          # None, "graceful" or "fast"
        self._exit_code = EXIT_OK
        self._deaths: list[float] = []
        self.booted: asyncio.Event | None = None
        self._version = ""
        # systemd (cluster.supervisor.systemd): taken from the environment in run(), so that no worker inherits it
        self.state = "starting"                # starting, ready, reloading, lame duck, stopping
        self.notifier = systemd.Notifier(None)
        self.status: ServiceStatus | None = None
        self._watchdog_usec = 0
        self._fatal: tuple[str, int] | None = None   # why the broker stops on its own: STATUS= and ERRNO=
        self._monitor_sock: socket.socket | None = None
        self.reloader = Reloader(self)
        self.lame_duck: LameDuck | None = None
        self._lame_duck_ints = 0
        self.commands = CommandServer(self._command)
        # TLS (cluster.security.tls): the certificate files as read at start or at the last reload, and the contexts
        # made of them.  Workers get the material and make their own; monitoring's context is used here.
        self.tls_material: tls.Material = {}
        self.tls_contexts: dict[str, Any] = {}

    # -- entry ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        # First: nothing the supervisor starts may inherit systemd's variables (workers would notify as us).
        self.notifier, self._watchdog_usec = systemd.take_environment()
        faulthandler.enable()   # a watchdog's SIGABRT (or a crash) leaves every thread's stack in the log
        setup_logging(self.config.logging, "supervisor")
        _raise_open_files_limit()
        # Hash the configured passwords (on threads, while everything else starts), then forget the plaintext:
        # workers are spawned with the stripped config, and get the hashes before the broker is ready.
        self.security = SecurityManager(self, self.config)
        self.config = without_plaintext_passwords(self.config)
        try:
            self.tls_material, self.tls_contexts = tls.load(self.config)
        except tls.TlsError as exc:
            return self._failed(f"configuration error: {exc}", errno.EINVAL, EXIT_CONFIG)
        for line in tls.summary(self.config, self.tls_material):
            log.info("%s", line)
        for line in tls.warnings(self.config, self.tls_material):
            log.warning("%s", line)
        queues = self.config.queues
        if queues.data_dir and queues.journal:
            try:
                self._data_dir_lock = datadir.lock(queues.data_dir)
            except datadir.DataDirInUse as exc:
                return self._failed(str(exc), errno.EBUSY, EXIT_FAILED)
            except OSError as exc:
                return self._failed(f"queues.data_dir {queues.data_dir}: {exc.strerror or exc}",
                                    exc.errno or errno.EIO, EXIT_FAILED)
        try:
            self.listeners, self._monitor_sock = open_listeners(self.config, self.nworkers,
                                                                adopt(self.config, systemd.listen_fds()))
        except systemd.ActivationError as exc:
            return self._failed(f"socket activation: {exc}", errno.EINVAL, EXIT_CONFIG)
        except OSError as exc:
            return self._failed(exc.strerror or str(exc), exc.errno or errno.EIO, EXIT_FAILED)
        try:
            try:
                # runtime.dir was checked at load; this still fails if it changed since (or the default's does)
                self.runtime_dir = runtime.create(self.config.runtime.dir)
            except OSError as exc:
                return self._failed(f"cannot create the runtime directory in "
                                    f"{self.config.runtime.dir or runtime.default_parent()}: {exc.strerror or exc}",
                                    exc.errno or errno.EIO, EXIT_FAILED)
            log.info("runtime directory %s", self.runtime_dir)
            try:
                code = eventloop.run(self._main(), self.config.workers.event_loop)
            except Exception as exc:   # a bug: systemd hears it too (`systemctl status`), then the traceback
                self.notifier.send(STATUS=f"internal error: {exc!r}", ERRNO=errno.EIO)
                raise
            if self._fatal is not None:  # the last word: what `systemctl status` shows after the exit
                self.notifier.send(STATUS=self._fatal[0], ERRNO=self._fatal[1])
            return code
        finally:
            for lst in self.listeners:
                lst.sock.close()
            if self._monitor_sock is not None:
                self._monitor_sock.close()
            self.launcher.close()   # the fork server goes: nothing the broker started outlives it
            if self.runtime_dir:
                runtime.remove(self.runtime_dir)
            self.notifier.close()

    def _failed(self, reason: str, err: int, code: int) -> int:
        """A start that cannot go on: the log, and systemd's STATUS= and ERRNO=."""
        log.error("%s", reason)
        self.notifier.send(STATUS=reason, ERRNO=err)
        return code

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._signals = asyncio.Queue()
        # Every handler is in place before READY=1: systemd >= 262 requires a Type=notify-reload service to
        # catch its ReloadSignal (SIGHUP) by then.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR2):
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        for sig in self._early_stops:   # arrived before this loop handled them (cli.entry)
            self._signals.put_nowait(sig)
        self.status = ServiceStatus(self.notifier, self._watchdog_usec, self)
        self.status.start()
        self.status.set(f"starting {self.nworkers} workers")
        self.booted = asyncio.Event()
        for i in range(self.nworkers):
            self._spawn(i, send_args=False)
        # The workers read their arguments once their own imports are done, which takes longer than this one.
        from shardbroker.cluster import VERSION

        self._version = VERSION
        for slot in self.slots:
            self._send_args(slot)
        if self.config.monitoring.enabled:  # while the workers boot: it answers in every state, "starting" too
            from shardbroker.cluster.monitoring.endpoints import Monitor

            self.monitor = Monitor(self)
            await self.monitor.start(sock=self._monitor_sock)
            self._monitor_sock = None   # the server owns it now
        if await self._wait_for_boot():
            self.acceptor = Acceptor(self.listeners, self.handoff.accepted, self.admission.refusal)
            self.acceptor.start()
            await self._start_commands()
            self._announce_ready()
            while self._stop is None:
                try:
                    sig = await asyncio.wait_for(self._signals.get(), 1.0)
                except TimeoutError:
                    sig = None
                if sig:  # 0 only wakes the loop
                    getattr(self, f"handle_{signal.Signals(sig).name[3:].lower()}")()
                murder_unresponsive(self.slots, self.config.workers.heartbeat_timeout)
                if self.lame_duck is not None and self._stop is None and self.lame_duck.finished():
                    log.info("lame duck: every client is gone; stopping")
                    self._stop = "graceful"
        await self._shutdown()
        self.status.close()
        return self._exit_code

    async def _start_commands(self) -> None:
        try:
            await self.commands.start(self.runtime_dir)
        except OSError as exc:  # a runtime.dir path too long for a unix socket, say: signals still work
            log.warning("no command socket (brokerctl reload/lameduck; SIGHUP and SIGUSR2 still work): %s", exc)

    async def _wait_for_boot(self) -> bool:
        """Until every worker has joined the fabric and holds the configured users (whose passwords are hashed
        meanwhile): only then may a client connect, and a login right after the ready line succeed."""
        deadline = time.monotonic() + self.config.workers.boot_timeout + 5
        users = asyncio.ensure_future(self.security.load_configured_users())
        users.add_done_callback(lambda _: self._signals.put_nowait(0))  # wake the wait below
        try:
            while not (self.booted.is_set() and users.done()) and self._stop is None:
                if time.monotonic() > deadline and not self.booted.is_set():
                    slow = [s.index for s in self.slots if s and s.state != "ready"]
                    self._halt(f"worker(s) {slow} did not boot within {self.config.workers.boot_timeout:g}s",
                               EXIT_BOOT_FAILED, errno.ETIMEDOUT)
                    break
                try:
                    sig = await asyncio.wait_for(self._signals.get(), 1.0)
                except TimeoutError:
                    continue
                if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR2):
                    self._stop = "fast"   # nothing to drain yet (and nothing to be a lame duck for)
        finally:
            if not users.done():
                users.cancel()
        if users.done() and not users.cancelled() and users.exception() is not None:
            self._halt(f"cannot load the configured users: {users.exception()}", EXIT_FAILED)
        return self.booted.is_set() and self._stop is None

    def wake(self) -> None:
        """Wake the main loop (0 is no signal): it looks again at what changed."""
        self._signals.put_nowait(0)

    def _announce_ready(self) -> None:
        parts = [f"{lst.protocol}={lst.describe()}" for lst in self.listeners]
        if self.monitor is not None:
            parts.append(f"monitoring={self.monitor.describe()}")
        pids = ",".join(str(s.pid) for s in self.slots if s)
        if speedups.IMPLEMENTATION != "compiled":
            log.warning("%s: every message costs more CPU", speedups.describe())
        log.info("ready: %s workers=%d pids=%s version=%s hot_path=%s", " ".join(parts), self.nworkers, pids,
                 self._version, speedups.IMPLEMENTATION)
        self.state = "ready"
        self.notifier.send(READY=1, MAINPID=os.getpid(),
                           STATUS=f"ready: {self.nworkers} workers, {' '.join(parts)}")

    # -- signals --------------------------------------------------------------------------------------------
    def handle_term(self) -> None:
        if self.lame_duck is not None:  # as nats-server: the unit's stop may come right after the SIGUSR2
            log.info("SIGTERM: in lame duck mode, %d client(s) left; it goes on (SIGQUIT stops now)",
                     self.lame_duck.clients_left())
            return
        log.info("SIGTERM: stopping gracefully")
        self._stop = "graceful"

    def handle_int(self) -> None:
        if self.lame_duck is not None:
            self._lame_duck_ints += 1
            if self._lame_duck_ints < 2:
                log.info("SIGINT: in lame duck mode; it goes on (again to stop now)")
                return
            log.warning("second SIGINT: ending lame duck mode; stopping gracefully")
        else:
            log.info("SIGINT: stopping gracefully (again to force)")
        self._stop = "graceful"

    def handle_quit(self) -> None:
        log.info("SIGQUIT: stopping now")
        self._stop = "fast"

    def handle_hup(self) -> None:
        if self.state != "ready":
            log.warning("SIGHUP: not reloading while %s", self.state)
            return
        asyncio.ensure_future(self.reload("SIGHUP"))

    def handle_usr2(self) -> None:
        self.enter_lame_duck("SIGUSR2")

    async def reload(self, origin: str) -> Outcome:
        self.state = "reloading"
        try:
            return await self.reloader.reload(origin)
        finally:
            if self.state == "reloading":
                self.state = "ready"

    def enter_lame_duck(self, origin: str) -> dict:
        if self.state not in ("ready", "reloading"):
            log.warning("%s: not entering lame duck mode while %s", origin, self.state)
            return {"ok": False, "error": f"the broker is {self.state}"}
        self.state = "lame duck"
        self.lame_duck = LameDuck(self)
        return {"ok": True, "pid": os.getpid(), **self.lame_duck.begin(origin)}

    async def _command(self, request: dict) -> dict:
        """A request on the command socket (brokerctl)."""
        cmd = request.get("cmd")
        if cmd == "reload":
            if self.state not in ("ready", "reloading"):
                return {"ok": False, "error": f"not reloading while {self.state}"}
            return (await self.reload("brokerctl reload")).as_dict()
        if cmd == "lameduck":
            return self.enter_lame_duck("brokerctl lameduck")
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def set_status(self, text: str) -> None:
        if self.status is not None:
            self.status.set(text)

    def _halt(self, reason: str, code: int, err: int = errno.EIO) -> None:
        log.error("%s; stopping", reason)
        self._exit_code = code
        self._fatal = (reason, err)
        self.notifier.send(STATUS=reason, ERRNO=err)
        if self._stop is None:
            self._stop = "graceful"
        if self._signals is not None:
            self._signals.put_nowait(0)  # wake the main loop

    # -- workers --------------------------------------------------------------------------------------------
    def _spawn(self, index: int, send_args: bool = True) -> None:
        """Start worker ``index`` (workers.entry: forked, or a fresh interpreter); it reports ``ready`` once it
        has joined the fabric.  Returns at once: all the workers boot at the same time."""
        self._epoch += 1
        loop = asyncio.get_running_loop()
        proc = self.launcher.spawn(index)
        before = self.slots[index]
        slot = WorkerSlot(index, self._epoch, proc, pid=proc.pid,
                          restarts=before.restarts + 1 if before is not None else 0)
        slot.channel = control.Channel(proc.ctl_sock, partial(self.messages.dispatch, slot), lambda: None)
        self.slots[index] = slot
        loop.add_reader(proc.sentinel, self._on_worker_exit, slot)
        if send_args:
            self._send_args(slot)

    def _send_args(self, slot: WorkerSlot) -> None:
        loop = asyncio.get_running_loop()
        slot.process.send_args((slot.index, slot.epoch, self.nworkers, self.config, self.runtime_dir,
                                self.security.worker_state(), self.server_info(), self.tls_material),
                               loop.add_writer, loop.remove_writer)

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

    def _on_worker_exit(self, slot: WorkerSlot) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(slot.process.sentinel)
        slot.process.join(1)
        code = slot.process.exitcode
        how = f"exit code {code}" if code is not None and code >= 0 else \
            f"signal {signal.Signals(-code).name}" if code is not None else "unknown status"
        was, slot.state = slot.state, "dead"
        unread = slot.process.unread()   # sent to it after it last read: in order, and before the unsent ones
        if slot.channel is not None:
            slot.channel.read_pending()  # what it said before it died (a move, closed connections) still counts
            unread += slot.channel.unsent()
            slot.channel.close()
        self.handoff.rehand(slot, control.decode_all(unread), stopping=self._stop is not None)
        self.messages.forget(slot)   # questions it will never answer: now, not in 2 s
        self.security.worker_gone(slot.index)
        self.admission.worker_gone(slot.index)
        if self._stop is not None:
            log.info("worker %d (pid %d) exited: %s", slot.index, slot.pid, how)
            return
        if was == "booting" and self.lame_duck is None:
            self._halt(f"worker {slot.index} (pid {slot.pid}) failed to boot: {slot.boot_error or how}",
                       EXIT_BOOT_FAILED)
            return
        for other in self.live_slots():  # the dead one is marked dead already
            other.channel.send({"k": "peer_down", "w": slot.index, "epoch": slot.epoch})
        if self.lame_duck is not None:  # going out of service: its clients are gone, nothing to replace
            log.error("worker %d (pid %d) died (%s) in lame duck mode; not replacing it", slot.index, slot.pid, how)
            self._signals.put_nowait(0)
            return
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < _CRASH_WINDOW] + [now]
        if len(self._deaths) > _CRASH_LIMIT:  # a crash loop: this death is not replaced, and says why
            self._halt(f"worker {slot.index} (pid {slot.pid}) died ({how}): {len(self._deaths)} worker deaths in "
                       f"{_CRASH_WINDOW:g}s, a crash loop", EXIT_FAILED)
            return
        log.error("worker %d (pid %d) died (%s); replacing it", slot.index, slot.pid, how)
        self.set_status(f"worker {slot.index} died ({how}); replacing it")
        self._spawn(slot.index)

    def live_slots(self) -> list[WorkerSlot]:
        """The workers that are running (booting or ready)."""
        return [s for s in self.slots if s is not None and s.state != "dead"]

    async def query(self, message: dict, timeout: float = 2.0, slots: list[WorkerSlot] | None = None) -> list[dict]:
        """Ask every ready worker (or ``slots``); a worker that does not answer in time is reported as such."""
        return await self.messages.query(message, timeout, slots)

    # -- stopping -------------------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        self.state = "stopping"
        grace = self.config.shutdown.grace_period
        alive = self.live_slots()
        deadline = time.monotonic() + grace + 2.0
        # systemd's stop timeout is extended while connections and workers go (STOPPING=1 first)
        self.status.drain("stopping", partial(left, alive), deadline + 1.0)
        if self.acceptor is not None:
            self.acceptor.close()
        await self.commands.close()
        if self._stop == "fast":
            for slot in alive:
                kill(slot.pid)
        else:
            for slot in alive:
                slot.channel.send({"k": "stop", "grace": grace})
        forced = False
        while any(s.state != "dead" for s in alive):
            if time.monotonic() > deadline and not forced:
                log.error("workers still running after the grace period; killing them")
                forced = True
                for slot in alive:
                    if slot.state != "dead":
                        kill(slot.pid)
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
                        kill(slot.pid)
        if self.monitor is not None:   # last: "stopping" is a state an operator watches too
            await self.monitor.close()
        # The counts of lines still held back (a crash loop's "worker 0 is back" lines) come before `stopped`:
        # operations.md promises the log ends with it, and at exit they would come after.
        flush_floods()
        log.info("stopped")


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
