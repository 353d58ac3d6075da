"""GET /metrics: what the supervisor gathers from its workers at scrape time, in Prometheus' text format (or
OpenMetrics when the scraper asks for it).

Why a collector over one scrape's replies, and not prometheus_client's Counter objects: the workers already count
everything in plain integers (an increment costs 37 ns, against 320 ns for ``Counter.inc()`` and 760 ns in the
library's multiprocess mode, per message), and the supervisor already asks them for those counts for /varz.  So
each scrape asks once more and renders the replies; prometheus_client does what it is best at: the exposition
formats, their escaping, and the choice between them by the Accept header.

Every counter is per worker (label ``worker``).  A replaced worker starts its counters again from 0 in the same
series, which rate() and increase() read as a counter reset: never a negative rate.  No broker-wide total is
exported, on purpose: summed here, it would drop whenever a worker died, and that drop would read as a reset of
the whole total.  ``sum by (instance)`` in PromQL, after rate(), is the total.

docs/operations.md lists every series.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from shardbroker.cluster.monitoring.processes import ProcessSample

MAX_QUEUE_SERIES = 1000   # work queues exported by name: the busiest ones, beyond that (clients name queues)


@dataclass
class WorkerSample:
    index: int
    pid: int
    restarts: int                # replacements of this index so far
    start_time: float            # epoch seconds
    heartbeat_age: float         # seconds since its last heartbeat
    stats: dict | None           # its stats reply; None: not asked (not ready) or did not answer
    process: ProcessSample | None


@dataclass
class Scrape:
    workers: list[WorkerSample]
    supervisor: ProcessSample | None
    start_time: float
    max_fds: int
    version: str
    nats_protocol: str
    max_connections: int
    max_pending_bytes: int
    queues: list[dict] = field(default_factory=list)   # /queuez rows (with "owner")
    # the supervisor's: connection limits (cluster.supervisor.admission)
    breaches: dict[str, int] = field(default_factory=dict)
    accept_errors: int = 0
    tls: dict[str, int] = field(default_factory=dict)   # the supervisor's TLS handshakes (monitoring), by outcome
    tls_not_after: dict[str, float] = field(default_factory=dict)   # listener -> when its certificate expires
    config_loaded: float = 0.0          # when the running configuration was loaded (start, or the last reload)
    reloads: dict[str, int] = field(default_factory=dict)   # reloads by outcome: ok, failed
    reload_ok: bool = True              # the last reload applied (true before any)


def render(scrape: Scrape, accept: str) -> tuple[bytes, str]:
    """The exposition, and its Content-Type, in the format ``accept`` asks for."""
    encoder, content_type = choose_encoder(accept)
    return encoder(BrokerCollector(scrape)), content_type


# The workers' stats fields (workers/hub.py stats()) as metrics: (field, name, help).
_WORKER_COUNTERS = (
    ("in_msgs", "shardbroker_in_messages", "Messages published by this worker's clients."),
    ("in_bytes", "shardbroker_in_bytes", "Payload bytes (NATS headers included) of the messages published."),
    ("out_msgs", "shardbroker_out_messages", "Deliveries to this worker's clients."),
    ("out_bytes", "shardbroker_out_bytes", "Payload bytes (NATS headers included) of the deliveries."),
    ("out_wire_bytes", "shardbroker_out_wire_bytes", "Bytes written to client sockets, framing and replies included."),
    ("total_connections", "shardbroker_connections_accepted", "Connections this worker adopted."),
    ("slow_consumers", "shardbroker_slow_consumers",
     "Connections closed for having more than max_pending bytes unread."),
    ("backpressure_episodes", "shardbroker_backpressure_episodes",
     "Times a lagging consumer made this worker pause reading its publishers."),
    ("backpressure_released", "shardbroker_backpressure_released",
     "Consumers found not reading at all and no longer waited for."),
    ("callback_errors", "shardbroker_callback_errors",
     "Exceptions caught in a callback (the fabric reader, a sync point, a turn's phase, a commit's reply) so the "
     "others went on: each is a bug, logged with its traceback."),
    ("queue_dropped", "shardbroker_queue_group_dropped_messages",
     "Queue-group deliveries dropped: the member picked had gone or could no longer receive the subject."),
    ("journal_refused", "shardbroker_workqueue_journal_refused_requests",
     "Work-queue pushes and receives refused (journal_unavailable): the queue journal could not be written."),
    ("journal_compactions", "shardbroker_workqueue_journal_compactions",
     "Work-queue journal rewrites as the live state (compactions) put in place."),
    ("queues_refused", "shardbroker_workqueue_too_many_queues_refusals",
     "Work-queue pushes and long polls refused (too_many_queues): the worker held queues.max_queues_per_worker."),
    ("queues_forgotten", "shardbroker_workqueue_queues_forgotten",
     "Work queues forgotten after queues.forget_idle empty and untouched."),
)
_WORKER_GAUGES = (
    ("connections", "shardbroker_connections", "Client connections open.", ""),
    ("subscriptions", "shardbroker_subscriptions", "Subscriptions held, queue subscriptions included.", ""),
    ("queue_subscriptions", "shardbroker_queue_group_subscriptions", "Queue-group subscriptions held.", ""),
    ("patterns", "shardbroker_subscription_patterns", "Distinct subscription patterns of this worker's clients.", ""),
    ("remote_patterns", "shardbroker_remote_patterns", "Patterns other workers hold that this one routes to.", ""),
    ("route_cache", "shardbroker_route_cache_entries", "Cached subject routes.", ""),
    ("owned_subjects", "shardbroker_owned_subjects", "Subjects whose counters this worker keeps (/topicz).", ""),
    ("pending_bytes", "shardbroker_pending_bytes", "Bytes queued for this worker's clients and not yet read by them.",
     "bytes"),
    ("pending_bytes_max", "shardbroker_largest_connection_pending_bytes",
     "The most bytes one connection has unread: the one closest to being a slow consumer.", "bytes"),
    ("pending_polls", "shardbroker_pending_polls", "Work-queue receives of this worker's clients waiting (long polls).",
     ""),
    ("journal_bytes", "shardbroker_workqueue_journal_bytes", "The work-queue journal's size.", "bytes"),
)
_FABRIC_COUNTERS = (
    ("lost_frames", "shardbroker_fabric_lost_frames", "Frames from other workers found missing (sequence gaps)."),
    ("lost_messages", "shardbroker_fabric_lost_messages", "Messages in the frames found missing."),
    ("dropped_messages", "shardbroker_fabric_dropped_messages",
     "Messages not sent to a worker that acknowledged nothing for fabric.stall_timeout."),
    ("stalls", "shardbroker_fabric_stalls", "Times a full window to another worker paused this worker's publishers."),
)
_LINK_GAUGES = (
    ("up", "shardbroker_fabric_link_up", "1 while the link to the peer works both ways.", ""),
    ("inflight_bytes", "shardbroker_fabric_link_inflight_bytes", "Bytes sent to the peer and not yet acknowledged.",
     "bytes"),
    ("lagging", "shardbroker_fabric_link_lagging", "1 while the peer is treated as stuck (messages for it dropped).",
     ""),
)
_LINK_COUNTERS = (
    ("messages_out", "shardbroker_fabric_sent_messages", "Messages sent to the peer worker."),
    ("messages_in", "shardbroker_fabric_received_messages", "Messages received from the peer worker."),
)
# The workers' ``leafnodes`` stats (workers/protocols/leaf/leafnodes.py), summed over each worker's leaf connections
_LEAF_GAUGES = (
    ("connections", "shardbroker_leafnode_connections", "Leaf connections to NATS hubs up now."),
    ("remotes", "shardbroker_leafnode_remotes",
     "Leaf connections the worker keeps (one per configured remote): up, dialling or waiting to redial."),
)
_LEAF_COUNTERS = (
    ("slow_consumers", "shardbroker_leafnode_slow_consumers",
     "Messages for a hub dropped because more than leafnodes.max_pending_bytes were waiting to reach it."),
    ("oversize", "shardbroker_leafnode_oversize",
     "Messages for a hub dropped because they were over the hub's max_payload."),
    ("reconnects", "shardbroker_leafnode_reconnects", "Redials of a leaf connection after a failure or a loss."),
    ("dropped", "shardbroker_leafnode_dropped_messages",
     "Messages from a hub that no client here may take (the remote's deny_imports, a subject not valid here)."),
)
# /queuez fields: (field, name, help, unit, scale)
_QUEUE_GAUGES = (
    ("visible", "shardbroker_workqueue_visible_messages", "Messages ready to be received.", "", 1),
    ("in_flight", "shardbroker_workqueue_in_flight_messages", "Messages leased and not yet acked.", "", 1),
    ("delayed", "shardbroker_workqueue_delayed_messages", "Messages waiting for their delay to end.", "", 1),
    ("messages", "shardbroker_workqueue_messages", "Messages stored.", "", 1),
    ("bytes", "shardbroker_workqueue_bytes", "Bytes of the messages stored.", "bytes", 1),
    ("waiters", "shardbroker_workqueue_waiters", "Receivers waiting in a long poll.", "", 1),
    ("oldest_visible_age_ms", "shardbroker_workqueue_oldest_visible_age_seconds",
     "Age of the oldest visible message.", "seconds", 0.001),
)
_QUEUE_COUNTERS = (
    ("pushed", "shardbroker_workqueue_pushed_messages", "Messages pushed."),
    ("delivered", "shardbroker_workqueue_delivered_messages", "Leases granted."),
    ("redelivered", "shardbroker_workqueue_redelivered_messages", "Leases granted on messages leased before."),
    ("acked", "shardbroker_workqueue_acked_messages", "Leases acked."),
    ("nacked", "shardbroker_workqueue_nacked_messages", "Leases nacked."),
    ("expired", "shardbroker_workqueue_expired_leases", "Leases that lapsed."),
    ("extended", "shardbroker_workqueue_extended_leases", "Lease extensions."),
    ("dead_lettered", "shardbroker_workqueue_dead_lettered_messages", "Messages moved to the dead-letter queue."),
    ("stale_receipts", "shardbroker_workqueue_stale_receipts", "Requests answered lease_lost."),
    ("duplicate_acks", "shardbroker_workqueue_duplicate_acks", "Acks answered already_acked."),
    ("rejected", "shardbroker_workqueue_rejected_messages", "Pushed messages refused with queue_full."),
    ("duplicate_pushes", "shardbroker_workqueue_duplicate_pushes", "Pushed messages not stored again: dedup_id."),
)


class BrokerCollector:
    """A prometheus_client collector over one Scrape (the encoders take any object with ``collect``)."""

    def __init__(self, scrape: Scrape) -> None:
        self.scrape = scrape

    def collect(self) -> Iterator[Metric]:
        yield from self._broker()
        yield from self._workers()
        yield from self._processes()
        yield from self._fabric()
        yield from self._leafnodes()
        yield from self._queues()
        yield from self._limits()
        yield from self._tls()

    def _broker(self) -> Iterator[Metric]:
        s = self.scrape
        yield InfoMetricFamily("shardbroker_build", "The broker's version, and the Python that runs it.",
                               value={"version": s.version, "nats_protocol": s.nats_protocol,
                                      "python": platform.python_version(),
                                      "implementation": platform.python_implementation()})
        yield GaugeMetricFamily("shardbroker_start_time_seconds", "When the supervisor started (epoch seconds).",
                                s.start_time, unit="seconds")
        yield GaugeMetricFamily("shardbroker_workers", "Worker processes configured.", len(s.workers))
        yield GaugeMetricFamily("shardbroker_max_connections", "limits.max_connections: the broker refuses more.",
                                s.max_connections)
        yield GaugeMetricFamily("shardbroker_max_pending_bytes",
                                "limits.max_pending_bytes: a connection with more unread is a slow consumer.",
                                s.max_pending_bytes, unit="bytes")
        # as Prometheus itself exports its own (prometheus_config_last_reload_successful)
        yield GaugeMetricFamily("shardbroker_config_last_reload_successful",
                                "1 if the last reload applied (or none was asked), 0 if it was refused and the "
                                "running configuration kept.", 1 if s.reload_ok else 0)
        yield GaugeMetricFamily("shardbroker_config_last_reload_success_timestamp_seconds",
                                "When the running configuration was loaded (epoch seconds): the start, or the last "
                                "reload that applied.", s.config_loaded, unit="seconds")
        reloads = CounterMetricFamily("shardbroker_config_reloads", "Reloads asked (SIGHUP, brokerctl reload), by "
                                      "outcome.", labels=("outcome",))
        for outcome in ("ok", "failed"):
            reloads.add_metric((outcome,), s.reloads.get(outcome, 0))
        yield reloads

    def _workers(self) -> Iterator[Metric]:
        ws = self.scrape.workers
        up = GaugeMetricFamily("shardbroker_worker_up",
                               "1 if the worker is ready and answered this scrape, 0 if not.", labels=("worker",))
        info = GaugeMetricFamily("shardbroker_worker_info", "The worker's process id (value 1).",
                                 labels=("worker", "pid"))
        restarts = CounterMetricFamily("shardbroker_worker_restarts",
                                       "Times this worker was replaced (it died or was killed as stuck).",
                                       labels=("worker",))
        started = GaugeMetricFamily("shardbroker_worker_start_time_seconds",
                                    "When the current process of this worker started (epoch seconds).",
                                    labels=("worker",), unit="seconds")
        heartbeat = GaugeMetricFamily("shardbroker_worker_heartbeat_age_seconds",
                                      "Seconds since the worker's event loop last sent its heartbeat.",
                                      labels=("worker",), unit="seconds")
        for w in ws:
            label = (str(w.index),)
            up.add_metric(label, 1 if w.stats is not None else 0)
            info.add_metric((label[0], str(w.pid)), 1)
            restarts.add_metric(label, w.restarts)
            started.add_metric(label, w.start_time)
            heartbeat.add_metric(label, round(w.heartbeat_age, 3))
        yield from (up, info, restarts, started, heartbeat)

        answered = [w for w in ws if w.stats is not None]
        for key, name, doc in _WORKER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=("worker",),
                                         unit="bytes" if name.endswith("_bytes") else "")
            for w in answered:
                family.add_metric((str(w.index),), w.stats.get(key, 0))
            yield family
        for key, name, doc, unit in _WORKER_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=("worker",), unit=unit)
            for w in answered:
                family.add_metric((str(w.index),), w.stats.get(key, 0))
            yield family

        lag = HistogramMetricFamily("shardbroker_event_loop_lag_seconds",
                                    "How late the worker's event loop ran a timer, sampled ten times a second.",
                                    labels=("worker",), unit="seconds")
        lag_max = GaugeMetricFamily("shardbroker_event_loop_lag_max_seconds",
                                    "The worst event-loop lag of the last 10 to 20 seconds.",
                                    labels=("worker",), unit="seconds")
        for w in answered:
            sample = w.stats.get("loop_lag")
            if not sample:
                continue
            buckets = [(repr(float(b)), n) for b, n in zip(sample["bounds"], sample["buckets"])]
            buckets.append(("+Inf", sample["count"]))
            lag.add_metric((str(w.index),), buckets, sample["sum"])
            lag_max.add_metric((str(w.index),), sample["max_seconds"])
        yield lag
        yield lag_max

    def _processes(self) -> Iterator[Metric]:
        """The standard process_* names, one series per process: label worker="0".., or "supervisor"."""
        s = self.scrape
        rss = GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size.", labels=("worker",),
                                unit="bytes")
        cpu = CounterMetricFamily("process_cpu_seconds", "User and system CPU time spent.", labels=("worker",),
                                  unit="seconds")
        fds = GaugeMetricFamily("process_open_fds", "Open file descriptors.", labels=("worker",))
        max_fds = GaugeMetricFamily("process_max_fds", "The open-files limit.", labels=("worker",))
        start = GaugeMetricFamily("process_start_time_seconds", "When the process started (epoch seconds).",
                                  labels=("worker",), unit="seconds")
        procs = [("supervisor", s.supervisor, s.start_time)]
        procs += [(str(w.index), w.process, w.start_time) for w in s.workers]
        for label, sample, started in procs:
            if sample is None:
                continue
            rss.add_metric((label,), sample.rss)
            cpu.add_metric((label,), round(sample.cpu_seconds, 2))
            fds.add_metric((label,), sample.open_fds)
            max_fds.add_metric((label,), s.max_fds)
            start.add_metric((label,), started)
        yield from (rss, cpu, fds, max_fds, start)

    def _fabric(self) -> Iterator[Metric]:
        answered = [w for w in self.scrape.workers if w.stats is not None]
        for key, name, doc in _FABRIC_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=("worker",))
            for w in answered:
                family.add_metric((str(w.index),), w.stats.get("fabric", {}).get(key, 0))
            yield family
        congested = GaugeMetricFamily("shardbroker_fabric_congested",
                                      "1 while a full window to another worker holds this worker's publishers.",
                                      labels=("worker",))
        for w in answered:
            congested.add_metric((str(w.index),), 1 if w.stats.get("fabric", {}).get("congested") else 0)
        yield congested
        tables = [(k, GaugeMetricFamily(n, d, labels=("worker", "peer"), unit=u)) for k, n, d, u in _LINK_GAUGES]
        tables += [(k, CounterMetricFamily(n, d, labels=("worker", "peer"))) for k, n, d in _LINK_COUNTERS]
        for w in answered:
            for peer, link in w.stats.get("fabric", {}).get("links", {}).items():
                for key, family in tables:
                    family.add_metric((str(w.index), peer), int(link.get(key, 0)))
        for _, family in tables:
            yield family

    def _leafnodes(self) -> Iterator[Metric]:
        """Each worker's leaf connections to NATS hubs, summed per worker (workers without leaf remotes: none)."""
        stats = [(str(w.index), w.stats["leafnodes"]) for w in self.scrape.workers
                 if w.stats is not None and "leafnodes" in w.stats]
        for key, name, doc in _LEAF_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=("worker",))
            for worker, leaf in stats:
                family.add_metric((worker,), leaf.get(key, 0))
            yield family
        messages = CounterMetricFamily("shardbroker_leafnode_messages",
                                       "Messages over the leaf connections: in from the hubs, out to them.",
                                       labels=("worker", "direction"))
        nbytes = CounterMetricFamily("shardbroker_leafnode_bytes", "Payload bytes (headers included) of those "
                                     "messages.", labels=("worker", "direction"), unit="bytes")
        for worker, leaf in stats:
            for direction in ("in", "out"):
                messages.add_metric((worker, direction), leaf.get(f"{direction}_msgs", 0))
                nbytes.add_metric((worker, direction), leaf.get(f"{direction}_bytes", 0))
        yield messages
        yield nbytes
        for key, name, doc in _LEAF_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=("worker",))
            for worker, leaf in stats:
                family.add_metric((worker,), leaf.get(key, 0))
            yield family

    def _per_process(self, family, supervisor: dict, field: str) -> None:
        """``family`` labelled (worker, key): the supervisor's counts, then each worker's ``stats[field]``."""
        for key, n in sorted(supervisor.items()):
            family.add_metric(("supervisor", key), n)
        for w in self.scrape.workers:
            if w.stats is not None:
                for key, n in sorted(w.stats.get(field, {}).items()):
                    family.add_metric((str(w.index), key), n)

    def _limits(self) -> Iterator[Metric]:
        """Limits broken, per process that counts them: the supervisor (connections), each worker (the rest)."""
        s = self.scrape
        family = CounterMetricFamily("shardbroker_limit_breaches",
                                     "Times a client ran into a limit (refused, or closed, in its protocol's words).",
                                     labels=("worker", "limit"))
        self._per_process(family, s.breaches, "breaches")
        yield family
        yield CounterMetricFamily("shardbroker_accept_errors",
                                  "Accepts that failed for want of file descriptors (each pauses that listener).",
                                  value=s.accept_errors)

    def _tls(self) -> Iterator[Metric]:
        """TLS handshakes by outcome, per process that does them: each worker (its listeners), the supervisor
        (monitoring); and when each listener's certificate expires, to alert on before it does."""
        s = self.scrape
        family = CounterMetricFamily("shardbroker_tls_handshakes",
                                     "TLS handshakes by outcome: ok, failed (certificate or protocol), timeout "
                                     "(tls.handshake_timeout), plaintext (a client without TLS, refused).",
                                     labels=("worker", "outcome"))
        self._per_process(family, s.tls, "tls")
        yield family
        expiry = GaugeMetricFamily("shardbroker_tls_certificate_not_after",
                                   "When the listener's TLS certificate expires (epoch seconds).",
                                   labels=("listener",), unit="seconds")
        for listener, when in sorted(s.tls_not_after.items()):
            expiry.add_metric((listener,), when)
        yield expiry

    def _queues(self) -> Iterator[Metric]:
        rows = self.scrape.queues
        count = GaugeMetricFamily("shardbroker_workqueues", "Work queues this worker owns.", labels=("worker",))
        per_owner: dict[int, int] = {}
        for row in rows:
            per_owner[row["owner"]] = per_owner.get(row["owner"], 0) + 1
        for w in self.scrape.workers:
            if w.stats is not None:
                count.add_metric((str(w.index),), per_owner.get(w.index, 0))
        yield count
        if len(rows) > MAX_QUEUE_SERIES:
            rows = sorted(rows, key=lambda r: (-r.get("messages", 0), r["queue"]))[:MAX_QUEUE_SERIES]
        labels = ("queue", "worker")
        for key, name, doc, unit, scale in _QUEUE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels, unit=unit)
            for row in rows:
                family.add_metric((row["queue"], str(row["owner"])), row.get(key, 0) * scale)
            yield family
        for key, name, doc in _QUEUE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for row in rows:
                family.add_metric((row["queue"], str(row["owner"])), row.get(key, 0))
            yield family
