"""This worker as a leaf of NATS deployments (docs/leafnodes.md): its connections to the remotes, and the rules that
tie them to the hub (../shared/reference/leafnodes.md §9).

Every worker dials every remote itself, with the instance's ``cluster`` name and a ``name`` of its own: the hub
never echoes one worker's interest or messages to another worker of the same cluster, so each worker
- advertises its own clients' interest (plain: once per pattern; queue groups: their member count, on every change),
- forwards to the hub what its own clients publish where the hub has interest (never what came over the fabric or
  from the hub), and for queue groups only those the broker has no member of, anywhere (local members first),
- delivers what the hub sends to its own clients: to every plain subscriber, and to one member of each queue group
  the message names, of this worker if it has one, else another worker's (over the fabric).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from typing import TYPE_CHECKING

import orjson

from shardbroker.router.subjects import is_valid_pattern
from shardbroker.workers.message import KIND_RAW, as_bytes
from shardbroker.workers.protocols.leaf import codec
from shardbroker.workers.protocols.leaf.link import LeafLink
from shardbroker.workers.speedups import msg_tails
from shardbroker.workers.turn import TURN_BUDGET

if TYPE_CHECKING:
    from shardbroker.cluster.config import Config, LeafRemoteConfig
    from shardbroker.workers.delivery import Route
    from shardbroker.workers.hub import Hub


def _key(remote: LeafRemoteConfig) -> bytes:
    return orjson.dumps(dataclasses.asdict(remote))


class Leafnodes:
    def __init__(self, hub: Hub, config: Config, server_id: str) -> None:
        self.hub = hub
        self.index = hub.index
        self.loop = hub.loop
        self.mark_dirty = hub.mark_dirty
        self.server_id = server_id
        self.lds = ""
        self.cluster = ""
        self.settings = config.leafnodes
        self.links: dict[bytes, LeafLink] = {}
        self.plain: dict[str, int] = {}                  # this worker's clients' patterns -> subscriptions
        self.queues: dict[tuple[str, str], int] = {}     # (pattern, group) -> this worker's members
        self.dropped = 0      # messages from a hub that no client here may take (deny_imports, a bad subject)
        self._max_topic = config.limits.max_topic_length
        hub.attach(self)
        hub.interest.leaf = self
        hub.leafnodes = self
        self.apply(config)

    # -- configuration ------------------------------------------------------------------------------------------
    def apply(self, config: Config) -> None:
        """The ``leafnodes`` section as it is now: links to remotes no longer listed close, new ones dial; a
        changed instance name redials everything."""
        section = config.leafnodes
        self.settings = section
        self._max_topic = config.limits.max_topic_length
        cluster = section.name or config.nats.server_name or self.server_id
        if cluster != self.cluster:
            self.cluster = cluster
            # One loop-detection subject per instance and name, shared by its workers (the server id is the
            # instance's): while a reload renames the instance, its workers change names one after another, and
            # the hub passes the old name's $LDS to the new name's connections, which must not take it for a loop.
            digest = hashlib.sha256(f"{self.server_id}/{cluster}".encode()).digest()
            self.lds = "$LDS." + base64.b32encode(digest).decode()[:22]
            self.close()
        wanted = {_key(remote): remote for remote in section.remotes}
        for key in [k for k in self.links if k not in wanted]:
            self.links.pop(key).close()
        for key, remote in wanted.items():
            link = self.links.get(key)
            if link is None:
                link = self.links[key] = LeafLink(self, remote, section)
                link.start()
            link.settings = section
        self.hub.invalidate()

    def close(self) -> None:
        links, self.links = self.links, {}
        for link in links.values():
            link.close()

    # -- local interest (workers.interest calls it for every subscription added or removed) ----------------------
    def local_changed(self, pattern: str, queue: str | None, delta: int) -> None:
        if queue is None:
            n = self.plain.get(pattern, 0) + delta
            if n > 0:
                self.plain[pattern] = n
            else:
                self.plain.pop(pattern, None)
            if not (n == 0 or (n == 1 and delta > 0)):
                return   # the hub hears of plain interest only when it starts and when it ends
        else:
            key = (pattern, queue)
            n = self.queues.get(key, 0) + delta
            if n > 0:
                self.queues[key] = n
            else:
                self.queues.pop(key, None)
        for link in self.links.values():
            link.local_changed(pattern, queue, max(n, 0))

    def interest(self) -> list[tuple[str, str | None, int]]:
        """All of it, for a link that (re)connected."""
        return [(p, None, 1) for p in self.plain] + [(p, q, w) for (p, q), w in self.queues.items()]

    def hub_interest_changed(self) -> None:
        self.hub.invalidate()

    # -- backpressure: a hub reading slower than this worker's clients publish to it sets their pace ---------------
    @property
    def stall_bytes(self) -> int:
        return self.hub.stall_bytes

    def congested(self, link: LeafLink) -> None:
        self.hub.backpressure.congested(link)

    def drained(self, link: LeafLink) -> None:
        self.hub.backpressure.drained(link)

    # -- to the hubs --------------------------------------------------------------------------------------------
    def targets(self, subject: str, groups_here: set[str] | None) -> tuple:
        """The links a message to ``subject`` published here goes to, each with the queue groups it names there
        (bytes, or None): the hub's interest, less the groups the broker has members of (``groups_here``), less
        what the hub's permissions or the remote's deny_exports forbid."""
        out = []
        subject_b = subject.encode()
        for link in self.links.values():
            if link.state != "connected" or not len(link.hub):
                continue
            plain, names = link.hub.match(subject)
            if names and groups_here:
                names = [n for n in names if n not in groups_here]
            if (plain or names) and link.perms.may_export(subject):
                queues = " ".join(names).encode() if names else None
                out.append((link, queues, codec.message_head(subject_b, None, queues)))   # the head without reply
        return tuple(out)

    @staticmethod
    def forward(route: Route, kind: int, payload: bytes, reply: str | None, headers: bytes | None) -> None:
        """A client of this worker published to ``route``'s subject: one LMSG (HMSG) per link that wants it."""
        body = as_bytes(kind, payload)
        size = len(body) if headers is None else len(body) + len(headers)
        if not reply:
            for link, _, head in route.leaf:
                link.send(codec.lmsg(head, headers, body), size)
            return
        reply_b = reply.encode()
        for link, queues, _ in route.leaf:
            link.send(codec.lmsg(codec.message_head(route.subject_b, reply_b, queues), headers, body), size)

    @staticmethod
    def forward_run(route: Route, kind: int, payloads: list[bytes], reply: str | None) -> None:
        """``forward`` for a run of messages without headers: each link's LMSGs made in one compiled call (the
        ``MSG`` tails NATS subscribers get are an LMSG's tails too) and queued as one write."""
        bodies = payloads if kind == KIND_RAW else [as_bytes(kind, p) for p in payloads]
        size = sum(map(len, bodies))
        largest = max(map(len, bodies))
        reply_b = reply.encode() if reply else None
        for link, queues, head in route.leaf:
            if largest > link.max_payload or (queues and reply_b):
                for body in bodies:   # the rare forms: one at a time
                    link.send(codec.lmsg(codec.message_head(route.subject_b, reply_b, queues), None, body), len(body))
                continue
            prefix = b"LMSG " + route.subject_b if queues is None else b"LMSG" + head[:-1]
            tails = msg_tails(bodies, reply_b)
            tails.insert(0, b"")
            link.send_run(prefix.join(tails), len(bodies), size)

    # -- from the hubs ------------------------------------------------------------------------------------------
    def received(self, link: LeafLink, subject: bytes, reply: bytes | None, queues: tuple, headers: bytes | None,
                 payload: bytes) -> None:
        hub = self.hub
        route = hub.routes_b.get(subject)
        if route is None:
            try:
                text = subject.decode()
            except UnicodeDecodeError:
                self.dropped += 1
                return
            if not is_valid_pattern(text, self._max_topic):
                self.dropped += 1
                return
            route = hub.route_for(text)
        if link.perms.local_import_deny and not link.perms.may_receive(route.subject):
            self.dropped += 1
            return
        reply_s = reply.decode("utf-8", "replace") if reply else None
        if route.local:
            hub.deliver(route, KIND_RAW, payload, reply_s, headers, None)
        if queues and not self._to_groups(route, queues, payload, reply_s, headers):
            hub.queue_dropped += 1
        hub.turn_work += 1

    def _to_groups(self, route: Route, names: tuple[bytes, ...], payload: bytes, reply: str | None,
                   headers: bytes | None) -> bool:
        """One member of each queue group the hub named: of this worker if it has one, else another worker's.
        -> whether some member was found."""
        if not route.queued:
            return False
        hub = self.hub
        targets = hub.groups.pick_named(hub.groups_of(route), names, self.index)
        for worker, members in targets.items():
            if worker == self.index:
                hub.deliver_members(route.subject, KIND_RAW, payload, reply, headers, members)
            else:
                hub.fabric.send(worker, (route.subject, KIND_RAW, payload, reply, headers, ("m", members)),
                                len(payload))
                hub.schedule_flush()
        return bool(targets)

    def read_done(self, link: LeafLink) -> None:
        """After a link's read: a turn's budget spent waits for the next turn, and publishers held back by slow
        consumers hold the hub back too (its messages wait in the TCP connection, as a client's would)."""
        hub = self.hub
        transport = link.transport
        if transport is None:
            return
        if hub.holding:
            transport.pause_reading()
            hub.held.add(link)
        elif hub.turn_work >= TURN_BUDGET:
            transport.pause_reading()
            self.loop.call_soon(link.release)

    # -- hub part -----------------------------------------------------------------------------------------------
    def peer_ready(self, peer: int) -> None:
        pass

    def peer_reset(self, peer: int) -> None:
        pass

    def connection_closed(self, cid: int) -> None:
        pass

    def users_changed(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def stats(self) -> dict:
        links = list(self.links.values())
        return {"leafnodes": {
            "connections": sum(link.state == "connected" for link in links),
            "remotes": len(links),
            "in_msgs": sum(link.in_msgs for link in links),
            "out_msgs": sum(link.out_msgs for link in links),
            "in_bytes": sum(link.in_bytes for link in links),
            "out_bytes": sum(link.out_bytes for link in links),
            "slow_consumers": sum(link.slow_consumers for link in links),
            "oversize": sum(link.oversize for link in links),
            "reconnects": sum(link.reconnects for link in links),
            "dropped": self.dropped,
        }}

    def leafz(self, subs: bool) -> list[dict]:
        return [link.leafz(subs) for link in self.links.values()]
