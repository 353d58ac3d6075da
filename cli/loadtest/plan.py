"""From a scenario to one task spec per Spark partition: which connections each task opens, with which role.

Publishers and subscribers go to separate tasks, so each side's CPU is measured alone and end-to-end latency is
timed across two processes.  The plan is a pure function of the scenario and the run id: the same scenario gives
the same tasks, connections, publisher ids and (with its seed) the same Poisson arrivals.
"""

from __future__ import annotations

import dataclasses
import socket

from shardbroker.cli.loadtest.scenario import ENDPOINT_OF, Scenario, Workload

PUB_ID_STRIDE = 1 << 16      # pub_id = task * stride + connection: a publisher id says which task sent it


def subject(run_id: str, w: Workload, topic: int) -> str:
    # The run id in the subject means a stray message from another run can never be counted as this run's.
    return f"lt.{run_id[:8]}.{w.name}.{topic}"


def clock_subject(run_id: str, task: int) -> str:
    """Where a task answers (and receives answers to) clock probes."""
    return f"lt.{run_id[:8]}.clock.{task}"


def roles(w: Workload) -> tuple[str, str]:
    return ("producer", "consumer") if w.protocol == "queue" else ("publisher", "subscriber")


def split_endpoint(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint {value!r}: expected host:port")
    return host.strip("[]"), int(port)


def build(sc: Scenario, run_id: str, endpoints: dict[str, str], progress: tuple[str, int] | None) -> list[dict]:
    late_any = any(w.late_subscribers for w in sc.workloads)
    common = {"run_id": run_id, "warmup": sc.warmup, "duration": sc.duration, "drain_timeout": sc.drain_timeout,
              "interval": sc.interval, "tick": sc.tick, "setup_timeout": sc.setup_timeout, "seed": sc.seed,
              "user": sc.user, "password_env": sc.password_env, "progress": progress, "late_round": late_any,
              "clock_probes": sc.clock_probes,
              "driver_host": socket.gethostname()}
    tasks: list[dict] = []
    for w in sc.workloads:
        pub_role, sub_role = roles(w)
        endpoint = endpoints[ENDPOINT_OF[w.protocol]]
        stages = [(s.duration, s.rate) for s in w.stages] or [(sc.warmup + sc.duration, w.rate)]
        wl = dataclasses.asdict(w)
        if w.publishers:
            first = len(tasks)
            specs = [dict(common, task=first + i, workload=wl, role=pub_role, endpoint=endpoint, stages=stages,
                          conns=[]) for i in range(w.publisher_tasks)]
            k = 0
            for t in range(w.topics):
                for _ in range(w.producers_per_topic):
                    spec = specs[k % w.publisher_tasks]
                    spec["conns"].append({"subject": subject(run_id, w, t),
                                          "pub_id": spec["task"] * PUB_ID_STRIDE + len(spec["conns"]),
                                          "share": 1.0 / w.publishers})
                    k += 1
            tasks += specs
        if w.subscribers:
            first = len(tasks)
            specs = [dict(common, task=first + i, workload=wl, role=sub_role, endpoint=endpoint, stages=stages,
                          conns=[]) for i in range(w.subscriber_tasks)]
            k = late = 0
            for t in range(w.topics):
                for s in range(w.subscriptions_per_topic):
                    is_late = not w.grouped and late < w.late_subscribers
                    late += is_late
                    for _ in range(w.consumers_per_subscription):
                        spec = specs[k % w.subscriber_tasks]
                        spec["conns"].append({"subject": subject(run_id, w, t),
                                              "group": f"g{s}" if w.grouped and w.protocol != "queue" else "",
                                              "late": is_late})
                        k += 1
            tasks += specs
    return tasks
