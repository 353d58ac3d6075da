"""The data source's options, read and checked once, on the driver, before the query starts: an unknown or
misspelled option, a missing or doubled target, a value of the wrong kind is one ``OptionError`` naming it."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_BROKER = "127.0.0.1:8080"   # the NDJSON listener, as brokerctl loadtest --broker
SPARK_OWN = {"path", "checkpointlocation"}   # what Spark itself may pass among the options


class OptionError(ValueError):
    """One line: which option, and what it takes."""


@dataclass(frozen=True)
class Options:
    host: str
    port: int
    queue: str | None
    subject: str | None
    consumer: str | None
    user: str | None
    password_env: str | None
    partitions: int
    lease_seconds: int
    max_per_trigger: int | None
    include_headers: bool
    idle_commit: bool
    write_id: str | None


    def password(self) -> str | None:
        """The password, from the environment variable ``passwordEnv`` names (read where it is needed: on the
        driver and on each executor), so that it is never an option Spark shows in its plans and UI."""
        if self.password_env is None:
            return None
        value = os.environ.get(self.password_env)
        if value is None:
            raise OptionError(f"passwordEnv: the environment variable {self.password_env!r} is not set here")
        return value


NAMES = ("broker", "queue", "subject", "consumer", "user", "passwordEnv", "numPartitions", "leaseSeconds",
         "maxMessagesPerTrigger", "includeHeaders", "idleCommit", "writeId")
KNOWN = {name.lower(): name for name in NAMES}   # Spark hands options over lower-cased


def parse(options: dict, reading: bool) -> Options:
    given = {k.lower(): v for k, v in options.items()}
    unknown = sorted(k for k in given if k not in KNOWN and k not in SPARK_OWN)
    if unknown:
        raise OptionError(f"unknown option {unknown[0]!r} (known: {', '.join(NAMES)})")
    queue, subject = given.get("queue"), given.get("subject")
    if queue is not None and subject is not None or reading and queue is None and subject is None:
        raise OptionError("give exactly one of the options queue (a work queue: at-least-once) and subject "
                          "(pub/sub: at-most-once as a source, at-least-once as a sink)"
                          + ("; a sink may give neither and name each row's in a queue or subject column"
                             if not reading else ""))
    broker = given.get("broker", DEFAULT_BROKER)
    host, _, port = broker.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise OptionError(f"broker: {broker!r} is not host:port (the NDJSON listener, default {DEFAULT_BROKER})")
    consumer = given.get("consumer")
    if reading and queue is not None and not consumer:
        raise OptionError("consumer: a queue source needs a consumer name, the same across restarts of the query "
                          "(it names its receives, so that a replay reads the same messages)")
    if consumer is not None and ("/" in consumer or not consumer.strip()):
        raise OptionError(f"consumer: {consumer!r} must be a non-empty name without '/'")
    return Options(
        host=host.strip("[]"), port=int(port), queue=queue, subject=subject, consumer=consumer,
        user=given.get("user"), password_env=given.get("passwordenv"),
        partitions=_int(given, "numpartitions", 2, 1, 1024),
        lease_seconds=_int(given, "leaseseconds", 120, 1, 43200),
        max_per_trigger=_int(given, "maxmessagespertrigger", None, 1, 100_000_000),
        include_headers=_bool(given, "includeheaders", False), idle_commit=_bool(given, "idlecommit", True),
        write_id=given.get("writeid"))


def _int(given: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = given.get(key)
    if value is None:
        return default
    text = str(value).strip()
    if not text.isdigit() or not lo <= int(text) <= hi:
        raise OptionError(f"{KNOWN[key]}: {value!r} must be an integer from {lo} to {hi}")
    return int(text)


def _bool(given: dict, key: str, default: bool) -> bool:
    value = given.get(key)
    if value is None:
        return default
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise OptionError(f"{KNOWN[key]}: {value!r} must be true or false")
    return text == "true"
