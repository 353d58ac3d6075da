"""What a client can send that the broker cannot write back: JSON nested deeper than orjson writes (it reads 1,024
levels and writes 254 inside a reply), and subjects of thousands of tokens.

Such a line gets ``invalid_json`` on its own connection and nothing else happens.  Before, a deep ``id`` whose
reply was rendered in a callback (a ``sub``'s deferred ok, a queue reply coming back from its owner, the owner's
commit) raised inside the worker's loop: the fabric reader stopped for good (that worker never heard from the
others again, and /healthz still said ok), or a commit dropped the other clients' replies of that turn.
"""

import json
import socket
import time

import pytest

from support.harness import Raw, on_worker

DEEP = b"[" * 300 + b"1" + b"]" * 300      # readable, not writable
DEEPEST = b"[" * 1000 + b"1" + b"]" * 1000  # readable, and deep enough for the standard library's recursion too


def _line(prefix: bytes, value: bytes) -> bytes:
    return prefix + value + b"}\n"


@pytest.mark.parametrize("line", [
    _line(b'{"op":"sub","topic":"x","id":', DEEP),
    _line(b'{"op":"ping","id":', DEEP),
    _line(b'{"op":"auth","user":"u","pass":"p","id":', DEEP),
    _line(b'{"op":"pub","topic":"x","data":', DEEP),
    _line(b'{"op":"pub","topic":"x","id":1,"data":', DEEPEST),
    _line(b'{"op":"qpush","queue":"q","id":', DEEP),
    _line(b'{"op":"qpush","queue":"q","id":2,"data":', DEEP),
    _line(b'{"op":"qpush","queue":"q","id":3,"messages":[{"data":', DEEPEST + b"}]"),
    _line(b'{"op":"qrecv","queue":"q","id":', DEEP),
    _line(b'{"op":"admin.list_users","id":', DEEP),
])
def test_deep_json_gets_invalid_json_and_the_connection_goes_on(broker, line):
    with Raw(broker.port) as c:
        c.send(line + b'{"op":"ping","id":"after"}\n')
        reply = c.json()
        assert reply["ok"] is False and reply["error"] == "invalid_json", reply
        assert c.json() == {"ok": True, "id": "after"}
    assert "Traceback" not in broker.log()


def test_a_deep_id_on_every_worker_cuts_no_worker_off(start_broker):
    """The finding's reproduction: the line on both workers, then cross-worker pub/sub, subscription oks and
    queue replies still work, and nothing was caught as a failed callback."""
    broker = start_broker(workers=2)
    deep_sub = _line(b'{"op":"sub","topic":"x","id":', DEEP)
    deep_push = _line(b'{"op":"qpush","queue":"jobs","data":"x","id":', DEEP)
    attackers = [on_worker(broker.port, w) for w in (0, 1)]
    for a in attackers:
        a.send(deep_sub + deep_push)
        assert a.json()["error"] == "invalid_json"
        assert a.json()["error"] == "invalid_json"
    subscriber, publisher = on_worker(broker.port, 0), on_worker(broker.port, 1)
    assert subscriber.request({"op": "sub", "topic": "feed", "id": "s"}) == {"ok": True, "id": "s"}
    for i in range(20):
        assert publisher.request({"op": "pub", "topic": "feed", "data": i}) == {"ok": True}
    assert [subscriber.json()["data"] for _ in range(20)] == list(range(20))
    # queue replies from whichever worker owns the queue, to both workers' clients
    for c in (subscriber, publisher):
        assert c.request({"op": "qpush", "queue": "jobs", "data": "j", "id": 7})["ok"] is True
    varz = broker.varz()
    assert varz["callback_errors"] == 0
    assert broker.http("/healthz") == (200, {"status": "ok"})
    for c in attackers + [subscriber, publisher]:
        c.close()


def test_pipelined_pushes_all_answered_while_another_client_sends_deep_ids(start_broker):
    """The commit-loop variant: a victim pipelining pushes to the owner loses no reply."""
    broker = start_broker(workers=2)
    victim = Raw(broker.port)
    attacker = Raw(broker.port)
    batch = b"".join(json.dumps({"op": "qpush", "queue": "q", "data": i, "id": i}).encode() + b"\n"
                     for i in range(50))
    deep = _line(b'{"op":"qpush","queue":"q","data":"x","id":', DEEP)
    for _ in range(20):
        attacker.send(deep)
        victim.send(batch)
        assert [victim.json()["id"] for _ in range(50)] == list(range(50))
        assert attacker.json()["error"] == "invalid_json"
    stat = victim.request({"op": "qstat", "queue": "q"})
    assert stat["ok"] and stat["stat"]["messages"] == 1000, stat


@pytest.mark.parametrize("protocol", ["ndjson", "nats"])
def test_a_subscription_of_a_thousand_wildcards_breaks_no_publisher(start_broker, protocol):
    broker = start_broker(workers=2)
    stars = ".".join(["*"] * 1000)
    long_subject = ".".join(["a"] * 1000)
    subscriber = Raw(broker.port)
    assert subscriber.request({"op": "sub", "topic": stars}) == {"ok": True}
    for _ in range(2):   # one publisher per worker
        if protocol == "ndjson":
            with Raw(broker.port) as p:
                assert p.request({"op": "pub", "topic": long_subject, "data": 1}) == {"ok": True}
        else:
            s = socket.create_connection(("127.0.0.1", broker.ports["nats"]), timeout=5)
            s.sendall(b'CONNECT {"verbose":false}\r\nPUB %s 1\r\nx\r\nPING\r\n' % long_subject.encode())
            got = b""
            deadline = time.monotonic() + 5
            while b"PONG\r\n" not in got and time.monotonic() < deadline:
                got += s.recv(65536)
            assert b"PONG\r\n" in got and b"-ERR" not in got, got[-200:]
            s.close()
        assert subscriber.json()["topic"] == long_subject
    assert "RecursionError" not in broker.log()
