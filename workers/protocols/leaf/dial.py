"""How a leaf connection is made and made again (../shared/reference/leafnodes.md §1, §1.6, §5): the redial loop,
the URLs in turn, and the handshake; ``link.LeafLink`` is the connection once it is up.

- Handshake: TCP (or TLS first, ``handshake_first``), the hub's INFO (``client_id`` and ``leafnode_urls`` prove it is
  a leafnode port), TLS when either side asks, CONNECT (no ``lang``: that is a client's; a nats-server ``version``),
  the hub's ``connect_info`` INFO with the permissions it grants; then the link sends its whole interest.
- Redials: the remote's URLs in turn (and those the hub cluster advertises), after ``reconnect`` plus jitter,
  doubling on repeated failures up to ``reconnect_max``; 30 s after a loop, a same-cluster refusal or a permission
  violation, 5 s after a version refusal, as nats-server waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shardbroker.cluster.config import parse_url
from shardbroker.workers.protocols.leaf import codec
from shardbroker.workers.protocols.leaf.credentials import LeafAuthError, client_tls_context, connect_auth
from shardbroker.workers.protocols.leaf.permissions import LeafPermissions

if TYPE_CHECKING:
    from shardbroker.cluster.config import LeafnodesConfig, LeafRemoteConfig, LeafUrl
    from shardbroker.workers.protocols.leaf.hubinterest import HubInterest

log = logging.getLogger("broker.leaf")

VERSION = "2.10.0"         # the nats-server level whose leaf protocol this speaks (a hub's min_version reads it)
FIRST_INFO_TIMEOUT = 2.0   # nats-server's first_info_timeout is 1 s; a loaded 2-core machine needs more
CONNECT_INFO_TIMEOUT = 2.0
PENALTIES = (("Loop detected", 30.0), ("same cluster name", 30.0), ("Permissions Violation", 30.0),
             ("minimum version", 5.0))


class Owner(Protocol):
    """What a link needs of the worker's leafnodes (``leafnodes.Leafnodes``)."""

    index: int
    lds: str
    cluster: str
    server_id: str
    loop: asyncio.AbstractEventLoop
    mark_dirty: Callable

    stall_bytes: int

    def interest(self) -> list[tuple[str, str | None, int]]: ...   # (pattern, queue, weight) of local clients
    def congested(self, link: Dialing) -> None: ...   # the hub reads slower than we write (backpressure)
    def drained(self, link: Dialing) -> None: ...
    def received(self, link: Dialing, subject: bytes, reply: bytes | None, queues: tuple, headers: bytes | None,
                 payload: bytes) -> None: ...
    def hub_interest_changed(self) -> None: ...
    def read_done(self, link: Dialing) -> None: ...   # after a read: the turn's budget and held publishers


class Closed(Exception):
    """The connection ended; ``penalty``: seconds the next dial must wait at least."""

    def __init__(self, reason: str, penalty: float = 0.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.penalty = penalty


class Dialing:
    """The half of ``link.LeafLink`` that dials: what it needs of the other half is named here."""

    owner: Owner
    hub: HubInterest
    remote: LeafRemoteConfig
    settings: LeafnodesConfig
    name: str
    state: str
    urls: list[LeafUrl]
    url: LeafUrl
    info: dict
    transport: asyncio.Transport | None
    parser: codec.Parser
    perms: LeafPermissions
    account: str
    max_payload: int
    connected_at: float
    failures: int
    reconnects: int
    last_error: str
    retry_at: float
    _next_url: int
    _early: list[tuple]
    _wake: asyncio.Future | None
    _lost: asyncio.Future | None

    def _connected(self) -> None: ...
    def _event(self, event: tuple) -> None: ...
    def _drop_connection(self) -> None: ...

    async def _run(self) -> None:
        failures = 0
        while self.state != "closed":
            url = self._pick_url()
            self.state = "connecting"
            connected = False
            try:
                await self._session(url)
            except Closed as exc:
                connected = self.connected_at > 0
                reason, penalty = exc.reason, exc.penalty
            except asyncio.CancelledError:
                self._drop_connection()
                raise
            except (TimeoutError, OSError, LeafAuthError) as exc:
                reason = _describe(exc)
                penalty = 0.0
            except Exception as exc:   # a bug here must not end the redials: say so, and dial again
                log.exception("leafnode %s (%s): internal error", url.url, self.name)
                reason, penalty = f"internal error: {exc!r}", 0.0
            self._drop_connection()
            if self.state == "closed":
                return
            self.last_error = reason
            reconnect = self.settings.reconnect
            if connected:   # the jitter spreads the redials of every worker (and every leaf) after a hub restart
                failures = 0
                delay = reconnect + random.uniform(0, reconnect)
            else:
                failures += 1
                self.failures += 1
                delay = min(reconnect * 2 ** (failures - 1), self.settings.reconnect_max) + random.uniform(0, reconnect)
            delay = max(delay, penalty)
            log.warning("leafnode %s (%s): %s; redialling in %.1fs", url.url, self.name, reason, delay)
            self.state = "waiting"
            self.retry_at = time.time() + delay
            await asyncio.sleep(delay)
            self.reconnects += 1

    def _pick_url(self) -> LeafUrl:
        urls = self.urls
        if not self.remote.ignore_discovered_servers:
            for address in self.info.get("leafnode_urls") or ():
                if isinstance(address, str) and address.count(":") >= 1:
                    try:
                        found = parse_url("nats-leaf://" + address, "leafnode_urls")
                    except Exception:
                        continue
                    if all((u.host, u.port) != (found.host, found.port) for u in urls):
                        urls.append(found)
        url = urls[self._next_url % len(urls)]
        self._next_url += 1
        self.url = url
        return url

    # -- one connection -----------------------------------------------------------------------------------------
    async def _session(self, url: LeafUrl) -> None:
        loop = self.owner.loop
        tls = client_tls_context(self.remote, url)
        first = not isinstance(self.remote.tls, bool) and self.remote.tls.handshake_first
        timeout = FIRST_INFO_TIMEOUT + (self._tls_timeout() if tls is not None else 0)
        self.parser = codec.Parser(1 << 26)
        self.connected_at = 0.0
        self.account = ""   # nothing of an earlier connection's grants holds for this one
        self.perms = LeafPermissions(deny_imports=self.remote.deny_imports, deny_exports=self.remote.deny_exports)
        self._early = []
        self._lost = loop.create_future()
        if tls is not None and first:
            ctx, hostname = tls
            await asyncio.wait_for(loop.create_connection(lambda: self, url.host, url.port, ssl=ctx,
                                                          server_hostname=hostname,
                                                          ssl_handshake_timeout=self._tls_timeout()), timeout)
        else:
            await asyncio.wait_for(loop.create_connection(lambda: self, url.host, url.port), timeout)
        info = await self._expect_info(timeout, "the hub's INFO")
        if not info.get("client_id") or "leafnode_urls" not in info:
            raise Closed("attempted to connect to the wrong port (not a leafnode port)")
        self.info = info
        self.max_payload = int(info.get("max_payload") or 1 << 20)
        if info.get("tls_required") and tls is None:   # the hub insists: the system's CAs verify it
            tls = client_tls_context(dataclasses.replace(self.remote, tls=True), url)
        if tls is not None and not first:
            await self._start_tls(*tls)
        fields = {"version": VERSION, "server_id": self.owner.server_id, "name": self.name,
                  "cluster": self.owner.cluster, "headers": True, "remote_account": self.remote.account}
        if self.remote.deny_imports:
            fields["deny_pub"] = list(self.remote.deny_imports)
        fields.update(connect_auth(self.remote, url, info.get("nonce")))
        self.transport.write(codec.connect(fields))
        if info.get("info_on_connect"):
            while True:
                reply = await self._expect_info(CONNECT_INFO_TIMEOUT, "the hub's answer to CONNECT")
                if reply.get("connect_info"):
                    break
            self._hub_info(reply)
        self._connected()
        early, self._early = self._early, []
        for event in early:
            self._event(event)
        if self.hub.take_changed():
            self.owner.hub_interest_changed()
        reason = await self._lost
        raise reason

    def _tls_timeout(self) -> float:
        tls = self.remote.tls
        return tls.timeout if not isinstance(tls, bool) else 2.0

    async def _start_tls(self, ctx: ssl.SSLContext, hostname: str | None) -> None:
        loop = self.owner.loop
        transport = await asyncio.wait_for(
            loop.start_tls(self.transport, self, ctx, server_hostname=hostname,
                           ssl_handshake_timeout=self._tls_timeout()), self._tls_timeout() + 1)
        self.transport = transport

    async def _expect_info(self, timeout: float, what: str) -> dict:
        deadline = self.owner.loop.time() + timeout
        while True:
            while self._early:
                event = self._early.pop(0)
                if event[0] == codec.INFO:
                    return event[1]
                if event[0] == codec.REMOTE_ERR:
                    raise Closed(f"the hub said -ERR '{event[1]}'", penalty_for(event[1]))
                if event[0] == codec.ERR:
                    raise Closed(f"protocol error from the hub: {event[1]}")
                if event[0] == codec.PING:
                    self.transport.write(codec.PONG_LINE)
            if self._lost.done():
                raise self._lost.result()
            left = deadline - self.owner.loop.time()
            if left <= 0:
                raise Closed(f"no INFO from the hub within {timeout:g}s ({what})")
            self._wake = self.owner.loop.create_future()
            await asyncio.wait([self._wake, self._lost], timeout=left, return_when=asyncio.FIRST_COMPLETED)

    def _hub_info(self, info: dict) -> None:
        self.account = str(info.get("remote_account") or "")
        self.perms = LeafPermissions(info.get("import"), info.get("export"), self.remote.deny_imports,
                                     self.remote.deny_exports)
        urls = info.get("leafnode_urls")
        if urls:
            self.info["leafnode_urls"] = urls


def penalty_for(text: str) -> float:
    for needle, seconds in PENALTIES:
        if needle.lower() in text.lower():
            return seconds
    return 0.0


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out connecting"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    text = str(exc) or type(exc).__name__
    return text
