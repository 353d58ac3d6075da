"""Limits per client and per user, each against a real broker over real sockets: the protocol's words for the
refusal, and the breach counted in /varz and /metrics.  docs/configuration.md (limits) lists them."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request

import pytest
from test_nats import NatsRaw

from support.harness import Raw


def breaches(broker) -> dict:
    return broker.varz()["breaches"]


def metric_lines(broker, name: str) -> list[str]:
    url = f"http://127.0.0.1:{broker.ports['monitoring']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return [line for line in text.splitlines() if line.startswith(name)]


def raw_from(port: int, source: str) -> Raw:
    """A Raw connection from another loopback address (127.0.0.0/8 is all this machine)."""
    r = Raw.__new__(Raw)
    r.sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    r.buf, r.timeout = b"", 5.0
    return r


def secure(**limits) -> dict:
    return {"limits": limits, "security": {
        "enabled": True, "iterations": 1000, "failures_per_address": 1000,
        "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]},
        "users": [{"username": "alice", "password": "a", "permissions": ["publish:>", "subscribe:>"]},
                  {"username": "bob", "password": "b", "permissions": ["publish:>", "subscribe:>"]}]}}


# -- max_subscriptions ---------------------------------------------------------------------------------------
def test_max_subscriptions_in_every_protocol_and_counted(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_subscriptions": 2}, "bridge": {"enabled": True, "port": 0}},
                     args=["--bridge-port", "0"])
    with Raw(b.port) as c:
        assert c.request({"op": "sub", "topic": "a"}) == {"ok": True}
        assert c.request({"op": "sub", "topic": "b"}) == {"ok": True}
        assert c.request({"op": "sub", "topic": "c"}) == {"ok": False, "error": "too_many_subscriptions"}
        assert c.request({"op": "sub", "topic": "a"}) == {"ok": True}   # held already: not a new one
        assert c.request({"op": "ping"}) == {"ok": True}                # the connection stays
    with NatsRaw(b) as n:
        n.send(b"SUB a 1\r\nSUB b 2\r\nSUB c 3\r\nPING\r\n")
        expected = b"-ERR 'maximum subscriptions exceeded'\r\nPONG\r\n"   # nats-server's text; it stays open too
        assert n.read_exactly(expected) == expected
    with Raw(b.ports["bridge"]) as br:
        br.send(b"Sa      Sb      Sc      ")
        got = b""
        while len(got) < 3:
            data = br.sock.recv(16)
            if not data:
                break
            got += data
        assert got == b"OOF" and br.closed()   # Bridge has only F, and F closes
    assert breaches(b)["max_subscriptions"] == 3
    assert 'shardbroker_limit_breaches_total{limit="max_subscriptions",worker="0"} 3.0' in \
        metric_lines(b, "shardbroker_limit_breaches_total")


# -- max_connections_per_address ---------------------------------------------------------------------------
@pytest.mark.exclusive   # a reply within 0.5 s of a close
def test_max_connections_per_address_over_all_workers(start_broker):
    b = start_broker(workers=2, config={"limits": {"max_connections_per_address": 2}})
    one, two = Raw(b.port), Raw(b.port)
    assert one.request({"op": "ping"}) == {"ok": True} and two.request({"op": "ping"}) == {"ok": True}
    with Raw(b.port) as third:   # the two others are on two workers: the count is the broker's
        assert third.json() == {"ok": False, "error": "max_connections_per_address"}
        assert third.closed()
    with Raw(b.ports["nats"]) as nats:
        assert nats.line() == b"-ERR 'maximum connections exceeded'\r\n" and nats.closed()
    with raw_from(b.port, "127.0.0.2") as other:   # another address has its own count
        assert other.request({"op": "ping"}) == {"ok": True}
    one.close()
    # the close reaches the supervisor at the end of the worker's turn: a reconnect is let in (almost) at once
    closed_at = time.monotonic()
    while True:
        with Raw(b.port) as again:
            reply = again.request({"op": "ping"})
        if reply == {"ok": True} or time.monotonic() - closed_at > 2:
            break
        time.sleep(0.01)
    assert reply == {"ok": True} and time.monotonic() - closed_at < 0.5, reply
    two.close()
    got = breaches(b)
    assert got["max_connections_per_address"] >= 2, got


def test_refusals_reach_only_the_address_over_its_limit(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_connections_per_address": 1}})
    with raw_from(b.port, "127.0.0.3") as a, raw_from(b.port, "127.0.0.4") as c:
        assert a.request({"op": "ping"}) == {"ok": True} and c.request({"op": "ping"}) == {"ok": True}
        with raw_from(b.port, "127.0.0.3") as refused:
            assert refused.json() == {"ok": False, "error": "max_connections_per_address"}


# -- max_connections_per_user ------------------------------------------------------------------------------
def test_max_connections_per_user_over_workers_and_protocols(start_broker):
    b = start_broker(workers=2, config=secure(max_connections_per_user=2))
    first, second = Raw(b.port), Raw(b.port)
    assert first.request({"op": "auth", "user": "alice", "pass": "a"}) == {"ok": True}
    assert second.request({"op": "auth", "user": "alice", "pass": "a"}) == {"ok": True}
    with Raw(b.port) as third:
        assert third.request({"op": "auth", "user": "alice", "pass": "a"}) == \
            {"ok": False, "error": "max_connections_per_user"}
        assert third.closed()
    with NatsRaw(b, connect=b'CONNECT {"verbose":false,"user":"alice","pass":"a"}\r\nPING\r\n') as n:
        assert n.line() == b"-ERR 'maximum account active connections exceeded'\r\n" and n.closed()
    with Raw(b.port) as other:   # another user is counted apart
        assert other.request({"op": "auth", "user": "bob", "pass": "b"}) == {"ok": True}
    # a re-login as the same user is no new session; as another user it moves
    assert first.request({"op": "auth", "user": "alice", "pass": "a"}) == {"ok": True}
    assert first.request({"op": "auth", "user": "bob", "pass": "b"}) == {"ok": True}
    with NatsRaw(b, connect=b'CONNECT {"verbose":false,"user":"alice","pass":"a"}\r\nPING\r\n') as n:
        assert n.line() == b"PONG\r\n"
    second.close()
    first.close()
    assert breaches(b)["max_connections_per_user"] == 2
    assert 'shardbroker_limit_breaches_total{limit="max_connections_per_user",worker="supervisor"} 2.0' in \
        metric_lines(b, "shardbroker_limit_breaches_total")


def test_a_closed_session_frees_its_place_and_a_killed_worker_frees_all_of_its(start_broker):
    b = start_broker(workers=2, config=secure(max_connections_per_user=1))
    c = Raw(b.port)
    assert c.request({"op": "auth", "user": "alice", "pass": "a"}) == {"ok": True}
    os.kill(c.request({"op": "info"})["info"]["pid"], signal.SIGKILL)
    assert c.closed()
    b.wait_log(r"worker \d is back")
    with Raw(b.port) as again:
        assert again.request({"op": "auth", "user": "alice", "pass": "a"}) == {"ok": True}


# -- pending long polls ------------------------------------------------------------------------------------
def _recv(n: NatsRaw, sid: int, inbox: str) -> None:
    body = json.dumps({"batch": 1, "expires": 5_000_000_000}).encode()
    n.send(b"PUB $Q.RECV.jobs %s %d\r\n%s\r\n" % (inbox.encode(), len(body), body))


def _msg(n: NatsRaw) -> tuple[bytes, bytes]:
    head = n.line()
    assert head.startswith(b"MSG "), head
    size = int(head.split()[-1])
    body = n.read_exactly(b"x" * (size + 2))[:-2]
    return head, body


def test_max_pending_polls_per_connection_and_per_worker(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_pending_polls": 2, "max_pending_polls_per_worker": 3}})
    with NatsRaw(b) as n, NatsRaw(b) as m:
        n.send(b"SUB _INBOX.> 1\r\nPING\r\n")
        assert n.line() == b"PONG\r\n"
        for i in range(3):
            _recv(n, 1, f"_INBOX.{i}")
        head, body = _msg(n)   # the third waits for nothing: refused at once, the others wait
        assert head.split()[1] == b"_INBOX.2" and json.loads(body) == \
            {"ok": False, "error": "too_many_waiters", "retry": True}
        m.send(b"SUB _INBOX.> 1\r\nPING\r\n")
        assert m.line() == b"PONG\r\n"
        _recv(m, 1, "_INBOX.m1")   # the worker's third
        _recv(m, 1, "_INBOX.m2")   # its fourth: over the worker's bound
        head, body = _msg(m)
        assert head.split()[1] == b"_INBOX.m2" and json.loads(body)["error"] == "too_many_waiters"
        assert b.varz()["pending_polls"] == 3
        got = breaches(b)
        assert got["max_pending_polls"] == 1 and got["max_pending_polls_per_worker"] == 1, got
    deadline = time.monotonic() + 5   # their connections closed: the polls are forgotten
    while b.varz()["pending_polls"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.varz()["pending_polls"] == 0


def test_ndjson_long_poll_over_the_worker_bound(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_pending_polls_per_worker": 1}})
    with Raw(b.port) as a, Raw(b.port) as c:
        a.send(b'{"op":"qrecv","queue":"jobs","wait_ms":5000}\n')
        time.sleep(0.2)
        assert c.request({"op": "qrecv", "queue": "jobs", "wait_ms": 5000}) == \
            {"ok": False, "error": "too_many_waiters", "retry": True}
        assert c.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"] is True
        assert a.json()["messages"][0]["data"] == 1


# -- the handshake deadline --------------------------------------------------------------------------------
def test_handshake_deadline_in_every_protocol(start_broker):
    b = start_broker(workers=1, config={"limits": {"handshake_timeout": 0.5}, "bridge": {"enabled": True},
                                        "qlite": {"enabled": True}},
                     args=["--bridge-port", "0", "--qlite-port", "0"])
    t0 = time.monotonic()
    with Raw(b.port) as silent, Raw(b.port) as half, Raw(b.port) as talker, NatsRaw(b, connect=None) as n, \
            NatsRaw(b, connect=None) as nhalf, Raw(b.ports["bridge"]) as br, Raw(b.ports["qlite"]) as q:
        half.send(b'{"op":"pi')
        nhalf.send(b"CONNECT {")
        br.send(b"Sabc")
        talker.send(b'{"op":"ping"}\n')
        assert talker.json() == {"ok": True}
        assert silent.json(timeout=3) == {"ok": False, "error": "handshake_timeout"} and silent.closed()
        assert time.monotonic() - t0 >= 0.45
        assert half.json(timeout=3) == {"ok": False, "error": "handshake_timeout"} and half.closed()
        assert n.line(timeout=3) == b"-ERR 'Authentication Timeout'\r\n" and n.closed()
        assert nhalf.line(timeout=3) == b"-ERR 'Authentication Timeout'\r\n" and nhalf.closed()
        assert br.sock.recv(1) == b"F" and br.closed()
        assert q.closed(timeout=3)   # qlite closes without a word, as its original server does
        assert talker.nothing(0.3) and talker.request({"op": "ping"}) == {"ok": True}   # met it: stays
    assert breaches(b)["handshake_timeout"] == 6


# -- payload limits, counted ---------------------------------------------------------------------------------
def test_payload_and_control_line_breaches_are_counted(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_line_bytes": 100}, "nats": {"max_payload": 10}})
    with Raw(b.port) as c:
        c.send(b'{"op":"pub","topic":"a","data":"' + b"x" * 200 + b'"}\n')
        assert c.json() == {"ok": False, "error": "line_too_long"} and c.closed()
    with NatsRaw(b) as n:
        n.send(b"PUB a 11\r\n")
        assert n.line() == b"-ERR 'Maximum Payload Violation'\r\n" and n.closed()
    with NatsRaw(b) as n:
        n.send(b"SUB " + b"a" * 5000 + b" 1\r\n")
        assert n.line() == b"-ERR 'maximum control line exceeded'\r\n" and n.closed()
    got = breaches(b)
    assert got["max_payload"] == 2 and got["max_control_line"] == 1, got


def test_subscriptions_are_bounded_per_party_not_only_per_connection(start_broker):
    """Finding A14: with a bound per connection only, one address's connections multiplied it, and every worker
    held all of their patterns.  A party (a user; with security off, a client address) holds at most
    limits.max_subscriptions_per_user on a worker, over all its connections; another address is not affected."""
    b = start_broker(workers=1, config={"limits": {"max_subscriptions": 40, "max_subscriptions_per_user": 50}})
    greedy = [Raw(b.port, source="127.0.0.8") for _ in range(3)]
    taken = 0
    for i, c in enumerate(greedy):
        for j in range(40):
            reply = c.request({"op": "sub", "topic": f"s.{i}.{j}"})
            taken += reply == {"ok": True}
            assert reply in ({"ok": True}, {"ok": False, "error": "too_many_subscriptions"})
    assert taken == 50
    with Raw(b.port, source="127.0.0.9") as other:
        assert other.request({"op": "sub", "topic": "mine"}) == {"ok": True}
    greedy[0].close()   # its 40 come back to the address
    time.sleep(0.3)
    assert greedy[2].request({"op": "sub", "topic": "again"}) == {"ok": True}
    breaches = b.varz()["breaches"]
    assert breaches["max_subscriptions_per_user"] == 70 and breaches.get("max_subscriptions", 0) == 0, breaches
    for c in greedy[1:]:
        c.close()
