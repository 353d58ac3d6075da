"""The multiprocess cluster: delivery across workers, order, wildcards, the shard map, replacing workers."""

import asyncio
import os
import random
import signal
import time
import zlib

import nats
import pytest

from shardbroker.cli.client import AsyncClient

from support.harness import Raw, pid_alive


async def spread(port: int, workers: int, per_worker: int, user: str | None = None,
                 password: str | None = None) -> dict[int, list[AsyncClient]]:
    """Open connections (authenticated as ``user`` if given) until each worker holds ``per_worker`` of them."""
    by_worker: dict[int, list[AsyncClient]] = {w: [] for w in range(workers)}
    extra = []
    while any(len(v) < per_worker for v in by_worker.values()):
        c = await AsyncClient.connect("127.0.0.1", port, user=user, password=password)
        w = (await c.info())["worker"]
        (by_worker[w] if len(by_worker[w]) < per_worker else extra).append(c)
        assert len(extra) < 64, "the acceptor does not spread connections over the workers"
    for c in extra:
        await c.close()
    return by_worker


async def close_spread(by_worker: dict[int, list[AsyncClient]]) -> None:
    for clients in by_worker.values():
        for c in clients:
            await c.close()


def test_cross_worker_delivery_and_per_publisher_order(start_broker):
    b = start_broker(workers=4)

    async def run():
        clients = await spread(b.port, 4, 2)
        subs = [cs[0] for cs in clients.values()]          # one subscriber on every worker
        pubs = [cs[1] for cs in clients.values()]          # one publisher on every worker
        for s in subs:
            await s.sub("order.>")
        per_pub = 2500                                     # 4 x 2500 = 10,000 messages
        for i, p in enumerate(pubs):
            for n in range(per_pub):
                await p.pub(f"order.p{i}", n, wait=False)
        for p in pubs:
            await p.ping()                                 # every publish before it was processed
        for s in subs:
            seen = {i: [] for i in range(len(pubs))}
            for _ in range(per_pub * len(pubs)):
                m = await s.next_message(timeout=20)
                seen[int(m.topic[len("order.p"):])].append(m.data)
            for i, got in seen.items():
                assert got == list(range(per_pub)), f"publisher {i} out of order or lossy"
            with pytest.raises(TimeoutError):
                await s.next_message(timeout=0.2)
        await close_spread(clients)

    asyncio.run(run())
    varz = b.varz()
    assert varz["fabric_lost_frames"] == 0 and varz["fabric_lost_messages"] == 0
    assert varz["in_msgs"] == 10_000
    assert varz["out_msgs"] == 40_000


def test_wildcard_subscriptions_across_workers(start_broker):
    b = start_broker(workers=3)
    patterns = ["chat.*", "chat.>", "*.room1", ">", "chat.room1", "chat.*.x", "other"]

    async def run():
        clients = await spread(b.port, 3, 3)
        flat = [c for cs in clients.values() for c in cs]
        subs = dict(zip(patterns, flat))
        for pattern, c in subs.items():
            await c.sub(pattern)
        publisher = flat[-1]
        subjects = ["chat.room1", "chat", "chat.room1.x", "lobby.room1", "other", "chat.a.x", "chat.a.y.x"]
        for s in subjects:
            await publisher.pub(s, s)
        expected = {
            "chat.*": ["chat.room1"],
            "chat.>": ["chat.room1", "chat.room1.x", "chat.a.x", "chat.a.y.x"],
            "*.room1": ["chat.room1", "lobby.room1"],
            ">": subjects,
            "chat.room1": ["chat.room1"],
            "chat.*.x": ["chat.room1.x", "chat.a.x"],
            "other": ["other"],
        }
        for pattern, c in subs.items():
            got = []
            while True:
                try:
                    got.append((await c.next_message(timeout=0.5)).topic)
                except TimeoutError:
                    break
            assert got == expected[pattern], pattern
        for c in flat:
            await c.close()

    asyncio.run(run())


def test_subscription_is_in_force_on_every_worker_when_ok_arrives(start_broker):
    """No sleep between sub and pub: the ok of a sub means a publish from any worker reaches it."""
    b = start_broker(workers=4)

    async def run():
        clients = await spread(b.port, 4, 1)
        conns = [cs[0] for cs in clients.values()]
        for round_ in range(50):
            sub, pub = conns[round_ % 4], conns[(round_ + 1) % 4]
            topic = f"fresh.{round_}"
            await sub.sub(topic)
            await pub.pub(topic, round_)
            assert (await sub.next_message(timeout=5)).data == round_
        for c in conns:
            await c.close()

    asyncio.run(run())


def test_subject_owner_keeps_counters(start_broker):
    b = start_broker(workers=3)

    async def run():
        clients = await spread(b.port, 3, 1)
        for w, cs in clients.items():
            for _ in range(w + 1):
                await cs[0].pub("counted.subject", "x" * 10)
        await close_spread(clients)

    asyncio.run(run())
    owner = zlib.crc32(b"counted.subject") % 3
    deadline = time.monotonic() + 10
    while True:
        rows = b.http("/topicz?subject=counted.subject")[1]["subjects"]
        if rows and rows[0]["msgs"] == 6:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    assert rows[0]["owner"] == owner
    assert rows[0]["bytes"] == 6 * len(b'"xxxxxxxxxx"')


def test_subject_counters_forget_the_least_recently_active_past_their_bound(start_broker):
    # limits.max_tracked_subjects bounds what the owner keeps (a stream of unique reply subjects, say): past it,
    # down to nine tenths, the subjects forgotten being the least recently active
    b = start_broker(workers=1, config={"limits": {"max_tracked_subjects": 100}})

    def topicz() -> dict[str, int]:
        return {row["subject"]: row["msgs"] for row in b.http("/topicz?limit=1000")[1]["subjects"]}

    def publish(conn: Raw, subjects: list[str]) -> None:
        conn.send(b"".join(b'{"op":"pub","topic":"%s","data":1}\n' % s.encode() for s in subjects))
        for _ in subjects:
            assert conn.json() == {"ok": True}

    def until(done) -> dict[str, int]:
        deadline = time.monotonic() + 10
        while not done(rows := topicz()):
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
        return rows

    first = [f"old.{i}" for i in range(80)]
    fresh = [f"new.{i}" for i in range(40)]
    with Raw(b.port) as conn:
        publish(conn, first)
        until(lambda rows: len(rows) == 80)
        publish(conn, ["old.0"] + fresh)   # old.0 active again; 120 subjects in all
        rows = until(lambda rows: "new.39" in rows)
    assert len(rows) == 90
    assert rows["old.0"] == 2 and all(rows.get(s) == 1 for s in fresh)
    assert set(first) - set(rows) <= set(first[1:])   # the 30 forgotten are among the untouched ones


def test_killed_worker_is_replaced_and_other_clients_keep_receiving(start_broker):
    b = start_broker(workers=4)

    async def run():
        clients = await spread(b.port, 4, 2)
        victim = 2
        victim_pid = (await clients[victim][0].info())["pid"]
        survivors = [w for w in clients if w != victim]
        for w in clients:
            await clients[w][0].sub("live.feed")
        publisher = clients[survivors[0]][1]
        await publisher.pub("live.feed", "before")
        for w in clients:
            assert (await clients[w][0].next_message(timeout=5)).data == "before"

        mark = len(b.log())
        os.kill(victim_pid, signal.SIGKILL)
        with pytest.raises(ConnectionError):
            await clients[victim][0].next_message(timeout=5)
        # Survivors keep receiving, while the worker is being replaced and after.
        for n in range(20):
            await publisher.pub("live.feed", n)
            await asyncio.sleep(0.02)
        for w in survivors:
            assert [(await clients[w][0].next_message(timeout=5)).data for _ in range(20)] == list(range(20))
        b.wait_log(rf"worker {victim} is back \(pid (\d+)\)", timeout=10, after=mark)
        assert not pid_alive(victim_pid)

        # The replacement takes connections (it has the fewest) and is part of the fabric again.
        newcomer = await AsyncClient.connect("127.0.0.1", b.port)
        info = await newcomer.info()
        assert info["worker"] == victim and info["pid"] != victim_pid
        await newcomer.sub("live.feed")
        await publisher.pub("live.feed", "after")
        assert (await newcomer.next_message(timeout=5)).data == "after"
        await newcomer.pub("live.feed", "from-new")
        for w in survivors:
            got = [(await clients[w][0].next_message(timeout=5)).data for _ in range(2)]
            assert got == ["after", "from-new"]
        await close_spread(clients)
        await newcomer.close()

    asyncio.run(run())
    assert b.varz()["worker_count"] == 4


def test_unresponsive_worker_is_killed_and_replaced(start_broker):
    b = start_broker(workers=2, config={"workers": {"heartbeat_timeout": 2}})
    with Raw(b.port) as c:
        c.request({"op": "info"})
    stuck = b.pids[1]
    mark = len(b.log())
    os.kill(stuck, signal.SIGSTOP)  # its event loop stops: no more heartbeats
    b.wait_log(r"worker 1 \(pid %d\) sent no heartbeat" % stuck, timeout=15, after=mark)
    b.wait_log(r"worker 1 is back", timeout=15, after=mark)
    assert not pid_alive(stuck)
    with Raw(b.port) as s, Raw(b.port) as p:
        s.request({"op": "sub", "topic": "after.stall"})
        p.request({"op": "pub", "topic": "after.stall", "data": 1})
        assert s.json() == {"topic": "after.stall", "data": 1}


def test_two_brokers_on_one_host_do_not_collide(start_broker):
    one = start_broker(workers=2)
    two = start_broker(workers=2)
    assert one.runtime_dir() and one.runtime_dir() != two.runtime_dir()
    with Raw(one.port) as s1, Raw(two.port) as s2, Raw(one.port) as p1:
        s1.request({"op": "sub", "topic": "same.topic"})
        s2.request({"op": "sub", "topic": "same.topic"})
        for _ in range(4):  # publish from connections on both workers of broker one
            with Raw(one.port) as p:
                p.request({"op": "pub", "topic": "same.topic", "data": "one"})
        p1.request({"op": "ping"})
        assert [s1.json()["data"] for _ in range(4)] == ["one"] * 4
        assert s2.nothing(0.5)


def test_runs_of_subjects_keep_publish_order_for_every_subscriber(start_broker):
    """Consecutive messages to one subject travel as a batch; a subscriber of several subjects must still see one
    publisher's messages in publish order, on the publisher's worker and on the other, whatever the protocols."""
    b = start_broker(workers=2)
    rng = random.Random(7)
    sequence = []
    while len(sequence) < 800:
        sequence += [rng.choice("abc")] * rng.randint(1, 40)
    expect_all = list(range(len(sequence)))
    expect = {s: [i for i, x in enumerate(sequence) if x == s] for s in "abc"}

    async def run():
        clients = await spread(b.port, 2, 2)
        nd_subs = [clients[0][0], clients[1][0]]
        publisher = clients[0][1]                  # subscribed to everything too: its acks interleave
        for c in nd_subs + [publisher]:
            await c.sub("run.>")
        await clients[1][1].sub("run.a")
        natses = [await nats.connect(f"nats://127.0.0.1:{b.ports['nats']}", allow_reconnect=False)
                  for _ in range(2)]
        got: dict[str, list] = {}

        def collect(key):
            async def cb(msg):
                got.setdefault(key, []).append(int(msg.data))
            return cb

        for k, nc in enumerate(natses):
            await nc.subscribe("run.>", cb=collect(f"nats{k}.all"))
            await nc.subscribe("run.b", cb=collect(f"nats{k}.b"))  # two subscriptions on one connection
        await asyncio.sleep(0)
        for nc in natses:
            await nc.flush()

        async def drain(c, n):
            return [(await c.next_message(timeout=10)).data for _ in range(n)]

        # An NDJSON publisher, then a NATS one, each publishing the same runs of subjects.
        for i, s in enumerate(sequence):
            await publisher.pub(f"run.{s}", i, wait=False)
        await publisher.ping()
        for c in nd_subs + [publisher]:
            assert await drain(c, len(sequence)) == expect_all
        assert await drain(clients[1][1], len(expect["a"])) == expect["a"]
        for i, s in enumerate(sequence):
            await natses[0].publish(f"run.{s}", b"%d" % i)
        await natses[0].flush()
        for c in nd_subs:
            assert [int(x) for x in await drain(c, len(sequence))] == expect_all
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(len(got.get(f"nats{k}.all", [])) < 2 * len(sequence)
                                                  for k in range(2)):
            await asyncio.sleep(0.05)
        for k in range(2):
            assert got[f"nats{k}.all"] == expect_all + expect_all
            assert got[f"nats{k}.b"] == expect["b"] + expect["b"]
        for nc in natses:
            await nc.close()
        await close_spread(clients)

    asyncio.run(run())
