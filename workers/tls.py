"""TLS on a worker (docs/security.md#tls): each listener's context, the handshake of each socket handed over, and
what the handshakes came to (/varz, /metrics).

The supervisor only accepts and hands the socket over; the handshake happens here, in the worker that will serve
the connection, on its event loop, driven by asyncio's (or uvloop's) own TLS as bytes arrive: nothing waits on a
socket (``cluster.security.tls.accept``).  The contexts are built from the certificate material the supervisor read and
checked, at start and at each reload (``apply``); connections already open keep the session they have.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from shardbroker.cluster.config import Config, protocols
from shardbroker.cluster.security import tls

log = logging.getLogger("broker.tls")

AUTO_FIRST = 0.05   # nats-server's handshake_first "auto": this long for a ClientHello, then INFO in plaintext


class WorkerTls:
    def __init__(self, config: Config, material: tls.Material) -> None:
        self.contexts: dict = {}
        self.settings: dict = {}
        # outcomes of cluster.security.tls.accept, counted
        self.counts = {"ok": 0, "plaintext": 0, "timeout": 0, "failed": 0, "closed": 0}
        error = self.apply(config, material)
        if error:
            raise tls.TlsError(error)

    def apply(self, config: Config, material: tls.Material) -> str | None:
        """New contexts, for the connections from now on; on an error the running ones stay, and it is
        returned."""
        try:
            contexts = tls.contexts(config, material)
        except tls.TlsError as exc:
            log.error("TLS not reloaded (the running certificates stay): %s", exc)
            return str(exc)
        self.contexts = contexts
        self.settings = {s.listener: s for s in tls.enabled(config)}
        return None

    async def adopt(self, protocol: str, sock: socket.socket, factory: Callable) -> bool:
        """Connect the session ``factory`` makes to the socket handed over, through a TLS handshake where the
        listener has TLS; False if it never got connected (the socket is closed then)."""
        loop = asyncio.get_running_loop()
        ctx = self.contexts.get(protocol)
        if ctx is None:
            await loop.connect_accepted_socket(factory, sock)
            return True
        s = self.settings[protocol]
        peer = sock.getpeername()
        session = factory()
        session.tls = True
        session.tls_verify = s.verify or s.verify_and_map
        session.tls_map = s.verify_and_map
        greeting = greet_after = None
        if protocols.BY_NAME[protocol].greets_first and s.handshake_first is not True:
            # nats-server's order: INFO in plaintext (saying tls_required), then the client's handshake
            greeting = lambda: session.tls_greeting(peer)   # noqa: E731
            greet_after = AUTO_FIRST if s.handshake_first == "auto" else None
        outcome, why = await tls.accept(sock, ctx, s.handshake_timeout, lambda: session,
                                        protocols.BY_NAME[protocol].tls_refusal, greeting, greet_after)
        self.counts[outcome] += 1
        if outcome != "ok" and outcome != "closed":
            log.info("cid:%d %s:%d %s: TLS handshake %s: %s; closed", session.cid, peer[0], peer[1], protocol,
                     "refused" if outcome == "plaintext" else outcome, why,
                     extra={"cid": session.cid, "peer": f"{peer[0]}:{peer[1]}", "protocol": protocol,
                            "reason": why})
        return outcome == "ok"

    def stats(self) -> dict:
        """Handshakes by outcome (a client that left before its first byte is not counted): /varz, /metrics."""
        return {"tls": {k: v for k, v in self.counts.items() if k != "closed"}}
