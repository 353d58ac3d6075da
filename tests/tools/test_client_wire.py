"""The client side's codecs (cli/wire: NDJSON, NATS, RESP), sans I/O: what they write, byte for byte; what they read,
fed whole, split at every position and one byte at a time, with partial frames and errors; and, where the broker
has the other end (workers/protocols/ndjson/codec.py, workers/protocols/nats/codec.py, workers/delivery.py),
that each end reads what the other writes."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading

import orjson
import pytest

from shardbroker.cli.bench import wire as bench_wire
from shardbroker.cli.wire import nats, ndjson, resp

from support.harness import REPO, NatsFrames


def splits(data: bytes):
    """``data`` in pieces: whole, cut in two at every position, one byte at a time, and cut at random places."""
    yield [data]
    for i in range(len(data) + 1):
        yield [data[:i], data[i:]]
    yield [data[i:i + 1] for i in range(len(data))]
    rnd = random.Random(len(data))
    for _ in range(20):
        cuts = sorted(rnd.sample(range(len(data) + 1), min(len(data) + 1, 5)))
        yield [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]


def fed(parse, pieces: list[bytes]) -> tuple[list, bytes]:
    """What a ``parse(buf) -> (items, used)`` reads of ``pieces`` arriving one after another, and what is left."""
    buf, out = b"", []
    for piece in pieces:
        buf += piece
        items, used = parse(buf)
        out += items
        buf = buf[used:]
    return out, buf


# -- NDJSON ------------------------------------------------------------------------------------------------------

def test_ndjson_requests_are_one_line_with_op_first():
    assert ndjson.request("ping") == b'{"op":"ping"}\n'
    assert ndjson.request("pub", topic="a.b", data={"x": [1, "é"]}) == \
        b'{"op":"pub","topic":"a.b","data":{"x":[1,"\xc3\xa9"]}}\n'
    assert ndjson.request("auth", user="u", **{"pass": "p"}) == b'{"op":"auth","user":"u","pass":"p"}\n'
    assert ndjson.encode({"op": "qstat", "queue": "q"}) == b'{"op":"qstat","queue":"q"}\n'
    assert ndjson.request("pub", topic="t", data="a\nb").count(b"\n") == 1   # a newline in data is escaped


def test_ndjson_requests_are_what_the_broker_reads():
    from shardbroker.workers.protocols.ndjson import codec as ndjson_codec
    for line in (ndjson.request("sub", topic="chat.*"), ndjson.request("qpush", queue="q", data=[1, {"a": None}]),
                 ndjson.encode({"op": "ping", "id": "ready"})):
        lines, tail = ndjson_codec.split_lines(b"", line, 1 << 20)
        assert tail == b"" and ndjson_codec.parse(lines[0]) == orjson.loads(line)


def test_ndjson_lines_split_anywhere():
    data = b'{"ok":true}\n\n{"topic":"t","data":1}\n  \n{"ok":false,"error":"x"}\n{"ok":tr'
    whole = data.split(b"\n")[:-1]

    def parse(buf: bytes) -> tuple[list[bytes], int]:
        done, rest = ndjson.lines(buf)
        return done, len(buf) - len(rest)

    for pieces in splits(data):
        got, rest = fed(parse, pieces)
        assert got == whole and rest == b'{"ok":tr'
    assert ndjson.lines(b"") == ([], b"")
    assert ndjson.lines(b"partial") == ([], b"partial")
    assert ndjson.lines(b"a\nb\n") == ([b"a", b"b"], b"")


def test_ndjson_first_line():
    assert ndjson.first_line(b"") is None
    assert ndjson.first_line(b'{"ok":true}') is None
    assert ndjson.first_line(b'{"ok":true}\n{"ok"') == (b'{"ok":true}\n', b'{"ok"')
    assert ndjson.first_line(b"\n\n") == (b"\n", b"\n")


def test_ndjson_decoder_split_anywhere_skips_blank_lines_and_keeps_the_tail():
    objs = [{"ok": True}, {"topic": "a", "data": {"n": 1}}, {"ok": False, "error": "bad"}, {"topic": "b", "data": "x"}]
    data = b"".join(orjson.dumps(o) + b"\n" for o in objs[:2]) + b"   \n\r\n" + \
        b"".join(orjson.dumps(o) + b"\r\n" for o in objs[2:]) + b'{"topic":"c"'
    for pieces in splits(data):
        dec = ndjson.Decoder()
        got = [obj for piece in pieces for obj in dec.feed(piece)]
        assert got == objs
        assert dec.feed(b',"data":2}\n') == [{"topic": "c", "data": 2}]
        assert dec.feed(b"") == []


def test_ndjson_decoder_raises_on_a_line_that_is_not_json():
    dec = ndjson.Decoder()
    with pytest.raises(orjson.JSONDecodeError):
        dec.feed(b'{"ok":true}\nnot json\n')
    assert dec.feed(b'{"ok":true}\n') == [{"ok": True}]   # the bad line is gone with the read it came in


def test_ndjson_replies_and_deliveries():
    assert ndjson.is_reply({"ok": False, "error": "x"}) and not ndjson.is_reply({"topic": "t", "data": 1})
    assert ndjson.delivery({"topic": "t", "data": [1], "reply": "r", "encoding": "base64"}) == \
        ndjson.Delivery("t", [1], {"reply": "r", "encoding": "base64"})
    assert ndjson.delivery({}) == ("", None, {})
    assert ndjson.error_of(b'{"ok":false,"error":"queue_full","room":3}') == "queue_full"
    assert ndjson.error_of(b'{"ok":false}') == {"ok": False}
    assert ndjson.error_of(b"garbage \xff") == "garbage \ufffd"
    assert ndjson.error_of(b"[1]") == [1]


def test_ndjson_prefixes_are_how_the_broker_starts_replies_and_deliveries():
    from shardbroker.workers import delivery
    from shardbroker.workers.message import KIND_JSON
    from shardbroker.workers.protocols.ndjson import codec as ndjson_codec
    for line in (ndjson_codec.OK, ndjson_codec.reply({"id": 1}), ndjson_codec.reply_with({}, {"info": {}})):
        assert line.startswith(ndjson.OK) and line.startswith(ndjson.REPLY)
    for line in (ndjson_codec.error("bad"), ndjson_codec.reply({}, "bad")):
        assert line.startswith(ndjson.REPLY) and not line.startswith(ndjson.OK)
    line = delivery.ndjson_delivery(delivery.ndjson_prefix("a.b"), KIND_JSON, b'{"n":1}', "inbox", None)
    assert line.startswith(ndjson.DELIVERY)
    [obj] = ndjson.Decoder().feed(line)
    assert ndjson.delivery(obj) == ("a.b", {"n": 1}, {"reply": "inbox"})


# -- NATS --------------------------------------------------------------------------------------------------------

def test_nats_commands_byte_for_byte():
    assert nats.connect({"verbose": False, "pedantic": False, "echo": False}) == \
        b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\n'
    assert nats.sub("a.*", 7) == nats.sub(b"a.*", 7) == b"SUB a.* 7\r\n"
    assert nats.sub("a.*", 7, "g") == nats.sub("a.*", 7, b"g") == b"SUB a.* g 7\r\n"
    assert nats.sub("a.*", 7, "") == b"SUB a.* 7\r\n"
    assert nats.pub("a.b", b"hi") == nats.pub(b"a.b", b"hi", b"") == b"PUB a.b 2\r\nhi\r\n"
    assert nats.pub("a.b", b"", "_INBOX.1") == b"PUB a.b _INBOX.1 0\r\n\r\n"
    assert nats.pub_head(b"s", 28) == b"PUB s 28\r\n"
    assert nats.pub_head("é", 1, "r") == "PUB é r 1\r\n".encode()
    assert nats.empty_pubs([b"$JS.ACK.a", b"$JS.ACK.b"]) == b"PUB $JS.ACK.a 0\r\n\r\nPUB $JS.ACK.b 0\r\n\r\n"
    assert nats.empty_pubs([]) == b""
    assert (nats.PING, nats.PONG) == (b"PING\r\n", b"PONG\r\n")


def test_nats_commands_are_what_the_broker_reads():
    from shardbroker.workers.protocols.nats import codec as nats_codec
    parser = nats_codec.Parser(4096, 1 << 20)
    got = parser.feed(nats.connect({"verbose": True}) + nats.sub("a.*", 3, "q") + nats.pub("a.b", b"x\r\ny", "r")
                      + nats.pub_head("a.c", 2) + b"zz\r\n" + nats.empty_pubs([b"ack.1"]) + nats.PING)
    assert got[0] == (nats_codec.OP_CONNECT, b'{"verbose":true}')
    assert got[1] == (nats_codec.OP_SUB, b"a.*", b"q", b"3")
    # PUBs come one by one or as a run to one subject: (subject, reply, payloads) either way
    pubs = [(c[1], c[2], c[4]) if c[0] == nats_codec.OP_PUB else (c[1], c[2], p) for c in got[2:-1]
            for p in (c[3] if c[0] == nats_codec.OP_PUBS else [None])]
    assert pubs == [(b"a.b", b"r", b"x\r\ny"), (b"a.c", None, b"zz"), (b"ack.1", None, b"")]
    assert got[-1] == (nats_codec.OP_PING,)


def _server_stream() -> tuple[bytes, list]:
    """What a NATS server may send, and the items ``parse(..., controls=True)`` reads of it."""
    from shardbroker.workers.delivery import Outgoing
    from shardbroker.workers.protocols.nats import codec as nats_codec
    from shardbroker.workers.protocols.nats import greeting
    items: list = []
    out = [greeting.info_line({"server_id": "x", "client_id": 7})]
    items.append(b'INFO {"server_id":"x","client_id":7} ')
    plain = Outgoing(b"a.b", None, None, b"hello")
    out.append(plain.msg_line(b"1") + plain.body)
    items.append((b"a.b", b"", b"", b"hello"))
    tricky = Outgoing(b"c", b"_INBOX.9", b"NATS/1.0\r\nK: v\r\n\r\n", b"MSG x 1 3\r\nabc\r\n")
    out.append(tricky.msg_line(b"2") + tricky.body)
    items.append((b"c", b"_INBOX.9", b"", b"MSG x 1 3\r\nabc\r\n"))
    out.append(tricky.hmsg_line(b"2") + tricky.hbody)
    items.append((b"c", b"_INBOX.9", b"NATS/1.0\r\nK: v\r\n\r\n", b"MSG x 1 3\r\nabc\r\n"))
    hplain = Outgoing(b"d", None, b"NATS/1.0\r\n\r\n", b"")
    out.append(hplain.hmsg_line(b"3") + hplain.hbody)
    items.append((b"d", b"", b"NATS/1.0\r\n\r\n", b""))
    out += [nats_codec.PING, nats_codec.OK, nats_codec.PONG, nats_codec.no_responders(b"_INBOX.q", b"4")]
    items += [b"PING", b"+OK", b"PONG", (b"_INBOX.q", b"", b"NATS/1.0 503\r\n\r\n", b"")]
    empty = Outgoing(b"e", None, None, b"")
    out.append(empty.msg_line(b"5") + empty.body)
    items.append((b"e", b"", b"", b""))
    return b"".join(out), items


def test_nats_parse_split_anywhere():
    data, items = _server_stream()
    messages = [i for i in items if type(i) is tuple]
    for pieces in splits(data + b"MSG z 1 5\r\nab"):
        got, rest = fed(lambda buf: nats.parse(buf, controls=True), pieces)
        assert got == items and rest == b"MSG z 1 5\r\nab"
        got, rest = fed(nats.parse, pieces)
        assert got == messages and rest == b"MSG z 1 5\r\nab"


def test_nats_parse_peek_slices_only_the_start_of_each_payload():
    data, items = _server_stream()
    for peek in (0, 3, 5, 100):
        got, used = nats.parse(data, controls=True, peek=peek)
        assert used == len(data)
        assert got == [(*i[:3], i[3][:peek]) if type(i) is tuple else i for i in items]
    frame = b"MSG a 1 10\r\n0123456789\r\n"
    for pieces in splits(frame * 3):
        assert fed(lambda buf: nats.parse(buf, peek=4), pieces) == ([(b"a", b"", b"", b"0123")] * 3, b"")


def test_nats_parse_waits_for_a_whole_frame():
    frame = b"MSG a 1 r 5\r\nhello\r\n"
    for i in range(len(frame)):
        assert nats.parse(frame[:i], controls=True) == ([], 0)
    assert nats.parse(frame) == ([(b"a", b"r", b"", b"hello")], len(frame))
    assert nats.parse(b"PING\r") == ([], 0)
    assert nats.parse(b"PING\r\nPO", controls=True) == ([b"PING"], 6)


def test_nats_err_raises_unless_control_lines_are_asked_for():
    data = b"MSG a 1 1\r\nx\r\n-ERR 'Authorization Violation'\r\nMSG b 1 1\r\ny\r\n"
    with pytest.raises(nats.ServerError) as err:
        nats.parse(data)
    assert err.value.line == b"-ERR 'Authorization Violation'"
    assert str(err.value) == "-ERR 'Authorization Violation'"
    items, used = nats.parse(data, controls=True)
    assert items == [(b"a", b"", b"", b"x"), b"-ERR 'Authorization Violation'", (b"b", b"", b"", b"y")]
    assert used == len(data)
    assert nats.error_text(items[1]) == "Authorization Violation"
    assert nats.parse(b"-ERR 'x") == ([], 0)   # not a whole line yet: nothing raised


def test_nats_frame_size_gives_each_frame_its_bytes():
    data, items = _server_stream()
    got, used = nats.parse(data, controls=True)
    pos, frames = 0, []
    for item in got:
        size = nats.frame_size(data, pos, item)
        frames.append(data[pos:pos + size])
        pos += size
    assert pos == used == len(data) and b"".join(frames) == data
    assert [nats.parse(f, controls=True)[0] for f in frames] == [[i] for i in items]


def test_nats_info():
    assert nats.info(b'INFO {"client_id":3} \r\n') == {"client_id": 3}
    assert nats.info(b'INFO {"client_id":3}') == {"client_id": 3}


def test_bench_nats_frames_keeps_its_error():
    with pytest.raises(bench_wire.QueueProtocolError, match=r"^nats-server: -ERR 'Stale Connection'$"):
        bench_wire.nats_frames(b"-ERR 'Stale Connection'\r\n")
    data = b"INFO {}\r\nMSG a 1 2\r\nhi\r\n"
    assert bench_wire.nats_frames(data + b"MS") == ([(b"a", b"", b"", b"hi")], len(data))


def test_harness_nats_frames_takes_what_it_is_asked_for_and_answers_pings():
    data = (b"INFO {} \r\nMSG _INBOX.t.1 1 5\r\nfirst\r\n+OK\r\nPING\r\n"
            b"HMSG _INBOX.t.2 1 12 14\r\nNATS/1.0\r\n\r\nhi\r\n-ERR 'Slow Consumer'\r\n"
            b"MSG _INBOX.t.3 1 r.x 8\r\nMSG\r\nx\r\n\r\n")
    messages = [(b"_INBOX.t.1", b"", b"", b"first"), (b"_INBOX.t.2", b"", b"NATS/1.0\r\n\r\n", b"hi"),
                (b"_INBOX.t.3", b"r.x", b"", b"MSG\r\nx\r\n")]
    mine, theirs = socket.socketpair()
    with mine, theirs:
        writer = threading.Thread(target=lambda: [mine.sendall(data[i:i + 7]) for i in range(0, len(data), 7)])
        writer.start()
        frames = NatsFrames(theirs)
        got = frames.take(2) + frames.take(len(messages) - 2)
        writer.join()
        assert got == [("1", b"", b"first"), ("2", b"NATS/1.0\r\n\r\n", b"hi"), ("3", b"", b"MSG\r\nx\r\n")]
        assert frames.buf == b"" and len(frames.raw) == len(messages)
        assert [nats.parse(raw)[0] for raw in frames.raw] == [[m] for m in messages]
        mine.settimeout(5)
        assert mine.recv(100) == b"PONG\r\n"


# -- RESP --------------------------------------------------------------------------------------------------------

def test_resp_commands_byte_for_byte():
    assert resp.command(b"PING") == b"*1\r\n$4\r\nPING\r\n"
    assert resp.command(b"PUBLISH", b"ch", b"a\r\nb") == b"*3\r\n$7\r\nPUBLISH\r\n$2\r\nch\r\n$4\r\na\r\nb\r\n"
    assert resp.command(b"SET", b"k", b"") == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n"


REPLIES = [
    (b"+OK\r\n", b"OK"),
    (b":42\r\n", 42),
    (b":-1\r\n", -1),
    (b"$5\r\nhe\r\nl\r\n", b"he\r\nl"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
    (b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$3\r\nabc\r\n", [b"message", b"ch", b"abc"]),
    (b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n", [b"subscribe", b"ch", 1]),
    (b"*2\r\n*2\r\n$3\r\n1-1\r\n*2\r\n$1\r\nd\r\n$-1\r\n+x\r\n", [[b"1-1", [b"d", None]], b"x"]),
    (b"*2\r\n*-1\r\n-ERR in\r\n", [None, "ERR in"]),
]


def _plain(value):
    """Errors as their text, for comparing."""
    if isinstance(value, resp.Error):
        return str(value)
    return [_plain(v) for v in value] if isinstance(value, list) else value


def test_resp_each_reply_and_every_prefix_of_it():
    for data, value in REPLIES:
        assert _plain(resp.parse(data)[0]) == value and resp.parse(data)[1] == len(data)
        assert _plain(resp.parse(b"junk" + data, 4)[0]) == value
        for i in range(len(data)):
            assert resp.parse(data[:i]) is None, data[:i]
            assert resp.replies(data[:i]) == ([], 0)


def test_resp_replies_split_anywhere():
    data = b"".join(d for d, _ in REPLIES) + b"-WRONGPASS invalid username-password pair\r\n" + b"*2\r\n$3\r\nab"
    want = [v for _, v in REPLIES] + ["WRONGPASS invalid username-password pair"]
    for pieces in splits(data):
        got, rest = fed(resp.replies, pieces)
        assert [_plain(v) for v in got] == want and rest == b"*2\r\n$3\r\nab"


def test_resp_errors_are_values_and_garbage_raises():
    err = resp.parse(b"-ERR unknown command\r\n")[0]
    assert isinstance(err, resp.Error) and str(err) == "ERR unknown command"
    with pytest.raises(resp.ProtocolError) as exc:
        resp.replies(b":1\r\n?what\r\n")
    assert exc.value.line == b"?what"
    with pytest.raises(resp.ProtocolError):
        resp.parse(b"*1\r\n%1\r\n")


# -- the layer ---------------------------------------------------------------------------------------------------

def test_the_client_wire_imports_nothing_of_the_broker():
    """cli/wire ships with the client: it may not import workers, router or cluster, directly or not (pyproject.toml's
    import-linter contract states it for the code; this is what a program importing it loads)."""
    code = ("import sys, shardbroker.cli.wire.ndjson, shardbroker.cli.wire.nats, shardbroker.cli.wire.resp; "
            "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules if m.startswith('shardbroker.')} & "
            "{'shardbroker.workers', 'shardbroker.router', 'shardbroker.cluster'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
