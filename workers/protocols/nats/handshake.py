"""A NATS session's handshake: the INFO it greets with, and the CONNECT that sets its options and proves who the
client is (a password, a token, a certificate mapped to a user, or nats-server's no_auth_user), before anything
else it sends is taken.

A mixin of ``workers.protocols.nats.session.NatsSession``: the handshake is one phase of that one object's life,
kept in a room of its own so that the session's room holds what a connected client does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import orjson

from shardbroker.workers.auth import RateLimited
from shardbroker.workers.protocols.nats import codec, greeting

if TYPE_CHECKING:
    from shardbroker.cluster.config import NatsConfig

log = logging.getLogger("broker.nats")

ERR_AUTH_VIOLATION = "Authorization Violation"
ERR_AUTH_TIMEOUT = "Authentication Timeout"
ERR_STALE = "Stale Connection"
ERR_INVALID_SUBJECT = "Invalid Subject"
ERR_INVALID_PUB_SUBJECT = "Invalid Publish Subject"
ERR_MAX_SUBS = "maximum subscriptions exceeded"
ERR_MAX_USER_CONNECTIONS = "maximum account active connections exceeded"   # nats-server's, per account
ERR_PROTOCOL = "invalid client protocol"
ERR_NO_RESPONDERS = "no responders requires headers support"

_FIRST_PING = 2.0  # nats-server's first RTT ping after CONNECT

async def _known(user):
    """A login whose answer is already known (a certificate's user), taking the password check's path."""
    return user



class Handshake:
    """INFO and CONNECT, for ``NatsSession`` (whose attributes these methods read and set)."""

    _cfg: NatsConfig

    def tls_greeting(self, peer: tuple) -> bytes:
        """The INFO that goes out in plaintext before the TLS handshake (workers.tls, as nats-server does); the
        session then starts without one."""
        self.peer = (peer[0], peer[1])
        self._greeted = True
        return greeting.info_line(self._info())

    def acceptor_greeted(self) -> None:
        """The supervisor's acceptor sent the INFO (``greeting``): the session starts without one."""
        self._greeted = True

    def _info(self) -> dict:
        return greeting.info_fields(self.hub.server_info, self.cid, self.peer[0], self._secure, self.tls,
                                    self.tls_verify)

    # -- CONNECT --------------------------------------------------------------------------------------------
    def _connect(self, raw: bytes) -> None:
        try:
            opts = orjson.loads(raw)
        except orjson.JSONDecodeError:
            opts = None
        if type(opts) is not dict:
            self._fail(None)
            return
        flags = {}
        for key in ("verbose", "pedantic", "echo", "headers", "no_responders", "tls_required"):
            value = opts.get(key)
            if value is not None and type(value) is not bool:
                self._fail(None)  # nats-server cannot unmarshal it: protocol violation
                return
            flags[key] = value
        protocol = opts.get("protocol", 0)
        if type(protocol) is not int or not 0 <= protocol <= 1:
            self._fail(ERR_PROTOCOL)
            return
        if "account" in opts or "new_account" in opts:
            self._fail(ERR_AUTH_VIOLATION)
            return
        if opts.get("nkey") not in (None, "") or opts.get("jwt") not in (None, ""):
            # No nkeys or JWTs here (docs/nats.md): a client that believes it proved an identity with one must
            # not be let in on other grounds (user/pass beside it, or no security at all).
            self._fail(ERR_AUTH_VIOLATION)
            return
        headers = bool(flags["headers"])
        no_responders = bool(flags["no_responders"])
        if no_responders and not headers:
            self._fail(ERR_NO_RESPONDERS)
            return
        for key in ("verbose", "pedantic", "echo"):
            if flags[key] is not None:
                setattr(self, key, flags[key])
        self.headers, self.no_responders = headers, no_responders
        self.name = str(opts.get("name") or "")[:256]
        self.lang = str(opts.get("lang") or "")[:64]
        self.version = str(opts.get("version") or "")[:64]
        if not self._secure:
            self._connected()
            return
        mapped = self.certificate_user()
        if mapped is not None:
            # nats-server's verify_and_map: the certificate names the user, whatever CONNECT says
            self.suspend()
            asyncio.ensure_future(self._authenticate(_known(mapped)))
            return
        user, password, token = opts.get("user"), opts.get("pass"), opts.get("auth_token")
        if user in (None, "") and password in (None, "") and token in (None, ""):
            # No credentials at all: nats-server's no_auth_user, if configured and existing now.  Credentials
            # that are given are always checked, and a wrong one never falls back to it.
            fallback = self.hub.auth.no_auth_user()
            if fallback is None:
                self._fail(ERR_AUTH_VIOLATION)
            else:
                self._authenticated(fallback)
            return
        if self.hub.auth.is_blocked(self.peer[0]):
            self._fail(ERR_AUTH_VIOLATION)
            return
        auth = self.hub.auth
        if isinstance(user, str) and user and isinstance(password, str):
            check = auth.attempt(self.peer[0], lambda: auth.verify(user, password))
        elif isinstance(token, str) and token:
            check = auth.attempt(self.peer[0], lambda: auth.verify_token(token))
        else:
            self._fail(ERR_AUTH_VIOLATION)
            return
        self.suspend()
        asyncio.ensure_future(self._authenticate(check))

    async def _authenticate(self, check) -> None:
        try:
            user = await check
        except RateLimited:
            user = None
        except Exception:
            log.exception("password check failed on connection %d", self.cid)
            user = None
        if self.closed:
            return
        if user is None:   # nats-server has no word for a refusal of the address: the same violation
            self._fail(ERR_AUTH_VIOLATION)
            return
        if not await self.hub.claim(self, user.name):
            self._fail(ERR_MAX_USER_CONNECTIONS)
            return
        if self.closed:
            return
        self._authenticated(user)
        self.resume_held()

    def _authenticated(self, user) -> None:
        self.user = user
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        self.drop_forbidden_subscriptions()
        self._connected()

    def _connected(self) -> None:
        if self.verbose:
            self.send(codec.OK)
        if not self.connected:
            self.connected = True
            self._ping_timer = self.hub.loop.call_later(min(_FIRST_PING, self._cfg.ping_interval), self._ping_tick)

    def _auth_timeout(self) -> None:
        self._auth_timer = None
        if self.user is None and not self.closed:
            self._fail(ERR_AUTH_TIMEOUT)
