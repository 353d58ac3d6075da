"""qlite's wire protocol (docs/qlite.md).

- ``test_codec_*`` and ``test_config_*``: the sans-IO codec (framing, the handshake's frames, requests) and the
  configuration, without a broker.
- The rest: the real broker with the qlite listener on (``{"qlite": {"enabled": true, "port": 0}}``; its port is
  the ready line's ``qlite=host:port``), real sockets, and a real bcrypt computation on the client's side.
"""

import json
import os
import struct
import threading
import time
import zlib

import bcrypt
import pytest

from shardbroker.cluster.config import ConfigError, load
from shardbroker.workers.protocols.qlite import codec

from support.harness import Raw

QUEUE = "qlite"
SECRETS = {"pub": "pub-secret", "pub2": "pub2-secret", "sub": "sub-secret", "sub2": "sub2-secret"}
TOO_LONG = b"FAIL;error: message is longer than limit of 10 megabytes"
INVALID = b"FAIL;error: password is invalid"
NOT_CORRELATED = (b"FAIL;the key you provided does not correlate to any value being processed, "
                  b"expiration time may have been exceeded")


# -- the codec, without a broker ---------------------------------------------------------------------------------

def test_codec_frames_pipelined_and_fragmented():
    frames = [b"PUSH;a", b"", b"LEN;", b"x" * 70_000]
    wire = b"".join(codec.frame(f) for f in frames)
    d = codec.Deframer()
    assert d.feed(wire) == frames          # all in one read
    assert not d.partial
    boundaries, at = set(), 0
    for f in frames:
        at += 4 + len(f)
        boundaries.add(at)
    d = codec.Deframer()
    got = []
    for i in range(len(wire)):             # one byte at a time
        got += d.feed(wire[i:i + 1])
        assert d.partial == (i + 1 not in boundaries)   # part of a frame is in, or none
    assert got == frames
    d = codec.Deframer()                   # arbitrary splits, across headers
    got = []
    for chunk in (wire[:2], wire[2:9], wire[9:10], wire[10:70_000], wire[70_000:]):
        got += d.feed(chunk)
    assert got == frames and d.frames == 4


def test_codec_frame_limits():
    d = codec.Deframer()
    ok = codec.frame(b"a")
    out = d.feed(ok + struct.pack("<I", codec.MAX_FRAME + 1) + b"zzz" + ok)
    assert out[0] == b"a" and isinstance(out[1], codec.FrameTooLong) and len(out) == 2
    assert out[1].length == codec.MAX_FRAME + 1 and not out[1].first
    assert d.broken and not d.partial and d.feed(ok) == []    # nothing after it is read
    d = codec.Deframer()                   # exactly 10 MiB is allowed: it is waited for
    assert d.feed(struct.pack("<I", codec.MAX_FRAME)) == [] and d.partial
    d = codec.Deframer(first_limit=codec.HANDSHAKE_FRAME_MAX)  # the handshake frame has its own, smaller limit
    out = d.feed(struct.pack("<I", 5000))
    assert isinstance(out[0], codec.FrameTooLong) and out[0].first
    d = codec.Deframer(first_limit=10)     # ... only the first frame
    assert d.feed(codec.frame(b"0123456789") + codec.frame(b"y" * 5000)) == [b"0123456789", b"y" * 5000]


def test_codec_greeting_and_challenge():
    for _ in range(2000):                  # a NUL would be in ~6 % of random 16-byte strings
        challenge = codec.new_challenge()
        assert len(challenge) == 16 and b"\0" not in challenge
    g = codec.greeting(challenge)
    assert g[:4] == b"\x1a\x00\x00\x00" and g[4:14] == b"greetings;" and g[14:] == challenge and len(g) == 30
    assert codec.parse_greeting(g[4:]) == challenge


def test_codec_parse_auth():
    h = b"$2b$10$" + b"a" * 53
    assert codec.parse_auth(b"\x00pub;" + h) == ("publisher", b"pub", h)
    assert codec.parse_auth(b"\x01sub;" + h) == ("subscriber", b"sub", h)
    assert codec.parse_auth(b"\x07sub;" + h)[0] == "subscriber"     # any non-zero byte, as the original
    assert codec.parse_auth(b"\xffsub;")[2] == b""
    for payload, text in ((b"", "error: message is empty"),
                          (b"\x00pub", "error: authentication packet formatted incorrectly"),
                          (b"\x00pub;x;y", "error: authentication packet formatted incorrectly")):
        with pytest.raises(codec.QliteError) as exc:
            codec.parse_auth(payload)
        assert str(exc.value) == text
    assert codec.auth_frame("publisher", b"pub", h)[4:] == b"\x00pub;" + h


def test_codec_bcrypt_hashes():
    real = bcrypt.hashpw(b"s" + b"c" * 16, bcrypt.gensalt(4))
    assert codec.bcrypt_cost(real) == 4 and codec.acceptable_hash(real)
    tail = real[7:]
    for prefix, cost, ok in ((b"$2a$", 10, True), (b"$2y$", 12, True), (b"$2b$", 13, False),
                             (b"$2b$", 31, False), (b"$2b$", 3, False), (b"$2x$", 10, False), (b"$1$x", 10, False)):
        h = prefix + b"%02d$" % cost + tail
        assert codec.acceptable_hash(h) is ok, h
    assert not codec.acceptable_hash(real[:-1]) and not codec.acceptable_hash(real + b"a")
    assert not codec.acceptable_hash(real[:-1] + b";")
    # what the client hashes, cut at 72 bytes as Go does; $2a$/$2y$ verify as $2b$
    secret, challenge = b"k" * 56, codec.new_challenge()
    assert codec.bcrypt_input(secret, challenge) == secret + challenge
    assert codec.bcrypt_input(b"k" * 60, challenge) == b"k" * 60 + challenge[:12]
    h = bcrypt.hashpw(secret + challenge, bcrypt.gensalt(4))
    assert bcrypt.checkpw(codec.bcrypt_input(secret, challenge), codec.normalized_hash(b"$2y$" + h[4:]))


def test_codec_requests():
    assert codec.parse_request(b"PUSH;hello;world") == (b"PUSH", b"hello;world")
    assert codec.parse_request(b"push;") == (b"PUSH", b"")
    assert codec.parse_request(b"hIdE;\x01\x00\x00\x00") == (b"HIDE", b"\x01\x00\x00\x00")
    for payload, text in ((b"PUSH", "no semicolon delimiter found"), (b"", "no semicolon delimiter found"),
                          (b";data", "error: bad request")):
        with pytest.raises(codec.QliteError) as exc:
            codec.parse_request(payload)
        assert str(exc.value) == text
    assert codec.seconds(b"\x05\x00\x00") is None
    assert codec.seconds(b"\x05\x00\x00\x00junk") == 5
    assert codec.poll_args(b"\x05\x00\x00\x00") == (5, 0)
    assert codec.poll_args(b"\x05\x00\x00\x00\x02\x00\x00\x00") == (5, 2)
    assert codec.id_and_u32(b"i" * 16 + b"\x03\x00\x00") is None
    assert codec.id_and_u32(b"i" * 16 + b"\x03\x00\x00\x00") == (b"i" * 16, 3)
    assert codec.unknown_function(b"FOO") == ("error: error can not handle function FOO, options are PUSH, HIDE, "
                                             "POLL, DEL and LEN")
    assert codec.bad_id(15) == "invalid UUID (got 15 bytes)"


def test_codec_replies():
    assert codec.ok() == b"\x05\x00\x00\x00PASS;"
    assert codec.ok(codec.u32(3)) == b"\x09\x00\x00\x00PASS;\x03\x00\x00\x00"
    assert codec.u32(-1) == b"\x00\x00\x00\x00" and codec.u32(1 << 40) == b"\xff\xff\xff\xff"
    assert codec.fail("queue is empty") == b"\x13\x00\x00\x00FAIL;queue is empty"
    assert codec.parse_reply(b"PASS;x") == (True, b"x") and codec.parse_reply(b"FAIL;y") == (False, b"y")
    stat = codec.stat_payload(1, 2, 3, 4, 5)
    assert len(stat) == 24 and codec.parse_stat(stat) == {"visible": 1, "in_flight": 2, "delayed": 3, "dlq": 4,
                                                          "oldest_age_ms": 5}
    assert codec.parse_message(b"r" * 16 + b";body;with;semicolons") == (b"r" * 16, b"body;with;semicolons")


def test_codec_refusal_bytes():
    from shardbroker.workers.protocols.qlite.session import PROTOCOL, REFUSAL

    assert PROTOCOL == "qlite"
    assert REFUSAL is codec.REFUSAL
    assert REFUSAL == codec.frame(b"FAIL;error: the max amount of connections have already been connected")
    from shardbroker.cluster.config.protocols import BY_NAME

    assert BY_NAME["qlite"].refusal == REFUSAL   # what the acceptor writes is the codec's frame


# -- configuration ------------------------------------------------------------------------------------------------

def _load(tmp_path, doc: dict):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    return load(str(path))


def test_config_qlite_defaults_and_queue(tmp_path):
    c = load(None)
    q = c.qlite
    assert (q.enabled, q.bind, q.port, q.queue) == (False, None, 7070, "qlite")
    assert (q.max_publishers, q.max_subscribers, q.max_message_size) == (1, 2, 9437184)
    assert (q.io_timeout, q.max_polling_time, q.max_hidden_time) == (3.0, 10.0, 30)
    assert c.queues.queues == []           # off: no queue of its own
    c = _load(tmp_path, {"qlite": {"enabled": True, "max_hidden_time": 65535, "max_message_size": 5000}})
    assert c.qlite.max_hidden_time == 43200  # clamped to the queues' 12 h
    (d,) = c.queues.queues
    assert (d.name, d.max_message_bytes, d.max_deliveries) == ("qlite", 5000, 0)
    # a queue configured by name keeps its own settings
    c = _load(tmp_path, {"qlite": {"enabled": True, "queue": "jobs"},
                         "queues": {"queues": [{"name": "jobs", "max_deliveries": 3}]}})
    assert [(d.name, d.max_deliveries) for d in c.queues.queues] == [("jobs", 3)]
    with pytest.raises(ConfigError, match=r"qlite\.queue"):
        _load(tmp_path, {"qlite": {"enabled": True, "queue": "a.*"}})
    with pytest.raises(ConfigError, match=r"qlite\.max_message_size"):
        _load(tmp_path, {"qlite": {"max_message_size": (10 << 20) + 1}})


def test_config_qlite_secret(tmp_path):
    def users(**u):
        return {"security": {"users": [{"username": "q", **u}]}}

    c = _load(tmp_path, users(qlite_secret="s" * 56))
    assert c.security.users[0].qlite_secret == "s" * 56
    with pytest.raises(ConfigError, match=r"security\.users\[0\]\.qlite_secret: must be at most 56 bytes"):
        _load(tmp_path, users(qlite_secret="s" * 57))
    with pytest.raises(ConfigError, match=r"at most 56 bytes \(UTF-8\), got 58"):
        _load(tmp_path, users(qlite_secret="é" * 29))
    for bad in ("", "a\0b"):
        with pytest.raises(ConfigError, match="qlite_secret"):
            _load(tmp_path, users(qlite_secret=bad))


def test_config_registry_carries_qlite_secret(tmp_path):
    from shardbroker.cluster.config import has_qlite_secrets, without_plaintext_passwords
    from shardbroker.cluster.security.users import Registry, from_config

    # Spaces and "!" are outside the password hash's alphabet: a short secret like "qs" turned up inside the random
    # hash's base64 now and then, and the test failed with nothing wrong.
    secret = "the qlite secret!"
    c = _load(tmp_path, {"security": {"iterations": 1000, "users": [
        {"username": "q", "password": "pw", "qlite_secret": secret}, {"username": "plain", "password": "pw"}]}})
    assert has_qlite_secrets(c)
    registry = Registry.from_snapshot(from_config(c.security).snapshot())   # as the workers get it
    assert registry.get("q").qlite_secret == secret and registry.get("plain").qlite_secret is None
    assert secret not in repr(registry.get("q"))
    stripped = without_plaintext_passwords(c)
    assert [u.qlite_secret for u in stripped.security.users] == [None, None]


# -- a qlite client ------------------------------------------------------------------------------------------------

class Q(Raw):
    """A qlite client over a real socket."""

    def frame(self, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            if len(self.buf) >= 4:
                n = struct.unpack_from("<I", self.buf)[0]
                if len(self.buf) >= 4 + n:
                    payload, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete frame; have {self.buf[:200]!r}")
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError(f"closed; have {self.buf[:200]!r}")
            self.buf += data

    def greeting(self) -> bytes:
        return codec.parse_greeting(self.frame())

    def call(self, fn: str, data: bytes = b"", timeout: float | None = None) -> bytes:
        self.send(codec.request(fn, data))
        return self.frame(timeout)


def qport(broker) -> int:
    assert "qlite" in broker.ports, f"no qlite listener in the ready line (not wired yet?): {broker.ports}"
    return broker.ports["qlite"]


def answer(challenge: bytes, user: str, secret: str, role: int = 0, cost: int = 10) -> bytes:
    """The client's auth frame: bcrypt(secret ‖ challenge), as a qlite client computes it."""
    hashed = bcrypt.hashpw(codec.bcrypt_input(secret.encode(), challenge), bcrypt.gensalt(cost))
    return codec.auth_frame(role, user.encode(), hashed)


def connect(broker, user: str, role: int = 0, secret: str | None = None, cost: int = 10) -> Q:
    conn = Q(qport(broker))
    conn.send(answer(conn.greeting(), user, SECRETS[user] if secret is None else secret, role, cost))
    reply = conn.frame()
    assert reply == b"PASS;", reply
    return conn


def publisher(broker, user: str = "pub") -> Q:
    return connect(broker, user, 0)


def subscriber(broker, user: str = "sub") -> Q:
    return connect(broker, user, 1)


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def qconfig(security: dict | None = None, **qlite) -> dict:
    users = [{"username": name, "qlite_secret": secret} for name, secret in SECRETS.items()]
    users.append({"username": "nosecret", "password": "pw"})
    return {"qlite": {"enabled": True, "port": 0, **qlite},
            "security": security or {"iterations": 1000, "users": users}}


def push(conn: Q, body: bytes) -> int:
    reply = conn.call("PUSH", body)
    assert reply[:5] == b"PASS;" and len(reply) == 9, reply
    return struct.unpack("<I", reply[5:])[0]


def hide(conn: Q, seconds: int = 30) -> tuple[bytes, bytes]:
    reply = conn.call("HIDE", u32(seconds))
    assert reply[:5] == b"PASS;", reply
    return codec.parse_message(reply[5:])


def length(conn: Q) -> int:
    reply = conn.call("LEN")
    assert reply[:5] == b"PASS;" and len(reply) == 9, reply
    return struct.unpack("<I", reply[5:])[0]


def ndjson(broker, obj: dict) -> dict:
    with Raw(broker.port) as conn:
        return conn.request(obj)


# -- the handshake ------------------------------------------------------------------------------------------------

def test_login_pass_and_failures(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with Q(qport(b)) as conn:
        first = conn.frame()
        assert len(first) == 26 and first[:10] == b"greetings;" and b"\0" not in first[10:]
        conn.send(answer(first[10:], "pub", SECRETS["pub"]))
        assert conn.frame() == b"PASS;"
        assert length(conn) == 0
    # a wrong secret, an unknown user, a user without a qlite_secret: the same answer, then the close
    for user, secret in (("pub", "wrong"), ("nobody", "x"), ("nosecret", "pw")):
        with Q(qport(b)) as conn:
            conn.send(answer(conn.greeting(), user, secret))
            assert conn.frame() == INVALID, user
            assert conn.closed(), user
    # each connection has its own challenge: an answer to another one fails
    with Q(qport(b)) as one, Q(qport(b)) as two:
        c1, c2 = one.greeting(), two.greeting()
        assert c1 != c2
        two.send(answer(c1, "pub", SECRETS["pub"]))
        assert two.frame() == INVALID
    # malformed login frames
    for payload, text in ((b"", b"FAIL;error: message is empty"),
                          (b"\x00pub", b"FAIL;error: authentication packet formatted incorrectly"),
                          (b"\x00pub;a;b", b"FAIL;error: authentication packet formatted incorrectly")):
        with Q(qport(b)) as conn:
            conn.greeting()
            conn.send(codec.frame(payload))
            assert conn.frame() == text
            assert conn.closed()


@pytest.mark.exclusive   # refused within 0.5 s
def test_expensive_or_foreign_hashes_are_refused_without_bcrypt(start_broker):
    b = start_broker(workers=1, config=qconfig())
    tail = bcrypt.hashpw(b"x", bcrypt.gensalt(4))[7:]
    for fake in (b"$2b$13$" + tail, b"$2b$31$" + tail, b"$2x$10$" + tail, b"$2b$03$" + tail, b"plaintext"):
        with Q(qport(b)) as conn:
            conn.greeting()
            started = time.monotonic()
            conn.send(codec.auth_frame(0, b"pub", fake))
            assert conn.frame() == INVALID, fake
            assert time.monotonic() - started < 0.5, fake   # cost 31 would take days
            assert conn.closed()
    # a real cost-12 hash (the highest accepted) and a $2y$ one pass
    with Q(qport(b)) as conn:
        conn.send(answer(conn.greeting(), "pub", SECRETS["pub"], cost=12))
        assert conn.frame() == b"PASS;"
    with Q(qport(b)) as conn:
        challenge = conn.greeting()
        hashed = bcrypt.hashpw(SECRETS["sub"].encode() + challenge, bcrypt.gensalt(4))
        conn.send(codec.auth_frame(1, b"sub", b"$2y$" + hashed[4:]))
        assert conn.frame() == b"PASS;"


def test_any_nonzero_role_byte_is_a_subscriber(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with connect(b, "sub", role=7) as conn:
        assert conn.call("PUSH", b"x") == b"FAIL;subscribers cannot push to the queue"
        assert conn.call("HIDE", u32(5)) == b"FAIL;queue is empty"


def test_handshake_pipelined_with_requests_and_fragmented(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with Q(qport(b)) as conn:   # the login and two requests in one write
        conn.send(answer(conn.greeting(), "pub", SECRETS["pub"]) + codec.request("PUSH", b"a")
                  + codec.request("LEN"))
        assert conn.frame() == b"PASS;"
        assert conn.frame() == b"PASS;" + u32(1)
        assert conn.frame() == b"PASS;" + u32(1)
    with Q(qport(b)) as conn:   # everything one byte at a time
        wire = answer(conn.greeting(), "sub", SECRETS["sub"], role=1) + codec.request("HIDE", u32(10))
        for i in range(len(wire)):
            conn.send(wire[i:i + 1])
            time.sleep(0.001)
        assert conn.frame() == b"PASS;"
        receipt, body = codec.parse_message(conn.frame()[5:])
        assert body == b"a"
        wire = codec.request("DEL", receipt)
        for i in range(len(wire)):
            conn.send(wire[i:i + 1])
        assert conn.frame() == b"PASS;" + receipt


def test_handshake_and_frame_deadlines(start_broker):
    b = start_broker(workers=2, config=qconfig(io_timeout=0.3))
    with Q(qport(b)) as conn:   # no login within 3 x io_timeout: closed without a word
        conn.greeting()
        started = time.monotonic()
        assert conn.closed(3)
        assert 0.7 < time.monotonic() - started < 2.5 and conn.buf == b""
    with publisher(b) as conn:
        time.sleep(1.2)         # idle, well past 3 x io_timeout: still there
        assert length(conn) == 0
        conn.send(codec.request("LEN")[:3])   # a frame begun and not finished within io_timeout
        started = time.monotonic()
        assert conn.closed(3)
        assert 0.2 < time.monotonic() - started < 2.0 and conn.buf == b""
    with publisher(b) as conn:  # a slow frame is fine while each one arrives in time
        for _ in range(3):
            wire = codec.request("LEN")
            conn.send(wire[:3])
            time.sleep(0.1)
            conn.send(wire[3:])
            assert conn.frame() == b"PASS;" + u32(0)


# -- requests --------------------------------------------------------------------------------------------------

def test_publisher_push_and_len(start_broker):
    b = start_broker(workers=2, config=qconfig(max_message_size=1000))
    with publisher(b) as conn:
        assert [push(conn, b"m%d" % i) for i in range(3)] == [1, 2, 3]
        assert length(conn) == 3
        assert conn.call("push", b"lower-case verb") == b"PASS;" + u32(4)
        assert conn.call("PUSH") == b"FAIL;cannot push empty message"
        assert conn.call("PUSH", b"x" * 1001) == b"FAIL;message exceeds acceptable message size"
        assert push(conn, b"x" * 1000) == 5
        assert conn.call("FOO", b"x") == (b"FAIL;error: error can not handle function FOO, options are PUSH, HIDE, "
                                          b"POLL, DEL and LEN")
        assert conn.call("len") == b"PASS;" + u32(5)
    stat = ndjson(b, {"op": "qstat", "queue": QUEUE})["stat"]
    assert (stat["visible"], stat["pushed"]) == (5, 5)


def test_subscriber_hide_del_round_trip(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with publisher(b) as pub, subscriber(b) as sub:
        push(pub, b"hello;world\0")
        push(pub, b"second")
        receipt, body = hide(sub, 30)
        assert body == b"hello;world\0" and len(receipt) == 16
        assert b";" not in receipt and b"\0" not in receipt
        assert length(sub) == 1 and length(pub) == 1
        assert sub.call("DEL", receipt) == b"PASS;" + receipt
        assert sub.call("DEL", receipt) == NOT_CORRELATED          # a second DEL fails, as the original
        assert sub.call("DEL", os.urandom(16)) == NOT_CORRELATED
        assert sub.call("DEL", receipt[:15]) == b"FAIL;invalid UUID (got 15 bytes)"
        assert hide(sub)[1] == b"second"
        assert sub.call("HIDE", u32(30)) == b"FAIL;queue is empty"


def test_hide_expiry_redelivers_with_a_new_receipt(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with publisher(b) as pub, subscriber(b) as sub:
        push(pub, b"job")
        first, body = hide(sub, 1)
        assert sub.call("HIDE", u32(1)) == b"FAIL;queue is empty"
        time.sleep(1.2)
        second, again = hide(sub, 5)
        assert again == b"job" and second != first
        assert sub.call("DEL", first) == NOT_CORRELATED             # the stale receipt
        assert sub.call("DEL", second) == b"PASS;" + second


def test_hidden_time_limits_and_short_data(start_broker):
    b = start_broker(workers=2, config=qconfig(max_hidden_time=20))
    with publisher(b) as pub, subscriber(b) as sub:
        push(pub, b"x")
        assert sub.call("HIDE", u32(21)) == b"FAIL;provided hidden duration is longer then the max viable time"
        assert sub.call("POLL", u32(21)) == b"FAIL;provided hidden duration is longer then the max viable time"
        for fn in ("HIDE", "POLL"):
            assert sub.call(fn, b"\x05\x00\x00") == b"FAIL;hidden time must be a 4 byte little endian uint32"
            assert sub.call(fn) == b"FAIL;hidden time must be a 4 byte little endian uint32"
        receipt, body = hide(sub, 20)                                # equality is allowed
        assert body == b"x"
        assert sub.call("DEL", receipt) == b"PASS;" + receipt       # the connection lived through it all


def test_requests_pipelined_in_one_write_are_answered_in_order(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with publisher(b) as pub, subscriber(b) as sub:
        pub.send(codec.request("PUSH", b"a") + codec.request("PUSH", b"b") + codec.request("LEN")
                 + codec.frame(b"XYZ;1") + codec.frame(b"no-separator") + codec.frame(b";x")
                 + codec.request("HIDE", u32(5)) + codec.request("PUSH", b"c"))
        assert [pub.frame() for _ in range(8)] == [
            b"PASS;" + u32(1), b"PASS;" + u32(2), b"PASS;" + u32(2),
            b"FAIL;error: error can not handle function XYZ, options are PUSH, HIDE, POLL, DEL and LEN",
            b"FAIL;no semicolon delimiter found", b"FAIL;error: bad request",
            b"FAIL;publishers cannot hide messages on the queue", b"PASS;" + u32(3)]
        sub.send(codec.request("HIDE", u32(30)) * 4 + codec.request("LEN"))
        replies = [sub.frame() for _ in range(5)]
        assert [codec.parse_message(r[5:])[1] for r in replies[:3]] == [b"a", b"b", b"c"]
        assert replies[3:] == [b"FAIL;queue is empty", b"PASS;" + u32(0)]


def test_poll_waits_for_a_push_from_another_connection(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with subscriber(b) as sub, publisher(b) as pub:
        started = time.monotonic()
        sub.send(codec.request("POLL", u32(30)))
        assert sub.nothing(0.3)
        push(pub, b"late")
        receipt, body = codec.parse_message(sub.frame(5)[5:])
        assert body == b"late" and time.monotonic() - started < 3
        # an NDJSON client pushing to the same queue name: a string arrives as its UTF-8 bytes, any other
        # JSON value as its JSON encoding
        sub.send(codec.request("POLL", u32(30)))
        assert sub.nothing(0.2)
        assert ndjson(b, {"op": "qpush", "queue": QUEUE, "data": "from ndjson"})["ok"] is True
        assert codec.parse_message(sub.frame(5)[5:])[1] == b"from ndjson"
        assert ndjson(b, {"op": "qpush", "queue": QUEUE, "data": {"a": [1, 2]}})["ok"] is True
        assert codec.parse_message(sub.call("POLL", u32(30))[5:])[1] == b'{"a":[1,2]}'
        # and an NDJSON consumer receives what qlite pushed (bytes that are UTF-8: a JSON string)
        push(pub, b"to ndjson")
        got = ndjson(b, {"op": "qrecv", "queue": QUEUE})["messages"]
        assert [m["data"] for m in got] == ["to ndjson"]


def test_poll_times_out_with_the_original_text(start_broker):
    b = start_broker(workers=2, config=qconfig(max_polling_time=2))
    with subscriber(b) as sub:
        started = time.monotonic()
        assert sub.call("POLL", u32(5) + u32(1), timeout=5) == (
            b"FAIL;error: no data could be dequeued in the specified time period")
        assert 0.9 < time.monotonic() - started < 1.8                # our optional wait, under the maximum
        started = time.monotonic()
        assert sub.call("POLL", u32(5) + u32(60), timeout=5).startswith(b"FAIL;error: no data")
        assert 1.9 < time.monotonic() - started < 2.8                # capped by max_polling_time
        started = time.monotonic()
        assert sub.call("POLL", u32(5), timeout=5).startswith(b"FAIL;error: no data")
        assert 1.9 < time.monotonic() - started < 2.8


def test_oversized_frames(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with publisher(b) as pub:
        # exactly 10 MiB is read in full, and refused as too large a message; the connection stays
        pub.send(codec.frame(b"PUSH;" + b"x" * (codec.MAX_FRAME - 5)))
        assert pub.frame(20) == b"FAIL;message exceeds acceptable message size"
        assert length(pub) == 0
        pub.send(struct.pack("<I", codec.MAX_FRAME + 1) + b"PUSH;")
        assert pub.frame() == TOO_LONG
        assert pub.closed()
    with Q(qport(b)) as conn:   # also as the first frame
        conn.greeting()
        conn.send(struct.pack("<I", 0xFFFFFFFF))
        assert conn.frame() == TOO_LONG
        assert conn.closed()
    assert b.varz()["breaches"]["max_payload"] == 3   # each counted, as every protocol's payload limit


def test_role_violations_keep_the_connection(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with publisher(b) as pub, subscriber(b) as sub:
        for fn, data, text in (("HIDE", u32(1), b"publishers cannot hide messages on the queue"),
                               ("POLL", u32(1), b"publishers cannot poll the queue"),
                               ("DEL", b"r" * 16, b"publishers cannot delete hidden messages"),
                               ("EXT", b"r" * 16 + u32(1), b"publishers cannot extend hidden messages"),
                               ("NACK", b"r" * 16 + u32(1), b"publishers cannot return hidden messages"),
                               ("STAT", b"", b"publishers cannot read the queue's statistics")):
            assert pub.call(fn, data) == b"FAIL;" + text
        assert sub.call("PUSH", b"x") == b"FAIL;subscribers cannot push to the queue"
        assert push(pub, b"ok") == 1 and length(sub) == 1


def test_connection_limits_are_the_brokers(start_broker):
    b = start_broker(workers=2, config=qconfig())   # every qlite connection is on the queue's owner: one set of seats
    pub = publisher(b)
    with Q(qport(b)) as conn:
        conn.send(answer(conn.greeting(), "pub2", SECRETS["pub2"]))
        assert conn.frame() == b"FAIL;error: the max amount of publishers have already been connected"
        assert conn.closed()
    subs = [subscriber(b, "sub"), subscriber(b, "sub2")]
    with Q(qport(b)) as conn:
        conn.send(answer(conn.greeting(), "sub", SECRETS["sub"], role=1))
        assert conn.frame() == b"FAIL;error: the max amount of subscribers have already been connected"
        assert conn.closed()
    pub.close()                                     # its seat is free again once its close is seen
    deadline = time.monotonic() + 5
    while True:
        with Q(qport(b)) as conn:
            conn.send(answer(conn.greeting(), "pub2", SECRETS["pub2"], cost=4))
            if conn.frame() == b"PASS;":
                assert push(conn, b"x") == 1
                break
        assert time.monotonic() < deadline, "the publisher's seat was never freed"
        time.sleep(0.05)
    for s in subs:
        s.close()


def test_extensions_ext_nack_stat(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with publisher(b) as pub, subscriber(b) as sub:
        empty = codec.parse_stat(sub.call("STAT")[5:])
        assert empty == {"visible": 0, "in_flight": 0, "delayed": 0, "dlq": 0, "oldest_age_ms": 0}
        push(pub, b"one")
        push(pub, b"two")
        time.sleep(0.05)
        receipt, body = hide(sub, 1)
        assert body == b"one"
        assert sub.call("EXT", receipt + u32(30)) == b"PASS;" + receipt
        time.sleep(1.2)                              # past the first deadline: the extension holds
        stat = codec.parse_stat(sub.call("STAT")[5:])
        assert (stat["visible"], stat["in_flight"], stat["delayed"], stat["dlq"]) == (1, 1, 0, 0)
        assert stat["oldest_age_ms"] >= 1000
        assert sub.call("NACK", receipt + u32(0)) == b"PASS;" + receipt       # back at once
        assert sub.call("NACK", receipt + u32(0)) == NOT_CORRELATED
        assert sub.call("EXT", receipt + u32(5)) == NOT_CORRELATED
        assert length(sub) == 2
        receipt, body = hide(sub, 30)
        assert body == b"one"                        # it kept its place
        assert sub.call("NACK", receipt + u32(1)) == b"PASS;" + receipt       # back after a second
        stat = codec.parse_stat(sub.call("STAT")[5:])
        assert (stat["visible"], stat["in_flight"], stat["delayed"]) == (1, 0, 1)
        assert sub.call("EXT", receipt[:8]) == (b"FAIL;error: EXT needs a 16 byte id followed by a 4 byte little "
                                               b"endian uint32")
        assert sub.call("NACK", receipt) == (b"FAIL;error: NACK needs a 16 byte id followed by a 4 byte little "
                                            b"endian uint32")
        assert sub.call("NACK", receipt + u32(43201)) == (b"FAIL;error: the delay is longer than the max of "
                                                         b"43200 seconds")
        r2, _ = hide(sub, 30)
        assert sub.call("EXT", r2 + u32(31)) == b"FAIL;provided hidden duration is longer then the max viable time"
        time.sleep(1.1)
        assert length(sub) == 1


def test_security_on_roles_need_permissions(start_broker):
    users = [{"username": "pub", "password": "pw", "qlite_secret": SECRETS["pub"], "permissions": ["publish:qlite"]},
             {"username": "sub", "password": "pw", "qlite_secret": SECRETS["sub"],
              "permissions": ["subscribe:qlite"]},
             {"username": "pub2", "password": "pw", "qlite_secret": SECRETS["pub2"],
              "permissions": ["publish:other", "subscribe:other"]}]
    security = {"enabled": True, "iterations": 1000, "admin_user": {"username": "admin", "password": "pw"},
                "users": users}
    b = start_broker(workers=2, config=qconfig(security=security))
    for user, role, text in (("pub", 1, b"FAIL;error: user does not have the subscriber role"),
                             ("sub", 0, b"FAIL;error: user does not have the publisher role"),
                             ("pub2", 0, b"FAIL;error: user does not have the publisher role"),
                             ("pub", 0, b"PASS;"), ("sub", 1, b"PASS;")):
        with Q(qport(b)) as conn:
            conn.send(answer(conn.greeting(), user, SECRETS[user], role))
            assert conn.frame() == text, (user, role)
            if text != b"PASS;":
                assert conn.closed()
    with Q(qport(b)) as conn:                       # the PBKDF2 password is not a qlite secret
        conn.send(answer(conn.greeting(), "pub", "pw"))
        assert conn.frame() == INVALID


def test_a_poll_cancelled_by_its_close_leases_nothing(start_broker):
    b = start_broker(workers=2, config=qconfig())
    with publisher(b) as pub:
        sub = subscriber(b)
        sub.send(codec.request("POLL", u32(30)))
        time.sleep(0.2)
        sub.close()                                  # the wait is cancelled: nothing is leased to it
        time.sleep(0.2)
        push(pub, b"kept")
        with subscriber(b) as other:
            assert hide(other)[1] == b"kept"


def test_many_subscribers_share_the_work_once_each(start_broker):
    b = start_broker(workers=2, config=qconfig(max_subscribers=4))
    subs = [subscriber(b, "sub") for _ in range(4)]
    got: list[bytes] = []
    lock = threading.Lock()

    def consume(conn: Q) -> None:
        while True:
            reply = conn.call("POLL", u32(30) + u32(1), timeout=5)
            if not reply.startswith(b"PASS;"):
                return
            receipt, body = codec.parse_message(reply[5:])
            assert conn.call("DEL", receipt) == b"PASS;" + receipt
            with lock:
                got.append(body)

    threads = [threading.Thread(target=consume, args=(s,)) for s in subs]
    for t in threads:
        t.start()
    with publisher(b) as pub:
        pub.send(b"".join(codec.request("PUSH", b"%d" % i) for i in range(200)))
        replies = [pub.frame() for _ in range(200)]
        assert all(r.startswith(b"PASS;") for r in replies)
    for t in threads:
        t.join(15)
    assert sorted(got, key=int) == [b"%d" % i for i in range(200)]
    for s in subs:
        s.close()


def test_connections_go_to_the_queues_owner(start_broker):
    """Whatever the acceptor's balance would say: 2 workers, 5 connections, each on the owner of the queue (which
    is worker 1 for one name and worker 0 for the other), so no request of theirs crosses to another worker."""
    for queue in ("qlite", "work"):
        b = start_broker(workers=2, config=qconfig(queue=queue))
        conns = [publisher(b), subscriber(b, "sub"), subscriber(b, "sub2"), Q(qport(b)), Q(qport(b))]
        try:
            conns[3].greeting()
            conns[4].greeting()
            status, page = b.http("/connz?limit=100")
            workers = [c["worker"] for c in page["connections"] if c["type"] == "qlite"]
            assert status == 200 and workers == [zlib.crc32(queue.encode()) % 2] * 5, (queue, page)
            assert push(conns[0], b"here") == 1 and hide(conns[1])[1] == b"here"
        finally:
            for c in conns:
                c.close()
            b.close()


def test_connections_in_their_handshake_are_capped_per_worker(start_broker):
    from shardbroker.workers.protocols.qlite.session import MAX_HANDSHAKES, MAX_HANDSHAKES_PER_ADDRESS

    b = start_broker(workers=1, config=qconfig())
    waiting = []
    try:
        for i in range(MAX_HANDSHAKES):   # from as many addresses as the cap per address needs
            conn = Q(qport(b), source=f"127.0.0.{10 + i // MAX_HANDSHAKES_PER_ADDRESS}")
            conn.greeting()
            waiting.append(conn)
        with Q(qport(b), source="127.0.0.200") as extra:
            assert extra.frame() == b"FAIL;error: the max amount of connections have already been connected"
            assert extra.closed()
        waiting.pop().close()                       # a place comes free
        deadline = time.monotonic() + 5
        while True:
            with Q(qport(b)) as conn:
                if conn.frame()[:10] == b"greetings;":
                    break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with publisher(b) as pub:                   # the free place takes a login
            assert length(pub) == 0
    finally:
        for conn in waiting:
            conn.close()


def test_one_address_holds_only_a_few_handshakes(start_broker):
    """Finding A15: 70 idle connections from one address held every handshake seat (64), and every qlite login
    was refused, again each time they reconnected."""
    from shardbroker.workers.protocols.qlite.session import MAX_HANDSHAKES_PER_ADDRESS

    b = start_broker(workers=1, config=qconfig())
    idle = []
    try:
        for _ in range(MAX_HANDSHAKES_PER_ADDRESS):
            conn = Q(qport(b), source="127.0.0.7")
            conn.greeting()
            idle.append(conn)
        for _ in range(62):   # the rest refused at once
            with Q(qport(b), source="127.0.0.7") as extra:
                assert extra.frame() == b"FAIL;error: the max amount of connections have already been connected"
        with publisher(b) as pub:                   # from another address: in, at once
            assert length(pub) == 0
    finally:
        for conn in idle:
            conn.close()


def test_failed_logins_block_the_address(start_broker):
    config = qconfig()
    config["security"].update(failures_per_address=2, block_duration=60)
    b = start_broker(workers=2, config=config)
    for _ in range(2):
        with Q(qport(b)) as conn:
            conn.send(answer(conn.greeting(), "pub", "wrong", cost=4))
            assert conn.frame() == INVALID
    deadline = time.monotonic() + 5
    while True:   # the supervisor tells every worker; then even the right secret is refused, unchecked
        with Q(qport(b)) as conn:
            conn.send(answer(conn.greeting(), "pub", SECRETS["pub"], cost=4))
            if conn.frame() == INVALID:
                break
        assert time.monotonic() < deadline, "the address was never blocked"
        time.sleep(0.05)
