"""The leafnode codec (workers/protocols/leaf/codec.py) against the lines nats-server 2.15.1 was measured sending and
taking (../shared/reference/leafnodes.md §2-3, §6 transcripts), and what a broken hub gets."""

from __future__ import annotations

import pytest

from shardbroker.workers.protocols.leaf import codec
from shardbroker.workers.protocols.leaf.codec import ERR, INFO, LS_ADD, LS_DEL, MSG, OK, PING, PONG, REMOTE_ERR, Parser


def feed(data: bytes, max_payload: int = 1 << 20, max_line: int = codec.CONTROL_LINE_MAX) -> list:
    return Parser(max_payload, max_line).feed(data)


def test_transcript_from_the_hub():
    data = (b'INFO {"server_id":"NAJU","client_id":5,"connect_info":true,"remote_account":"$G"}\r\n'
            b"LS+ $LDS.FdEQOf7uozS5S64ESu3br9\r\nLS+ hub.plain\r\nLS+ work wq 1\r\nLS- work wq\r\n"
            b"LMSG leaf.x 8\r\nfrom-hub\r\nLMSG work | wq 2\r\nh2\r\nLMSG _INBOX.a.b 13\r\npong-from-hub\r\n"
            b"HMSG raw.plain 18 20\r\nNATS/1.0\r\nK: V\r\n\r\np1\r\nLMSG raw.q | g 2\r\nq1\r\n"
            b"LMSG hubsvc rawinbox.1 4\r\nping\r\nPING\r\nPONG\r\n+OK\r\n"
            b"-ERR 'Loop detected for leafnode account=\"$G\". Delaying attempt to reconnect for 30s'\r\n")
    events = feed(data)
    assert events[0] == (INFO, {"server_id": "NAJU", "client_id": 5, "connect_info": True, "remote_account": "$G"})
    assert events[1:5] == [(LS_ADD, b"$LDS.FdEQOf7uozS5S64ESu3br9", None, 0), (LS_ADD, b"hub.plain", None, 0),
                           (LS_ADD, b"work", b"wq", 1), (LS_DEL, b"work", b"wq")]
    assert events[5:11] == [
        (MSG, b"leaf.x", None, (), None, b"from-hub"),
        (MSG, b"work", None, (b"wq",), None, b"h2"),
        (MSG, b"_INBOX.a.b", None, (), None, b"pong-from-hub"),
        (MSG, b"raw.plain", None, (), b"NATS/1.0\r\nK: V\r\n\r\n", b"p1"),
        (MSG, b"raw.q", None, (b"g",), None, b"q1"),
        (MSG, b"hubsvc", b"rawinbox.1", (), None, b"ping"),
    ]
    assert events[11:14] == [(PING,), (PONG,), (OK,)]
    assert events[14] == (REMOTE_ERR, 'Loop detected for leafnode account="$G". Delaying attempt to reconnect '
                                      'for 30s')


def test_reply_and_queues_and_case_and_tabs():
    events = feed(b"lmsg\ta + r.1 q1 q2  3\r\nabc\r\nls+ a.*\tg  7\n")
    assert events == [(MSG, b"a", b"r.1", (b"q1", b"q2"), None, b"abc"), (LS_ADD, b"a.*", b"g", 7)]


def test_split_payload_across_reads():
    parser = Parser(1 << 20)
    big = b"x" * 200_000
    data = b"LMSG big 200000\r\n" + big + b"\r\nPING\r\n"
    out = []
    for i in range(0, len(data), 7000):
        out += parser.feed(data[i:i + 7000])
    assert out == [(MSG, b"big", None, (), None, big), (PING,)]


@pytest.mark.parametrize("data, reason", [
    (b"LMSG a 5\r\nabcdeXY", "not followed by CRLF"),
    (b"LMSG a 2000\r\n", "over max_payload"),
    (b"HMSG a 5 3\r\n", "malformed HMSG sizes"),
    (b"LMSG a x\r\n", "malformed LMSG size"),
    (b"LMSG a + 3\r\n", "'+' and no reply"),
    (b"LMSG a r s 3\r\n", "malformed LMSG arguments"),
    (b"LS+ a q x\r\n", "malformed LS+"),
    (b"LS- a b c\r\n", "malformed LS-"),
    (b"SUB a 1\r\n", "unknown operation 'SUB'"),
    (b"INFO {nope\r\n", "not JSON"),
    (b"INFO [1]\r\n", "not a JSON object"),
    (b"\r\n", "empty control line"),
])
def test_bad_input_is_an_error_and_stops(data, reason):
    parser = Parser(1024)
    events = parser.feed(data + b"PING\r\n")
    assert events[-1][0] == ERR and reason in events[-1][1]
    assert parser.feed(b"PING\r\n") == []   # nothing more after an error


def test_control_line_bound_while_arriving():
    parser = Parser(1024, max_control_line=100)
    assert parser.feed(b"LS+ " + b"a" * 60) == []
    events = parser.feed(b"a" * 60)   # no newline yet: the line is refused before it ends
    assert events[0][0] == ERR and "control line" in events[0][1]


def test_encodings():
    assert codec.ls_add(b"a.b") == b"LS+ a.b\r\n"
    assert codec.ls_add(b"w", b"q", 3) == b"LS+ w q 3\r\n"
    assert codec.ls_del(b"w", b"q") == b"LS- w q\r\n"
    assert codec.ls_del(b"a") == b"LS- a\r\n"
    assert codec.lmsg(codec.message_head(b"s", None, None), None, b"hi") == b"LMSG s 2\r\nhi\r\n"
    assert codec.lmsg(codec.message_head(b"s", b"r", None), None, b"hi") == b"LMSG s r 2\r\nhi\r\n"
    assert codec.lmsg(codec.message_head(b"s", None, b"q1 q2"), None, b"") == b"LMSG s | q1 q2 0\r\n\r\n"
    assert codec.lmsg(codec.message_head(b"s", b"r", b"q"), b"NATS/1.0\r\n\r\n", b"x") == \
        b"HMSG s + r q 12 13\r\nNATS/1.0\r\n\r\nx\r\n"
    assert codec.connect({"name": "sb-w0"}) == b'CONNECT {"name":"sb-w0"}\r\n'
    assert codec.err("Loop") == b"-ERR 'Loop'\r\n"
    # what a spoke sends parses back as a hub's message would
    line = codec.lmsg(codec.message_head(b"s", b"r", b"q"), b"NATS/1.0\r\n\r\n", b"x")
    assert feed(line) == [(MSG, b"s", b"r", (b"q",), b"NATS/1.0\r\n\r\n", b"x")]
