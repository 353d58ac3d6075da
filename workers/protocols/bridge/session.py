"""A client connection speaking Bridge's binary protocol (see ``protocols.bridge.codec`` and docs/bridge.md).

Fixed against the original: a connection may carry several commands (any number of ``S`` and ``U``, then at most
one ``P``, whose data runs to the end of the stream); ``U`` really unsubscribes; there is no per-publish heartbeat,
so a dead subscriber never stalls a publisher.

A ``P`` stream becomes one message on ``bridge.<topic>`` when the publisher half-closes (at most
``bridge.max_publish_bytes``); ``O`` is answered for each 128-byte chunk as it arrives.  Bridge subscribers receive
any message on their subject, from any protocol, as chunks and the end marker.
"""

from __future__ import annotations

from shardbroker.workers.connection import Connection
from shardbroker.workers.hub import Hub
from shardbroker.workers.message import KIND_RAW, as_bytes
from shardbroker.workers.protocols.bridge import codec
from shardbroker.workers.subscription import Subscription


class BridgeSession(Connection):
    protocol = "bridge"
    close_on_eof = False

    def __init__(self, hub: Hub, cid: int) -> None:
        super().__init__(hub, cid)
        self._parser = codec.Parser()
        self._publishing: str | None = None   # the subject of the P in progress
        self._data: list[bytes] = []
        self._size = 0
        self._acked = 0                       # bytes of the P stream answered with O
        self._max = hub.config.bridge.max_publish_bytes
        if hub.auth.enabled:
            self.user = hub.auth.registry.get(hub.config.bridge.user or "")

    def opened(self) -> None:
        # Bridge cannot authenticate, but a verified client certificate can name its user (tls.verify_and_map).
        self.user = self.certificate_user() or self.user

    def handshake_timeout(self) -> None:
        self._fail()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        items = self._parser.feed(data)
        if items:
            self.process(items)

    def execute(self, item: tuple) -> None:
        """One command, in order; a subscription not yet in force everywhere holds the ones after it."""
        cmd, arg = item
        if cmd == codec.DATA:
            self._stream(arg)
        elif cmd == codec.CMD_PUBLISH:
            if not self._allowed(arg, publish=True):
                self._fail()
                return
            self._publishing = arg
        elif cmd == codec.CMD_SUBSCRIBE:
            if not self._allowed(arg, publish=False):
                self._fail()
                return
            if arg in self.subs:
                self.send(codec.OK)
                return
            if self.hub.subscription_refused(self) is not None:
                self._fail()
                return
            sub = self.subs[arg] = Subscription(self, arg, arg)
            if self.hub.subscribe(sub, self._in_force):
                self.send(codec.OK)
            else:
                self.suspend()
        elif cmd == codec.CMD_UNSUBSCRIBE:
            sub = self.subs.pop(arg, None)
            if sub is not None:
                self.hub.unsubscribe(sub)
            self.send(codec.OK)
        else:
            self._fail()

    def _in_force(self) -> None:
        if self.closed:
            return
        self.send(codec.OK)
        self.resume_held()

    def _allowed(self, subject: str, publish: bool) -> bool:
        if not self.hub.auth.enabled:
            return True
        if self.user is None:
            return False
        perms = self.user.permissions
        return perms.may_publish(subject) if publish else perms.may_subscribe(subject)

    def _fail(self) -> None:
        self.send(codec.FAIL)
        self.close()

    # -- publishing -----------------------------------------------------------------------------------------
    def _stream(self, data: bytes) -> None:
        self._size += len(data)
        full = (min(self._size, self._max) - self._acked) // codec.CHUNK  # chunks within the limit
        if full:
            self.send(codec.OK * full)
            self._acked += full * codec.CHUNK
        if self._size > self._max:
            self.hub.breach("max_payload")
            self._fail()
            return
        self._data.append(data)

    def eof_received(self) -> bool:
        if self._publishing is None or self.closed:
            return super().eof_received()  # a subscriber that half-closed still receives deliveries
        self.peer_eof = True
        if self._size > self._acked:
            self.send(codec.OK)  # the last, partial chunk
        payload = b"".join(self._data)
        self._data = []
        hub = self.hub
        route = hub.route(self._publishing)
        self.msgs_in += 1
        self.bytes_in += len(payload)
        hub.publish(route, KIND_RAW, payload, None, None, self)
        self.close()
        return True

    # -- delivery -------------------------------------------------------------------------------------------
    def deliver_message(self, subject: str, kind: int, payload: bytes, reply: str | None,
                        headers: bytes | None) -> None:
        body = as_bytes(kind, payload)
        framed = codec.chunks(body)
        self.msgs_out += 1
        self.bytes_out += len(body)
        for part in framed:
            self.send(part)
