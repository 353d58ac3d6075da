"""A permission taken away is in force at once, for receives already waiting too (finding A7): a waiting NDJSON
long poll, a NATS ``$Q.RECV`` with ``expires`` and a qlite ``POLL`` got messages pushed after the admin's
``set_permissions`` was acknowledged.  Now each is refused when the change lands, the messages pushed after it stay
in the queue, and whichever worker owns the queue asks again at the moment it hands messages over."""

import asyncio
import json

import nats
from test_qlite import SECRETS, Q, answer, qport

from shardbroker.workers.protocols.qlite import codec
from shardbroker.workers.workqueues.journal import Journal
from shardbroker.workers.workqueues.rules import Settings
from shardbroker.workers.workqueues.shard import Shard

from support.harness import Raw, on_worker

PERMS = ["publish:jobs", "subscribe:jobs", "subscribe:_INBOX.>"]
CONFIG = {
    "qlite": {"enabled": True, "port": 0, "queue": "jobs", "max_polling_time": 30},
    "security": {"enabled": True, "iterations": 1000, "failures_per_address": 1000,
                 "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]},
                 "users": [{"username": "alice", "password": "alicepw", "qlite_secret": SECRETS["sub"],
                            "permissions": PERMS}]},
}


def _login(conn: Raw, user: str, password: str) -> Raw:
    assert conn.request({"op": "auth", "user": user, "pass": password}) == {"ok": True}
    return conn


def test_waiting_receives_of_every_protocol_end_when_the_permission_goes(start_broker):
    broker = start_broker(workers=2, config=CONFIG)
    # alice waits on both workers over NDJSON, over NATS, and over qlite (on the queue's owner)
    waiting = [on_worker(broker.port, w, "alice", "alicepw") for w in (0, 1)]
    for i, c in enumerate(waiting):
        c.send(json.dumps({"op": "qrecv", "queue": "jobs", "wait_ms": 20000, "id": i}).encode() + b"\n")
    poller = Q(qport(broker))
    poller.send(answer(poller.greeting(), "alice", SECRETS["sub"], role=1))
    assert poller.frame() == b"PASS;"
    poller.send(codec.request("POLL", struct_u32(30) + struct_u32(20)))

    async def run():
        nc = await nats.connect(f"nats://alice:alicepw@127.0.0.1:{broker.ports['nats']}", allow_reconnect=False)
        pending = asyncio.ensure_future(nc.request("$Q.RECV.jobs", b'{"batch":1,"expires":20000000000}',
                                                   timeout=15))
        await asyncio.sleep(0.5)   # every receive is waiting
        admin = _login(Raw(broker.port), "admin", "adminpw")
        assert admin.request({"op": "admin.set_permissions", "user": "alice",   # the inbox stays hers
                              "permissions": ["publish:jobs", "subscribe:_INBOX.>"]}) == {"ok": True}
        for n in (1, 2):
            assert admin.request({"op": "qpush", "queue": "jobs", "data": f"secret-after-revoke-{n}"})["ok"]
        reply = await pending
        assert json.loads(reply.data) == {"ok": False, "error": "permission_denied"}
        await nc.close()
        return admin

    admin = asyncio.run(run())
    for i, c in enumerate(waiting):
        assert c.json(timeout=5) == {"ok": False, "error": "permission_denied", "id": i}
    assert poller.frame(timeout=5) == b"FAIL;error: user does not have the subscriber role"
    assert poller.closed()
    stat = admin.request({"op": "qstat", "queue": "jobs"})["stat"]
    assert stat["visible"] == 2 and stat["in_flight"] == 0, stat


def struct_u32(n: int) -> bytes:
    return n.to_bytes(4, "little")


def test_the_owner_asks_again_when_it_hands_messages_over(tmp_path):
    """In-process, the queue owner's side: whoever the worker that sent a receive believed, the owner refuses a
    receive (waiting or not) of a user who may no longer receive, at the moment it would lease; a change of users
    answers the waiting ones at once; nothing is leased to them."""
    async def main():
        allowed = {"alice": True, "bob": True}
        shard = Shard(0, Settings(), Journal(str(tmp_path / "q.journal")), lambda: None, 256)
        shard.may_receive = lambda user, queue: allowed[user]
        replies = {}

        def ask(key, op, **args):
            shard.handle(op, dict(args, queue="jobs"), (0, key), lambda r: replies.__setitem__(key, r))

        ask(1, "recv", wait_ms=20000, user="alice")
        ask(2, "recv", wait_ms=20000, user="bob")
        ask(3, "recv", wait_ms=20000, user="alice")
        shard.commit()
        allowed["alice"] = False   # a change on its way to this worker: the waiters are asked when served
        ask(9, "push", data=b"m1", kind=0)
        shard.commit()
        assert replies[1] == {"ok": False, "error": "permission_denied"}
        assert replies[2]["ok"] and [m[3] for m in replies[2]["messages"]] == [b"m1"]
        assert 3 not in replies   # no message was left for it: it waits, until the change lands here
        shard.recheck_waiters()
        shard.commit()
        assert replies[3] == {"ok": False, "error": "permission_denied"}
        ask(9, "push", data=b"m2", kind=0)
        ask(4, "recv", user="alice")
        shard.commit()
        assert replies[4] == {"ok": False, "error": "permission_denied"}
        ask(5, "stat")
        shard.commit()
        assert replies[5]["stat"]["visible"] == 1 and replies[5]["stat"]["in_flight"] == 1
        shard.journal.close()

    asyncio.run(main())


def test_a_queue_group_member_narrowed_is_passed_over_not_dropped(start_broker):
    """Finding A8: after one member of a queue group may no longer receive a subject, the group's messages on it
    all go to the members that may (they were picked round-robin and half were dropped)."""
    config = {"security": {"enabled": True, "iterations": 1000,
                           "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]},
                           "users": [{"username": "alice", "password": "alicepw",
                                      "permissions": ["publish:chat.*", "subscribe:chat.*"]}]}}
    broker = start_broker(workers=3, config=config)

    async def run():
        url = f"127.0.0.1:{broker.ports['nats']}"
        members = {}
        got: dict[str, list] = {"alice": [], "admin": []}
        for user in ("alice", "admin"):
            for _ in range(2):   # two members each, spread over the workers
                nc = await nats.connect(f"nats://{user}:{user}pw@{url}", allow_reconnect=False)

                async def cb(msg, user=user):
                    got[user].append(msg.data)
                await nc.subscribe("chat.*", queue="grp", cb=cb)
                await nc.flush()
                members.setdefault(user, []).append(nc)
        publisher = members["admin"][0]
        for i in range(100):
            await publisher.publish("chat.room2", b"%d" % i)
        await publisher.flush()
        await asyncio.sleep(0.3)
        assert len(got["alice"]) + len(got["admin"]) == 100 and got["alice"], got
        with Raw(broker.port) as admin:
            _login(admin, "admin", "adminpw")
            assert admin.request({"op": "admin.set_permissions", "user": "alice",
                                  "permissions": ["subscribe:chat.room1"]}) == {"ok": True}
        for user in got:
            got[user].clear()
        for i in range(100):
            await publisher.publish("chat.room2", b"%d" % i)
            await publisher.publish("chat.room1", b"r1-%d" % i)
        await publisher.flush()
        await asyncio.sleep(0.5)
        assert sorted(m for m in got["admin"] if not m.startswith(b"r1")) == sorted(b"%d" % i for i in range(100))
        assert all(m.startswith(b"r1-") for m in got["alice"]) and got["alice"]   # still a member for room1
        assert len(got["alice"]) + len([m for m in got["admin"] if m.startswith(b"r1")]) == 100
        for ncs in members.values():
            for nc in ncs:
                await nc.close()

    asyncio.run(run())
    assert broker.varz()["workers"] and sum(w.get("queue_dropped", 0) for w in broker.varz()["workers"]) == 0
