"""A field a work-queue request does not define is refused, naming it and the nearest one that exists, before
anything is done (``{"op":"qrecv","visibility":1}`` was a 30 s lease, ``"delay":5000`` pushed at once); and the
values finding A17 found taken for what they are not."""

import asyncio
import json

import nats

from harness import Raw


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
