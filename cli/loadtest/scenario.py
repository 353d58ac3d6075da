"""A load-test scenario: the TOML file a user writes, read with the standard library and checked before anything
starts, so a typo costs a one-line error rather than a Spark job.

Times are strings with a unit ("500us", "2s", "1.5ms", "2m") or numbers of seconds.  A scenario holds one or more
workloads that run at once in one barrier stage (a mixed scenario: fan-out over NDJSON beside a work queue, say);
each workload has its own protocol, topology and load model.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field

PROTOCOLS = ("ndjson", "nats", "redis", "queue")
# Which broker endpoint each protocol talks to (queue requests are NDJSON requests).
ENDPOINT_OF = {"ndjson": "ndjson", "queue": "ndjson", "nats": "nats", "redis": "redis"}

# Spark settings without which a failed or slow task would run the load a second time (the barrier RDD is the load
# test itself; docs/loadtest.md): the job always sets them, and a scenario's [spark] conf may not change them.
SAFETY_CONF = {
    "spark.dynamicAllocation.enabled": "false",
    "spark.speculation": "false",
    "spark.task.maxFailures": "1",
    "spark.stage.maxConsecutiveAttempts": "1",
}

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h)?\s*$")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


class ScenarioError(ValueError):
    """A scenario that cannot run; the message names the key."""


def seconds(value, key: str) -> float:
    if isinstance(value, bool):
        raise ScenarioError(f"{key}: expected a duration such as \"2s\" or \"500us\", got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ScenarioError(f"{key}: must not be negative")
        return float(value)
    m = _DURATION.match(value) if isinstance(value, str) else None
    if not m:
        raise ScenarioError(f"{key}: expected a duration such as \"2s\" or \"500us\", got {value!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@dataclass(frozen=True)
class Stage:
    duration: float      # seconds
    rate: float          # aggregate msg/s of the workload


@dataclass(frozen=True)
class QueueOptions:
    visibility: float = 5.0          # lease length, seconds
    batch: int = 100                 # qrecv max
    wait: float = 1.0                # long poll, seconds
    abandon: float = 0.0             # fraction of first deliveries never acked (their leases expire)
    priority: int | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    protocol: str
    topics: int = 1
    producers_per_topic: int = 1
    subscriptions_per_topic: int = 1
    consumers_per_subscription: int = 1   # > 1: a queue group (NATS) or competing consumers
    size: int = 128
    model: str = "open"                   # open | closed
    arrival: str = "uniform"              # uniform | poisson
    rate: float = 1000.0                  # aggregate msg/s, all publishers together
    stages: tuple[Stage, ...] = ()
    window: int = 0                       # closed model: messages in flight per connection
    publisher_tasks: int = 1
    subscriber_tasks: int = 1
    late_subscribers: int = 0             # subscriptions that join `late_after` into the measure phase
    late_after: float = 0.0
    queue: QueueOptions = QueueOptions()

    @property
    def grouped(self) -> bool:
        return self.protocol == "queue" or self.consumers_per_subscription > 1

    @property
    def publishers(self) -> int:
        return self.topics * self.producers_per_topic

    @property
    def subscribers(self) -> int:
        return self.topics * self.subscriptions_per_topic * self.consumers_per_subscription

    def rate_at(self, t: float, warmup: float, duration: float) -> float:
        """Planned aggregate rate at ``t`` seconds after the start: stages if given, else the flat rate."""
        if t < 0 or t >= warmup + duration:
            return 0.0
        if not self.stages:
            return self.rate
        at = 0.0
        for stage in self.stages:
            if t < at + stage.duration:
                return stage.rate
            at += stage.duration
        return self.stages[-1].rate


@dataclass(frozen=True)
class Scenario:
    name: str
    workloads: tuple[Workload, ...]
    seed: int = 42
    warmup: float = 1.0
    duration: float = 5.0
    drain_timeout: float = 5.0
    interval: float = 1.0
    tick: float = 0.001
    setup_timeout: float = 60.0
    clock_probes: str = "auto"          # auto: only towards publishers on another host; always; off
    endpoints: dict[str, str] = field(default_factory=dict)   # protocol endpoint -> "host:port"
    user: str | None = None
    password_env: str = "BROKER_PASSWORD"
    spark_conf: dict[str, str] = field(default_factory=dict)
    thresholds: dict[str, str] = field(default_factory=dict)
    output: str = "results/{name}-{ts}"
    text: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def protocols(self) -> list[str]:
        return sorted({w.protocol for w in self.workloads})

    def endpoints_needed(self) -> list[str]:
        return sorted({ENDPOINT_OF[w.protocol] for w in self.workloads})


_TOP = {"name", "seed", "warmup", "duration", "drain_timeout", "interval", "tick", "setup_timeout", "clock_probes",
        "broker",
        "auth", "spark", "workload", "thresholds", "output"}
_WORKLOAD = {"name", "protocol", "topics", "producers_per_topic", "subscriptions_per_topic",
             "consumers_per_subscription", "size", "model", "arrival", "rate", "stages", "window",
             "publisher_tasks", "subscriber_tasks", "late_subscribers", "late_after", "queue"}
_QUEUE = {"visibility", "batch", "wait", "abandon", "priority"}


def loads(text: str, source: str = "scenario") -> Scenario:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{source}: not valid TOML: {exc}") from None
    return _scenario(raw, text)


def load(path: str) -> Scenario:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ScenarioError(f"{path}: {exc.strerror}") from None
    return loads(text, path)


def _unknown(table: dict, known: set, where: str) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise ScenarioError(f"{where}{extra[0]}: unknown key (known: {', '.join(sorted(known))})")


def _int(table: dict, key: str, where: str, default: int, lo: int, hi: int) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ScenarioError(f"{where}{key}: expected an integer from {lo} to {hi}, got {value!r}")
    return value


def _number(table: dict, key: str, where: str, default: float, lo: float, hi: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ScenarioError(f"{where}{key}: expected a number from {lo:g} to {hi:g}, got {value!r}")
    return float(value)


def _choice(table: dict, key: str, where: str, default: str, choices: tuple[str, ...]) -> str:
    value = table.get(key, default)
    if value not in choices:
        raise ScenarioError(f"{where}{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _workload(raw: dict, i: int) -> Workload:
    where = f"workload[{i}]."
    if not isinstance(raw, dict):
        raise ScenarioError(f"workload[{i}]: expected a table")
    _unknown(raw, _WORKLOAD, where)
    name = raw.get("name", f"w{i}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ScenarioError(f"{where}name: 1-32 letters, digits, '-' or '_', got {name!r}")
    protocol = _choice(raw, "protocol", where, "ndjson", PROTOCOLS)
    stages = []
    for j, st in enumerate(raw.get("stages", [])):
        if not isinstance(st, dict) or set(st) - {"duration", "rate"} or "duration" not in st:
            raise ScenarioError(f"{where}stages[{j}]: expected {{duration = \"10s\", rate = 5000}}")
        stages.append(Stage(seconds(st["duration"], f"{where}stages[{j}].duration"),
                            _number(st, "rate", f"{where}stages[{j}].", 0, 0, 1e8)))
    q = raw.get("queue", {})
    if not isinstance(q, dict):
        raise ScenarioError(f"{where}queue: expected a table")
    _unknown(q, _QUEUE, f"{where}queue.")
    if q and protocol != "queue":
        raise ScenarioError(f"{where}queue: only for protocol = \"queue\"")
    queue = QueueOptions(
        visibility=seconds(q.get("visibility", 5.0), f"{where}queue.visibility"),
        batch=_int(q, "batch", f"{where}queue.", 100, 1, 1000),
        wait=seconds(q.get("wait", 1.0), f"{where}queue.wait"),
        abandon=_number(q, "abandon", f"{where}queue.", 0.0, 0.0, 1.0),
        priority=_int(q, "priority", f"{where}queue.", 4, 0, 9) if "priority" in q else None)
    if not 0 < queue.visibility <= 43200:
        raise ScenarioError(f"{where}queue.visibility: from 1ms to 12h")
    w = Workload(
        name=name, protocol=protocol,
        topics=_int(raw, "topics", where, 1, 1, 10_000),
        producers_per_topic=_int(raw, "producers_per_topic", where, 1, 0, 10_000),
        subscriptions_per_topic=_int(raw, "subscriptions_per_topic", where, 1, 0, 10_000),
        consumers_per_subscription=_int(raw, "consumers_per_subscription", where, 1, 1, 10_000),
        size=_int(raw, "size", where, 128, 0, 1 << 20),
        model=_choice(raw, "model", where, "open", ("open", "closed")),
        arrival=_choice(raw, "arrival", where, "uniform", ("uniform", "poisson")),
        rate=_number(raw, "rate", where, 1000, 0, 1e8),
        stages=tuple(stages),
        window=_int(raw, "window", where, 0, 0, 1_000_000),
        publisher_tasks=_int(raw, "publisher_tasks", where, 1, 1, 10_000),
        subscriber_tasks=_int(raw, "subscriber_tasks", where, 1, 1, 10_000),
        late_subscribers=_int(raw, "late_subscribers", where, 0, 0, 10_000),
        late_after=seconds(raw.get("late_after", 0), f"{where}late_after"),
        queue=queue)
    if w.model == "closed" and w.window < 1:
        raise ScenarioError(f"{where}window: the closed model needs window >= 1 (messages in flight per connection)")
    if w.protocol == "queue" and w.subscriptions_per_topic != 1:
        raise ScenarioError(f"{where}subscriptions_per_topic: a queue has one set of consumers; "
                            "use consumers_per_subscription")
    if w.protocol == "redis" and w.consumers_per_subscription > 1:
        raise ScenarioError(f"{where}consumers_per_subscription: Redis pub/sub has no queue groups")
    if w.late_subscribers > w.topics * w.subscriptions_per_topic:
        raise ScenarioError(f"{where}late_subscribers: at most topics x subscriptions_per_topic")
    if w.late_subscribers and w.grouped:
        raise ScenarioError(f"{where}late_subscribers: only for plain subscriptions (not groups or queues)")
    if w.publisher_tasks > max(1, w.publishers) or w.subscriber_tasks > max(1, w.subscribers):
        raise ScenarioError(f"{where}publisher_tasks/subscriber_tasks: more tasks than connections")
    if w.size < 64 and w.protocol in ("ndjson", "queue"):
        raise ScenarioError(f"{where}size: at least 64 bytes over NDJSON (the header is 56 hex digits)")
    if w.size < 28:
        raise ScenarioError(f"{where}size: at least 28 bytes (the header: publisher, sequence, two times)")
    return w


def _scenario(raw: dict, text: str) -> Scenario:
    _unknown(raw, _TOP, "")
    workloads = raw.get("workload")
    if not isinstance(workloads, list) or not workloads:
        raise ScenarioError("workload: at least one [[workload]] table is needed")
    ws = tuple(_workload(w, i) for i, w in enumerate(workloads))
    names = [w.name for w in ws]
    if len(set(names)) != len(names):
        raise ScenarioError("workload.name: each workload needs its own name")
    broker = raw.get("broker", {})
    if not isinstance(broker, dict) or set(broker) - {"ndjson", "nats", "redis"}:
        raise ScenarioError("broker: a table of ndjson/nats/redis = \"host:port\"")
    auth = raw.get("auth", {})
    if not isinstance(auth, dict) or set(auth) - {"user", "password_env"}:
        raise ScenarioError("auth: a table with user and password_env (the password itself never goes in a file)")
    spark = raw.get("spark", {})
    if not isinstance(spark, dict) or set(spark) - {"conf"} or not isinstance(spark.get("conf", {}), dict):
        raise ScenarioError("spark: a table with conf = {\"spark.key\" = \"value\"}")
    thresholds = raw.get("thresholds", {})
    if not isinstance(thresholds, dict) or not all(isinstance(v, str) for v in thresholds.values()):
        raise ScenarioError("thresholds: a table of metric = \"<op> <value>\" strings, e.g. lost = \"== 0\"")
    sc = Scenario(
        name=_name(raw.get("name", "loadtest")), workloads=ws,
        seed=_int(raw, "seed", "", 42, 0, 2**63 - 1),
        warmup=seconds(raw.get("warmup", 1.0), "warmup"),
        duration=seconds(raw.get("duration", 5.0), "duration"),
        drain_timeout=seconds(raw.get("drain_timeout", 5.0), "drain_timeout"),
        interval=seconds(raw.get("interval", 1.0), "interval"),
        tick=seconds(raw.get("tick", 0.001), "tick"),
        setup_timeout=seconds(raw.get("setup_timeout", 60.0), "setup_timeout"),
        clock_probes=_choice(raw, "clock_probes", "", "auto", ("auto", "always", "off")),
        endpoints={k: str(v) for k, v in broker.items()},
        user=auth.get("user"), password_env=auth.get("password_env", "BROKER_PASSWORD"),
        spark_conf={str(k): str(v) for k, v in spark.get("conf", {}).items()},
        thresholds=dict(thresholds), output=str(raw.get("output", "results/{name}-{ts}")), text=text)
    for key, value in sc.spark_conf.items():
        if key in SAFETY_CONF and value.lower() != SAFETY_CONF[key]:
            raise ScenarioError(f"spark.conf: {key} must stay {SAFETY_CONF[key]} (a retried or duplicated task "
                                "would run the load twice)")
    if sc.duration <= 0:
        raise ScenarioError("duration: must be more than 0")
    if not 0.1 <= sc.interval <= 60:
        raise ScenarioError("interval: from 100ms to 60s")
    for key in ("warmup", "duration"):
        n = getattr(sc, key) / sc.interval
        if abs(n - round(n)) > 1e-9:
            raise ScenarioError(f"{key}: must be a whole number of intervals ({sc.interval:g}s)")
    if not 1e-3 <= sc.tick <= 0.1:
        # libuv (uvloop) and epoll time in whole milliseconds: uvloop rounds a 0.5 ms sleep to 0, and a publisher
        # would spin a core at any rate (on a small machine, the broker's core).
        raise ScenarioError("tick: from 1ms to 100ms (event loop timers count whole milliseconds)")
    for w in ws:
        if w.stages and abs(sum(s.duration for s in w.stages) - (sc.warmup + sc.duration)) > 1e-9:
            raise ScenarioError(f"workload {w.name}: stages must add up to warmup + duration "
                                f"({sc.warmup + sc.duration:g}s)")
        if w.late_subscribers and not 0 < w.late_after < sc.duration:
            raise ScenarioError(f"workload {w.name}: late_after must fall inside the measure phase")
        if w.protocol == "queue" and w.queue.visibility >= sc.drain_timeout and w.queue.abandon:
            raise ScenarioError(f"workload {w.name}: drain_timeout must be longer than queue.visibility when "
                                "leases are abandoned, or their redeliveries cannot be counted")
    from shardbroker.cli.loadtest.thresholds import parse  # the threshold grammar lives with its evaluation
    try:
        parse(sc.thresholds, [w.name for w in ws])
    except ValueError as exc:
        raise ScenarioError(f"thresholds: {exc}") from None
    return sc


def _name(value) -> str:
    if not isinstance(value, str) or not re.match(r"^[A-Za-z0-9_.-]{1,64}$", value):
        raise ScenarioError(f"name: 1-64 letters, digits, '.', '-' or '_', got {value!r}")
    return value
