"""What the workers say on their control channels, and the questions the supervisor asks them there.

A message is a dict whose ``k`` names it; ``dispatch`` calls ``handle_<k>``, as gunicorn's arbiter does for
signals, so a new kind of message is a new method.  These are a class of their own, apart from the supervisor's
signal handlers: a worker's ``k`` can name no method but these.  A question (``query``) carries a request number
that the worker's ``reply`` gives back; a worker that dies answers the questions it was asked at once, as
unresponsive (``forget``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Protocol

from shardbroker.cluster.supervisor.admission import Admission
from shardbroker.cluster.supervisor.handoff import Handoff
from shardbroker.cluster.supervisor.slots import WorkerSlot

log = logging.getLogger("broker.supervisor")


class Cluster(Protocol):
    """What the messages need of the supervisor (cluster.supervisor.core.Supervisor), named here: it imports this."""

    state: str
    slots: list[Any]             # WorkerSlot or None, by worker index
    booted: asyncio.Event        # set once every first worker is ready
    admission: Admission
    security: Any                # security.manager.SecurityManager
    handoff: Handoff

    def set_status(self, text: str) -> None: ...

    def wake(self) -> None: ...


class WorkerMessages:
    def __init__(self, sup: Cluster) -> None:
        self.sup = sup
        self._requests: dict[int, tuple[asyncio.Future, dict]] = {}
        self._next_req = 0

    def dispatch(self, slot: WorkerSlot, msg: dict, fds: list[int]) -> None:
        kind = msg.get("k")
        if kind == "move":   # the one message whose descriptor is handed on
            self.sup.handoff.move(slot, msg, fds)
            return
        for fd in fds:
            os.close(fd)
        handler = getattr(self, f"handle_{kind}", None) if isinstance(kind, str) else None
        if handler is None:
            log.error("unknown message %r from worker %d", kind, slot.index)
            return
        handler(slot, msg)

    def handle_hb(self, slot: WorkerSlot, msg: dict) -> None:
        slot.last_heartbeat = time.monotonic()

    def handle_closed(self, slot: WorkerSlot, msg: dict) -> None:
        for cid in msg.get("cids", ()):
            if self.sup.admission.closed(cid) == slot.index:
                slot.live = max(0, slot.live - 1)

    def handle_claim(self, slot: WorkerSlot, msg: dict) -> None:
        """A login: may this connection act as that user (limits.max_connections_per_user)?"""
        ok = self.sup.admission.claim(int(msg["cid"]), str(msg["user"]))
        slot.channel.send({"k": "reply", "req": msg.get("req"), "data": {"ok": ok}})

    def handle_ready(self, slot: WorkerSlot, msg: dict) -> None:
        """It has joined the fabric: the last of the first workers ends the boot; a replacement is back."""
        slot.state = "ready"
        slot.last_heartbeat = time.monotonic()
        sup = self.sup
        if sup.booted.is_set():
            log.info("worker %d is back (pid %d)", slot.index, slot.pid)
            if sup.state == "ready":
                sup.set_status(f"worker {slot.index} is back (pid {slot.pid})")
        elif all(s is not None and s.state == "ready" for s in sup.slots):
            sup.booted.set()
            sup.wake()  # wake the supervisor's wait for the boot now

    def handle_boot_error(self, slot: WorkerSlot, msg: dict) -> None:
        slot.boot_error = str(msg.get("error"))

    def handle_reply(self, slot: WorkerSlot, msg: dict) -> None:
        waiting = self._requests.pop(msg.get("req"), None)
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(msg.get("data"))

    def handle_admin(self, slot: WorkerSlot, msg: dict) -> None:
        asyncio.ensure_future(self.sup.security.admin(slot, msg))

    def handle_users_ack(self, slot: WorkerSlot, msg: dict) -> None:
        self.sup.security.acknowledged(slot, int(msg.get("v", 0)))

    def handle_auth_fail(self, slot: WorkerSlot, msg: dict) -> None:
        self.sup.security.auth_failure(str(msg.get("ip")))

    def handle_auth_begin(self, slot: WorkerSlot, msg: dict) -> None:
        """May this worker check a password from that address now? (it may wait)"""
        asyncio.ensure_future(self._auth_begin(slot, msg))

    async def _auth_begin(self, slot: WorkerSlot, msg: dict) -> None:
        address = str(msg.get("ip"))
        ok = await self.sup.security.attempts.begin(slot.index, address)
        if ok and self.sup.slots[slot.index] is not slot:   # it died while it waited: nobody will end that check
            self.sup.security.attempts.end(slot.index, address, failed=False)
            return
        slot.channel.send({"k": "reply", "req": msg.get("req"), "data": {"ok": ok}})

    def handle_auth_end(self, slot: WorkerSlot, msg: dict) -> None:
        self.sup.security.attempts.end(slot.index, str(msg.get("ip")), bool(msg.get("failed")))

    def handle_ldm_done(self, slot: WorkerSlot, msg: dict) -> None:
        slot.ldm_done = True
        self.sup.wake()  # the main loop checks whether every worker is done

    # -- questions ------------------------------------------------------------------------------------------
    async def query(self, message: dict, timeout: float = 2.0, slots: list[WorkerSlot] | None = None) -> list[dict]:
        """Ask every ready worker (or ``slots``); a worker that does not answer in time is reported as such."""
        loop = asyncio.get_running_loop()
        waits = []
        for slot in self.sup.slots if slots is None else slots:
            if slot is None or (slots is None and slot.state != "ready") or slot.state == "dead":
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

    def forget(self, dead: WorkerSlot) -> None:
        """The questions ``dead`` will never answer: answered now, as unresponsive, not when they time out."""
        for req, (fut, who) in list(self._requests.items()):
            if who.get("pid") == dead.pid:
                del self._requests[req]
                if not fut.done():
                    fut.set_result({**who, "unresponsive": True})
