"""The work-queue operations, in one table that the shard, the queue service and every protocol read.

One row per operation the shard runs (``Shard.handle`` dispatches to ``Shard._<name>``):

- ``fields``: what a client may give it, with its type; the shard checks each value's range.  NDJSON takes exactly
  these beside ``op``, ``queue`` and ``id`` (anything else is ``unknown_field``, ``fields.unknown``).
- ``permission``: ``publish:<queue>`` to push, ``subscribe:<queue>`` for what a consumer does, ``admin`` for purge
  and redrive; a stat takes either ``subscribe`` or ``admin`` (``service.allowed``).
- ``tokened``: it carries a token (worker, epoch, request) so that, sent again after its owner died, the owner's
  replacement sees a repeat instead of storing it twice (``service.QueueService.request``).
- ``makes``: it may make the queue it names (and counts against its maker's share of queues).
- ``waits``: it may wait for messages (a long poll: ``polls``, bounded per connection and per worker).
- How each protocol spells it: NDJSON's ``op``, the NATS ``$Q.<VERB>.<queue>`` verb (and the fields of its JSON
  body), qlite's commands.  A protocol with no spelling for an operation does not offer it.

The shard also takes arguments no client gives (``kind``, ``token``, ``user``, ``party``, ``pushes``, ...): what the
protocols and the service add on the way, documented where they are added.
"""

from __future__ import annotations

from dataclasses import dataclass

PUBLISH, SUBSCRIBE, ADMIN = "publish", "subscribe", "admin"


@dataclass(frozen=True)
class Operation:
    name: str
    fields: tuple[tuple[str, str], ...]   # (field, type) a client may give
    permission: str
    tokened: bool = False
    makes: bool = False
    waits: bool = False
    ndjson: str | None = None                   # NDJSON's op
    nats: str | None = None                     # $Q.<VERB>
    nats_body: tuple[str, ...] | None = None    # the fields of its JSON body (None: no JSON body)
    qlite: tuple[str, ...] = ()                 # qlite's commands that run it

    @property
    def args(self) -> tuple[str, ...]:
        """The fields the shard takes as its arguments (a push's content, data or messages, is the protocol's)."""
        return tuple(name for name, _ in self.fields if name not in CONTENT)


CONTENT = ("data", "messages")   # what a push stores: each protocol reads it its own way

OPERATIONS: tuple[Operation, ...] = (
    Operation("push", (("data", "any"), ("messages", "list"), ("priority", "int"), ("delay_ms", "int"),
                       ("dedup_id", "str")), PUBLISH, tokened=True, makes=True,
              ndjson="qpush", nats="PUSH", qlite=("PUSH",)),
    # a run of pushes to one queue, gathered by a protocol from one read: one request to the owner
    Operation("pushes", (), PUBLISH, tokened=True, makes=True),
    # ``attempt``: an id that makes the receive idempotent (attempts.py)
    Operation("recv", (("max", "int"), ("wait_ms", "int"), ("visibility_ms", "int"), ("release_on_close", "bool"),
                       ("attempt", "str")),
              SUBSCRIBE, makes=True, waits=True, ndjson="qrecv", nats="RECV",
              nats_body=("batch", "expires", "no_wait", "visibility_ms", "release_on_close", "attempt"),
              qlite=("HIDE", "POLL")),
    # ``attempts``: the leases of those receives, as a group
    Operation("ack", (("receipt", "str"), ("receipts", "list"), ("attempts", "list")), SUBSCRIBE, ndjson="qack",
              nats="ACK", qlite=("DEL",)),
    Operation("extend", (("receipt", "str"), ("visibility_ms", "int"), ("attempts", "list")), SUBSCRIBE,
              ndjson="qextend", qlite=("EXT",)),   # NATS: an ack with +WPI
    Operation("nack", (("receipt", "str"), ("delay_ms", "int")), SUBSCRIBE, ndjson="qnack",
              nats_body=("delay",), qlite=("NACK",)),   # NATS: an ack with -NAK and that body
    Operation("dead", (("receipt", "str"),), SUBSCRIBE, ndjson="qdead"),   # NATS: an ack with +TERM
    Operation("stat", (), SUBSCRIBE, ndjson="qstat", nats="STAT", nats_body=(), qlite=("LEN", "STAT")),
    Operation("purge", (), ADMIN, ndjson="qpurge", nats="PURGE", nats_body=()),
    Operation("redrive", (("to", "str"), ("max", "int")), ADMIN, ndjson="qredrive", nats="REDRIVE",
              nats_body=("to", "max")),
)

BY_NAME = {op.name: op for op in OPERATIONS}
