"""Work queues with visibility timeouts (qlite's model, done as SQS and beanstalkd users expect): ``model`` is one
queue's state machine, ``journal`` its crash safety, ``shard`` the queues a worker owns, ``service`` the way
every worker reaches the owners, ``operations`` the table of what may be asked, and each protocol's
``queue_verbs`` (``workers.protocols``) map its requests onto it.  See
docs/queues.md."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from typing import TYPE_CHECKING

from shardbroker.workers.workqueues import core
from shardbroker.workers.workqueues.journal import Journal
from shardbroker.workers.workqueues.rules import Settings
from shardbroker.workers.workqueues.service import QueueService
from shardbroker.workers.workqueues.shard import Shard

if TYPE_CHECKING:
    from shardbroker.cluster.config import Config
    from shardbroker.workers.hub import Hub

log = logging.getLogger("broker.queues")

# The collector's first threshold in a worker (CPython's default: 700).  A queue request leaves a few short-lived
# containers (the request, its arguments, its reply) alive until the end of the turn that answers it, and a turn
# answers up to a hundred or more: at 700 the young generation is collected several times per turn and every
# survivor is walked again in the next generation.  At 2,000 single pushes cost ~15 % less and the collector
# ~4 times less in all (scripts/measure/queue_hotpath.py --gc-threshold: 211 -> 58 ms per 200,000 pushes and their
# receive+ack), with a young collection's median pause 0.13 ms (10,000 saves no more, and its pauses are ~2 ms).
# Queued messages themselves are untracked tuples (``model``), never walked.
GC_THRESHOLD = 2_000


def settings(config: Config) -> tuple[Settings, dict[str, Settings]]:
    """The defaults, and each configured queue's settings (its keys over the defaults)."""
    q = config.queues
    base = Settings(visibility_ms=int(q.visibility_timeout * 1000), max_deliveries=q.max_deliveries,
                    max_message_bytes=q.max_message_bytes, max_messages=q.max_messages, max_bytes=q.max_bytes,
                    dedup_window_s=q.dedup_window)
    configured = {}
    for d in q.queues:
        changes = {key: getattr(d, key) for key in ("max_deliveries", "max_message_bytes", "max_messages",
                                                      "max_bytes") if getattr(d, key) is not None}
        if d.visibility_timeout is not None:
            changes["visibility_ms"] = int(d.visibility_timeout * 1000)
        configured[d.name] = dataclasses.replace(base, **changes)
    return base, configured


class PlacementError(Exception):
    """Kept journals were written by a broker with another worker count."""


def _same_placement(directory: str, workers: int) -> None:
    """A queue is placed by its name's hash modulo the worker count, and each worker replays its own journal:
    journals kept by a broker with another count would put queues where no request finds them.  Refuse, and say
    how to go on."""
    marker = os.path.join(directory, "queues.placement")
    try:
        with open(marker) as fh:
            recorded = int(fh.read().strip() or 0)
    except FileNotFoundError:
        recorded = 0
    except ValueError:
        recorded = -1
    if recorded and recorded != workers:
        raise PlacementError(f"queues.data_dir {directory} holds the queues of a broker with {recorded} workers; "
                             f"start it with --workers {recorded} (queues cannot move between workers yet)")
    if not recorded:
        tmp = f"{marker}.{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(f"{workers}\n")
        os.replace(tmp, marker)


def start(index: int, config: Config, runtime_dir: str, hub: Hub) -> QueueService:
    """This worker's shard, rebuilt from its journal (a replaced worker's, or a restarted broker's with
    ``queues.data_dir``), and the service that reaches every shard.  Runs before the worker joins the fabric, so
    nobody sends it a request before its queues are back."""
    q = config.queues
    path = None
    if q.journal:
        directory = q.data_dir or runtime_dir
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if q.data_dir:
            _same_placement(directory, hub.workers)
        path = os.path.join(directory, f"queues-{index}.journal")
    journal = Journal(path, q.fsync if q.data_dir else "no", durable=bool(q.data_dir))
    if core.IMPLEMENTATION != "compiled":
        log.warning("worker %d: work queues on the pure-Python loops (%s): every queued message costs more CPU",
                    index, core.MISSING)
    defaults, configured = settings(config)
    shard = Shard(index, defaults, journal, hub.schedule_flush, config.limits.max_topic_length, configured,
                  q.max_queues_per_worker, q.forget_idle, q.max_queues_per_user)
    replayed = shard.replay()
    if replayed:
        messages = sum(len(queue.messages) for queue in shard.queues.values())
        log.info("worker %d: replayed %d journal record(s): %d queue(s), %d message(s)",
                 index, replayed, len(shard.queues), messages)
    service = QueueService(hub, shard)
    for name in configured:   # configured queues exist from the start, at their owners
        if service.owner(name) == index:
            shard.queue(name)
    # What exists now (modules, configuration, the replayed queues) lives as long as the worker: out of the
    # collector's way for good.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
    return service
