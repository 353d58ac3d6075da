"""The compiled hot path (workers/_speedups.c) against its pure-Python reference (workers/purepath.py): the same
result for every input, random and mutated, whole or split at every byte; and the protocol tests on the pure path.

The compiled one must be there when ``make test`` runs the suite (it sets ``SHARDBROKER_REQUIRE_COMPILED``: the
Makefile makes sure of a compiler and Python's headers first); elsewhere, a missing extension skips the
comparisons, and the pure path is what runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz import _nats

from shardbroker.workers import purepath, speedups

from support.harness import REPO

try:
    from shardbroker.workers import _speedups as compiled
except ImportError:
    compiled = None

needs_compiled = pytest.mark.skipif(compiled is None, reason="the compiled extension is not built")
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_the_compiled_path_is_in_use_where_the_suite_requires_it():
    if os.environ.get("SHARDBROKER_REQUIRE_COMPILED") and not speedups.FORCED_PURE:
        assert speedups.IMPLEMENTATION == "compiled", speedups.MISSING


# -- inputs ----------------------------------------------------------------------------------------------------
# Well-formed PUBs in every shape the line allows, their near misses, and arbitrary bytes; then mutated.
SUBJECTS = [b"a", b"foo.bar", b"x" * 40, b"a\x00b", b"\xff\xfe", b"12", b"a\x0bb"]
PIECES = [b"PUB foo 5\r\nhello\r\n", b"pub foo 5\nhello\r\n", b"PuB\t foo \t 5 \t\r\nhello\r\n",
          b"PUB foo r.1 3\r\nabc\r\n", b"PUB foo r.2 3\r\nabc\r\n", b"PUB foo 0\r\n\r\n", b"PUB foo 000003\r\nabc\r\n",
          b"PUB foo 1234567890123\r\n", b"PUB foo 123456789012\r\n", b"PUB foo 5\r\nhelloXY", b"PUB foo 3\rx\n",
          b"PUB foo 3 4\r\nabc\r\n", b"PUB foo\x0b3\r\nabc\r\n", b"PUB foo 3\x0c\r\nabc\r\n", b"PUBfoo 3\r\nabc\r\n",
          b"PUB  foo  bar  7\r\nsevenXX\r\n", b"HPUB foo 2 4\r\nhhpp\r\n", b"SUB foo 1\r\n", b"PING\r\n", b"\r\n",
          b"PUB foo 5\r\nhel", b"PUB foo", b"PUB ", b"P", b"\n"]


def _pub(subject: bytes, reply: bytes | None, payload: bytes) -> bytes:
    return b"PUB " + subject + (b" " + reply if reply else b"") + b" %d\r\n" % len(payload) + payload + b"\r\n"


pubs = st.builds(_pub, st.sampled_from(SUBJECTS), st.one_of(st.none(), st.sampled_from([b"r", b"_INBOX.x"])),
                 st.binary(max_size=40))
streams = st.lists(st.one_of(pubs, st.sampled_from(PIECES), st.binary(max_size=16)), max_size=30).map(b"".join)


@st.composite
def mutated(draw) -> bytes:
    """A stream with bytes flipped, dropped, duplicated or inserted at random places."""
    data = bytearray(draw(streams))
    for _ in range(draw(st.integers(min_value=0, max_value=6))):
        if not data:
            break
        i = draw(st.integers(min_value=0, max_value=len(data) - 1))
        op = draw(st.sampled_from(["flip", "drop", "dup", "insert"]))
        if op == "flip":
            data[i] = draw(st.sampled_from(b" \t\r\n\x0b0123456789PUBpub\x00\xff"))
        elif op == "drop":
            del data[i]
        elif op == "dup":
            data[i:i] = data[i:i + draw(st.integers(min_value=1, max_value=8))]
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


# -- scan_pubs -------------------------------------------------------------------------------------------------
@needs_compiled
@FUZZ
@given(st.one_of(streams, mutated()), st.integers(min_value=0, max_value=80), st.integers(min_value=0, max_value=50))
def test_scan_pubs_same_on_both_paths_at_every_position(data, max_line, max_payload):
    for pos in range(len(data) + 2):
        assert compiled.scan_pubs(data, pos, max_line, max_payload) == \
            purepath.scan_pubs(data, pos, max_line, max_payload), pos


@needs_compiled
def test_scan_pubs_reads_a_run_and_stops_where_it_changes():
    data = _pub(b"a", None, b"1") + _pub(b"a", None, b"22") + _pub(b"a", b"r", b"3") + b"PING\r\n"
    for scan in (compiled.scan_pubs, purepath.scan_pubs):
        assert scan(data, 0, 4096, 1 << 20) == (b"a", None, [b"1", b"22"], len(_pub(b"a", None, b"1")) * 2 + 1)
        assert scan(data, 0, 4096, 1) == (b"a", None, [b"1"], len(_pub(b"a", None, b"1")))   # 2 B: too large
        assert scan(b"PING\r\n", 0, 4096, 1 << 20) == (None, None, [], 0)
        assert scan(memoryview(data)[:5], 0, 4096, 1 << 20) == (None, None, [], 0)


@needs_compiled
def test_scan_pubs_refuses_what_is_not_a_buffer():
    with pytest.raises(TypeError):
        compiled.scan_pubs("PUB a 1\r\nx\r\n", 0, 10, 10)
    with pytest.raises(TypeError):
        compiled.scan_pubs(b"", 0, 10)


# -- msg_tails -------------------------------------------------------------------------------------------------
@needs_compiled
@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=20), st.one_of(st.none(), st.just(b""), st.binary(max_size=30)))
def test_msg_tails_same_on_both_paths(payloads, reply):
    assert compiled.msg_tails(payloads, reply) == purepath.msg_tails(payloads, reply)


@needs_compiled
def test_msg_tails_refuses_what_is_not_a_list_of_bytes():
    for args in (([b"a", "b"], None), ((b"a",), None), ([b"a"], "r")):
        with pytest.raises(TypeError):
            compiled.msg_tails(*args)


# -- ndjson_runs -----------------------------------------------------------------------------------------------
def _ndjson_pub(topic: bytes, data: bytes) -> bytes:
    return b'{"op":"pub","topic":"' + topic + b'","data":"' + data + b'"}'


def _ndjson_qpush(queue: bytes, data: bytes) -> bytes:
    return b'{"op":"qpush","queue":"' + queue + b'","data":' + data + b'}'


NDJSON_LINES = [_ndjson_qpush(b"q", b'{"a":[1,2]}'), _ndjson_qpush(b"q", b'"x"') + b"\r", _ndjson_qpush(b"q", b""),
                _ndjson_qpush(b"q", b"1\r"), _ndjson_qpush(b"q", b"}"), _ndjson_qpush(b"q", b'1,"priority":2'),
                _ndjson_qpush(b"q", b'1,"priority":2'), _ndjson_qpush(b"q", b'1,"delay_ms":10'),
                _ndjson_qpush(b"q", b'1,"priority":9,"delay_ms":0'), _ndjson_qpush(b"q", b',"delay_ms":10'),
                _ndjson_qpush(b"q", b'1,"priority":012'), _ndjson_qpush(b"q", b'1,"priority":999999999'),
                _ndjson_qpush(b"q", b"\xc3\xa9\x7f"), _ndjson_qpush(b"a", b'"x"'),
                _ndjson_pub(b"a", b"x"), _ndjson_pub(b"a", b""), _ndjson_pub(b"a.b", b"hello world"),
                _ndjson_pub(b"a", b"x") + b"\r", _ndjson_pub(b"a", b'q\\"'), _ndjson_pub(b"", b"x"),
                _ndjson_pub(b"a", b"\xc3\xa9"), _ndjson_pub(b"a", b"x") + b" ", b'{"op":"pub","topic":"a","data":1}',
                b'{"topic":"a","op":"pub","data":"x"}', b'{"op":"sub","topic":"a"}', b"", b"\r", None]
ndjson_lines = st.lists(st.one_of(st.sampled_from(NDJSON_LINES),
                                  st.builds(_ndjson_pub, st.sampled_from([b"a", b"b.c", b"a b", b"*"]),
                                            st.binary(max_size=12)),
                                  st.builds(_ndjson_qpush, st.sampled_from([b"a", b"q", b"a b"]),
                                            st.binary(max_size=12)),
                                  st.builds(lambda data, p, d, u: _ndjson_qpush(b"q", data + p + d + u),
                                            st.binary(max_size=6),
                                            st.sampled_from([b"", b',"priority":', b',"priority":1', b',"priority":0',
                                                             b',"priority":10']),
                                            st.sampled_from([b"", b',"delay_ms":', b',"delay_ms":0',
                                                             b',"delay_ms":123456789', b',"delay_ms":9876543210']),
                                            st.one_of(st.sampled_from([b"", b',"dedup_id":""', b',"dedup_id":"',
                                                                       b',"dedup_id":"%s"' % (b"u" * 129)]),
                                                      st.builds(lambda u: b',"dedup_id":"%s"' % u,
                                                                st.binary(min_size=1, max_size=4)))),
                                  st.binary(max_size=40)), max_size=30)


@st.composite
def mutated_lines(draw) -> list:
    lines = draw(ndjson_lines)
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        i = draw(st.integers(min_value=0, max_value=max(0, len(lines) - 1)))
        if lines and lines[i]:
            line = bytearray(lines[i])
            j = draw(st.integers(min_value=0, max_value=len(line) - 1))
            line[j] = draw(st.integers(min_value=0, max_value=255))
            lines[i] = bytes(line)
    return lines


@needs_compiled
@FUZZ
@given(st.one_of(ndjson_lines, mutated_lines()))
def test_ndjson_runs_same_on_both_paths(lines):
    assert compiled.ndjson_runs(lines) == purepath.ndjson_runs(lines)


# Long enough for the compiled check's eight bytes at a time, with one byte that is not plain put anywhere.
PLAIN_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e, blacklist_characters='"\\'), max_size=40)
NOT_PLAIN = [b'"', b"\\", b"\x1f", b"\x7f", b"\x80", b"\xff", b"\x00", b"\xc3\xa9"]


def _plain_string(text: str, at: int = 0, bad: bytes = b"") -> bytes:
    raw = text.encode()
    at = min(at, len(raw))
    return b'"' + raw[:at] + bad + raw[at:] + b'"'


@needs_compiled
@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=12), st.builds(lambda b: b'"' + b + b'"', st.binary(max_size=10)),
                          st.builds(_plain_string, PLAIN_TEXT), st.builds(_plain_string, PLAIN_TEXT, st.integers(0, 40),
                                                                         st.sampled_from(NOT_PLAIN)),
                          st.sampled_from([b'"', b'""', b'"a b~"', b'"\\"', b'"a"b"', b'"\x7f"', b'"\xc3\xa9"'])),
                max_size=12))
def test_unplain_same_on_both_paths_and_leaves_only_json_strings_out(datas):
    left = compiled.unplain(datas)
    assert left == purepath.unplain(datas)
    for data in datas:
        if data not in left:   # JSON as it stands: a string, and the same one read back
            assert isinstance(json.loads(data), str) and json.dumps(json.loads(data)).encode() == data


@needs_compiled
def test_ndjson_runs_group_consecutive_publishes_to_one_topic():
    a1, a2, b1 = _ndjson_pub(b"a", b"1"), _ndjson_pub(b"a", b"22") + b"\r", _ndjson_pub(b"b", b"3")
    lines = [a1, a2, b1, b'{"op":"ping"}', a1, None]
    for runs in (compiled.ndjson_runs, purepath.ndjson_runs):
        assert runs(lines) == [(b"a", [b'"1"', b'"22"'], [a1, a2]), (b"b", [b'"3"'], [b1]), b'{"op":"ping"}',
                               (b"a", [b'"1"'], [a1]), None]
    q1, q2 = _ndjson_qpush(b"a", b'{"n":1}'), _ndjson_qpush(b"a", b"2") + b"\r"
    lines = [q1, q2, a1, q1, _ndjson_qpush(b"b", b"3")]
    for runs in (compiled.ndjson_runs, purepath.ndjson_runs):   # pushes and publishes never share a run
        assert runs(lines) == [(b"a", [b'{"n":1}', b"2"], [q1, q2], b"", None), (b"a", [b'"1"'], [a1]),
                               (b"a", [b'{"n":1}'], [q1], b"", None), (b"b", [b"3"], [lines[-1]], b"", None)]
    # a priority, then a delay, after the data: a run is pushes with the same ones, which travel as they were written
    p4, p4b, p4d = (_ndjson_qpush(b"a", b'"x"' + options) for options in
                    (b',"priority":4', b',"priority":4', b',"priority":4,"delay_ms":250'))
    d0, p0 = _ndjson_qpush(b"a", b'[1,"priority":3],"delay_ms":0'), _ndjson_qpush(b"a", b'1,"priority":0') + b"\r"
    lines = [q1, p4, p4b, p4d, d0, p0]
    for runs in (compiled.ndjson_runs, purepath.ndjson_runs):
        assert runs(lines) == [(b"a", [b'{"n":1}'], [q1], b"", None),
                               (b"a", [b'"x"', b'"x"'], [p4, p4b], b',"priority":4', None),
                               (b"a", [b'"x"'], [p4d], b',"priority":4,"delay_ms":250', None),
                               (b"a", [b'[1,"priority":3]'], [d0], b',"delay_ms":0', None),
                               (b"a", [b"1"], [p0], b',"priority":0', None)]
    # anything else after the data stays part of it (then not JSON: the line goes on its own), as does an option that
    # is not a JSON integer of up to nine digits, one out of order or repeated, or one that would leave no data
    for options in (b',"priority":04', b',"priority":-1', b',"priority":1234567890',
                    b',"priority":1.0', b',"priority":"1"', b',"priority":1 ',
                    b',"id":1', b',"dedup_id":""', b',"dedup_id":"%s"' % (b"k" * 129), b',"dedup_id":"a\\"b"',
                    b',"dedup_id":"\xc3\xa9"', b',"dedup_id":1'):
        line = _ndjson_qpush(b"a", b'"x"' + options)
        for runs in (compiled.ndjson_runs, purepath.ndjson_runs):
            assert runs([line]) == [(b"a", [b'"x"' + options], [line], b"", None)], options
    line = _ndjson_qpush(b"a", b'"x","priority":1,"priority":2')
    swapped = _ndjson_qpush(b"a", b'"x","delay_ms":1,"priority":2')
    bare = _ndjson_qpush(b"a", b',"priority":2')
    for runs in (compiled.ndjson_runs, purepath.ndjson_runs):
        assert runs([line]) == [(b"a", [b'"x","priority":1'], [line], b',"priority":2', None)]
        assert runs([swapped]) == [(b"a", [b'"x","delay_ms":1'], [swapped], b',"priority":2', None)]
        assert runs([bare]) == [(b"a", [b',"priority":2'], [bare], b"", None)]
    # a dedup_id last, of 1-128 plain characters: a run is pushes that all have one (and the same other options)
    u1, u2, u3 = (_ndjson_qpush(b"a", b'"x"' + options) for options in
                  (b',"dedup_id":"k-1"', b',"dedup_id":"%s"' % (b"k" * 128),
                   b',"priority":9,"delay_ms":5,"dedup_id":"~ a"'))
    lines = [u1, u2, q1, u3, u1]
    for runs in (compiled.ndjson_runs, purepath.ndjson_runs):
        assert runs(lines) == [(b"a", [b'"x"', b'"x"'], [u1, u2], b"", ["k-1", "k" * 128]),
                               (b"a", [b'{"n":1}'], [q1], b"", None),
                               (b"a", [b'"x"'], [u3], b',"priority":9,"delay_ms":5', ["~ a"]),
                               (b"a", [b'"x"'], [u1], b"", ["k-1"])]
    with pytest.raises(TypeError):
        compiled.ndjson_runs([b"x", "y"])
    with pytest.raises(TypeError):
        compiled.ndjson_runs((b"x",))


# -- qpush_batch -----------------------------------------------------------------------------------------------
def _batch_line(queue: bytes, datas: list[bytes]) -> bytes:
    return b'{"op":"qpush","queue":"' + queue + b'","messages":[' + b",".join(
        b'{"data":' + d + b"}" for d in datas) + b"]}"


json_texts = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                    st.text(max_size=6)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                          max_leaves=6).map(lambda v: json.dumps(v, ensure_ascii=False).encode())
DATA_PIECES = [b'"a\\"', b'"\\\""', b'"]}"', b'{"a": [1, "}"]}', b"[]", b"{}", b"-1.5e3", b"null", b'"', b"",
               b"1 ", b"[1", b'{"a":"', b"\\", b"1,2"]
batch_lines = st.builds(_batch_line, st.sampled_from([b"q", b"a.b", b"a b", b""]),
                        st.lists(st.one_of(json_texts, st.sampled_from(DATA_PIECES), st.binary(max_size=8)),
                                 max_size=5)) | st.binary(max_size=60)


@st.composite
def mutated_batch(draw) -> bytes:
    line = bytearray(draw(batch_lines))
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        if line:
            line[draw(st.integers(min_value=0, max_value=len(line) - 1))] = draw(st.sampled_from(b'"\\{}[],: \r1'))
    return bytes(line) + draw(st.sampled_from([b"", b"\r", b" "]))


@needs_compiled
@FUZZ
@given(st.one_of(batch_lines, mutated_batch()))
def test_qpush_batch_same_on_both_paths(line):
    assert compiled.qpush_batch(line) == purepath.qpush_batch(line)


@needs_compiled
def test_qpush_batch_gives_each_data_value_as_written():
    datas = [b'"x"', b'{"a": [1, "]}"], "b": {"c": null}}', b"-1.5e3", b'"q\\"\\\\"', b"123456789012345678901234567890",
             b"[]", b"true"]
    line = _batch_line(b"a.b", datas)
    for batch in (compiled.qpush_batch, purepath.qpush_batch):
        assert batch(line) == datas
        assert batch(line + b"\r") == datas
        assert [json.loads(d) for d in batch(line)] == [item["data"] for item in json.loads(line)["messages"]]
        # the request's other fields after the messages (the caller checks which): the data as before
        for tail in (b',"id":1}', b',"dedup_id":"a-1","priority":9,"delay_ms":5}', b',"x":{"y":1}}'):
            assert batch(line[:-1] + tail) == datas, tail
        for other in (line + b" ", line.replace(b'{"data":-', b'{"data": -'), _batch_line(b"q", []),
                      line.replace(b'"x"}', b'"x","priority":2}'), line[:-2] + b"]",
                      line[:-1] + b',"messages":[{"data":2}]}',   # a second batch: a parser keeps that one
                      line[:-1] + b',"x":{"messages":1}}',         # (any "messages" after them: the general path)
                      line[:-1] + b',"id":1', line[:-1] + b'x}', line[:-1] + b',}' + b"\r\r",
                      b'{"op":"qpush","queue":"q","data":1}', _batch_line(b"\\u0071", [b"1"])):
            assert batch(other) is None, other
    with pytest.raises(TypeError):
        compiled.qpush_batch("x")


# -- the parser on each path, split anywhere -------------------------------------------------------------------
@needs_compiled
@FUZZ
@given(st.one_of(streams, mutated()), st.integers(min_value=8, max_value=80), st.integers(min_value=0, max_value=50))
def test_parser_same_on_both_paths_whole_and_split_at_every_byte(data, max_line, max_payload):
    whole = _nats([data], max_line, max_payload, scan=purepath.scan_pubs)
    assert _nats([data], max_line, max_payload, scan=compiled.scan_pubs) == whole
    for cut in range(1, len(data)):
        pieces = [data[:cut], data[cut:]]
        assert _nats(pieces, max_line, max_payload, scan=compiled.scan_pubs) == whole, cut
    one_byte = [data[i:i + 1] for i in range(len(data))]
    assert _nats(one_byte, max_line, max_payload, scan=compiled.scan_pubs) == whole


# -- the broker on each path -----------------------------------------------------------------------------------
def test_broker_says_which_path_it_runs(start_broker):
    pure = start_broker(workers=2, env={"SHARDBROKER_NO_EXTENSIONS": "1"})
    assert pure.varz()["hot_path"] == "pure"
    assert "hot path: pure Python (SHARDBROKER_NO_EXTENSIONS is set)" in pure.log()
    assert "work queues on the pure-Python loops (SHARDBROKER_NO_EXTENSIONS is set)" in pure.log()
    assert pure.wait_log(r"ready: .* hot_path=(\S+)").group(1) == "pure"
    if compiled is not None:
        default = start_broker(workers=1, env={"SHARDBROKER_NO_EXTENSIONS": ""})
        assert default.varz()["hot_path"] == "compiled"
        assert default.wait_log(r"ready: .* hot_path=(\S+)").group(1) == "compiled"
        assert "pure-Python loops" not in default.log()


# The protocol and routing tests that go through the hot paths, again on the pure ones (the rest of the suite runs
# them, and all the others, compiled where built): byte-exact transcripts whole and split, real NATS clients
# (wildcards, headers, UNSUB limits, echo, queue groups, request/reply), NDJSON publishing and ordering, the ping
# barriers and routing across workers, and the NATS parser's fuzz.  What comes before or beside publishing
# (logins, INFO, pings, limits, reconnects) does not touch the hot path and runs once.
_PURE = {
    "tests/protocols/test_nats.py": ["nats_py_pub_sub_wildcards_and_flush", "nats_py_request_reply_and_no_responders",
                           "nats_py_queue_groups_across_workers_exactly_once_and_fair", "nats_py_headers",
                           "nats_py_unsubscribe_limit_and_drain", "nats_py_echo_false",
                           "transcript_pipelined_in_one_packet", "transcript_split_at_every_byte_boundary",
                           "transcript_one_byte_at_a_time", "headers_are_stripped_for_clients_without_headers",
                           "pedantic_and_plain_publish_to_wildcards", "slow_nats_consumer_is_closed_without_err",
                           "cross_protocol_delivery_both_ways", "byte_counters_count_payloads_as_nats_server"],
    "tests/protocols/test_ndjson_protocol.py": ["readme_insecure_transcript_byte_for_byte",
                                      "publisher_receives_its_own_message_after_delivery_order",
                                      "data_passes_through_unchanged",
                                      "many_requests_in_one_packet_and_one_request_split_across_packets",
                                      "overlapping_patterns_deliver_once_per_connection"],
    "tests/protocols/test_delivery_barrier.py": ["nats_pong_means_cross_worker_messages_are_delivered",
                                       "ndjson_ping_reply_means_cross_worker_messages_are_delivered",
                                       "drain_of_a_responder_answers_requests_in_flight"],
    "tests/cluster/test_cluster.py": ["cross_worker_delivery_and_per_publisher_order",
                              "wildcard_subscriptions_across_workers"],
    "tests/cluster/test_load.py": ["slow_but_steady_subscriber_sets_the_pace_instead_of_being_cut"],
    "tests/unit/test_fuzz.py": ["nats_split_anywhere_same_as_whole"],
    # the work queues' loops (workers/workqueues/purecore.py): receive, ack in batches, redelivery, dead letters,
    # counts, a receive's rendering, a replay after kill -9, and qlite's receipts
    "tests/queues/test_queues.py": ["push_recv_ack_round_trip_preserves_data",
                             "visibility_expiry_redelivers_and_old_receipt_is_lost",
                             "max_deliveries_dead_letters_and_redrive", "duplicate_ack", "batch_ack_mixed",
                             "qstat_exact_counts"],
    "tests/queues/test_queue_cluster.py": ["kill_9_of_the_owner_loses_nothing_acknowledged"],
    "tests/queues/test_qlite.py": ["hide_expiry_redelivers_with_a_new_receipt", "many_subscribers_share_the_work_once_each"],
    # runs of canonical pushes (purepath.ndjson_runs), canonical batch pushes (purepath.qpush_batch)
    "tests/queues/test_queue_push_runs.py": [
        "a_long_run_of_pipelined_pushes_is_answered_in_order_and_stores_the_data_as_written",
        "runs_of_pushes_with_a_priority_or_a_delay_keep_them_and_refuse_alone_what_is_out_of_range",
        "a_canonical_batch_push_stores_each_data_as_written"],
    "tests/queues/test_queue_dedup.py": ["a_push_sent_again_with_its_dedup_id_is_stored_once"],
}
PURE_PATH_TESTS = [f"{path}::test_{name}" for path, names in _PURE.items() for name in names]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(speedups.FORCED_PURE, reason="this run is on the pure path already")
def test_protocol_tests_pass_on_the_pure_path():
    env = dict(os.environ, SHARDBROKER_NO_EXTENSIONS="1")
    env.pop("SHARDBROKER_REQUIRE_COMPILED", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PURE_PATH_TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
