"""Property-based tests of every codec (hypothesis): any byte sequence, split anywhere, gives the same result as
unsplit, and nothing raises out of a parser.  The inputs mix well-formed frames with arbitrary bytes, so that both
the paths a client takes and the ones a broken or hostile one takes are covered, with small limits so that the
limit checks are reached often.

``FUZZ_EXAMPLES`` sets the inputs tried per property (default 1,000: one to three seconds per codec; a long run:
``FUZZ_EXAMPLES=50000 pytest tests/unit/test_fuzz.py``).  Each test counts what it tried (``-s`` prints it);
docs/reliability.md records a long run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardbroker.workers.protocols.bridge import codec as bridge_codec
from shardbroker.workers.protocols.leaf import codec as leaf_codec
from shardbroker.workers.protocols.nats import codec as nats_codec
from shardbroker.workers.protocols.ndjson import codec as ndjson_codec
from shardbroker.workers.protocols.qlite import codec as qlite_codec

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TRIED: dict[str, int] = {}


def _tried(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


def stream(pieces: list[bytes], padded: st.SearchStrategy[bytes] = st.nothing()) -> st.SearchStrategy[bytes]:  # noqa: B008 (a strategy, immutable)
    """Byte strings made of well-formed pieces, lines padded to lengths near the limits, and arbitrary bytes, in
    any order."""
    return st.lists(st.one_of(st.sampled_from(pieces), padded, st.binary(max_size=24)), max_size=24).map(b"".join)


def padded(heads: list[bytes], tails: list[bytes], pad: bytes = b" ") -> st.SearchStrategy[bytes]:
    """A line of any length up to past the limits the tests use (a line's length decides the limit's checks)."""
    return st.builds(lambda head, k, tail: head + pad * k + tail, st.sampled_from(heads),
                     st.integers(min_value=0, max_value=130), st.sampled_from(tails))


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in points + [len(data)]:
        out.append(data[last:p])
        last = p
    return out


CUTS = st.lists(st.integers(min_value=0, max_value=10_000), max_size=12)
ONE_BYTE = st.booleans()   # also feed it one byte at a time


def pieces_of(data: bytes, cuts: list[int], one_byte: bool) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))] if one_byte else split(data, cuts)


# -- NDJSON ----------------------------------------------------------------------------------------------------
NDJSON_PIECES = [b'{"op":"pub","topic":"a.b","data":{"x":[1,2.5,"s"]}}\n', b'{"op":"sub","topic":"a.*"}\n',
                 b'{"op":"ping","id":7}\r\n', b"\n", b"\r\n", b'{"data":123456789012345678901234567890}\n',
                 b'{"op":', b'"\xff\xfe"', b"[1,2]\n", b"null\n", b"\x00"]


def _ndjson(chunks: list[bytes], max_line: int) -> list:
    """What a session makes of the chunks: each line parsed (None: too long, which ends the session)."""
    tail, out = b"", []
    for chunk in chunks:
        lines, tail = ndjson_codec.split_lines(tail, chunk, max_line)
        for line in lines:
            if line is None:
                out.append("line_too_long")
                return out
            out.append(ndjson_codec.parse(line))
            ndjson_codec.is_blank(line)
    out.append(("tail", tail))
    return out


@FUZZ
@given(stream(NDJSON_PIECES, padded([b'{"op":"ping"', b"{"], [b"}\n", b"}\r\n", b"}"])), CUTS, ONE_BYTE,
       st.integers(min_value=8, max_value=120))
def test_ndjson_split_anywhere_same_as_whole(data, cuts, one_byte, max_line):
    _tried("ndjson")
    assert _ndjson(pieces_of(data, cuts, one_byte), max_line) == _ndjson([data], max_line)


# -- NATS ------------------------------------------------------------------------------------------------------
NATS_PIECES = [b"PUB foo 5\r\nhello\r\n", b"pub foo.bar reply.x 3\r\nabc\r\n", b"PUB a 0\r\n\r\n",
               b"HPUB h 12 14\r\nNATS/1.0\r\n\r\nhi\r\n", b"SUB foo 1\r\n", b"sub foo q 2\n", b"UNSUB 1 5\r\n",
               b"PING\r\n", b"PONG\r\n", b"CONNECT {\"verbose\":false}\r\n", b"INFO {}\r\n", b"PUB x 99999\r\n",
               b"PUB x 3\r\nabcXY", b"\t PING \t\r\n", b"\r\n", b"SUB " + b"s" * 70 + b" 1\r\n"]


def _nats(chunks: list[bytes], max_line: int, max_payload: int, scan=None) -> list:
    """The parser's commands, a run of PUBs counted as its PUBs (how a stream is cut into reads decides the runs);
    ``scan``: one implementation of ``scan_pubs`` (tests/unit/test_speedups.py), else the one in use."""
    parser = nats_codec.Parser(max_line, max_payload, scan=scan)
    out = []
    for chunk in chunks:
        for cmd in parser.feed(chunk):
            if cmd[0] == nats_codec.OP_PUBS:
                out.extend((nats_codec.OP_PUB, cmd[1], cmd[2], None, payload) for payload in cmd[3])
            else:
                out.append(cmd)
    return out


@FUZZ
@given(stream(NATS_PIECES, padded([b"PING", b"SUB a 1", b"PUB a 1", b"CONNECT {}", b"HPUB a 0 1"],
                                   [b"\r\n", b"\n", b"\r", b"\r\nx\r\n", b"\nx\r\n"])), CUTS, ONE_BYTE,
       st.integers(min_value=16, max_value=80),
       st.integers(min_value=0, max_value=40))
def test_nats_split_anywhere_same_as_whole(data, cuts, one_byte, max_line, max_payload):
    _tried("nats")
    assert _nats(pieces_of(data, cuts, one_byte), max_line, max_payload) == _nats([data], max_line, max_payload)


# -- Bridge ----------------------------------------------------------------------------------------------------
BRIDGE_PIECES = [b"Schat   ", b"Uchat   ", b"Pnews   ", b"Sa.b-c_d", b"X1234567", b"S", b"\x00" * 8, b"hello"]


def _bridge(chunks: list[bytes]) -> list:
    """The parser's items, the publish stream's pieces joined (how it arrives in pieces is the kernel's)."""
    parser = bridge_codec.Parser()
    out: list = []
    for chunk in chunks:
        for kind, arg in parser.feed(chunk):
            if kind == bridge_codec.DATA and out and out[-1][0] == bridge_codec.DATA:
                out[-1] = (kind, out[-1][1] + arg)
            else:
                out.append((kind, arg))
    return out


@FUZZ
@given(stream(BRIDGE_PIECES), CUTS, ONE_BYTE)
def test_bridge_split_anywhere_same_as_whole(data, cuts, one_byte):
    _tried("bridge")
    assert _bridge(pieces_of(data, cuts, one_byte)) == _bridge([data])


# -- qlite -----------------------------------------------------------------------------------------------------
def _frame(payload: bytes) -> bytes:
    return qlite_codec.frame(payload)


QLITE_PIECES = [_frame(b"\x00alice;$2b$04$" + b"a" * 53), _frame(b"PUSH;hello"), _frame(b"poll;\x05\x00\x00\x00"),
                _frame(b"HIDE;\x01"), _frame(b"DEL;" + b"r" * 16), _frame(b"LEN;"), _frame(b"nosemicolon"),
                _frame(b""), b"\xff\xff\xff\x7f", b"\x05\x00\x00\x00ab"]


def _qlite(chunks: list[bytes], limit: int, first_limit: int) -> list:
    """The frames, each as the session would read it: the first as a login, the others as requests."""
    deframer = qlite_codec.Deframer(limit, first_limit)
    out: list = []
    for chunk in chunks:
        for item in deframer.feed(chunk):
            if isinstance(item, qlite_codec.FrameTooLong):
                out.append(("too_long", item.length, item.first))
                continue
            parse = qlite_codec.parse_auth if not out else qlite_codec.parse_request
            try:
                out.append(parse(item))
            except qlite_codec.QliteError as exc:   # the one exception the codec may raise: a FAIL reply
                out.append(("fail", str(exc)))
    return out


@FUZZ
@given(stream(QLITE_PIECES), CUTS, ONE_BYTE, st.integers(min_value=0, max_value=64),
       st.integers(min_value=0, max_value=128))
def test_qlite_split_anywhere_same_as_whole(data, cuts, one_byte, limit, first_limit):
    _tried("qlite")
    assert _qlite(pieces_of(data, cuts, one_byte), limit, first_limit) == _qlite([data], limit, first_limit)


# -- leaf (what a NATS hub sends a leaf connection) -------------------------------------------------------------
LEAF_PIECES = [b"LS+ a.b\r\n", b"LS+ w q 3\r\n", b"ls- w q\r\n", b"LS- a.b\r\n", b"LMSG a 2\r\nhi\r\n",
               b"LMSG a r 1\r\nx\r\n", b"LMSG a | q1 q2 0\r\n\r\n", b"LMSG a + r q 3\r\nabc\r\n",
               b"HMSG a 12 14\r\nNATS/1.0\r\n\r\nhi\r\n", b"HMSG a + r q 2 3\r\nabc\r\n", b"PING\r\n",
               b"PONG\n", b"-ERR 'Loop detected'\r\n", b"+OK\r\n", b'INFO {"a":1}\r\n', b"INFO [\r\n",
               b"LMSG a 3\r\nabcXY", b"LS+ \r\n", b"LMSG a | 1\r\nx\r\n", b"\t ping \t\r\n"]


def _leaf(chunks: list[bytes], max_line: int, max_payload: int) -> list:
    parser = leaf_codec.Parser(max_payload, max_line)
    return [event for chunk in chunks for event in parser.feed(chunk)]


@FUZZ
@given(stream(LEAF_PIECES, padded([b"LS+ a", b"LMSG a 1", b"HMSG a 0 1", b"-ERR x"],
                                   [b"\r\n", b"\n", b"\r", b"\r\nx\r\n", b"\nx\r\n"])), CUTS, ONE_BYTE,
       st.integers(min_value=16, max_value=80), st.integers(min_value=0, max_value=40))
def test_leaf_split_anywhere_same_as_whole(data, cuts, one_byte, max_line, max_payload):
    _tried("leaf")
    assert _leaf(pieces_of(data, cuts, one_byte), max_line, max_payload) == _leaf([data], max_line, max_payload)


def test_fuzz_counts():
    """Runs last in this module: what was tried (visible with -s)."""
    print(f"\nfuzz inputs tried per codec: {TRIED}")
