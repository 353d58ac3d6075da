"""``brokerctl queue``, run as a user runs it, against a real broker."""

import json
import subprocess
import sys

from support.harness import REPO


def brokerctl(broker, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardbroker.cli", "queue", args[0], "-p", str(broker.port), *args[1:]]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_push_recv_ack_stat_redrive_purge(start_broker):
    broker = start_broker(workers=2, config={"queues": {"max_deliveries": 1}})
    first = brokerctl(broker, "push", "cli.jobs", "hello").stdout.strip()
    brokerctl(broker, "push", "--json", "--priority", "9", "cli.jobs", '{"n": 1}')
    lines = brokerctl(broker, "recv", "-n", "5", "cli.jobs").stdout.splitlines()
    got = [json.loads(line) for line in lines]
    assert [m["data"] for m in got] == [{"n": 1}, "hello"] and got[1]["id"] == first
    acked = brokerctl(broker, "ack", "cli.jobs", got[0]["receipt"], "not-a-receipt", check=False)
    assert acked.returncode == 1
    assert acked.stdout.splitlines() == [f"{got[0]['receipt']} ok", "not-a-receipt invalid_receipt"]
    stat = json.loads(brokerctl(broker, "stat", "cli.jobs").stdout)
    assert (stat["in_flight"], stat["acked"]) == (1, 1)
    empty = brokerctl(broker, "recv", "--wait-ms", "100", "cli.none", check=False)
    assert empty.returncode == 3 and empty.stdout == ""
    bad = brokerctl(broker, "push", "bad.*", "x", check=False)
    assert bad.returncode == 1 and "invalid_queue" in bad.stderr
    # the leased message goes to the DLQ once its single delivery is nacked; redrive brings it back
    nack = subprocess.run([sys.executable, "-c", f"""
from shardbroker.cli.client import BlockingClient
c = BlockingClient.connect("127.0.0.1", {broker.port})
print(c.request("qnack", queue="cli.jobs", receipt="{got[1]['receipt']}")["state"])"""],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert nack.stdout.strip() == "dead", nack.stderr
    assert brokerctl(broker, "redrive", "cli.jobs.dlq").stdout.strip() == "moved 1"
    assert brokerctl(broker, "recv", "--ack", "cli.jobs").returncode == 0
    brokerctl(broker, "push", "cli.jobs", "x")
    assert brokerctl(broker, "purge", "--yes", "cli.jobs").stdout.strip() == "purged 1"


def test_a_receipt_that_begins_with_a_dash_is_a_receipt(start_broker):
    """Receipts are base64url: one in 64 begins with '-', which must not be read as an option."""
    broker = start_broker(workers=1)
    brokerctl(broker, "push", "cli.jobs", "x")
    done = brokerctl(broker, "ack", "cli.jobs", "-lz3V1TqAbCdEfGhIjKlMn", "ok-not-a-receipt", "--", "-x",
                     check=False)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == ["-lz3V1TqAbCdEfGhIjKlMn unknown_receipt", "ok-not-a-receipt invalid_receipt",
                                        "-x invalid_receipt"]
