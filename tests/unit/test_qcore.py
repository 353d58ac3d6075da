"""The work queues' compiled loops (workers/workqueues/_qcore.c) against their pure-Python reference
(workers/workqueues/purecore.py): the same results and the same changes to the queue's dicts, on random queues
with live, expired, unknown and malformed receipts; and the queue protocol tests again on the pure path
(tests/unit/test_speedups.py runs them there with the publishing ones).

As with the publishing hot path, ``make test`` requires the compiled one (``SHARDBROKER_REQUIRE_COMPILED``);
elsewhere a missing extension skips the comparisons.
"""

from __future__ import annotations

import base64
import copy
import gc
import marshal
import os

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardbroker.workers import speedups
from shardbroker.workers.message import KIND_JSON, KIND_RAW
from shardbroker.workers.protocols.ndjson.queue_verbs import _message
from shardbroker.workers.workqueues import core, purecore

try:
    from shardbroker.workers.workqueues import _qcore as compiled
except ImportError:
    compiled = None

needs_compiled = pytest.mark.skipif(compiled is None, reason="the compiled extension is not built")
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES // 2, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_the_compiled_loops_are_in_use_where_the_suite_requires_it():
    if os.environ.get("SHARDBROKER_REQUIRE_COMPILED") and not speedups.FORCED_PURE:
        assert core.IMPLEMENTATION == "compiled", core.MISSING


def _both(name: str, make_args, expect_error: type | None = None):
    """Run ``name`` on each path with its own copy of the arguments: -> (pure's, compiled's) (result, args)."""
    out = []
    for impl in (purecore, compiled):
        args = copy.deepcopy(make_args)
        try:
            result = getattr(impl, name)(*args)
        except Exception as exc:   # noqa: BLE001 - the same exception type on both paths is part of the contract
            result = type(exc)
        out.append((result, args))
    return out


# -- receipts and ids ----------------------------------------------------------------------------------------------
@needs_compiled
@FUZZ
@given(st.binary(max_size=200), st.integers(1, 40))
def test_b64url_chunks_same_on_both_paths_and_each_decodes_to_its_chunk(raw, width):
    texts = compiled.b64url_chunks(raw, width)
    assert texts == purecore.b64url_chunks(raw, width)
    assert len(texts) == len(raw) // width
    for k, text in enumerate(texts):
        assert base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)) == raw[k * width:(k + 1) * width]
        assert "=" not in text and "+" not in text and "/" not in text


@needs_compiled
def test_b64url_chunks_refuse_bad_arguments_alike():
    for args in ((b"abc", 0), (b"abc", -1), ("text", 3), (b"abc", "3"), (None, 3)):
        (pure, _), (comp, _) = _both("b64url_chunks", args)
        assert isinstance(pure, type) and pure is comp, args


# -- random queues -------------------------------------------------------------------------------------------------
NOW = 1_000_000


@st.composite
def queues(draw):
    """A queue's state as the model keeps it: messages, leases (live and expired) and deliveries, and a batch of
    receipts to ack: live, expired, repeated, unknown, and not text at all."""
    n = draw(st.integers(0, 30))
    seqs = list(range(1, n + 1))
    store, deliveries, leases, leased = {}, {}, {}, {}
    # messages pushed together share their wall clock's int object (the compiled delivered converts it once)
    walls = draw(st.lists(st.integers(0, 2 ** 62), min_size=1, max_size=3))
    for seq in seqs:
        data = draw(st.sampled_from([b'"x"', b"", b"1" * 50, b"[1,2]"]))
        store[seq] = (seq, f"id{seq:014d}", KIND_JSON, data, draw(st.integers(0, 9)),
                      walls[draw(st.integers(0, len(walls) - 1))], None, None, 0)
        if draw(st.booleans()):
            deliveries[seq] = draw(st.integers(0, 5))
        if draw(st.booleans()):
            receipt = f"r{seq:021d}"
            deadline = NOW + draw(st.integers(-3, 3))
            leases[receipt] = (seq, NOW - 10, deadline, 30_000, None)
            leased[seq] = receipt
    candidates = list(leases) + ["r" + "9" * 21, "", 7, None, b"bytes"]
    batch = draw(st.lists(st.sampled_from(candidates), max_size=40)) if candidates else []
    return store, deliveries, leases, leased, batch


@needs_compiled
@FUZZ
@given(queues(), st.integers(0, 5))
def test_ack_run_same_on_both_paths(queue, start):
    store, deliveries, leases, leased, batch = queue
    args = (leases, leased, store, deliveries, batch, start, NOW, [], [], {"ok": True})
    (pure, pure_args), (comp, comp_args) = _both("ack_run", args)
    assert pure == comp
    assert pure_args == comp_args   # every dict and list it touched, alike


@needs_compiled
@FUZZ
@given(queues())
def test_a_whole_batch_acked_in_runs_same_on_both_paths(queue):
    """As ``Queue.ack_many`` drives it: a run, the receipt it stopped at skipped, the next run."""
    store, deliveries, leases, leased, batch = queue
    states = []
    for impl in (purecore, compiled):
        s = copy.deepcopy((leases, leased, store, deliveries, batch))
        done, results, stops, size, i = [], [], [], 0, 0
        while True:
            i, got = impl.ack_run(*s, i, NOW, done, results, "ACKED")
            size += got
            if i >= len(batch):
                break
            stops.append(i)
            i += 1
        states.append((s, done, results, stops, size))
    assert states[0] == states[1]
    s, done, results, stops, size = states[0]
    assert len(done) == len(set(done)) == len(results)   # a receipt is acked once, however often it is named
    assert not set(done) & set(s[0])                        # and its lease is gone


@needs_compiled
def test_ack_run_refuses_a_negative_start_and_raises_alike_on_a_broken_state():
    (pure, _), (comp, _) = _both("ack_run", ({}, {}, {}, {}, ["a"], -1, NOW, [], [], None))
    assert pure is comp is ValueError
    # a lease whose message is gone: KeyError on both, as the Python loop would raise it
    broken = ({"a": (1, 0, NOW + 5, 1, None)}, {1: "a"}, {}, {}, ["a"], 0, NOW, [], [], None)
    (pure, _), (comp, _) = _both("ack_run", broken)
    assert pure is comp is KeyError


@needs_compiled
@FUZZ
@given(queues(), st.lists(st.integers(1, 35), max_size=20), st.sampled_from([None, ("c", 7)]))
def test_grant_and_delivered_same_on_both_paths(queue, seqs, holder):
    store, deliveries, leases, leased, _ = queue
    receipts = [f"n{k:021d}" for k in range(len(seqs))]
    grant = (leases, leased, deliveries, seqs, receipts, NOW, NOW + 30 * 10 ** 9, 30_000, holder)
    (pure, pure_args), (comp, comp_args) = _both("grant", grant)
    assert pure == comp and pure_args == comp_args
    if isinstance(pure, type):
        return
    delivered = (store, pure_args[2], seqs, receipts, 1_000_000)
    (pure, _), (comp, _) = _both("delivered", delivered)
    assert pure == comp   # a list of D_* tuples, or KeyError where a seq has no message


# -- a qrecv reply's messages --------------------------------------------------------------------------------------
ids = st.one_of(st.text(alphabet="abcXYZ09-_", min_size=1, max_size=22), st.sampled_from(["é", "\u2603", "a\"b"]))
numbers = st.one_of(st.integers(0, 20), st.integers(2 ** 62, 2 ** 70), st.integers(-5, -1), st.booleans(),
                    st.integers(-2 ** 63, 2 ** 63 - 1),   # the compiled digits' whole range, its ends included
                    st.sampled_from([-2 ** 63, -2 ** 63 + 1, 2 ** 63 - 1, 9, 10, 99, 100, -10, 10 ** 18]))
deliveries_ = st.tuples(ids, ids, st.sampled_from([KIND_JSON, KIND_RAW, 5]),
                        st.sampled_from([b'"text"', b"{}", b"12", b"\xff\x00raw"]), numbers, numbers, numbers,
                        st.sampled_from([None, "", "expired", "max_deliveries"]), st.sampled_from([None, "src.q"]))


@needs_compiled
@FUZZ
@given(st.lists(deliveries_, max_size=12))
def test_render_deliveries_same_on_both_paths(messages):
    try:
        pure = purecore.render_deliveries(messages, KIND_JSON, _message)
    except Exception as exc:   # noqa: BLE001
        with pytest.raises(type(exc)):
            compiled.render_deliveries(messages, KIND_JSON, _message)
        return
    assert compiled.render_deliveries(messages, KIND_JSON, _message) == pure


@needs_compiled
def test_render_deliveries_writes_what_a_client_reads():
    messages = [("AAAAAAAAAAAAAAAA", "B" * 22, KIND_JSON, b'{"a":[1,"\xc3\xa9"]}', 2, 9, 1_700_000_000_000, None, None),
                ("CCCCCCCCCCCCCCCC", "D" * 22, KIND_RAW, b"\x00\xff", 1, 0, 5, None, None),
                ("EEEEEEEEEEEEEEEE", "F" * 22, KIND_JSON, b"12", 21, 0, 6, "max_deliveries", "q")]
    got = orjson.loads(b"[" + compiled.render_deliveries(messages, KIND_JSON, _message) + b"]")
    assert got[0] == {"id": "AAAAAAAAAAAAAAAA", "receipt": "B" * 22, "data": {"a": [1, "é"]}, "deliveries": 2,
                      "priority": 9, "enqueued_at": 1_700_000_000_000}
    assert got[1]["encoding"] == "base64" and base64.b64decode(got[1]["data"]) == b"\x00\xff"
    assert got[2]["dead_reason"] == "max_deliveries" and got[2]["source"] == "q" and got[2]["data"] == 12


@needs_compiled
def test_render_deliveries_refuses_a_render_that_returns_no_bytes():
    with pytest.raises(TypeError):
        compiled.render_deliveries([("i", "r", KIND_RAW, b"x", 1, 0, 0, None, None)], KIND_JSON, lambda m: "text")
    assert compiled.render_deliveries([], KIND_JSON, _message) == b""


# -- storing a run of pushes -----------------------------------------------------------------------------------------
@needs_compiled
@FUZZ
@given(st.dictionaries(st.integers(0, 30), st.just(("old",)), max_size=5), st.integers(0, 20),
       st.lists(st.binary(max_size=20), max_size=12), st.booleans(), st.integers(0, 9))
def test_store_run_same_on_both_paths(store, seq, datas, short, priority):
    ids = [f"id{i}" for i in range(len(datas) - short)]   # short: one id too few
    (pure, pure_args), (comp, comp_args) = _both("store_run", (store, seq, ids, KIND_RAW, datas, priority, 17))
    assert pure == comp   # the data's bytes, or IndexError where the ids ran out
    assert pure_args == comp_args
    if pure is not IndexError:
        assert pure == sum(map(len, datas))
        assert all(pure_args[0][seq + i] == (seq + i, f"id{i}", KIND_RAW, d, priority, 17, "", "", 0)
                   for i, d in enumerate(datas))
    (pure, _), (comp, _) = _both("store_run", ({}, 0, ["a"], KIND_RAW, [7], 0, 0))
    assert pure is comp is TypeError   # a data without a length


@needs_compiled
def test_the_compiled_loops_leave_new_message_and_lease_tuples_to_no_collector_pass():
    store = {}
    compiled.store_run(store, 1, ["a", "b"], KIND_RAW, [b"x", b"yy"], 0, 5)
    assert not any(gc.is_tracked(m) for m in store.values())
    holder = tuple([0, 7])           # made at run time: tracked, as a connection's holder is at first
    leases = {}
    compiled.grant(leases, {}, {}, [1], ["r1"], 1, 2, 3, holder)
    assert gc.is_tracked(leases["r1"])   # it holds a tuple the collector has not looked at: left to it
    gc.collect()
    compiled.grant(leases, {}, {}, [2], ["r2"], 1, 2, 3, holder)
    assert not gc.is_tracked(leases["r2"]) and not gc.is_tracked(holder)
    compiled.grant(leases, {}, {}, [3], ["r3"], 1, 2, 3, [0, 7])   # a list: it could be in a cycle
    assert gc.is_tracked(leases["r3"])
    store = {}
    compiled.store_put(store, [tuple([1, "a", KIND_RAW, b"x"]), tuple([2, "b", KIND_RAW, b"y", [0]])])
    assert not gc.is_tracked(store[1]) and gc.is_tracked(store[2])   # a list in it: left to the collector


@needs_compiled
@FUZZ
@given(st.dictionaries(st.integers(0, 30), st.just(("old",)), max_size=5),
       st.lists(st.one_of(st.tuples(st.integers(0, 30), st.just("id"), st.just(KIND_RAW), st.binary(max_size=9)),
                          st.tuples(st.integers(0, 30), st.just("id"), st.just(KIND_RAW), st.integers()),
                          st.tuples(st.integers(0, 30)), st.lists(st.integers(), min_size=4, max_size=4)),
                max_size=8))
def test_store_put_same_on_both_paths(store, messages):
    (pure, pure_args), (comp, comp_args) = _both("store_put", (store, messages))
    assert pure == comp   # the data's bytes, or TypeError at a message that is no tuple or has no data's length
    assert pure_args == comp_args   # what came before the bad one is stored on both


# -- a snapshot's records of visible messages --------------------------------------------------------------------
_SNAPSHOT_MESSAGE = st.tuples(
    st.integers(1, 3), st.sampled_from(["A" * 16, "B" * 16, "short", "\u00e9" * 16, 7]), st.sampled_from([0, 1]),
    st.binary(max_size=4), st.sampled_from([4, 9]), st.sampled_from([5, 6]), st.sampled_from(["", "", "dead"]),
    st.sampled_from(["", "", "jobs"]), st.sampled_from([0, 0, 1]))


@needs_compiled
@FUZZ
@given(st.lists(_SNAPSHOT_MESSAGE, max_size=30), st.integers(1, 4), st.booleans())
def test_snapshot_pushes_same_on_both_paths_and_every_message_once_in_order(steps, least, bad):
    seq, messages = 0, []
    for step, *rest in steps:      # sequence numbers rising, mostly by one
        seq += step if step < 3 else 1
        messages.append((seq, *rest))
    if bad:
        messages.insert(len(messages) // 2, (seq + 1, "A" * 16))   # no message tuple
    (pure, _), (comp, _) = _both("snapshot_pushes", (messages, 16, least))
    assert pure == comp
    if bad:
        assert pure is TypeError
        return
    back = []
    for record in pure:
        if record[0] == "pushcol":   # as Queue.apply stores it
            _, token, first, ids, kind, datas, priority, wall = record
            assert token is None and len(datas) >= least and len(ids) == 16 * len(datas)
            back += [(first + i, ids[16 * i:16 * i + 16], kind, d, priority, wall, "", "", 0)
                     for i, d in enumerate(datas)]
        else:
            assert record[0] == "pushes" and record[1] is None and record[3] is None
            back += record[2]
    assert back == messages
    assert not any(a[0] == b[0] == "pushes" for a, b in zip(pure, pure[1:]))   # the rest joined, not split


# -- the journal's records ------------------------------------------------------------------------------------------
def _typed(value):
    """``value`` with each container's and scalar's type spelled out: == on it compares types too (True == 1,
    1 == 1.0, and a tuple is not a list), and NaN compares equal to itself."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_typed(v) for v in value]
    if isinstance(value, dict):
        return "dict", [(_typed(k), _typed(v)) for k, v in value.items()]
    if isinstance(value, (set, frozenset)):
        return type(value).__name__, sorted(map(repr, value))
    return type(value).__name__, repr(value)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 31 - 2, 2 ** 31 + 1),
                    st.integers(-2 ** 63, 2 ** 63 - 1), st.integers(-2 ** 80, 2 ** 80), st.floats(allow_nan=True),
                    st.text(max_size=300), st.text(alphabet="ab\ud800\udfff", max_size=5), st.binary(max_size=300),
                    st.frozensets(st.integers(0, 3), max_size=2))
records = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.lists(inner, max_size=6).map(tuple),
    st.tuples(scalars, st.integers(255, 257)).map(lambda vn: (vn[0],) * vn[1]),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=4)), max_leaves=40)


@needs_compiled
@FUZZ
@given(records)
def test_flat_dumps_reads_back_as_marshal_does_on_both_paths(value):
    held = [value, copy.copy(value)]   # held elsewhere too, as a receipt kept by the leases is: marshal refers back
    for impl in (purecore, compiled):
        assert _typed(marshal.loads(impl.flat_dumps(held))) == _typed(held)


@needs_compiled
def test_flat_dumps_writes_marshal_format_4_without_back_references():
    receipt = "abc"   # held elsewhere too (by this code's constants), as a queue's dicts hold its receipts
    # marshal.dumps writes the second sight of the receipt as a reference to the first; flat_dumps writes it again
    assert b"r" + b"\x01\x00\x00\x00" in marshal.dumps([receipt, receipt], 4)
    assert compiled.flat_dumps([receipt, receipt]) == b"[\x02\x00\x00\x00" + b"z\x03abc" * 2
    assert compiled.flat_dumps((None, True, False, 7, -1)) == b")\x05NTFi\x07\x00\x00\x00i\xff\xff\xff\xff"
    # 2**40: three 15-bit digits, least significant first; negative: a negative count
    assert compiled.flat_dumps(2 ** 40) == b"l\x03\x00\x00\x00" + b"\x00\x00\x00\x00\x00\x04"
    assert compiled.flat_dumps(-2 ** 40) == b"l\xfd\xff\xff\xff" + b"\x00\x00\x00\x00\x00\x04"
    assert compiled.flat_dumps(b"\x00x") == b"s\x02\x00\x00\x00\x00x"
    assert compiled.flat_dumps("é") == b"u\x02\x00\x00\x00\xc3\xa9"
    assert compiled.flat_dumps({"a": []}) == b"{z\x01a[\x00\x00\x00\x000"
    # what it leaves to marshal: marshal's own bytes, and marshal's own refusal
    assert compiled.flat_dumps({1, 2}) == marshal.dumps({1, 2}, 4)
    with pytest.raises(ValueError):
        compiled.flat_dumps([object()])
