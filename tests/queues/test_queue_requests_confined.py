"""A NATS work-queue request is a request to the broker, and its answer goes to the requesting connection alone:
the attacks of findings A2-A4 (shared/reference/findings-2026-11/adversarial.md), as written there.

- A2: publishes with a ``$Q.PUSH.<q>`` reply subject (or to it, over NDJSON) got the subject into the route cache,
  and the worker then took later ``$Q.PUSH.<q>`` requests for plain publishes (a subscriber stole the pushes and
  forged their ``ok``s, nothing was stored).
- A3: the broker answered on any reply subject, so a user who may not publish to ``orders.*`` made it publish
  content of the user's choosing there.
- A4: ``$Q.RECV`` deliveries reached every subscriber of the requester's inbox.
"""

import asyncio
import json

import nats

from support.harness import Raw, on_worker

USERS = [
    {"username": "alice", "password": "alicepw",
     "permissions": ["publish:jobs", "subscribe:jobs", "subscribe:_INBOX.>", "publish:chat.*", "subscribe:chat.*"]},
    {"username": "bob", "password": "bobpw", "permissions": ["subscribe:_INBOX.>"]},
    {"username": "eve", "password": "evepw", "permissions": ["publish:public.*", "subscribe:public.*"]},
    {"username": "billing", "password": "billpw", "permissions": ["subscribe:orders.>"]},
]
SECURE = {"security": {"enabled": True, "iterations": 1000, "failures_per_address": 1000,
                       "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]},
                       "users": USERS}}


def _url(broker, user: str | None = None) -> str:
    password = next((u["password"] for u in USERS if u["username"] == user), None)
    creds = f"{user}:{password}@" if user else ""
    return f"nats://{creds}127.0.0.1:{broker.ports['nats']}"


async def _connections_on_every_worker(broker, workers: int, user: str | None = None) -> list:
    """Connections until each worker has one (the acceptor spreads them)."""
    conns = [await nats.connect(_url(broker, user), allow_reconnect=False) for _ in range(workers * 2)]
    return conns


def test_reply_subjects_of_queue_requests_cannot_make_queue_requests_plain_publishes(start_broker):
    broker = start_broker(workers=2)

    async def run():
        attackers = await _connections_on_every_worker(broker, 2)
        stolen: list[bytes] = []

        async def thief(msg):
            if msg.reply:   # a request: answer it as if stored
                stolen.append(msg.data)
                await attackers[0].publish(msg.reply, b'{"ok":true,"id":"FORGEDFORGEDFORG"}')

        await attackers[0].subscribe("$Q.PUSH.jobs", cb=thief)
        victims = await _connections_on_every_worker(broker, 2)
        for nc in victims:   # their inbox subscriptions first: a subscription change empties the route cache
            await nc.request("$Q.STAT.jobs", b"", timeout=5)
        for nc in attackers:
            for _ in range(2):
                await nc.publish("$Q.STAT.nothing", b"", reply="$Q.PUSH.jobs")
                await nc.publish("$Q.STAT.nothing", b"", reply="$Q.RECV.jobs")
            await nc.flush()
        with Raw(broker.port) as nd:   # and the NDJSON way: two plain publishes to the subject
            for _ in range(2):
                assert nd.request({"op": "pub", "topic": "$Q.PUSH.jobs", "data": 1}) == {"ok": True}
        for i, nc in enumerate(victims):
            answer = json.loads((await nc.request("$Q.PUSH.jobs", b"order #%d" % i, timeout=5)).data)
            assert answer["ok"] is True and answer["id"] != "FORGEDFORGEDFORG"
        stat = json.loads((await victims[0].request("$Q.STAT.jobs", b"", timeout=5)).data)["stat"]
        assert stat["messages"] == len(victims)
        got = await victims[0].request("$Q.RECV.jobs", b'{"batch":1}', timeout=5)
        assert got.data == b"order #0"
        assert stolen == []
        for nc in attackers + victims:
            await nc.close()

    asyncio.run(run())


def test_queue_answers_land_on_no_subject_the_requester_may_not_publish_to(start_broker):
    broker = start_broker(workers=2, config=SECURE)
    listeners = [on_worker(broker.port, w, "billing", "billpw") for w in (0, 1)]
    for c in listeners:
        assert c.request({"op": "sub", "topic": "orders.>"}) == {"ok": True}

    async def run():
        billing = await nats.connect(_url(broker, "billing"), allow_reconnect=False)
        seen: list[bytes] = []

        async def record(msg):
            seen.append(msg.data)

        await billing.subscribe("orders.>", cb=record)
        await billing.flush()
        eve = await nats.connect(_url(broker, "eve"), allow_reconnect=False)
        alice = await nats.connect(_url(broker, "alice"), allow_reconnect=False)
        await eve.publish("$Q.STAT.whatever", b"", reply="orders.new")
        pushed = json.loads((await alice.request("$Q.PUSH.jobs", b'{"order":"FAKE-9999"}', timeout=5)).data)
        assert pushed["ok"] is True
        await alice.publish("$Q.RECV.jobs", b'{"batch":1}', reply="orders.paid")
        await alice.publish("$Q.STAT.jobs", b"", reply="orders.paid")
        for nc in (eve, alice):
            await nc.flush()
        await asyncio.sleep(0.5)
        assert seen == []
        # alice had no subscription to be handed the message on: it was not leased to nobody
        stat = json.loads((await alice.request("$Q.STAT.jobs", b"", timeout=5)).data)["stat"]
        assert stat["messages"] == 1 and stat["visible"] == 1 and stat["in_flight"] == 0, stat
        for nc in (billing, eve, alice):
            await nc.close()

    asyncio.run(run())
    for c in listeners:
        assert c.nothing(0.2), c.buf


def test_a_receive_reaches_no_other_subscriber_of_the_requesters_inbox(start_broker):
    broker = start_broker(workers=2, config=SECURE)

    async def run():
        bobs = await _connections_on_every_worker(broker, 2, "bob")
        sniffed: list[bytes] = []

        async def sniff(msg):
            sniffed.append(msg.data)

        for bob in bobs:
            await bob.subscribe("_INBOX.>", cb=sniff)
            await bob.flush()
        alice = await nats.connect(_url(broker, "alice"), allow_reconnect=False)
        assert json.loads((await alice.request("$Q.PUSH.jobs", b"secret job payload", timeout=5)).data)["ok"]
        msg = await alice.request("$Q.RECV.jobs", b'{"batch":1}', timeout=5)
        assert msg.data == b"secret job payload"
        await msg.ack()
        await alice.flush()
        await asyncio.sleep(0.3)
        assert sniffed == []
        for nc in bobs + [alice]:
            await nc.close()

    asyncio.run(run())


def test_the_q_subjects_are_the_brokers_own_whatever_the_protocol(start_broker):
    """$Q.> is an internal subscription (workers/hub.py serve, as nats-server serves $JS.API.>): a NATS PUB there is
    a queue request, no client's subscription to $Q.> receives anything, and an NDJSON publish there reaches
    nobody (NDJSON has its own queue operations) and stores nothing."""
    broker = start_broker(workers=2)

    async def main():
        requester = await nats.connect(_url(broker), allow_reconnect=False)
        snooper = await nats.connect(_url(broker), allow_reconnect=False)
        seen = []

        async def snoop(msg):
            seen.append(msg.subject)
        await snooper.subscribe("$Q.>", cb=snoop)
        await snooper.flush()
        with Raw(broker.port) as ndjson:
            assert ndjson.request({"op": "sub", "topic": "$Q.>"}) == {"ok": True}
            reply = await requester.request("$Q.PUSH.confined", b"one", timeout=5)
            assert json.loads(reply.data)["ok"] is True
            ndjson.send(b'{"op":"pub","topic":"$Q.PUSH.confined","data":"two"}\n')
            assert ndjson.json() == {"ok": True}
            await requester.flush()
            await snooper.flush()
            assert ndjson.nothing(0.3), "an NDJSON subscriber to $Q.> received a queue request"
            stat = ndjson.request({"op": "qstat", "queue": "confined"})
        assert seen == [], seen
        assert stat["stat"]["messages"] == 1, stat   # the NATS push alone
        await requester.close()
        await snooper.close()

    asyncio.run(main())
