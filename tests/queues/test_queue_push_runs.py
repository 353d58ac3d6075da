"""Runs of single pushes in their canonical form (``{"op":"qpush","queue":Q,"data":D}``, as our client and
orjson write them) are recognised by the NDJSON reader (``speedups.ndjson_runs``) and gathered without parsing
each line (``protocols.ndjson.queue_verbs.push_run``): each push still gets its own reply, in order, and anything the
fast path
does not take (data that is not JSON, a line that only looks canonical, a permission to check) is answered as
it always was.  A batch push in the canonical form (``{"op":"qpush","queue":Q,"messages":[{"data":D},...]}``)
travels as its data's text (``speedups.qpush_batch``), checked as any batch is."""

import itertools
import json

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_queues import owned_by, recv, stat

from support.harness import Raw, on_worker


def compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def canonical(queue: str, data) -> bytes:
    return compact({"op": "qpush", "queue": queue, "data": data})


def placed(broker, prefix: str, client_worker: int, owner: int) -> tuple[Raw, str]:
    return on_worker(broker.port, client_worker), owned_by(owner, prefix)


def drain(conn: Raw, queue: str, n: int) -> list[dict]:
    got: list[dict] = []
    while len(got) < n:
        batch = recv(conn, queue, max=1000)
        assert batch, f"only {len(got)} of {n} came back"
        got += batch
    return got


DATA = [{"n": 1, "nested": {"list": [1, 2.5, True, None]}}, "text", "é ✓", 0, -1.5e3, [], {},
        123456789012345678901234567890, 2 ** 64 + 1, 1e300, None, False]


def test_a_long_run_of_pipelined_pushes_is_answered_in_order_and_stores_the_data_as_written(start_broker):
    b = start_broker(workers=2, config={"queues": {"move_connections": False}})
    for owner in (1, 0):   # across workers, then on the owner
        conn, q = placed(b, f"run{owner}", 0, owner)
        datas = [DATA[i % len(DATA)] if i % 7 else {"i": i} for i in range(2500)]
        lines = [canonical(q, d) for d in datas]
        # in the middle of the run: a line that looks canonical but is not valid JSON, and one that is valid
        # but not a plain push (its "data" text is `1,"priority":9`)
        lines.insert(1200, b'{"op":"qpush","queue":"%s","data":[1,}\n' % q.encode())
        lines.insert(1500, b'{"op":"qpush","queue":"%s","data":"first","priority":9}\n' % q.encode())
        conn.send(b"".join(lines))
        replies = [conn.json() for _ in lines]
        assert replies[1200] == {"ok": False, "error": "invalid_json"}
        stored = replies[:1200] + replies[1201:]
        assert all(r["ok"] for r in stored) and len({r["id"] for r in stored}) == 2501
        assert stat(conn, q)["pushed"] == 2501
        got = drain(conn, q, 2501)
        assert got[0]["data"] == "first" and got[0]["id"] == replies[1500]["id"]
        assert [m["id"] for m in got[1:]] == [r["id"] for r in stored if r["id"] != got[0]["id"]]
        assert [m["data"] for m in got[1:]] == datas   # big integers exact, unicode and floats as sent
        conn.close()


def test_a_run_to_a_full_queue_refuses_only_what_does_not_fit(start_broker):
    b = start_broker(workers=2, config={"queues": {"max_messages": 4, "move_connections": False}})
    for owner in (1, 0):
        conn, q = placed(b, f"full{owner}", 0, owner)
        conn.send(b"".join(canonical(q, i) for i in range(6)) + compact({"op": "qstat", "queue": q}))
        replies = [conn.json() for _ in range(7)]
        assert [r["ok"] for r in replies[:6]] == [True] * 4 + [False] * 2
        assert replies[4:6] == [{"ok": False, "error": "queue_full", "retry": True}] * 2
        assert replies[6]["stat"]["visible"] == 4
        conn.close()


def test_a_run_is_checked_against_the_users_permissions(start_broker):
    b = start_broker(workers=2, config={"security": {
        "enabled": True, "iterations": 1000,
        "users": [{"username": "producer", "password": "pw", "permissions": ["publish:jobs"]}],
        "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]}}})
    conn = on_worker(b.port, 0, user="producer", password="pw")
    conn.send(b"".join(canonical("jobs", i) for i in range(3)) + b"".join(canonical("other", i) for i in range(3)))
    replies = [conn.json() for _ in range(6)]
    assert [r["ok"] for r in replies] == [True] * 3 + [False] * 3
    assert {r.get("error") for r in replies[3:]} == {"permission_denied"}
    conn.close()
    with Raw(b.port) as anonymous:   # no login: the run is refused line by line, as any request would be
        anonymous.send(canonical("jobs", 1) * 2)
        assert [anonymous.json()["error"] for _ in range(2)] == ["auth_required"] * 2


def test_runs_of_pushes_with_a_priority_or_a_delay_keep_them_and_refuse_alone_what_is_out_of_range(start_broker):
    """``,"priority":N`` and ``,"delay_ms":N`` after the data (the order orjson writes a dict in) keep a push on the
    fast path, a run being pushes with the same ones; each push is stored with its own, and one out of range is
    refused as the general path refuses it, alone."""
    b = start_broker(workers=2, config={"queues": {"move_connections": False}})
    for owner in (1, 0):   # across workers (one by one on the owner, each with its token), then on the owner
        conn, q = placed(b, f"opts{owner}", 0, owner)
        pushes = [(0, b""), (1, b""), (2, b',"priority":9'), (3, b',"priority":9'), (4, b',"priority":0'),
                  (5, b',"delay_ms":300'), (6, b',"priority":7,"delay_ms":300'), (7, b',"priority":10'),
                  (8, b',"delay_ms":43200001'), (9, b',"priority":9'), (10, b',"priority":0'), (11, b',"delay_ms":300'),
                  (12, b',"priority":4,"delay_ms":0')]
        conn.send(b"".join(b'{"op":"qpush","queue":"%s","data":{"n": %d}%s}\n' % (q.encode(), n, options)
                           for n, options in pushes))
        replies = [conn.json() for _ in pushes]
        # the same two pushes out of range in another spelling, which the general path takes
        conn.send(b'{"data":7,"op":"qpush","queue":"%s","priority":10}\n' % q.encode()
                  + b'{"data":8,"queue":"%s","op":"qpush","delay_ms":43200001}\n' % q.encode())
        assert replies[7] == conn.json() == {"ok": False, "error": "invalid_priority", "min": 0, "max": 9}
        assert replies[8] == conn.json() == {"ok": False, "error": "invalid_delay", "min": 0, "max": 43200000}
        assert all(r["ok"] for i, r in enumerate(replies) if i not in (7, 8))
        ids = {n: r["id"] for (n, _), r in zip(pushes, replies) if r["ok"]}
        s = stat(conn, q)
        assert (s["visible"], s["delayed"], s["pushed"]) == (8, 3, 11)
        conn.send(compact({"op": "qrecv", "queue": q, "max": 100}))
        raw = conn.line()
        assert raw.count(b'"data":{"n": ') == 8   # stored as written: these took the fast path
        got = orjson.loads(raw)["messages"]
        assert [(m["data"]["n"], m["priority"]) for m in got] == [
            (2, 9), (3, 9), (9, 9), (0, 4), (1, 4), (12, 4), (4, 0), (10, 0)]
        assert [m["id"] for m in got] == [ids[m["data"]["n"]] for m in got]
        later = recv(conn, q, max=100, wait_ms=2000)
        later += recv(conn, q, max=100, wait_ms=2000) if len(later) < 3 else []
        assert sorted((m["data"]["n"], m["priority"]) for m in later) == [(5, 4), (6, 7), (11, 4)]
        # in another spelling each line is parsed, and pushes with the same priority and delay are still stored
        # together: a value that only equals the others' (true, 1.0) is refused, as it is alone
        q2 = owned_by(owner, f"spelled{owner}")
        for values, stored in (([b"1", b"1", b"true", b"1.0", b"1"], [(0, 1), (1, 1), (4, 1)]),
                               ([b"1", b"null", b'"1"', b"1"], [(1, 4), (0, 1), (3, 1)])):   # null: the default
            conn.send(b"".join(b'{"queue": "%s", "op": "qpush", "data": %d, "priority": %s}\n' % (q2.encode(), n, v)
                               for n, v in enumerate(values)))
            assert [conn.json().get("error") for _ in values] == [
                "invalid_priority" if v in (b"true", b"1.0", b'"1"') else None for v in values]
            assert [(m["data"], m["priority"]) for m in recv(conn, q2, max=100)] == stored
        conn.close()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 80, max_value=2 ** 80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
DATA_TEXTS = st.one_of(
    JSON_VALUES.map(lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),                        # with spaces, \u escapes
    st.binary(max_size=24).filter(lambda b: b"\n" not in b),                   # anything, mostly not JSON
    st.sampled_from([b'1,"priority":9', b'1,"data":2', b'"x"}', b"[1,}", b"NaN", b'"\\ud800"', b"1e999"]))


def _request(line: bytes) -> dict | None:
    """The request ``line`` is (big integers exact), or None if it is not JSON."""
    try:
        req = json.loads(line)
    except ValueError:
        try:
            req = orjson.loads(line)
        except orjson.JSONDecodeError:
            return None
    return req if type(req) is dict else None


def test_any_data_text_in_a_canonical_push_is_stored_as_sent_or_refused_alone(start_broker):
    """Random data texts, most of them not JSON, in pipelined canonical pushes: one reply per line, in order; what
    is stored comes back equal to what the line says; what is refused is refused as invalid JSON; the connection
    and the broker go on."""
    b = start_broker(workers=2, config={"queues": {"move_connections": False}})
    conn = on_worker(b.port, 0)
    names = (f"fuzz.{i}" for i in itertools.count())

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(DATA_TEXTS, min_size=1, max_size=12))
    def check(texts):
        q = next(names)
        lines = [b'{"op":"qpush","queue":"%s","data":%s}\n' % (q.encode(), t) for t in texts]
        conn.send(b"".join(lines))
        replies = [conn.json() for _ in lines]
        stored = []   # (priority, data): a text like `1,"priority":9` makes a valid line with another priority
        for line, reply in zip(lines, replies):
            req = _request(line[:-1])
            if reply["ok"]:
                assert req is not None, (line, reply)
                if req.get("queue") == q:
                    stored.append((req.get("priority", 4), req.get("data")))
            elif req is None:
                assert reply["error"] == "invalid_json", (line, reply)
        got = recv(conn, q, max=100) if stored else []
        assert [m["data"] for m in got] == [data for _, data in sorted(stored, key=lambda s: -s[0])]
        assert conn.request({"op": "ping"})["ok"]

    check()
    conn.close()


def batch_line(queue: str, datas: list[bytes]) -> bytes:
    """A batch push in the canonical form, each data value's text as given."""
    return b'{"op":"qpush","queue":"%s","messages":[%s]}\n' % (
        queue.encode(), b",".join(b'{"data":%s}' % d for d in datas))


def test_a_canonical_batch_push_stores_each_data_as_written(start_broker):
    """A batch of nothing but data (``speedups.qpush_batch``) travels as the data's text: stored as written (big
    integers exact, spacing kept) and checked as any batch is, all or nothing."""
    b = start_broker(workers=2, config={"queues": {"move_connections": False, "max_message_bytes": 100,
                                                   "max_messages": 16}})
    texts = [json.dumps(d, ensure_ascii=False).encode() for d in DATA]   # json's spacing: '{"n": 1, ...}'
    for owner in (1, 0):   # across workers, then on the owner
        conn, q = placed(b, f"batch{owner}", 0, owner)
        conn.send(batch_line(q, texts))
        ids = conn.json()["ids"]
        assert len(ids) == len(DATA)
        got = recv(conn, q, max=100)
        assert [m["id"] for m in got] == ids and [m["data"] for m in got] == DATA
        assert stat(conn, q)["bytes"] == sum(map(len, texts))   # the size of the text as written
        # refused whole: a message too large (its index), then more than the queue has room for
        conn.send(batch_line(q, [b"1", b'"%s"' % (b"x" * 99), b"2"]) + batch_line(q, [b"1"] * 13))
        assert conn.json() == {"ok": False, "error": "message_too_large", "max": 100, "index": 1}
        assert conn.json() == {"ok": False, "error": "queue_full", "retry": True, "room": 16 - len(DATA)}
        # the other forms still go the general way: an option on an item, one on the request
        conn.send(b'{"op":"qpush","queue":"%s","messages":[{"data":1},{"data":2,"priority":9}]}\n' % q.encode()
                  + b'{"op":"qpush","queue":"%s","messages":[{"data":3}],"delay_ms":0,"id":7}\n' % q.encode())
        assert len(conn.json()["ids"]) == 2 and conn.json()["id"] == 7
        assert [m["data"] for m in recv(conn, q, max=10)] == [2, 1, 3]
        conn.close()


def test_a_push_of_columns_replays_to_the_same_messages(tmp_path):
    """Pushes of one kind and priority without a delay (a canonical batch, a run) are journaled as columns
    (``pushcol``): a replay rebuilds exactly the messages stored, ids, data, order and tokens included."""
    from test_wq_disk_full import Disk, run

    def body():
        d = Disk(str(tmp_path / "j"))
        replies = d.turn(("push", {"queue": "jobs", "datas": [b'"a"', b'{"b": 1}', b"3"]}),
                         ("pushes", {"queue": "jobs", "pushes": [b'"run1"', b'"run2"']}),
                         ("push", {"queue": "jobs", "datas": [b"4", b"5"], "priority": 9, "token": [1, 2, 3]}),
                         ("push", {"queue": "jobs", "datas": [b"6"], "delay_ms": 60_000}))
        assert all(box[0]["ok"] for box in replies)
        q = d.shard.queue("jobs")
        again = d.replayed().queue("jobs")
        assert again.messages == q.messages and len(q.messages) == 8
        assert again.tokens.get((1, 2, 3)) == tuple(replies[2][0]["ids"])
        assert [m[3] for m in again.peek_visible(10)] == [b"4", b"5", b'"a"', b'{"b": 1}', b"3", b'"run1"', b'"run2"']
        d.close()
    run(body)


def test_the_replies_to_a_read_of_several_turns_do_not_wait_for_a_long_poll_at_its_end(start_broker):
    """A read of more pushes than one turn takes (``PUSHES_PER_TURN``) goes on over several turns, and here ends
    with a long poll on an empty queue, which waits: the pushes' replies go out all the same, without waiting for
    the poll."""
    from shardbroker.workers.workqueues.service import PUSHES_PER_TURN

    b = start_broker(workers=2, config={"queues": {"move_connections": False}})
    conn, q = placed(b, "turns", 0, 0)
    n = 3 * PUSHES_PER_TURN   # three whole turns of pushes; the poll comes alone in the fourth
    conn.send(b"".join(canonical(q, i) for i in range(n)) + compact({"op": "qrecv", "queue": q + "-empty",
                                                                      "wait_ms": 20000}))
    replies = [conn.json(timeout=5) for _ in range(n)]   # well before the poll's 20 s are up
    assert all(r["ok"] for r in replies) and len({r["id"] for r in replies}) == n
    with Raw(b.port) as producer:
        assert producer.request({"op": "qpush", "queue": q + "-empty", "data": "late"})["ok"]
    assert [m["data"] for m in conn.json()["messages"]] == ["late"]
    conn.close()
