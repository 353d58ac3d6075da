"""A push's ``dedup_id`` (docs/queues.md): a producer that sends a push again, not knowing whether the first got
through (a lost connection, a retryable error), has it stored once, on every protocol, on the owner or across the
fabric, through a kill -9 of the owner and the compaction its replacement makes."""

import asyncio
import json
import os
import re
import signal
import time
import urllib.request

import nats
from test_queues import owned_by, push, recv, req, stat

from support.harness import Raw, on_worker
from support.waiting import wait_for

NO_MOVES = {"queues": {"move_connections": False}}


def test_a_push_sent_again_with_its_dedup_id_is_stored_once(start_broker):
    broker = start_broker(workers=2, config=NO_MOVES)
    for worker in (0, 1):   # across the fabric to the owner (worker 1), and on the owner itself
        conn, q, other = on_worker(broker.port, worker), owned_by(1, f"dd{worker}"), owned_by(0, f"dd{worker}")
        first = push(conn, q, {"n": 1}, dedup_id="order-17")
        again = req(conn, "qpush", queue=q, data={"n": 2}, dedup_id="order-17", id=5)
        assert again == {"ok": True, "id": 5, "msg_id": first, "duplicate": True}   # the request's id echoed
        again = req(conn, "qpush", queue=q, data={"n": 3}, dedup_id="order-17")
        assert again == {"ok": True, "id": first, "duplicate": True}
        s = stat(conn, q)
        assert (s["messages"], s["pushed"], s["duplicate_pushes"]) == (1, 1, 2)
        (msg,) = recv(conn, q, max=10)
        assert msg["data"] == {"n": 1}
        assert req(conn, "qack", queue=q, receipt=msg["receipt"]) == {"ok": True}
        # the window is the id's, not the message's: acked, it still names the first push
        assert req(conn, "qpush", queue=q, data=4, dedup_id="order-17") == {"ok": True, "id": first,
                                                                           "duplicate": True}
        assert stat(conn, q)["messages"] == 0
        # per queue: the same id elsewhere is another push
        assert push(conn, other, 5, dedup_id="order-17") != first

        # pipelined single pushes (gathered into one request to the owner), each judged on its own
        lines = [{"op": "qpush", "queue": q, "data": i, **extra} for i, extra in enumerate(
            [{"dedup_id": "p1"}, {"dedup_id": "p1"}, {}, {"dedup_id": "p2"}, {"dedup_id": 7}, {"dedup_id": "p2"},
             {"dedup_id": ["p3"]}, {"dedup_id": {"p": 3}}])]
        conn.send(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        replies = [json.loads(conn.line()) for _ in lines]
        assert replies[0] == {"ok": True, "id": replies[0]["id"]}
        assert replies[1] == {"ok": True, "id": replies[0]["id"], "duplicate": True}
        assert replies[2]["id"] not in (replies[0]["id"], replies[3]["id"]) and len(replies[2]) == 2
        assert replies[4] == {"ok": False, "error": "invalid_dedup_id", "min": 1, "max": 128}
        assert replies[5] == {"ok": True, "id": replies[3]["id"], "duplicate": True}
        assert replies[6] == replies[7] == replies[4]
        assert [m["data"] for m in recv(conn, q, max=10)] == [0, 2, 3]

        # a batch: its dedup_id names the whole batch
        batch = req(conn, "qpush", queue=q, messages=[{"data": "a"}, {"data": "b"}], dedup_id="b1")
        assert batch["ok"] and len(batch["ids"]) == 2 and "duplicate" not in batch
        assert req(conn, "qpush", queue=q, messages=[{"data": "c"}], dedup_id="b1") == {
            "ok": True, "ids": batch["ids"], "duplicate": True}
        # one form's id used by the other is a mistake, said so
        assert req(conn, "qpush", queue=q, data="d", dedup_id="b1") == {"ok": False, "error": "dedup_id_conflict"}
        assert req(conn, "qpush", queue=q, messages=[{"data": "e"}], dedup_id="p1") == {
            "ok": False, "error": "dedup_id_conflict"}
        for bad in ("", "x" * 129, 12, ["p1"], {"a": 1}, True):
            assert req(conn, "qpush", queue=q, data="f", dedup_id=bad) == {
                "ok": False, "error": "invalid_dedup_id", "min": 1, "max": 128}, bad
            assert req(conn, "qpush", queue=q, messages=[{"data": "f"}], dedup_id=bad)["error"] == "invalid_dedup_id"
        assert push(conn, q, "g", dedup_id="x" * 128)
        assert push(conn, q, "h", dedup_id="\u00e9t\u00e9 \u2603")
        s = stat(conn, q)
        assert (s["visible"], s["duplicate_pushes"]) == (4, 2 + 1 + 2 + 2)   # a, b, g, h: nothing else stored
        recv(conn, q, max=10)

        # in the canonical form (speedups.ndjson_runs), a dedup_id last: pipelined pushes with new ids are stored
        # together, their data as written; a read that names an id known, or one twice, is judged push by push
        head = b'{"op":"qpush","queue":"%s","data":' % q.encode()
        conn.send(b"".join(head + b'{"n": %d},"priority":6,"dedup_id":"c%d"}\n' % (i, i) for i in range(3)))
        ids = [conn.json() for _ in range(3)]
        assert all(r == {"ok": True, "id": r["id"]} for r in ids) and len({r["id"] for r in ids}) == 3
        replies = []
        for named in ([b"c1", b"m0"], [b"m1", b"m1", b"m2"], [b"x" * 129]):   # one read each
            conn.send(b"".join(head + b'%d,"dedup_id":"%s"}\n' % (len(replies) + i, u) for i, u in enumerate(named)))
            replies += [conn.json() for _ in named]
        assert replies[0] == {"ok": True, "id": ids[1]["id"], "duplicate": True}
        assert replies[3] == {"ok": True, "id": replies[2]["id"], "duplicate": True}
        new = [replies[i]["id"] for i in (1, 2, 4)]
        assert all(len(replies[i]) == 2 for i in (1, 2, 4)) and len(set(new)) == 3
        assert replies[5] == {"ok": False, "error": "invalid_dedup_id", "min": 1, "max": 128}
        conn.send(b'{"op":"qrecv","queue":"%s","max":10}\n' % q.encode())
        raw = conn.line()
        assert raw.count(b'"data":{"n": ') == 3   # as written
        assert [(m["data"], m["priority"], m["id"]) for m in json.loads(raw)["messages"]] == [
            ({"n": i}, 6, ids[i]["id"]) for i in range(3)] + [(1, 4, new[0]), (2, 4, new[1]), (4, 4, new[2])]
        assert stat(conn, q)["duplicate_pushes"] == 7 + 2
        conn.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.ports['monitoring']}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    for worker in (0, 1):
        assert re.search(r'shardbroker_workqueue_duplicate_pushes_total\{queue="%s",worker="1"\} 9\.0'
                         % re.escape(owned_by(1, f"dd{worker}")), metrics), metrics[-2000:]


def test_nats_msg_id_deduplicates_as_jetstream_does(start_broker):
    broker = start_broker(workers=2)

    async def run():
        nc = await nats.connect(f"nats://127.0.0.1:{broker.ports['nats']}", allow_reconnect=False)
        replies = [json.loads((await nc.request("$Q.PUSH.ndd", b"job-%d" % i,
                                                headers={"Nats-Msg-Id": "m-1"})).data) for i in range(3)]
        assert replies[0] == {"ok": True, "id": replies[0]["id"]}
        assert replies[1] == replies[2] == {"ok": True, "id": replies[0]["id"], "duplicate": True}
        msg = await nc.request("$Q.RECV.ndd", b'{"batch": 10}')
        assert msg.data == b"job-0"
        stat = json.loads((await nc.request("$Q.STAT.ndd", b"")).data)["stat"]
        assert stat["messages"] == 1
        bad = json.loads((await nc.request("$Q.PUSH.ndd", b"x", headers={"Nats-Msg-Id": "y" * 200})).data)
        assert bad == {"ok": False, "error": "invalid_dedup_id", "min": 1, "max": 128}
        await nc.close()

    asyncio.run(run())


def test_dedup_ids_outlive_a_kill_9_and_the_compaction_after_it(start_broker):
    """The first replacement replays the push's record and compacts: its snapshot no longer holds the (acked)
    message, only the remembered id.  The second replacement replays that snapshot: a retry is still known."""
    broker = start_broker(workers=2, config=NO_MOVES)
    q = owned_by(1, "ddcrash")
    conn = on_worker(broker.port, 0)   # on the worker that survives
    first = push(conn, q, "once", dedup_id="invoice-9")
    batch = req(conn, "qpush", queue=q, messages=[{"data": "x"}, {"data": "y"}], dedup_id="batch-9")["ids"]
    (msg,) = recv(conn, q, max=1)
    assert req(conn, "qack", queue=q, receipt=msg["receipt"])["ok"]
    with on_worker(broker.port, 1) as at_owner:   # pipelined on the owner: stored as one record, an id each
        at_owner.send(b"".join(json.dumps({"op": "qpush", "queue": q, "data": i, "dedup_id": f"run-{i}"}).encode()
                               + b"\n" for i in range(5)))
        run = [at_owner.json()["id"] for _ in range(5)]

    def owner(key):   # None while the worker is being replaced (/varz lists the workers up)
        return next((w[key] for w in broker.varz()["workers"] if w["worker"] == 1), None)

    for _ in range(2):
        pid = owner("pid")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: owner("pid") not in (pid, None), 10, "a replacement")
        wait_for(lambda: owner("journal_compactions"), 10, "the replacement's compaction")
        deadline = time.monotonic() + 10
        while True:   # the replacement may still be saying hello to the other worker
            again = req(conn, "qpush", queue=q, data="twice", dedup_id="invoice-9")
            if again.get("ok") or time.monotonic() > deadline:
                break
            assert again.get("retry"), again
            time.sleep(0.05)
        assert again == {"ok": True, "id": first, "duplicate": True}
        assert req(conn, "qpush", queue=q, messages=[{"data": "z"}], dedup_id="batch-9") == {
            "ok": True, "ids": batch, "duplicate": True}
        assert [req(conn, "qpush", queue=q, data=-1, dedup_id=f"run-{i}") for i in range(5)] == [
            {"ok": True, "id": run[i], "duplicate": True} for i in range(5)]
    s = stat(conn, q)
    assert s["messages"] == 7 and s["in_flight"] == 0   # x, y, the run; "once" acked, nothing stored twice
    conn.close()


def test_the_client_and_brokerctl_send_dedup_ids(start_broker):
    from test_queue_cli import brokerctl

    from shardbroker.cli.client import AsyncClient

    broker = start_broker(workers=2)

    async def run():
        async with await AsyncClient.connect("127.0.0.1", broker.port) as c:
            one = await c.qpush("cdd", {"n": 1}, dedup_id="k")
            assert await c.qpush("cdd", {"n": 2}, dedup_id="k") == one
            many = await c.qpush_many("cdd", ["a", "b"], dedup_id="kb")
            assert await c.qpush_many("cdd", ["c"], dedup_id="kb") == many
            return one, (await c.qstat("cdd"))["messages"]

    one, held = asyncio.run(run())
    assert held == 3
    assert brokerctl(broker, "push", "--dedup-id", "k", "cdd", "again").stdout.strip() == one
    assert brokerctl(broker, "stat", "cdd").stdout and json.loads(brokerctl(broker, "stat", "cdd").stdout)[
        "messages"] == 3
    raw = Raw(broker.port)
    assert req(raw, "qpush", queue="cdd", data=2, dedup_id="k") == {"ok": True, "id": one, "duplicate": True}
    raw.close()
