"""Jolt's NDJSON protocol, over raw sockets, against the real broker."""

import json

import pytest

from support.harness import Raw


def on_worker(port: int, worker: int, others: list) -> Raw:
    """A raw connection that landed on ``worker`` (the acceptor balances by live connections)."""
    for _ in range(16):
        conn = Raw(port)
        if conn.request({"op": "info"})["info"]["worker"] == worker:
            return conn
        others.append(conn)
    raise AssertionError(f"no connection landed on worker {worker}")


def test_readme_insecure_transcript_byte_for_byte(broker):
    spare = []
    a = on_worker(broker.port, 0, spare)
    b = on_worker(broker.port, 1, spare)  # publisher and subscriber on different workers
    a.send(b'{"op":"sub","topic":"chat.room1"}\n')
    assert a.line() == b'{"ok":true}\n'
    b.send(b'{"op":"pub","topic":"chat.room1","data":"hello world"}\n')
    assert b.line() == b'{"ok":true}\n'
    assert a.line() == b'{"topic":"chat.room1","data":"hello world"}\n'
    assert b.nothing()


MALFORMED = [
    # (input bytes, exact reply, connection stays open)
    (b'{"op":"pub","topic":"t","data":1\n', b'{"ok":false,"error":"invalid_json"}\n', True),
    (b'hello\n', b'{"ok":false,"error":"invalid_json"}\n', True),
    (b'[1,2,3]\n', b'{"ok":false,"error":"invalid_json"}\n', True),
    (b'"op"\n', b'{"ok":false,"error":"invalid_json"}\n', True),
    (b'{"op":"pub","topic":"t","data":"\xff\xfe"}\n', b'{"ok":false,"error":"invalid_json"}\n', True),
    (b'{"op":"fly"}\n', b'{"ok":false,"error":"unknown_op"}\n', True),
    (b'{"topic":"t"}\n', b'{"ok":false,"error":"unknown_op"}\n', True),
    (b'{"op":["pub"]}\n', b'{"ok":false,"error":"unknown_op"}\n', True),
    (b'{"op":"pub","data":1}\n', b'{"ok":false,"error":"missing_topic"}\n', True),
    (b'{"op":"sub","topic":""}\n', b'{"ok":false,"error":"missing_topic"}\n', True),
    (b'{"op":"sub","topic":"a..b"}\n', b'{"ok":false,"error":"invalid_topic"}\n', True),
    (b'{"op":"sub","topic":"a b"}\n', b'{"ok":false,"error":"invalid_topic"}\n', True),
    (b'{"op":"sub","topic":"a.>.b"}\n', b'{"ok":false,"error":"invalid_topic"}\n', True),
    (b'{"op":"sub","topic":42}\n', b'{"ok":false,"error":"invalid_topic"}\n', True),
    (b'{"op":"pub","topic":"chat.*","data":1}\n', b'{"ok":false,"error":"invalid_topic"}\n', True),
    (b'{"op":"pub","topic":".chat","data":1}\n', b'{"ok":false,"error":"invalid_topic"}\n', True),
]


@pytest.mark.parametrize("data,reply,stays_open", MALFORMED, ids=[m[0][:30].decode(errors="replace")
                                                                  for m in MALFORMED])
def test_malformed_input_gets_exact_reply(broker, data, reply, stays_open):
    with Raw(broker.port) as c:
        c.send(data)
        assert c.line() == reply
        c.send(b'{"op":"ping"}\n')
        assert c.line() == b'{"ok":true}\n'


def test_empty_and_blank_lines_are_ignored(broker):
    with Raw(broker.port) as c:
        c.send(b'\n\r\n   \n{"op":"ping","id":1}\n')
        assert c.line() == b'{"ok":true,"id":1}\n'
        assert c.nothing()


def test_over_long_line_is_refused_and_closed(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_line_bytes": 1024}})
    with Raw(b.port) as bystander, Raw(b.port) as c:
        bystander.request({"op": "sub", "topic": "still.here"})
        c.send(b'{"op":"ping"}\n' + b'{"op":"pub","topic":"t","data":"' + b"x" * 2000 + b'"}\n')
        assert c.line() == b'{"ok":true}\n'
        assert c.line() == b'{"ok":false,"error":"line_too_long"}\n'
        assert c.closed()
        # The limit also holds for a line still without its newline: memory stays bounded.
        with Raw(b.port) as d:
            d.send(b"x" * 1500)
            assert d.line() == b'{"ok":false,"error":"line_too_long"}\n'
            assert d.closed()
        with Raw(b.port) as p:
            assert p.request({"op": "pub", "topic": "still.here", "data": 1}) == {"ok": True}
        assert bystander.json() == {"topic": "still.here", "data": 1}


def test_line_at_the_limit_is_accepted(start_broker):
    b = start_broker(workers=1, config={"limits": {"max_line_bytes": 1024}})
    with Raw(b.port) as c:
        head = b'{"op":"pub","topic":"t","data":"'
        line = head + b"x" * (1024 - len(head) - 2) + b'"}'
        assert len(line) == 1024
        c.send(line + b"\n")
        assert c.line() == b'{"ok":true}\n'


def test_publisher_receives_its_own_message_after_delivery_order(broker):
    with Raw(broker.port) as c:
        assert c.request({"op": "sub", "topic": "self.echo"}) == {"ok": True}
        c.send(b'{"op":"pub","topic":"self.echo","data":{"n":1}}\n')
        got = [c.json(), c.json()]
        assert {"topic": "self.echo", "data": {"n": 1}} in got
        assert {"ok": True} in got


def test_cmd_alias_and_id_echo(broker):
    with Raw(broker.port) as c:
        c.send(b'{"cmd":"sub","topic":"alias.t","id":"s1"}\n')
        assert c.json() == {"ok": True, "id": "s1"}
        c.send(b'{"cmd":"pub","topic":"alias.t","data":[1,{"a":null}],"id":2}\n')
        got = [c.json(), c.json()]
        assert {"ok": True, "id": 2} in got
        assert {"topic": "alias.t", "data": [1, {"a": None}]} in got
        c.send(b'{"op":"nope","id":{"k":[1]}}\n')
        assert c.json() == {"ok": False, "error": "unknown_op", "id": {"k": [1]}}


@pytest.mark.parametrize("data", [
    "text", "", "h\u00e9llo \u2603 \U0001f600", 0, -7, 3.25, 1e300, True, False, None, [], {},
    {"nested": {"deep": [1, [2, [3, {"x": "y"}]]]}},
    18446744073709551615, -9223372036854775808, 123456789012345678901234567890,
    [123456789012345678901234567890, -98765432109876543210987654321],
])
def test_data_passes_through_unchanged(broker, data):
    with Raw(broker.port) as c:
        c.request({"op": "sub", "topic": "pass.through"})
        raw_data = json.dumps(data, ensure_ascii=False)
        c.send(b'{"op":"pub","topic":"pass.through","data":' + raw_data.encode() + b"}\n")
        lines = [c.line(), c.line()]
        delivery = next(line for line in lines if line.startswith(b'{"topic"'))
        assert json.loads(delivery) == {"topic": "pass.through", "data": data}


def test_many_requests_in_one_packet_and_one_request_split_across_packets(broker):
    with Raw(broker.port) as sub, Raw(broker.port) as pub:
        sub.request({"op": "sub", "topic": "frag.t"})
        batch = b"".join(b'{"op":"pub","topic":"frag.t","data":%d,"id":%d}\n' % (i, i) for i in range(200))
        pub.send(batch)
        assert [pub.json()["id"] for _ in range(200)] == list(range(200))
        assert [sub.json()["data"] for _ in range(200)] == list(range(200))
        one = b'{"op":"pub","topic":"frag.t","data":"split \xc3\xa9 across"}\n'
        for i in range(len(one)):  # one byte per packet, through a multi-byte UTF-8 character
            pub.send(one[i:i + 1])
        assert pub.line() == b'{"ok":true}\n'
        assert sub.json() == {"topic": "frag.t", "data": "split \u00e9 across"}


def test_unsub_stops_deliveries_and_is_idempotent(broker):
    with Raw(broker.port) as c, Raw(broker.port) as p:
        c.request({"op": "sub", "topic": "u.t"})
        assert c.request({"op": "unsub", "topic": "u.t"}) == {"ok": True}
        assert c.request({"op": "unsub", "topic": "u.t"}) == {"ok": True}
        p.request({"op": "pub", "topic": "u.t", "data": 1})
        assert c.nothing()


def test_overlapping_patterns_deliver_once_per_connection(broker):
    with Raw(broker.port) as c, Raw(broker.port) as p:
        for t in ("o.*", "o.>", "o.x", ">"):
            assert c.request({"op": "sub", "topic": t}) == {"ok": True}
        p.request({"op": "pub", "topic": "o.x", "data": 1})
        assert c.json() == {"topic": "o.x", "data": 1}
        assert c.nothing()


def test_auth_without_security_always_succeeds(broker):
    with Raw(broker.port) as c:
        assert c.request({"op": "auth", "user": "nobody", "pass": "x"}) == {"ok": True}
        assert c.request({"op": "auth"}) == {"ok": True}


def test_max_topic_length_counts_bytes_as_the_docs_say(start_broker):
    """M1: 16 '€' (48 bytes) passed a limit of 16, counted in characters."""
    b = start_broker(workers=1, config={"limits": {"max_topic_length": 16}})
    with Raw(b.port) as c:
        for topic, ok in (("a" * 16, True), ("a" * 17, False), ("é" * 8, True), ("é" * 9, False),
                          ("€" * 5, True), ("€" * 6, False)):
            for op in ("pub", "sub"):
                reply = c.request({"op": op, "topic": topic, "data": 1} if op == "pub" else {"op": op, "topic": topic})
                assert (reply == {"ok": True}) is ok, (op, topic, reply)
            queued = c.request({"op": "qpush", "queue": topic, "data": 1})
            assert queued["ok"] is ok, (topic, queued)


def test_integers_beyond_a_doubles_range_pass_through_exactly(broker):
    """M2: 'integers of any size' stopped at 308 digits (orjson reads numbers as doubles past 64 bits); the
    standard library reads them exactly, up to Python's 4,300 digits; a number infinite as a float is refused."""
    big = "9" * 400
    with Raw(broker.port) as sub, Raw(broker.port) as pub:
        assert sub.request({"op": "sub", "topic": "big"}) == {"ok": True}
        for data in (big, f"[1,-{big}]", f'{{"n":{big}}}'):
            pub.send(b'{"op":"pub","topic":"big","data":' + data.encode() + b'}\n')
            assert pub.json() == {"ok": True}
            assert sub.line() == b'{"topic":"big","data":' + data.encode() + b'}\n'
        for bad in ("1e400", "9" * 5000):
            pub.send(b'{"op":"pub","topic":"big","data":' + bad.encode() + b'}\n')
            assert pub.json() == {"ok": False, "error": "invalid_json"}
        pub.send(b'{"op":"qpush","queue":"big","data":' + big.encode() + b'}\n')
        assert pub.json()["ok"]
        got = pub.request({"op": "qrecv", "queue": "big"})
        assert got["messages"][0]["data"] == int(big)
