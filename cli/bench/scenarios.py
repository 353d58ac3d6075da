"""The bench's catalogue: the targets (a server, and the protocol spoken to it) and the scenarios run on them, with
the goals each scenario's results are held to.

The work-queue scenarios (``qpush``, ``qwork1``, ``qwork8``, ``qdrain1``, ``qdrain8``, ``qlatency``, and with batch
producers ``qpushb``, ``qwork1b``, ``qwork8b``; ``qload``) run on the targets that have queues: this broker over
NDJSON, the same broker with its queue journal off (a second instance, started only for them), Redis Streams
with a consumer group (with nothing on disk, and as ``redis-aof`` with its append-only file), and nats-server
JetStream (a work-queue stream in memory and a durable pull consumer, on a
server started with ``-js`` for them).  Each run uses a fresh queue, checks afterwards that every acknowledged
push was stored (``qpush``) or acked exactly once (the others), and removes the queue (cli/bench/measure.py).

The leaf scenarios (``leafin``, ``leafout``; only when named with ``-s``) run the same NATS traffic through a hub
nats-server and a leaf of it: this broker with a ``leafnodes`` remote to the hub (``shardbroker/leaf``) against a
nats-server leaf of the same hub (``nats-server/leaf``, with ``--peers nats``); the hub and that leaf are the newest
nats-server installed, 2.10 at least (cli/bench/leaf.py has how a run waits for the interest to cross).

The big scenarios (``wide20k``: fan-out to 20,000 subscriber connections; ``conn50k``: 50,000 connections; only
when named with ``-s``) are ``wide`` and ``connections`` at the sizes of issue 42, for a machine that has the
cores and the open files for them (cli/bench/scale.py).

The run that alternates the targets through the scenarios is cli/bench/runner.py; what one scenario on one target
does and measures, cli/bench/measure.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    label: str
    server: str     # which Server
    wire: str       # which protocol
    pubsub: bool = True     # runs the pub/sub scenarios
    queues: bool = False    # runs the work-queue scenarios
    tls: bool = False       # clients connect with TLS (--tls); not in the connection-scale scenario
    leaf: bool = False      # a leaf node of the bench's hub: runs the leaf scenarios (and only those)

    def runs(self, sc: Scenario) -> bool:
        """Whether this target takes part in ``sc``: leaves in the leaf scenarios, queue targets in the queue ones,
        pub/sub targets in the others."""
        if sc.leaf:
            return self.leaf
        return self.queues if sc.queue else self.pubsub


ALL_TARGETS = [
    Target("shardbroker/nats", "shardbroker", "nats"),
    Target("shardbroker/ndjson", "shardbroker", "ndjson", queues=True),
    Target("shardbroker/ndjson-nojournal", "shardbroker-nojournal", "ndjson", pubsub=False, queues=True),
    Target("nats-server", "nats-server", "nats"),
    Target("redis", "redis", "redis", queues=True),
    # Redis with its append-only file (fsync every second), for the queue scenarios: durable against durable
    Target("redis-aof", "redis-aof", "redis", pubsub=False, queues=True),
    Target("nats-server/jetstream", "nats-server-jetstream", "jetstream", pubsub=False, queues=True),
    # --tls: the same broker with TLS on its NATS and NDJSON ports, and nats-server with TLS (the cost of TLS)
    Target("shardbroker/nats-tls", "shardbroker-tls", "nats", tls=True),
    Target("shardbroker/ndjson-tls", "shardbroker-tls", "ndjson", tls=True),
    Target("nats-server-tls", "nats-server-tls", "nats", tls=True),
    # The leaf scenarios (-s leafin,leafout): this broker with a leafnodes remote to the bench's hub (a nats-server),
    # and a nats-server leaf of the same hub (with --peers nats), compression off on its link
    Target("shardbroker/leaf", "shardbroker-leaf", "nats", pubsub=False, leaf=True),
    Target("nats-server/leaf", "nats-server-leaf", "nats", pubsub=False, leaf=True),
]
OURS = ("shardbroker", "shardbroker-nojournal", "shardbroker-tls", "shardbroker-leaf")
QUEUE_RATE = 2000.0     # pushes per second in ``qlatency`` (Options.qrate)
# The receive+ack scenarios' goal (at or above Redis Streams), like for like: the journal, written before every
# reply, against Redis with its append-only file, which Redis also writes before every reply; and the broker with
# its journal off against Redis with nothing on disk.  Every row still shows its ratio to Redis with nothing on
# disk (``vs redis``): docs/performance.md, "Which Redis is the yardstick".
QUEUE_GOALS = (("shardbroker/ndjson", "redis-aof", 1.0), ("shardbroker/ndjson-nojournal", "redis", 1.0))
# The leaf scenarios' goal (issue 40): this broker as a leaf at 0.8x nats-server as a leaf of the same hub, or better
LEAF_GOALS = (("shardbroker/leaf", "nats-server/leaf", 0.8),)
# Not in the default set (cli/main.py's -s): they need a nats-server >= 2.10 as the hub, which the main table's
# peers do not (Debian's is 2.9), and they measure a link to another server rather than the broker's own clients.
LEAF_SCENARIOS = ("leafin", "leafout")
# Not in the default set either (issue 42): the wide fan-out and the connection scale at sizes that want a machine
# with more cores than the default run assumes, and more open files than many allow (cli/bench/scale.py: their
# connections go out from several loopback addresses, and a scenario the hard limit on open files cannot hold is
# skipped).  Their sizes are options of their own (--wide-max, --connections-max), small in the tests.
BIG_SCENARIOS = ("wide20k", "conn50k")
WIDE_MAX = 20_000
CONNECTIONS_MAX = 50_000


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    kind: str                       # "throughput", "latency" or "connections"
    pubs: int = 1
    subs: int = 1
    distinct: bool = False          # N→N: publisher i publishes to subject i, which subscriber i alone receives
    rate: float | None = None       # messages per second per publisher (latency)
    count: int | None = None        # messages per publisher, instead of publishing for the duration
    # seconds without deliveries that end a run (None: the generator's 0.75).  Not part of the rate, which ends at
    # the last delivery: only how long a pause in the deliveries is taken for their end.
    quiet: float | None = None
    connections: int = 0
    # (target, compared with, the ratio it must reach); for latency: at most that ratio of p99
    goals: tuple = ()
    # work queues: pubs producers and subs consumers of one queue.  On this broker with more than one worker,
    # where the producers and consumers are, relative to the queue's owner: "owner", "other" or "" (anywhere).
    queue: bool = False
    producer_at: str = ""
    consumer_at: str = ""
    window: int = 1000      # pushes a producer has unanswered at most (full speed)
    batch: int = 100        # messages per receive at most (each batch is acked with one request)
    wait_ms: int = 1000     # a receive's long poll
    drain: bool = False     # consumers start once the producer is done (count: pushes at most): receive+ack alone
    push_batch: int = 1     # messages per push request (this broker's batch qpush; Redis: that many XADDs)
    # leaf scenarios: "in": the publishers on the hub, the subscribers on the leaf; "out": the reverse
    leaf: str = ""

    @property
    def held(self) -> int:
        """Connections a run holds open at once, all of them in one process of nats-server or Redis."""
        return self.connections or self.pubs + self.subs


def scenarios(nn: int, wide: int, rate: float, connections: int, qrate: float = QUEUE_RATE,
              wide_max: int = WIDE_MAX, connections_max: int = CONNECTIONS_MAX) -> dict[str, Scenario]:
    return {s.name: s for s in [
        Scenario("fanout1", "fan-out 1→1", "throughput", 1, 1,
                 goals=(("shardbroker/nats", "nats-server", 0.75), ("shardbroker/ndjson", "redis", 1.0))),
        Scenario("fanout10", "fan-out 1→10", "throughput", 1, 10,
                 goals=(("shardbroker/nats", "nats-server", 1.0), ("shardbroker/ndjson", "redis", 1.0))),
        Scenario("fanout100", "fan-out 1→100", "throughput", 1, 100,
                 goals=(("shardbroker/nats", "nats-server", 1.0),)),
        Scenario("nn", f"N→N, N={nn}, across workers", "throughput", nn, nn, distinct=True,
                 goals=(("shardbroker/nats", "nats-server", 0.75),)),
        Scenario("wide", f"fan-out to {wide:,} connections", "throughput", 1, wide, count=200),
        Scenario("latency", f"latency at {rate:,.0f} msg/s", "latency", 1, 1, rate=rate,
                 goals=(("shardbroker/nats", "nats-server", 1.5),)),
        Scenario("connections", f"{connections:,} connections", "connections", connections=connections),
        # The same two, big ("big" in the title keeps them apart from the others in the report and the chart)
        # quiet: Redis reads the publisher's pipelined PUBLISHes 16 KiB at a time (~100 of them) and writes their
        # deliveries (~2,000,000) only once it has queued them all, a pause of seconds on a small machine that the
        # default 0.75 s took for the end (every delivery counted lost at 18,000 on 2 cores).  A run still ends
        # as soon as every subscriber has its messages (the generators' ``expect``).
        Scenario("wide20k", f"big fan-out to {wide_max:,} connections", "throughput", 1, wide_max, count=200,
                 quiet=5.0),
        Scenario("conn50k", f"big: {connections_max:,} connections", "connections", connections=connections_max),
        # Work queues.  The producer is on the queue's owner, the consumers on the other workers, so receives and
        # acks cross workers and pushes do not (a push from another worker costs a round trip between workers
        # per push: see docs/performance-notes.md).
        Scenario("qpush", "queue push, 1 producer", "throughput", 1, 0, queue=True, producer_at="owner"),
        Scenario("qwork1", "queue push→recv+ack 1→1", "throughput", 1, 1, queue=True, producer_at="owner",
                 consumer_at="other", goals=QUEUE_GOALS),
        Scenario("qwork8", "queue push→recv+ack 1→8", "throughput", 1, 8, queue=True, producer_at="owner",
                 consumer_at="other", goals=QUEUE_GOALS),
        Scenario("qdrain1", "queue recv+ack of a backlog, 1", "throughput", 1, 1, count=300_000, queue=True,
                 producer_at="owner", consumer_at="other", drain=True, goals=QUEUE_GOALS),
        Scenario("qdrain8", "queue recv+ack of a backlog, 8", "throughput", 1, 8, count=300_000, queue=True,
                 producer_at="owner", consumer_at="other", drain=True, goals=QUEUE_GOALS),
        Scenario("qlatency", f"queue latency at {qrate:,.0f} msg/s", "latency", 1, 1, rate=qrate, queue=True,
                 producer_at="owner", consumer_at="other"),
        # Batch producers: each push request carries 100 messages (Redis has no batch XADD: its producer
        # pipelines XADDs as in the others, which is how Redis batches).
        Scenario("qpushb", "queue push, 1 producer, batches of 100", "throughput", 1, 0, queue=True,
                 producer_at="owner", push_batch=100),
        Scenario("qwork1b", "queue batch push→recv+ack 1→1", "throughput", 1, 1, queue=True, producer_at="owner",
                 consumer_at="other", push_batch=100, goals=QUEUE_GOALS),
        Scenario("qwork8b", "queue batch push→recv+ack 1→8", "throughput", 1, 8, queue=True, producer_at="owner",
                 consumer_at="other", push_batch=100, goals=QUEUE_GOALS),
        # Leaf nodes: the same NATS traffic through a hub (a nats-server) and a leaf of it, this broker or a
        # nats-server (cli/bench/leaf.py).  In: the hub's publisher to subscribers on the leaf, which fans out
        # (this broker receives one copy per worker with subscribers, over each worker's own link).  Out: a
        # publisher on the leaf, which forwards every message over its link to the hub's subscriber.
        Scenario("leafin", "leaf: hub → leaf, 1→10", "throughput", 1, 10, leaf="in", goals=LEAF_GOALS),
        Scenario("leafout", "leaf: leaf → hub, 1→1", "throughput", 1, 1, leaf="out", goals=LEAF_GOALS),
    ]}


# This broker's queues in the bench hold more than the defaults (1,000,000 messages, 256 MiB a queue), so that a
# push scenario measures pushing rather than the bound: a producer at 500k msg/s fills a default queue in 2 s, and
# its pushes are refused (queue_full) from then on.  Redis Streams and JetStream are not bounded here either.
QUEUE_BOUNDS = {"queues": {"max_messages": 200_000_000, "max_bytes": 1 << 40}}
