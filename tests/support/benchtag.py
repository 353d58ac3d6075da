"""What the tests of ``brokerctl bench`` share: a tag in the environment that every process the bench starts
inherits, and the live processes that carry it (servers, workers, generators left behind)."""

import os
import uuid

import psutil


def tagged() -> tuple[dict, str]:
    """An environment whose tag every process the bench starts inherits, so leftovers are found by tag (not by
    name: other tests start brokers at the same time)."""
    tag = uuid.uuid4().hex
    return dict(os.environ, BENCH_TEST_TAG=tag), tag


def servers_left(tag: str) -> list:
    """Live processes that carry ``tag`` in their environment (servers, workers, generators)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get("BENCH_TEST_TAG") == tag:
                found.append(" ".join(proc.info["cmdline"] or []))
        except psutil.Error:
            continue
    return found
