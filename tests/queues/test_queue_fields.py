"""A field a work-queue request does not define is refused, naming it and the nearest one that exists, before
anything is done (``{"op":"qrecv","visibility":1}`` was a 30 s lease, ``"delay":5000`` pushed at once); and the
values finding A17 found taken for what they are not."""

import asyncio
import json

import nats

from support.harness import Raw


def test_ndjson_queue_requests_refuse_fields_they_do_not_define(broker):
    with Raw(broker.port) as c:
        assert c.request({"op": "qrecv", "queue": "f", "visibility": 1, "id": 1}) == \
            {"ok": False, "error": "unknown_field", "field": "visibility", "did_you_mean": "visibility_ms", "id": 1}
        assert c.request({"op": "qpush", "queue": "f", "data": "x", "delay": 5000}) == \
            {"ok": False, "error": "unknown_field", "field": "delay", "did_you_mean": "delay_ms"}
        assert c.request({"cmd": "qstat", "queue": "f", "zzzz": 1}) == \
            {"ok": False, "error": "unknown_field", "field": "zzzz"}
        assert c.request({"op": "qpush", "queue": "f", "messages": [{"data": 1}, {"data": 2, "prio": 3}]}) == \
            {"ok": False, "error": "unknown_field", "field": "prio", "did_you_mean": "priority", "index": 1}
        assert c.request({"op": "qrecv", "queue": "f", "release_on_close": "yes"}) == \
            {"ok": False, "error": "invalid_release_on_close"}
        stat = c.request({"op": "qstat", "queue": "f"})["stat"]
        assert stat["messages"] == 0, stat   # nothing refused was stored
        # the defined fields, all of them, still pass
        assert c.request({"op": "qpush", "queue": "f", "data": "x", "priority": 2, "delay_ms": 0,
                          "dedup_id": "d1", "id": "p"})["ok"]
        got = c.request({"op": "qrecv", "queue": "f", "max": 1, "wait_ms": 10, "visibility_ms": 1000,
                         "release_on_close": False})
        assert got["ok"] and got["messages"][0]["data"] == "x"


def test_nats_queue_bodies_refuse_fields_they_do_not_define(broker):
    async def run():
        nc = await nats.connect(f"nats://127.0.0.1:{broker.ports['nats']}", allow_reconnect=False)

        async def ask(subject, body, **headers):
            msg = await nc.request(subject, body, timeout=5, headers=headers or None)
            return json.loads(msg.data)

        assert await ask("$Q.RECV.f", b'{"batch":1,"visibility":1}') == \
            {"ok": False, "error": "unknown_field", "field": "visibility", "did_you_mean": "visibility_ms"}
        assert await ask("$Q.REDRIVE.f", b'{"too":"g"}') == \
            {"ok": False, "error": "unknown_field", "field": "too", "did_you_mean": "to"}
        assert (await ask("$Q.RECV.f", b'{"expires":1000000000000000000000000}'))["error"] == "invalid_wait"
        assert (await ask("$Q.RECV.f", b'{"no_wait":"yes"}'))["error"] == "invalid_no_wait"
        assert (await ask("$Q.RECV.f", b'{"release_on_close":"yes"}'))["error"] == "invalid_release_on_close"
        # an Arabic-Indic three is not a priority
        assert (await ask("$Q.PUSH.f", b"x", **{"Q-Priority": "\u0663"}))["error"] == "invalid_priority"
        assert (await ask("$Q.PUSH.f", b"x", **{"Q-Priority": "3"}))["ok"]
        msg = await nc.request("$Q.RECV.f", b'{"batch":1}', timeout=5)
        nak = json.loads((await nc.request(msg.reply, b'-NAK {"dealy":5}', timeout=5)).data)
        assert nak == {"ok": False, "error": "unknown_field", "field": "dealy", "did_you_mean": "delay"}
        assert json.loads((await nc.request(msg.reply, b"+ACK", timeout=5)).data) == {"ok": True}
        await nc.close()

    asyncio.run(run())


def test_one_user_cannot_take_every_new_queue_place(start_broker):
    """Finding A15: one user pushing to 2,000 names filled queues.max_queues_per_worker, and every other user's
    first push to a new queue got too_many_queues for as long as those queues held a message.  Each user (with
    security off, each client address) may make queues.max_queues_per_user of a worker's queues."""
    users = [{"username": u, "password": f"{u}pw", "permissions": ["publish:>", "subscribe:>"]}
             for u in ("eve", "alice")]
    broker = start_broker(workers=1, config={
        "queues": {"max_queues_per_worker": 20, "max_queues_per_user": 5},
        "security": {"enabled": True, "iterations": 1000, "users": users,
                     "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]}}})
    with Raw(broker.port) as eve, Raw(broker.port) as alice:
        for c, u in ((eve, "eve"), (alice, "alice")):
            assert c.request({"op": "auth", "user": u, "pass": f"{u}pw"}) == {"ok": True}
        replies = [eve.request({"op": "qpush", "queue": f"public.q{i}", "data": i}) for i in range(30)]
        assert sum(r["ok"] for r in replies) == 5
        assert replies[5] == {"ok": False, "error": "too_many_queues", "max": 5, "per": "user"}
        assert eve.request({"op": "qpush", "queue": "public.q0", "data": "again"})["ok"]   # its own, still
        assert alice.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"]
        assert broker.varz()["workers"][0]["queues_refused"] == 25


def test_without_security_each_address_has_its_share(start_broker):
    broker = start_broker(workers=1, config={"queues": {"max_queues_per_worker": 20, "max_queues_per_user": 3}})
    with Raw(broker.port, source="127.0.0.5") as greedy, Raw(broker.port, source="127.0.0.6") as other:
        assert [greedy.request({"op": "qpush", "queue": f"g{i}", "data": i})["ok"] for i in range(5)] == \
            [True, True, True, False, False]
        assert other.request({"op": "qpush", "queue": "mine", "data": 1})["ok"]


def test_one_table_of_queue_operations_is_what_every_protocol_spells():
    """workers/workqueues/operations.py is the vocabulary: the shard runs its rows, NDJSON's ops and NATS' $Q
    verbs are its spellings, and every qlite command runs one of its operations."""
    from shardbroker.workers.protocols.nats import queue_verbs as nats_ops
    from shardbroker.workers.protocols.ndjson import queue_verbs as ndjson_ops
    from shardbroker.workers.protocols.qlite import session as qlite
    from shardbroker.workers.workqueues import operations, shard

    rows = operations.OPERATIONS
    assert set(shard._OPS) == {op.name for op in rows}
    assert set(ndjson_ops.OPS) == {op.ndjson for op in rows if op.ndjson}
    assert nats_ops._OPS == {op.nats: op.name for op in rows if op.nats}
    spelled = [command.encode() for op in rows for command in op.qlite]
    assert sorted(spelled) == sorted(qlite._VERBS), "each qlite command is one operation's, once"
    assert {op.name for op in rows if op.permission == operations.ADMIN} == {"purge", "redrive"}
