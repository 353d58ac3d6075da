"""The pure modules, without a broker: subject rules, the trie, frames, codecs, configuration."""

import os
import random

import pytest

from shardbroker.cluster import config as cfgmod
from shardbroker.cluster import control
from shardbroker.router import frames
from shardbroker.router.shardmap import owner
from shardbroker.router.subjects import covers, is_valid_literal, is_valid_pattern
from shardbroker.router.sublist import Sublist
from shardbroker.workers import delivery
from shardbroker.workers.message import KIND_JSON, KIND_RAW
from shardbroker.workers.protocols.ndjson import codec


@pytest.mark.parametrize("subject,pattern_ok,literal_ok", [
    ("foo", True, True), ("foo.bar", True, True), ("foo.*", True, False), ("foo.>", True, False),
    (">", True, False), ("*", True, False), ("f*o.b>r", True, True), ("", False, False), (".foo", False, False),
    ("foo.", False, False), ("foo..bar", False, False), ("foo.>.bar", False, False), ("foo bar", False, False),
    ("foo\tbar", False, False), ("foo\nbar", False, False), ("caf\u00e9.\u2603", True, True),
])
def test_subject_syntax(subject, pattern_ok, literal_ok):
    assert is_valid_pattern(subject, 4096) is pattern_ok
    assert is_valid_literal(subject, 4096) is literal_ok


def test_subject_length_limit():
    assert is_valid_literal("a" * 10, 10)
    assert not is_valid_literal("a" * 11, 10)


MATCH_CASES = [
    ("foo.bar", "foo.bar", True), ("foo.*", "foo.bar", True), ("foo.*", "foo.bar.baz", False),
    ("foo.*", "foo", False), ("foo.>", "foo.bar.baz", True), ("foo.>", "foo", False), (">", "a", True),
    (">", "a.b.c", True), ("*.bar", "foo.bar", True), ("*.*", "a", False), ("*.>", "a.b", True),
    ("*.>", "a", False), ("a.*.c", "a.b.c", True), ("a.*.c", "a.b.d", False), ("foo", "foo.bar", False),
]


@pytest.mark.parametrize("pattern,subject,matches", MATCH_CASES)
def test_sublist_matching(pattern, subject, matches):
    sl = Sublist()
    sl.insert(pattern, "v")
    assert (sl.match(subject) == ["v"]) is matches
    assert covers(pattern, subject) is matches


def test_sublist_agrees_with_reference_matcher_on_random_patterns():
    rng = random.Random(7)
    toks = ["a", "b", "c"]
    patterns = {".".join(rng.choice(toks + ["*"]) for _ in range(rng.randint(1, 3))) for _ in range(60)}
    patterns |= {p + ".>" for p in list(patterns)[:20]} | {">"}
    sl = Sublist()
    for p in patterns:
        sl.insert(p, p)
    for _ in range(300):
        subject = ".".join(rng.choice(toks) for _ in range(rng.randint(1, 4)))
        assert sorted(sl.match(subject)) == sorted(p for p in patterns if covers(p, subject)), subject


def test_sublist_matches_a_pattern_of_thousands_of_wildcard_tokens():
    """A valid pattern of 2,000 '*' tokens (4 KiB, the default max_topic_length) matches without recursion: a
    recursive walk raised RecursionError for every publish to a long subject, on every worker (T5)."""
    sl = Sublist()
    sl.insert(".".join(["*"] * 2000), "stars")
    sl.insert(".".join(["a"] * 1999) + ".>", "tail")
    sl.insert("a.>", "short")
    assert sorted(sl.match(".".join(["a"] * 2000))) == ["short", "stars", "tail"]
    assert sl.match(".".join(["a"] * 1999)) == ["short"]


def test_sublist_remove_prunes_and_counts():
    sl = Sublist()
    assert sl.insert("a.b.c", 1) and not sl.insert("a.b.c", 1)
    sl.insert("a.*.c", 2)
    sl.insert("a.>", 3)
    gen = sl.generation
    assert len(sl) == 3
    assert sl.remove("a.b.c", 1) and not sl.remove("a.b.c", 1) and not sl.remove("x.y", 1)
    assert sl.generation > gen
    assert sorted(sl.match("a.b.c")) == [2, 3]
    sl.remove("a.*.c", 2)
    sl.remove("a.>", 3)
    assert len(sl) == 0 and sl._root.empty()
    assert sorted(sl.patterns()) == []


def test_sublist_patterns_snapshot():
    sl = Sublist()
    for p in ["a", "a.b", "a.*", "a.>", ">", "*.x"]:
        sl.insert(p, p)
    assert sorted(p for p, _ in sl.patterns()) == sorted(["a", "a.b", "a.*", "a.>", ">", "*.x"])


def test_shard_owner_is_crc32_mod_n_and_stable():
    import zlib
    for s in ["a", "chat.room1", "caf\u00e9"]:
        assert owner(s, 7) == zlib.crc32(s.encode()) % 7
    # CRC-32 is fixed by its standard: the map is the same on every machine, in every run, in every release.
    assert zlib.crc32(b"chat.room1") == 0x257009d5
    assert owner("chat.room1", 4) == 1 and owner("chat.room1", 8) == 5


def test_frames_round_trip():
    msgs = [("a.b", KIND_JSON, b'"x"', None, None), ("c", KIND_RAW, b"\x00\xff", "inbox.1", b"NATS/1.0\r\n\r\n")]
    ctrl = [("+", "a.*"), ("cnt", [("a.b", 3, 9)])]
    frame = frames.encode(5, 2, 9, 17, 100, 4, 7, msgs, ctrl)
    assert frame.startswith(frames.prefix(5))
    assert frames.decode(frame) == (2, 9, 17, 100, 4, 7, 0, msgs, ctrl)
    ack_only = frames.encode(1, 0, 3, 0, 0, 12, 7, [], [])
    assert len(ack_only) == frames.HEADER_SIZE
    assert frames.decode(ack_only) == (0, 3, 0, 0, 12, 7, 0, [], [])
    asking = frames.encode(1, 0, 3, 0, 0, 12, 7, [], [], frames.WANT_ACK)
    assert frames.decode(asking) == (0, 3, 0, 0, 12, 7, frames.WANT_ACK, [], [])
    with pytest.raises(ValueError):
        frames.decode(b"\x00\x01")
    with pytest.raises(ValueError):
        frames.decode(frame[:frames.HEADER_SIZE] + b"\xff\xfe")


@pytest.mark.parametrize("tail,data,max_line,lines,rest", [
    (b"", b"a\nb\n", 10, [b"a", b"b"], b""),
    (b"", b"a\nb", 10, [b"a"], b"b"),
    (b"x", b"y\n", 10, [b"xy"], b""),
    (b"", b"\n", 10, [b""], b""),
    (b"", b"abc", 10, [], b"abc"),
    (b"", b"a" * 11, 10, [None], b""),
    (b"", b"ok\n" + b"a" * 11 + b"\nnext\n", 10, [b"ok", None], b""),
    (b"", b"ok\n" + b"a" * 11, 10, [b"ok", None], b""),
    (b"", b"a" * 10 + b"\n", 10, [b"a" * 10], b""),
    (b"ab", b"c", 10, [], b"abc"),                            # a tail and no newline yet
    (b"a" * 6, b"a" * 5 + b"\nok\n", 10, [None], b""),         # the tail makes the first line too long
    (b"a" * 6, b"a" * 5, 10, [None], b""),
    (b"a" * 6, b"a\n" + b"b" * 9, 10, [b"a" * 7], b"b" * 9),
])
def test_ndjson_split_lines(tail, data, max_line, lines, rest):
    assert codec.split_lines(tail, data, max_line) == (lines, rest)


def test_a_line_arriving_in_small_pieces_is_extended_in_place_not_copied_at_every_read():
    """Finding A13: ``tail + rest`` at every read copied a slowly arriving line again each time (quadratic: 2 s of
    CPU for 1 MiB in 128-byte pieces).  The tail is one bytearray that each piece extends."""
    piece = b"x" * 128
    lines, tail = codec.split_lines(b"", b'{"op":"pub","topic":"t","data":"', 1 << 20)
    first = None
    for _ in range(8000):
        lines, tail = codec.split_lines(tail, piece, 1 << 20)
        assert lines == []
        first = first or tail
        assert tail is first   # the same buffer all along
    lines, tail = codec.split_lines(tail, b'"}\n', 1 << 20)
    assert lines == [b'{"op":"pub","topic":"t","data":"' + piece * 8000 + b'"}'] and type(lines[0]) is bytes
    assert tail == b""


def test_ndjson_exact_data_encoding():
    line = b'{"op":"pub","topic":"t","data":[123456789012345678901234567890, 1.5, "s"]}'
    req = codec.parse(line)
    assert codec.encode_data(line, req["data"]) == b'[123456789012345678901234567890,1.5,"s"]'
    line = b'{"op":"pub","topic":"t","data":-98765432109876543210}'
    assert codec.encode_data(line, codec.parse(line)["data"]) == b"-98765432109876543210"
    assert codec.encode_data(b"", "x") == b'"x"'


def test_ndjson_delivery_of_raw_payloads():
    prefix = delivery.ndjson_prefix("t")
    assert delivery.ndjson_delivery(prefix, KIND_RAW, b"hi", None, None) == b'{"topic":"t","data":"hi"}\n'
    assert delivery.ndjson_delivery(prefix, KIND_RAW, b"\xff", None, None) == \
        b'{"topic":"t","data":"/w==","encoding":"base64"}\n'
    assert delivery.ndjson_delivery(prefix, KIND_JSON, b"1", "r.1", None) == \
        b'{"topic":"t","data":1,"reply":"r.1"}\n'


def test_control_messages_are_chunked_and_reassembled():
    big = {"k": "reply", "data": "x" * (3 * control.CHUNK + 5)}
    datagrams = control.encode(big)
    assert len(datagrams) == 4 and all(len(d) <= control.CHUNK + 1 for d in datagrams)
    r = control.Reassembler()
    assert [r.feed(d) for d in datagrams] == [None, None, None, big]
    assert r.feed(control.encode({"k": "hb"})[0]) == {"k": "hb"}


def test_what_a_dead_worker_never_read_is_decoded_with_its_descriptors():
    """The first message's head was read by the worker before it died: its tail is dropped, and so is the
    descriptor that came with a message that cannot be decoded; the others come back whole."""
    big = control.encode({"k": "reply", "data": "x" * (2 * control.CHUNK)})
    conn = control.encode({"k": "conn", "cid": 7, "data": "y" * (2 * control.CHUNK)})
    r, w = os.pipe()
    lost_r, lost_w = os.pipe()
    unread = [(d, []) for d in big[1:]] + [(b"\x00{not json", [lost_r])] + \
        [(d, [r] if i == 0 else []) for i, d in enumerate(conn)] + [(control.encode({"k": "stop"})[0], [])]
    assert control.decode_all(unread) == [({"k": "conn", "cid": 7, "data": "y" * (2 * control.CHUNK)}, [r]),
                                          ({"k": "stop"}, [])]
    try:
        os.fstat(lost_r)
        raise AssertionError("the descriptor of an undecodable message was not closed")
    except OSError:
        pass
    for fd in (r, w, lost_w):
        os.close(fd)


def test_config_defaults_and_overrides(tmp_path):
    c = cfgmod.load(None)
    assert (c.network.bind, c.network.port) == ("127.0.0.1", 8080)
    assert c.limits.max_line_bytes == 1 << 20 and c.limits.max_pending_bytes == 8 << 20
    assert c.shutdown.grace_period == 5.0 and c.workers.count == "auto"
    p = tmp_path / "c.json"
    p.write_text('{"network": {"port": 9000}, "workers": {"count": 3}}')
    c = cfgmod.load(str(p), {"network.port": 0, "limits.max_line_bytes": 2048})
    assert c.network.port == 0 and c.workers.resolved_count() == 3 and c.limits.max_line_bytes == 2048
    assert c.source == str(p)


def test_config_security_rules():
    with pytest.raises(cfgmod.ConfigError, match="admin_user.username: must be set"):
        cfgmod.load(None, {"security.enabled": True})
    with pytest.raises(cfgmod.ConfigError, match=r"users\[0\]: give password or password_hash, not both"):
        cfgmod.load(None, {"security.users": [{"username": "u", "password": "a", "password_hash": "b"}]})


def _config_keys(cls, prefix=""):
    import dataclasses
    import typing
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and f.name != "admin_user":
            yield from _config_keys(tp, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_configuration_key_is_documented():
    from support.harness import REPO
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = [k for k in _config_keys(cfgmod.Config) if f"`{k}`" not in doc]
    assert not missing, f"undocumented configuration keys: {missing}"


def test_deploy_example_config_spells_out_the_defaults():
    from support.harness import REPO
    example = cfgmod.load(str(REPO / "deploy" / "config.example.json"), check_paths=False)  # the systemd unit's paths
    defaults = cfgmod.load(None)
    for section in ("network", "workers", "limits", "monitoring", "shutdown"):
        assert getattr(example, section) == getattr(defaults, section), section
    assert not example.security.enabled


def test_password_hash_format_and_verification():
    from shardbroker.cluster.config import passwords
    h = passwords.hash_password("pässword", 1000)
    assert h.startswith("$pbkdf2-sha256$i=1000$") and h.count("$") == 4
    assert passwords.verify(h, "pässword") and not passwords.verify(h, "password")
    assert passwords.hash_password("x", 1000) != passwords.hash_password("x", 1000)  # salted
    iterations, salt, dk = passwords.parse(h)
    assert (iterations, len(salt), len(dk)) == (1000, 16, 32)
    for bad in ["", "plain", "$pbkdf2-sha256$i=10$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA",
                "$pbkdf2-sha1$i=1000$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA", h.replace("i=1000", "i=abc")]:
        with pytest.raises(passwords.HashFormatError):
            passwords.parse(bad)


@pytest.mark.parametrize("perm,pattern,subscribe_ok", [
    ("subscribe:chat.*", "chat", True), ("subscribe:chat.*", "chat.>", True), ("subscribe:chat.*", "chat.*.x", True),
    ("subscribe:chat.*", "*.room1", False), ("subscribe:chat.*", "chatty", False), ("subscribe:chat.*", ">", False),
    ("subscribe:chat.>", "chat", False), ("subscribe:chat.>", "chat.*", True), ("subscribe:a.b.*", "a.>", False),
    ("subscribe:a.b.*", "a.b.c.>", True), ("subscribe:*", ">", True), ("subscribe:>", "*.x", True),
    ("subscribe:a.b", "a.b", True), ("subscribe:a.b", "a.*", False), ("admin", ">", True),
    ("publish:*", "x", False),
])
def test_permission_coverage(perm, pattern, subscribe_ok):
    from shardbroker.cluster.config.permissions import Permissions
    assert Permissions([perm]).may_subscribe(pattern) is subscribe_ok


def test_permission_strings_are_validated():
    from shardbroker.cluster.config.permissions import PermissionFormatError, Permissions
    for bad in ["publish", "publish:", "read:x", "publish:a.*.b", "publish:a..b", "subscribe:ch*.x.>.y"]:
        with pytest.raises(PermissionFormatError):
            Permissions([bad])


def test_the_runtime_directory_goes_on_a_tmpfs_where_there_is_one(tmp_path, monkeypatch):
    """$XDG_RUNTIME_DIR first; else /dev/shm if it is writable and large enough to hold journals; else the temp
    directory (cluster/runtime.py)."""
    import tempfile

    from shardbroker.cluster import runtime

    xdg = tmp_path / "xdg"
    xdg.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert runtime.default_parent() == str(xdg)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))   # not a directory: passed over
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(runtime, "SHM", str(shm))
    monkeypatch.setattr(runtime, "SHM_MIN_SIZE", 1)
    assert runtime.default_parent() == str(shm)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime.default_parent() == str(shm)
    st = os.statvfs(shm)
    monkeypatch.setattr(runtime, "SHM_MIN_SIZE", st.f_blocks * st.f_frsize + 1)   # too small: a container's
    assert runtime.default_parent() == tempfile.gettempdir()
    monkeypatch.setattr(runtime, "SHM", str(tmp_path / "none"))
    monkeypatch.setattr(runtime, "SHM_MIN_SIZE", 1)
    assert runtime.default_parent() == tempfile.gettempdir()
