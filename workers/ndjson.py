"""A client connection speaking Jolt's NDJSON protocol (see the Jolt README and docs/protocol.md).

Every complete line of a read is handled in order; replies and deliveries are queued and leave together at the
end of the turn.  A subscription that must first reach the other workers holds the lines after it (and reading)
until it is in force, so replies stay in request order and a later ``pub`` from anyone reaches it.
"""

from __future__ import annotations

import os
from typing import Callable

from router.subjects import is_valid_literal, is_valid_pattern

from . import ndjson_codec as codec
from .connection import PAUSE_SYNC, Connection
from .hub import Hub, Subscription
from .message import KIND_JSON

ERR_INVALID_JSON = codec.error("invalid_json")
ERR_LINE_TOO_LONG = codec.error("line_too_long")


class NdjsonSession(Connection):
    protocol = "ndjson"

    def __init__(self, hub: Hub, cid: int) -> None:
        super().__init__(hub, cid)
        self._tail = b""
        self._held: list | None = None   # lines waiting for a subscription to be in force
        self._max_line = hub.limits.max_line_bytes
        self._max_topic = hub.limits.max_topic_length

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.bytes_in += len(data)
        lines, self._tail = codec.split_lines(self._tail, data, self._max_line)
        if self._held is not None:
            self._held.extend(lines)
            return
        self._run(lines)
        if self.hub.congested and not self.closed:
            self.pause_for_fabric()

    def _run(self, lines: list) -> None:
        it = iter(lines)
        for line in it:
            if line is None:
                self.send(ERR_LINE_TOO_LONG)
                self.close()
                return
            self._handle(line)
            if self._held is not None:
                self._held.extend(it)
                return
            if self.closed:
                return

    def _handle(self, line: bytes) -> None:
        req = codec.parse(line)
        if req is None:
            if not codec.is_blank(line):  # blank lines (an extra Enter in netcat) are ignored
                self.send(ERR_INVALID_JSON)
            return
        op = req.get("op")
        if op is None:
            op = req.get("cmd")  # older Jolt clients
        handler = _OPS.get(op) if type(op) is str else None
        if handler is None:
            self.send(codec.reply(req, "unknown_op"))
            return
        handler(self, req, line)

    # -- operations -----------------------------------------------------------------------------------------
    def _topic(self, req: dict, valid: Callable[[str, int], bool]) -> str | None:
        """The request's topic, or None after replying with the reason it is unusable."""
        topic = req.get("topic")
        if topic is None or topic == "":
            self.send(codec.reply(req, "missing_topic"))
            return None
        if type(topic) is not str or not valid(topic, self._max_topic):
            self.send(codec.reply(req, "invalid_topic"))
            return None
        return topic

    def op_pub(self, req: dict, line: bytes) -> None:
        hub = self.hub
        topic = req.get("topic")
        route = hub.routes.get(topic) if type(topic) is str else None
        if route is None:
            topic = self._topic(req, is_valid_literal)
            if topic is None:
                return
            route = hub.route_for(topic)
        self.msgs_in += 1
        hub.publish(route, KIND_JSON, codec.encode_data(line, req.get("data")), None, None)
        self.send(codec.reply(req))

    def op_sub(self, req: dict, line: bytes) -> None:
        topic = self._topic(req, is_valid_pattern)
        if topic is None:
            return
        if topic in self.subs:
            self.send(codec.reply(req))
            return
        if len(self.subs) >= self.hub.limits.max_subscriptions:
            self.send(codec.reply(req, "too_many_subscriptions"))
            return
        sub = Subscription(self, topic, topic)
        self.subs[topic] = sub
        if self.hub.subscribe(sub, lambda: self._in_force(req)):
            self.send(codec.reply(req))
        else:
            self._held = []
            self.pause(PAUSE_SYNC)

    def _in_force(self, req: dict) -> None:
        if self.closed:
            return
        self.send(codec.reply(req))
        held, self._held = self._held or [], None
        self._run(held)
        if self._held is None:
            self.resume(PAUSE_SYNC)

    def op_unsub(self, req: dict, line: bytes) -> None:
        topic = self._topic(req, is_valid_pattern)
        if topic is None:
            return
        sub = self.subs.pop(topic, None)
        if sub is not None:
            self.hub.unsubscribe(sub)
        self.send(codec.reply(req))

    def op_ping(self, req: dict, line: bytes) -> None:
        self.send(codec.reply(req))

    def op_auth(self, req: dict, line: bytes) -> None:
        self.send(codec.reply(req))

    def op_info(self, req: dict, line: bytes) -> None:
        hub = self.hub
        self.send(codec.reply_with(req, {"info": {
            "server": "shardbroker", "worker": hub.index, "workers": hub.workers, "pid": os.getpid(),
            "cid": self.cid, "subscriptions": sorted(self.subs),
        }}))


_OPS = {
    "pub": NdjsonSession.op_pub,
    "sub": NdjsonSession.op_sub,
    "unsub": NdjsonSession.op_unsub,
    "ping": NdjsonSession.op_ping,
    "auth": NdjsonSession.op_auth,
    "info": NdjsonSession.op_info,
}
