"""Baseline of the hub's behaviour, in process (tests/support/inprocess.py): routing to every protocol's subscribers,
the
route cache, subscriptions' bookkeeping, queue groups, and across two workers joined by the real fabric: interest
gossip, a subscription in force everywhere before its ``ok``, publish order, a ping's reply meaning delivered,
unsubscribe, and backpressure from slow consumers.  Driven through the sessions' entry points only."""

from shardbroker.workers.protocols.bridge.session import BridgeSession
from shardbroker.workers.protocols.nats.session import NatsSession
from shardbroker.workers.protocols.ndjson.session import NdjsonSession

from support.inprocess import Broker, run, turns, until

OK = b'{"ok":true}\n'


async def nats(broker, worker=0, connect=b'{"verbose":false}'):
    c = broker.connect(NatsSession, worker)
    c.send(b"CONNECT " + connect + b"\r\n")
    await until(lambda: c.transport.data.endswith(b"\r\n"))
    assert c.take().startswith(b"INFO {")
    return c


async def ndjson_sub(broker, topic, worker=0):
    c = broker.connect(NdjsonSession, worker)
    c.send_json({"op": "sub", "topic": topic})
    await c.expect(OK)
    return c


# -- one worker ------------------------------------------------------------------------------------------------

def test_one_publish_reaches_the_matching_subscribers_of_every_protocol(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            nd = await ndjson_sub(b, "bridge.*")
            na = await nats(b)
            na.send(b"SUB bridge.> 5\r\nSUB bridge.other 6\r\nSUB bridge 7\r\n")
            br = b.connect(BridgeSession)
            br.send(b"Sroom   ")
            await br.expect(b"O")
            pub = b.connect(NdjsonSession)
            pub.send_json({"op": "pub", "topic": "bridge.room", "data": "hello"})
            await pub.expect(OK)
            await nd.expect(b'{"topic":"bridge.room","data":"hello"}\n')
            await na.expect(b"MSG bridge.room 5 5\r\nhello\r\n")
            await br.expect(b"\x05\x00hello\x04\x00\r\n\r\n")
            for c in (nd, na, br, pub):
                await c.silent()
            stats = b.hubs[0].stats()
            assert (stats["in_msgs"], stats["out_msgs"]) == (1, 3)
            assert (stats["subscriptions"], stats["patterns"]) == (5, 5)
            assert stats["connections"] == 4 and stats["total_connections"] == 4

    run(scenario)


def test_payloads_convert_between_json_and_bytes(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            nd = await ndjson_sub(b, "conv")
            na = await nats(b)
            na.send(b"SUB conv 1\r\n")
            pub = b.connect(NdjsonSession)
            pub.send_json({"op": "pub", "topic": "conv", "data": {"n": [1, 2.5, None]}},
                          {"op": "pub", "topic": "conv", "data": "caf\u00e9"})
            await nd.expect(b'{"topic":"conv","data":{"n":[1,2.5,null]}}\n{"topic":"conv","data":"caf\xc3\xa9"}\n')
            # a JSON string reaches NATS as its UTF-8 bytes, any other value as its JSON text
            await na.expect(b'MSG conv 1 18\r\n{"n":[1,2.5,null]}\r\nMSG conv 1 5\r\ncaf\xc3\xa9\r\n')
            np = await nats(b)
            np.send(b"PUB conv 3\r\n\xff\x00\x01\r\nPUB conv 2\r\nhi\r\n")
            # bytes that are not UTF-8 reach NDJSON as base64, flagged
            await nd.expect(b'{"topic":"conv","data":"/wAB","encoding":"base64"}\n{"topic":"conv","data":"hi"}\n')
            await na.expect(b"MSG conv 1 3\r\n\xff\x00\x01\r\nMSG conv 1 2\r\nhi\r\n")

    run(scenario)


def test_a_route_is_cached_from_its_second_publish_until_the_subscriptions_change(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            hub = b.hubs[0]
            sub = await ndjson_sub(b, "cache.*")
            pub = b.connect(NdjsonSession)
            pub.send_json({"op": "pub", "topic": "cache.a", "data": 1})
            await pub.expect(OK)
            assert hub.stats()["route_cache"] == 0     # a subject used once (an inbox) is not cached
            pub.send_json({"op": "pub", "topic": "cache.a", "data": 2})
            await pub.expect(OK)
            assert hub.stats()["route_cache"] == 1
            generation = hub.stats()["generation"]
            await ndjson_sub(b, "cache.b")
            assert hub.stats()["route_cache"] == 0 and hub.stats()["generation"] > generation
            await sub.expect(b'{"topic":"cache.a","data":1}\n{"topic":"cache.a","data":2}\n')

    run(scenario)


def test_unsubscribe_and_close_take_the_subscriptions_away(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            hub = b.hubs[0]
            a = await ndjson_sub(b, "u.*")
            a.send_json({"op": "sub", "topic": "u.>"})
            await a.expect(OK)
            n = await nats(b)
            n.send(b"SUB u.* 1\r\nSUB u.x 2\r\nPING\r\n")
            await n.expect(b"PONG\r\n")
            assert (hub.stats()["subscriptions"], hub.stats()["patterns"]) == (4, 3)
            a.send_json({"op": "unsub", "topic": "u.*"})
            await a.expect(OK)
            assert (hub.stats()["subscriptions"], hub.stats()["patterns"]) == (3, 3)   # u.* is still NATS'
            n.transport.close()   # the client went away
            await until(lambda: hub.stats()["connections"] == 1)
            assert (hub.stats()["subscriptions"], hub.stats()["patterns"]) == (1, 1)
            pub = b.connect(NdjsonSession)
            pub.send_json({"op": "pub", "topic": "u.x", "data": 0})
            await pub.expect(OK)
            await a.expect(b'{"topic":"u.x","data":0}\n')   # once, by u.>
            await a.silent()

    run(scenario)


def test_a_queue_group_gives_each_message_to_one_member_and_plain_subscribers_all(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path) as b:
            m1, m2, plain = await nats(b), await nats(b), await nats(b)
            m1.send(b"SUB jobs.* workers 1\r\n")
            m2.send(b"SUB jobs.> workers 2\r\n")
            plain.send(b"SUB jobs.new 3\r\n")
            pub = await nats(b)
            pub.send(b"".join(b"PUB jobs.new 2\r\n%02d\r\n" % i for i in range(10)) + b"PING\r\n")
            await pub.expect(b"PONG\r\n")
            await plain.expect(b"".join(b"MSG jobs.new 3 2\r\n%02d\r\n" % i for i in range(10)))
            got1 = m1.take().split(b"\r\n")[1::2]
            got2 = m2.take().split(b"\r\n")[1::2]
            assert sorted(got1 + got2) == [b"%02d" % i for i in range(10)]
            assert got1 == sorted(got1) and got2 == sorted(got2)
            # round robin from a random start (the first message's route is not cached: its pick is random too)
            assert len(got1) >= 4 and len(got2) >= 4, (got1, got2)

    run(scenario)


# -- two workers, the real fabric --------------------------------------------------------------------------------

def test_a_subscription_is_in_force_on_every_worker_before_its_ok(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, workers=2) as b:
            s = b.connect(NdjsonSession, worker=1)
            s.send_json({"op": "sub", "topic": "far.*", "id": 1}, {"op": "info", "id": 2})
            # nothing yet: the ok waits for worker 0's acknowledgement, and the request after it (and reading) too
            assert s.take() == b"" and not s.transport.reading
            assert b.hubs[0].stats()["remote_patterns"] == 0
            await s.expect(b'{"ok":true,"id":1}\n')
            assert b.hubs[0].stats()["remote_patterns"] == 1   # known there when the ok is sent
            (info,) = await s.json()
            assert info["id"] == 2 and info["info"]["worker"] == 1 and info["info"]["subscriptions"] == ["far.*"]
            assert s.transport.reading
            p = b.connect(NdjsonSession, worker=0)
            p.send_json({"op": "pub", "topic": "far.x", "data": "first"})
            await s.expect(b'{"topic":"far.x","data":"first"}\n')
            assert b.hubs[0].stats()["fabric"]["links"]["1"]["up"]

    run(scenario)


def test_one_publishers_messages_arrive_in_order_and_a_pong_means_delivered(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, workers=2) as b:
            s = await ndjson_sub(b, "seq", worker=1)
            n = await nats(b, worker=1)
            n.send(b"SUB seq 9\r\nPING\r\n")
            await n.expect(b"PONG\r\n")
            p = await nats(b, worker=0)
            p.send(b"".join(b"PUB seq %d\r\n%d\r\n" % (len(b"%d" % i), i) for i in range(300)) + b"PING\r\n")
            await p.expect(b"PONG\r\n")
            # no wait: the PONG left only once every message was handed to the subscribers on worker 1
            assert s.take() == b"".join(b'{"topic":"seq","data":"%d"}\n' % i for i in range(300))
            assert n.take() == b"".join(b"MSG seq 9 %d\r\n%d\r\n" % (len(b"%d" % i), i) for i in range(300))
            # NDJSON's ping: the same promise
            q = b.connect(NdjsonSession, worker=0)
            q.send_json({"op": "pub", "topic": "seq", "data": "last"}, {"op": "ping", "id": "p"})
            await q.expect(OK + b'{"ok":true,"id":"p"}\n')
            assert s.take() == b'{"topic":"seq","data":"last"}\n'
            stats = b.hubs[0].stats()["fabric"]
            assert (stats["lost_messages"], stats["dropped_messages"]) == (0, 0)

    run(scenario)


def test_a_queue_group_across_workers_delivers_each_message_once(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, workers=2) as b:
            m0, m1 = await nats(b, worker=0), await nats(b, worker=1)
            for sid, m in enumerate((m0, m1)):
                m.send(b"SUB work.q grp %d\r\nPING\r\n" % sid)
                await m.expect(b"PONG\r\n")
            for worker in (0, 1):   # publishers on both sides: the subject's owner picks, wherever it is
                p = await nats(b, worker=worker)
                p.send(b"".join(b"PUB work.q 3\r\n%d%02d\r\n" % (worker, i) for i in range(20)) + b"PING\r\n")
                await p.expect(b"PONG\r\n")
            got0, got1 = m0.take().split(b"\r\n")[1::2], m1.take().split(b"\r\n")[1::2]
            assert sorted(got0 + got1) == sorted(b"%d%02d" % (w, i) for w in (0, 1) for i in range(20))
            assert got0 and got1, (got0, got1)
            assert sum(h.stats()["queue_dropped"] for h in b.hubs) == 0

    run(scenario)


def test_unsubscribe_and_close_withdraw_the_interest_from_the_other_worker(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, workers=2) as b:
            hub0 = b.hubs[0]
            s = await ndjson_sub(b, "gone.*", worker=1)
            n = await nats(b, worker=1)
            n.send(b"SUB gone.> 1\r\nPING\r\n")
            await n.expect(b"PONG\r\n")
            assert hub0.stats()["remote_patterns"] == 2
            p = b.connect(NdjsonSession, worker=0)
            p.send_json({"op": "pub", "topic": "gone.a", "data": 1})
            s.send_json({"op": "unsub", "topic": "gone.*"})
            # the unsubscribe takes effect after what worker 0 had already read: that message still arrives
            await s.expect(b'{"topic":"gone.a","data":1}\n' + OK)
            await until(lambda: hub0.stats()["remote_patterns"] == 1)
            p.send_json({"op": "pub", "topic": "gone.a", "data": 2}, {"op": "ping"})
            await p.expect(OK + OK)
            await n.expect(b"MSG gone.a 1 1\r\n1\r\nMSG gone.a 1 1\r\n2\r\n")
            assert s.take() == b""
            n.transport.close()
            await until(lambda: hub0.stats()["remote_patterns"] == 0)
            p.send_json({"op": "pub", "topic": "gone.b", "data": 3}, {"op": "ping"})
            await p.expect(OK + OK)
            assert hub0.stats()["fabric"]["links"]["1"]["messages_out"] == 2   # the third had nowhere to go

    run(scenario)


def test_a_replacement_worker_learns_the_interest_of_the_others_and_they_forget_its_predecessors(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, workers=2) as b:
            s = await ndjson_sub(b, "keep.*", worker=1)
            old = await nats(b, worker=0)
            old.send(b"SUB w0.only 1\r\nPING\r\n")
            await old.expect(b"PONG\r\n")
            assert b.hubs[1].stats()["remote_patterns"] == 1
            new = await b.replace(0)
            assert old.transport.aborted
            assert new.stats()["remote_patterns"] == 1       # keep.*, from worker 1's answer to the hello
            await until(lambda: b.hubs[1].stats()["remote_patterns"] == 0)   # the old incarnation's interest
            p = b.connect(NdjsonSession, worker=0)
            p.send_json({"op": "pub", "topic": "keep.it", "data": "again"})
            await s.expect(b'{"topic":"keep.it","data":"again"}\n')

    run(scenario)


# -- backpressure and slow consumers ----------------------------------------------------------------------------

LIMITS = {"limits": {"max_pending_bytes": 4096}}   # a connection stalls publishers past 1024 bytes unsent


async def publish_when_reading(pub, n, size, on_paused=None):
    """``n`` publishes of ``size`` bytes of data, one read each, sent only while the broker reads the publisher
    (as a kernel would hold them); ``on_paused()`` is called each time it is found paused."""
    for i in range(n):
        if not pub.transport.reading and on_paused is not None:
            on_paused()
        await until(lambda: pub.transport.reading, what="the publisher to be read again")
        pub.send_json({"op": "pub", "topic": "bp", "data": "%03d" % i + "x" * (size - 3)})
        await turns(3)


def test_a_consumer_slower_than_its_publisher_holds_the_publisher_back(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, LIMITS) as b:
            sub = b.connect(NdjsonSession, reading_client=False)
            sub.send_json({"op": "sub", "topic": "bp"})
            await turns()
            sub.transport.client_reads()
            pub = b.connect(NdjsonSession)
            await publish_when_reading(pub, 8, 600, on_paused=sub.transport.client_reads)
            await until(lambda: pub.transport.data.count(b"\n") == 8)
            assert pub.take() == OK * 8
            assert pub.transport.pauses >= 1   # it was held back ...
            lines = (await sub.lines(9))[1:]   # ... and nothing was lost
            assert [line[22:25] for line in lines] == [b"%03d" % i for i in range(8)]
            stats = b.hubs[0].stats()
            assert stats["backpressure_episodes"] >= 1 and stats["slow_consumers"] == 0
            assert not sub.closed

    run(scenario)


def test_a_consumer_that_does_not_read_stops_holding_publishers_and_is_cut(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, LIMITS) as b:
            sub = b.connect(NdjsonSession, reading_client=False)
            sub.send_json({"op": "sub", "topic": "bp"})
            pub = b.connect(NdjsonSession)
            await publish_when_reading(pub, 10, 600)
            await until(lambda: sub.transport.lost)
            assert sub.transport.aborted       # a reset, not a close: its unsent output is dropped
            assert pub.take() == OK * 10 and not pub.closed
            stats = b.hubs[0].stats()
            assert stats["slow_consumers"] == 1 and stats["backpressure_released"] == 1
            assert stats["connections"] == 1

    run(scenario)


def test_fabric_frames_between_workers_are_not_lost_under_a_burst(tmp_path):
    async def scenario():
        async with await Broker.start(tmp_path, workers=2) as b:
            subs = [await ndjson_sub(b, "burst", worker=1) for _ in range(3)]
            p = await nats(b, worker=0)
            body = b"y" * 200
            p.send(b"".join(b"PUB burst 200\r\n%s\r\n" % body for _ in range(2000)) + b"PING\r\n")
            await p.expect(b"PONG\r\n", timeout=10)
            line = b'{"topic":"burst","data":"%s"}\n' % body
            for s in subs:
                assert s.take() == line * 2000
            assert b.hubs[1].stats()["out_msgs"] == 6000

    run(scenario)


def test_a_fan_out_to_many_connections_carries_many_messages_in_each_write(tmp_path):
    """With a thousand subscribers the writes are what a turn costs: a burst reaches each of them in a few writes
    (the turn's budget counts a write per subscriber per batch, not a unit per delivery), in order, and no turn
    does more than its budget and one batch's end."""
    from shardbroker.workers.turn import TURN_BUDGET

    async def scenario():
        async with await Broker.start(tmp_path) as b:
            hub = b.hubs[0]
            subs = []
            for _ in range(1000):
                c = await nats(b)
                c.send(b"SUB wide 1\r\n")
                subs.append(c)
            p = await nats(b)
            p.send(b"PING\r\n")
            await p.expect(b"PONG\r\n")
            worst = []
            start_turn = hub.turn.run

            def run_turn():
                worst.append(hub.turn_work)   # the work of the turn that ends here
                start_turn()
            hub.turn.run = run_turn
            before = [s.transport.writes for s in subs]
            p.send(b"".join(b"PUB wide 100\r\n%s\r\n" % (b"%03d" % i * 34)[:100] for i in range(200)) + b"PING\r\n")
            await p.expect(b"PONG\r\n", timeout=10)
            expected = b"".join(b"MSG wide 1 100\r\n%s\r\n" % (b"%03d" % i * 34)[:100] for i in range(200))
            for s, was in zip(subs, before):
                assert s.take() == expected
                assert s.transport.writes - was <= 5
            assert max(worst) <= TURN_BUDGET + 1000 + 200

    run(scenario)
