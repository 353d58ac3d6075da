"""Work queues across the cluster: a kill -9 of the worker that owns them loses nothing acknowledged (every push that
got
the end, leases held across the crash can still be acked, and nobody is answered twice or not at all."""

import asyncio
import glob
import json
import os
import re
import signal
import time
import urllib.request
import zlib

import pytest

from support.harness import NatsFrames, Raw, nats_on_worker, pid_alive
from support.harness import on_worker as raw_on_worker

N = 2000


class Conn:
    """One NDJSON connection, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> "Conn":
        return cls(*await asyncio.open_connection("127.0.0.1", port, limit=1 << 25))

    async def request(self, obj: dict) -> dict:
        self.writer.write(json.dumps(obj).encode() + b"\n")
        return json.loads(await asyncio.wait_for(self.reader.readline(), 30))

    def close(self) -> None:
        self.writer.close()


async def on_worker(port: int, worker: int) -> Conn:
    extra = []
    for _ in range(32):
        c = await Conn.open(port)
        if (await c.request({"op": "info"}))["info"]["worker"] == worker:
            for e in extra:
                e.close()
            return c
        extra.append(c)
    raise AssertionError("no connection landed on the wanted worker")


def test_kill_9_of_the_owner_loses_nothing_acknowledged(start_broker):
    # the clients stay on the worker that survives (they would move to the owner: workers/protocols/ndjson/moves.py)
    broker = start_broker(workers=2, config={"queues": {"move_connections": False}})
    queue = next(q for q in (f"crash.{i}" for i in range(100)) if zlib.crc32(q.encode()) % 2 == 1)
    owner_pid = next(w["pid"] for w in broker.varz()["workers"] if w["worker"] == 1)

    async def run():
        producer = await on_worker(broker.port, 0)   # clients on the worker that survives
        consumer = await on_worker(broker.port, 0)
        stored: set[int] = set()
        retried: set[int] = set()
        acked: list[int] = []
        unavailable = 0
        killed = asyncio.Event()

        async def produce():
            nonlocal unavailable
            for i in range(N):
                while True:
                    reply = await producer.request({"op": "qpush", "queue": queue, "data": i})
                    if reply["ok"]:
                        stored.add(i)
                        break
                    assert reply.get("retry"), reply
                    unavailable += 1
                    retried.add(i)
                    await asyncio.sleep(0.05)
                if i == N // 3:
                    os.kill(owner_pid, signal.SIGKILL)
                    killed.set()

        async def consume(until: float):
            while time.monotonic() < until:
                reply = await consumer.request({"op": "qrecv", "queue": queue, "max": 20, "wait_ms": 200,
                                                "visibility_ms": 1500})
                if not reply["ok"]:
                    assert reply.get("retry"), reply
                    await asyncio.sleep(0.05)
                    continue
                for m in reply["messages"]:
                    ack = await consumer.request({"op": "qack", "queue": queue, "receipt": m["receipt"]})
                    if ack["ok"]:
                        # already_acked too: each receipt is acked once here, so that is this ack, sent again
                        # after the owner died having journaled it
                        acked.append(m["data"])
                    elif not ack["ok"]:
                        # the lease was lost (expired during the outage): it is delivered again
                        assert ack["error"] in ("lease_lost", "queue_unavailable"), ack
                if not reply["messages"] and len(stored) == N and len(set(acked)) >= N:
                    return

        await asyncio.gather(produce(), consume(time.monotonic() + 60))
        assert killed.is_set()
        stat = (await consumer.request({"op": "qstat", "queue": queue}))["stat"]
        producer.close()
        consumer.close()
        return stored, retried, acked, unavailable, stat

    stored, retried, acked, unavailable, stat = asyncio.run(run())
    assert not pid_alive(owner_pid)
    assert stored == set(range(N))
    missing = stored - set(acked)
    assert not missing, f"{len(missing)} pushes that got ok were never delivered: {sorted(missing)[:10]}"
    twice = {v for v in acked if acked.count(v) > 1}
    # a value acked twice is two stored copies: only a push the client itself retried may have two
    assert twice <= retried, f"stored twice without a client retry: {sorted(twice - retried)[:10]}"
    assert stat["messages"] == 0 and stat["in_flight"] == 0, stat
    assert "replayed" in broker.log(), broker.log()[-2000:]


def test_kill_9_of_the_owner_loses_no_pipelined_nats_push_and_leases_survive_it(start_broker):
    # NATS pushes and acks pipelined in one packet go to the owner as one request each: a kill -9 of the owner
    # between them loses no push that was answered ok, and the leases taken before it are acked after it
    broker = start_broker(workers=2)
    queue = next(q for q in (f"ncrash.{i}" for i in range(100)) if zlib.crc32(q.encode()) % 2 == 1)
    owner_pid = next(w["pid"] for w in broker.varz()["workers"] if w["worker"] == 1)
    producer = nats_on_worker(broker, 0, "_INBOX.p")
    consumer = nats_on_worker(broker, 0, "_INBOX.c")
    answers_p, answers_c = NatsFrames(producer), NatsFrames(consumer)
    stored: set[int] = set()
    retried: set[int] = set()
    acked: list[int] = []

    def push(values: list[int]) -> None:
        while values:
            producer.sendall(b"".join(b"PUB $Q.PUSH.%s _INBOX.p.%d %d\r\n%d\r\n"
                                      % (queue.encode(), v, len(b"%d" % v), v) for v in values))
            answers = answers_p.by_token(len(values))
            again = []
            for v in values:
                reply = json.loads(answers[str(v)][1])
                if reply["ok"]:
                    stored.add(v)
                else:
                    assert reply.get("retry"), reply
                    again.append(v)
            retried.update(again)
            values = again
            if again:
                time.sleep(0.05)

    def stat(tag: str) -> dict:
        consumer.sendall(b"PUB $Q.STAT.%s _INBOX.c.%s 0\r\n\r\n" % (queue.encode(), tag.encode()))
        return json.loads(answers_c.by_token(1)[tag][1])["stat"]

    def receive(n: int, tag: str) -> list[tuple[int, str]]:
        # with n visible, a receive of n gets n: a receive's answer has no end marker, and a push a client
        # retried may be stored twice, so how many are left is asked, not assumed
        consumer.sendall(b'PUB $Q.RECV.%s _INBOX.c.%s %d\r\n{"batch":%d,"visibility_ms":5000}\r\n'
                         % (queue.encode(), tag.encode(), len(b'{"batch":%d,"visibility_ms":5000}' % n), n))
        got = []
        for token, headers, data in answers_c.take(n):
            assert token == tag and not headers.startswith(b"NATS/1.0 "), (token, headers)
            got.append((int(data), re.search(rb"Q-Receipt: (\S+)", headers).group(1).decode()))
        return got

    def ack(leases: list[tuple[int, str]]) -> None:
        while leases:
            consumer.sendall(b"".join(b"PUB $Q.ACK.%s.%s _INBOX.c.a%d 0\r\n\r\n" % (queue.encode(), r.encode(), i)
                                      for i, (_, r) in enumerate(leases)))
            answers = answers_c.by_token(len(leases))
            again = []
            for i, (value, receipt) in enumerate(leases):
                reply = json.loads(answers[f"a{i}"][1])
                if reply["ok"]:
                    acked.append(value)
                elif reply.get("retry"):
                    again.append((value, receipt))
                else:
                    assert reply["error"] == "lease_lost", reply   # expired during the outage: delivered again
            leases = again
            if again:
                time.sleep(0.05)

    try:
        for start in range(0, 1000, 50):
            push(list(range(start, start + 50)))
        held = receive(100, "held")
        assert len(held) == 100
        for start in range(1000, 2000, 50):
            push(list(range(start, start + 50)))
            if start == 1300:
                os.kill(owner_pid, signal.SIGKILL)
        ack(held)   # leases taken before the kill, acked after the owner's replay
        for round_ in range(200):
            visible = stat(f"s{round_}")["visible"]
            if not visible:
                break
            ack(receive(min(100, visible), f"r{round_}"))
        final = stat("final")
    finally:
        producer.close()
        consumer.close()
    assert not pid_alive(owner_pid)
    assert stored == set(range(2000))
    missing = stored - set(acked)
    assert not missing, f"{len(missing)} pushes that got ok were never delivered: {sorted(missing)[:10]}"
    twice = {v for v in acked if acked.count(v) > 1}
    assert twice <= retried, f"stored twice without a client retry: {sorted(twice - retried)[:10]}"
    assert set(v for v, _ in held) <= set(acked)
    assert final["messages"] == 0 and final["in_flight"] == 0, final
    assert "replayed" in broker.log(), broker.log()[-2000:]


@pytest.mark.parametrize("data_dir", [False, True], ids=["runtime-dir", "data-dir-everysec"])
def test_compaction_while_serving_keeps_what_came_meanwhile_through_a_kill_9(start_broker, tmp_path, data_dir):
    """The journal compacts a batch per turn while pushes go on (workers/workqueues/journal.py); the pushes
    acknowledged meanwhile are in the compacted journal: a kill -9 right after loses none of them.  With a
    ``data_dir`` and ``everysec``, the rewrite is synced in a thread and its rename left to the next sync (and the
    room the journal keeps allocated past its end is not in its size)."""
    config = {"queues": {"move_connections": False}}
    if data_dir:
        config["queues"].update(data_dir=str(tmp_path / "queues"), fsync="everysec")
    broker = start_broker(workers=2, config=config)
    queue = next(q for q in (f"compact.{i}" for i in range(100)) if zlib.crc32(q.encode()) % 2 == 1)
    owner_pid = next(w["pid"] for w in broker.varz()["workers"] if w["worker"] == 1)
    directory = str(tmp_path / "queues") if data_dir else broker.wait_log(r"runtime directory (\S+)").group(1)
    journal = os.path.join(directory, "queues-1.journal")
    big = "x" * 1_000_000

    async def run():
        producer = await on_worker(broker.port, 0)   # on the worker that survives
        consumer = await on_worker(broker.port, 0)
        # 70 MB of journal, all of it acked: past the 64 MiB at which it is compacted, and mostly dead
        for _ in range(70):
            assert (await producer.request({"op": "qpush", "queue": queue, "data": big}))["ok"]
        got = 0
        while got < 70:
            reply = await consumer.request({"op": "qrecv", "queue": queue, "max": 10})
            got += len(reply["messages"])
            acks = await consumer.request({"op": "qack", "queue": queue,
                                           "receipts": [m["receipt"] for m in reply["messages"]]})
            assert all(r["ok"] for r in acks["results"]), acks
        assert os.path.getsize(journal) > 64 << 20
        stored: list[int] = []   # pushed while the rewrite went on and after it, until 200 after it took over
        done_at = None
        deadline = time.monotonic() + 20
        while done_at is None or len(stored) < done_at + 200:
            assert time.monotonic() < deadline, broker.log()[-3000:]
            reply = await producer.request({"op": "qpush", "queue": queue, "data": len(stored)})
            assert reply["ok"], reply
            stored.append(len(stored))
            if done_at is None and len(stored) % 20 == 0 and _compactions(broker, 1):
                done_at = len(stored)
        compacted = os.path.getsize(journal)
        os.kill(owner_pid, signal.SIGKILL)
        received: list[int] = []
        deadline = time.monotonic() + 30
        while len(received) < len(stored):
            assert time.monotonic() < deadline, (len(received), len(stored))
            reply = await consumer.request({"op": "qrecv", "queue": queue, "max": 100, "wait_ms": 200})
            if not reply["ok"]:
                assert reply.get("retry"), reply   # the owner is being replaced
                await asyncio.sleep(0.05)
                continue
            received += [m["data"] for m in reply["messages"]]
            if reply["messages"]:
                await consumer.request({"op": "qack", "queue": queue,
                                        "receipts": [m["receipt"] for m in reply["messages"]]})
        producer.close()
        consumer.close()
        return stored, received, compacted

    stored, received, compacted = asyncio.run(run())
    assert compacted < 16 << 20                       # the dead 70 MB are gone
    assert sorted(received) == stored                 # every acknowledged push once, nothing else
    assert "replayed" in broker.log()
    # the replacement compacts what it replayed while serving too, and leaves no file of it behind
    deadline = time.monotonic() + 10
    while not _compactions(broker, 1):
        assert time.monotonic() < deadline, "the replacement did not compact what it replayed"
        time.sleep(0.05)
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.ports['monitoring']}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'shardbroker_workqueue_journal_compactions_total{worker="1"} 1.0' in metrics
    size = next(w["journal_bytes"] for w in broker.varz()["workers"] if w["worker"] == 1)
    assert f'shardbroker_workqueue_journal_bytes{{worker="1"}} {float(size)}' in metrics
    assert size == os.path.getsize(journal)
    assert not any(p.endswith(".tmp") or ".rewrite-" in p for p in os.listdir(os.path.dirname(journal)))


def _compactions(broker, worker: int) -> int:
    """The journal compactions worker ``worker`` has put in place (/varz; a replaced worker counts from 0)."""
    return next(w["journal_compactions"] for w in broker.varz()["workers"] if w["worker"] == worker)


def test_queuez_reports_each_queue_from_its_owner(start_broker):
    broker = start_broker(workers=2)

    async def run():
        c = await Conn.open(broker.port)
        names = [f"qz.{i}" for i in range(6)]
        for i, name in enumerate(names):
            for _ in range(i + 1):
                assert (await c.request({"op": "qpush", "queue": name, "data": "x"}))["ok"]
        got = await c.request({"op": "qrecv", "queue": names[2], "max": 2})
        assert len(got["messages"]) == 2
        c.close()

    asyncio.run(run())
    status, body = broker.http("/queuez")
    assert status == 200 and body["total"] == 6
    rows = {row["queue"]: row for row in body["queues"]}
    for i in range(6):
        name = f"qz.{i}"
        assert rows[name]["owner"] == zlib.crc32(name.encode()) % 2
        assert rows[name]["messages"] == i + 1 and rows[name]["pushed"] == i + 1
    assert rows["qz.2"]["in_flight"] == 2 and rows["qz.2"]["visible"] == 1
    one = broker.http("/queuez?queue=qz.3")[1]
    assert [row["queue"] for row in one["queues"]] == ["qz.3"]


@pytest.mark.parametrize("fsync", ["always", "everysec"])
def test_data_dir_keeps_queues_across_a_broker_restart_and_refuses_another_worker_count(start_broker, tmp_path,
                                                                                        fsync):
    config = {"queues": {"data_dir": str(tmp_path / "queues"), "fsync": fsync}}
    first = start_broker(workers=2, config=config)

    async def fill():
        c = await Conn.open(first.port)
        for i in range(20):
            assert (await c.request({"op": "qpush", "queue": f"keep.{i % 4}", "data": i}))["ok"]
        leased = await c.request({"op": "qrecv", "queue": "keep.0", "max": 2, "visibility_ms": 60_000})
        c.close()
        return [m["receipt"] for m in leased["messages"]]

    receipts = asyncio.run(fill())
    assert first.stop() == 0
    assert "not kept" not in first.log()          # with data_dir nothing is dropped at a stop
    journals = glob.glob(str(tmp_path / "queues" / "queues-*.journal"))
    assert len(journals) == 2
    for path in journals:   # everysec's room past the end (workers/workqueues/journal.py) is freed by the stop
        st = os.stat(path)
        assert st.st_size > 0 and st.st_blocks * 512 < st.st_size + (64 << 10), (path, st)
    second = start_broker(workers=2, config=config)

    async def check():
        c = await Conn.open(second.port)
        total = 0
        for q in range(4):
            total += (await c.request({"op": "qstat", "queue": f"keep.{q}"}))["stat"]["messages"]
        # a lease taken before the restart is still the consumer's: its receipt acks
        acks = [await c.request({"op": "qack", "queue": "keep.0", "receipt": r}) for r in receipts]
        c.close()
        return total, acks

    total, acks = asyncio.run(check())
    assert total == 20 and acks == [{"ok": True}, {"ok": True}]
    assert second.stop() == 0
    try:
        start_broker(workers=3, config=config)
    except RuntimeError as exc:
        assert "holds the queues of a broker with 2 workers" in str(exc)
    else:
        raise AssertionError("a broker with another worker count started on the same queues.data_dir")


def test_configured_queues_exist_and_override_the_defaults(start_broker):
    config = {"queues": {"max_deliveries": 5, "queues": [
        {"name": "conf.small", "max_messages": 2, "visibility_timeout": 0.2},
        {"name": "conf.once", "max_deliveries": 1}]}}
    broker = start_broker(workers=2, config=config)
    rows = {row["queue"]: row for row in broker.http("/queuez")[1]["queues"]}
    assert {"conf.small", "conf.once"} <= set(rows)            # configured: there before any push

    async def run():
        c = await Conn.open(broker.port)
        for i in range(2):
            assert (await c.request({"op": "qpush", "queue": "conf.small", "data": i}))["ok"]
        full = await c.request({"op": "qpush", "queue": "conf.small", "data": 2})
        assert full == {"ok": False, "error": "queue_full", "retry": True}
        assert (await c.request({"op": "qpush", "queue": "conf.other", "data": 0}))["ok"]   # defaults elsewhere
        got = (await c.request({"op": "qrecv", "queue": "conf.small"}))["messages"][0]
        await asyncio.sleep(0.3)                                  # its own 0.2 s visibility timeout
        again = (await c.request({"op": "qrecv", "queue": "conf.small"}))["messages"][0]
        assert again["id"] == got["id"] and again["deliveries"] == 2
        assert (await c.request({"op": "qpush", "queue": "conf.once", "data": "x"}))["ok"]
        m = (await c.request({"op": "qrecv", "queue": "conf.once"}))["messages"][0]
        assert (await c.request({"op": "qnack", "queue": "conf.once", "receipt": m["receipt"]}))["state"] == "dead"
        c.close()

    asyncio.run(run())


def test_bad_queue_definitions_are_refused_at_start(start_broker):
    for queues, text in (([{"name": "bad.*"}], "is not a queue name"),
                         ([{"name": "a"}, {"name": "a"}], "configured twice"),
                         ([{"name": "a", "max_deliveries": -1}], "max_deliveries")):
        try:
            start_broker(workers=1, config={"queues": {"queues": queues}})
        except RuntimeError as exc:
            assert text in str(exc) and "exited with 2" in str(exc)
        else:
            raise AssertionError(f"started with {queues}")


def test_expiry_is_never_early_and_an_idle_shard_does_not_spin(start_broker):
    """A lease lapses no earlier than its deadline; with leases, delays and long polls pending far ahead, the
    workers use (almost) no CPU: one timer per shard, no polling loop."""
    import psutil

    broker = start_broker(workers=2)

    async def run():
        c = await Conn.open(broker.port)
        waiter = await Conn.open(broker.port)
        for i in range(500):
            await c.request({"op": "qpush", "queue": f"idle.{i % 10}", "data": i})
        for i in range(10):
            got = await c.request({"op": "qrecv", "queue": f"idle.{i}", "max": 50, "visibility_ms": 3_600_000})
            assert len(got["messages"]) == 50
        await c.request({"op": "qpush", "queue": "idle.later", "data": 0, "delay_ms": 3_600_000})
        waiter.writer.write(b'{"op":"qrecv","queue":"idle.none","wait_ms":60000}\n')
        workers = [psutil.Process(p) for p in broker.pids]
        before = [sum(w.cpu_times()[:2]) for w in workers]
        await asyncio.sleep(2.0)
        used = [sum(w.cpu_times()[:2]) - b for w, b in zip(workers, before)]
        assert max(used) < 0.1, f"idle workers used {used} s of CPU in 2 s"
        # never early: a 300 ms lease is not given to anyone else before 300 ms have passed
        await c.request({"op": "qpush", "queue": "idle.early", "data": "x"})
        t0 = time.monotonic()
        first = await c.request({"op": "qrecv", "queue": "idle.early", "visibility_ms": 300})
        assert len(first["messages"]) == 1
        again = await c.request({"op": "qrecv", "queue": "idle.early", "wait_ms": 5000})
        waited = time.monotonic() - t0
        assert again["messages"][0]["deliveries"] == 2 and waited >= 0.3, waited
        c.close()
        waiter.close()

    asyncio.run(run())


def test_client_consume_extends_leases_acks_and_nacks(start_broker):
    """cli.client's consume(): a handler slower than the visibility timeout keeps its message (the lease is
    extended while it runs); a return acks, an exception nacks."""
    from shardbroker.cli.client import AsyncClient

    broker = start_broker(workers=2)

    async def run():
        c = await AsyncClient.connect("127.0.0.1", broker.port)
        other = await AsyncClient.connect("127.0.0.1", broker.port)
        for n in ("slow", "fail", "ok"):
            await c.qpush("consume.jobs", n)
        seen = []
        stop = asyncio.Event()

        async def handler(msg):
            seen.append((msg.data, msg.deliveries))
            if msg.data == "slow":
                await asyncio.sleep(0.7)                 # over twice the 300 ms visibility: kept by extensions
            elif msg.data == "fail" and msg.deliveries == 1:
                raise RuntimeError("first try fails")
            if len(seen) >= 4:
                stop.set()

        acked = await c.consume("consume.jobs", handler, visibility_ms=300, wait_ms=200, stop=stop)
        assert acked == 3
        # a nacked message goes back where it was (by its sequence), ahead of "ok"
        assert seen == [("slow", 1), ("fail", 1), ("fail", 2), ("ok", 1)]
        stat = await other.qstat("consume.jobs")
        assert (stat["messages"], stat["acked"], stat["nacked"], stat["extended"] >= 1) == (0, 3, 1, True)
        await c.close()
        await other.close()

    asyncio.run(run())


def test_pipelined_queue_requests_are_answered_in_order_before_a_half_close(start_broker):
    """Queue requests do not wait for each other's replies (they go on to the owners), but the replies keep the
    order of the requests, mixed with other requests' replies; a client that half-closes gets them all."""
    import socket

    broker = start_broker(workers=2)
    names = [f"pipe.{i}" for i in range(4)]          # owned by both workers
    lines = []
    for i in range(300):
        lines.append({"op": "qpush", "queue": names[i % 4], "data": i, "id": i})
        if i == 150:
            lines.append({"op": "ping", "id": "mid"})
            lines.append({"op": "qpush", "queue": "bad.*", "data": 0, "id": "bad"})
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
        s.sendall(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    replies = [json.loads(line) for line in data.splitlines()]
    assert [r.get("id") for r in replies] == [x["id"] for x in lines]
    assert all(r["ok"] for r in replies if r["id"] != "bad")
    assert next(r for r in replies if r["id"] == "bad")["error"] == "invalid_queue"

    async def count():
        c = await Conn.open(broker.port)
        total = 0
        for name in names:
            total += (await c.request({"op": "qstat", "queue": name}))["stat"]["messages"]
        c.close()
        return total

    assert asyncio.run(count()) == 300


def test_reading_unknown_queues_creates_nothing(start_broker):
    """qstat and receipts of names never pushed to answer as for an empty queue, and leave no queue behind:
    requests that only read cannot grow the broker's table of queues."""
    broker = start_broker(workers=2)

    async def run():
        c = await Conn.open(broker.port)
        for i in range(50):
            stat = (await c.request({"op": "qstat", "queue": f"ghost.{i}"}))["stat"]
            assert (stat["messages"], stat["visible"], stat["waiters"]) == (0, 0, 0)
            ack = await c.request({"op": "qack", "queue": f"ghost.{i}", "receipt": "A" * 22})
            assert ack == {"ok": False, "error": "unknown_receipt"}
        bad = await c.request({"op": "qstat", "queue": "ghost.*"})
        assert bad == {"ok": False, "error": "invalid_queue"}
        c.close()

    asyncio.run(run())
    assert broker.http("/queuez")[1]["total"] == 0


def test_a_second_broker_on_the_same_data_dir_refuses_to_start(start_broker, tmp_path):
    """Finding M3: two brokers on one queues.data_dir appended to the same journals, and one's acknowledged pushes
    were gone at the next start.  The second refuses, in one line naming the holder; once the first is gone (a
    kill -9 included), the directory is free again and everything acknowledged comes back."""
    config = {"queues": {"data_dir": str(tmp_path / "shared-queues")}}
    first = start_broker(workers=2, config=config)
    with Raw(first.port) as c:
        for i in range(3):
            assert c.request({"op": "qpush", "queue": "s", "data": f"A{i}"})["ok"]
    with pytest.raises(RuntimeError) as refused:
        start_broker(workers=2, config=config)
    text = str(refused.value)
    assert f"queues.data_dir {tmp_path / 'shared-queues'} is in use by another broker (pid {first.proc.pid})" \
        in text
    assert "Traceback" not in text and "ready:" not in text
    assert "exited with 1" in text
    first.kill()
    again = start_broker(workers=2, config=config)
    with Raw(again.port) as c:
        got = c.request({"op": "qrecv", "queue": "s", "max": 10})
        assert [m["data"] for m in got["messages"]] == ["A0", "A1", "A2"]


def test_a_stopped_owner_is_unavailable_after_two_seconds_not_after_its_heartbeat(start_broker):
    """Finding A12: with the queue's owner SIGSTOPped, a request from another worker waited out the heartbeat
    (10 s) until the owner was replaced.  An owner that acknowledges nothing for 2 s is treated as down: the
    request gets queue_unavailable (retry) within the next second's check; once it runs again, so does the queue."""
    broker = start_broker(workers=3, config={"workers": {"heartbeat_timeout": 60}})
    with Raw(broker.port) as c:
        owner = c.request({"op": "qstat", "queue": "jobs"})["stat"]["owner"]
    other = next(w for w in range(3) if w != owner)
    client = raw_on_worker(broker.port, other)
    assert client.request({"op": "sub", "topic": "stay"}) == {"ok": True}   # stays on its worker
    assert client.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"]
    pid = broker.pids[owner]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        client.send(b'{"op":"qpush","queue":"jobs","data":2}\n')
        reply = client.json(timeout=15)
        took = time.monotonic() - started
        assert reply == {"ok": False, "error": "queue_unavailable", "retry": True}, reply
        assert took < 4.5, took
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while True:
        reply = client.request({"op": "qstat", "queue": "jobs"})
        if reply.get("ok") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert reply["ok"] and reply["stat"]["owner"] == owner
    assert broker.pids[owner] == pid   # the same process: it was never replaced
    client.close()
