"""The leaf link's rules, in process: what may be advertised and sent to a hub (its import/export and the remote's
denies), what a hub advertised and how a subject matches it, and which queue member a hub's message goes to."""

from __future__ import annotations

import pytest

from shardbroker.workers.groups import Group, GroupTable
from shardbroker.workers.protocols.leaf.hubinterest import HubInterest
from shardbroker.workers.protocols.leaf.permissions import LeafPermissions, overlaps, pattern_covers


@pytest.mark.parametrize("a, b, covered", [
    ("down.>", "down.*", True), ("down.>", "down.a.b", True), ("down.*", "down.>", False), ("*.x", "a.x", True),
    ("a.*", "a.*", True), ("a.b", "a.*", False), (">", "a", True), ("a.>", "a", False), ("a.*", "a.b.c", False),
])
def test_pattern_covers(a, b, covered):
    assert pattern_covers(a, b) is covered


@pytest.mark.parametrize("a, b, overlap", [
    ("a.*", "*.b", True), ("a.>", "*", False), ("a.>", "*.b", True), ("a.b", "a.c", False), (">", "x.y", True),
    ("a.*.c", "a.b.>", True), ("a", "a.b", False),
])
def test_overlaps(a, b, overlap):
    assert overlaps(a, b) is overlap and overlaps(b, a) is overlap


def test_hub_permissions_measured_shape():
    # the connect_info INFO of a hub user with publish "up.>" and subscribe "down.>" (reference §1.7)
    perms = LeafPermissions({"allow": ["down.>", "_INBOX.>"]}, {"allow": ["up.>"]}, deny_exports=["up.secret"])
    assert perms.may_export("up.a") and not perms.may_export("other.b") and not perms.may_export("up.secret")
    assert perms.may_import("down.x") and perms.may_import("down.*") and perms.may_import("_INBOX.abc.*")
    assert not perms.may_import("other.x")          # a literal outside import closes the hub's link: never sent
    assert perms.may_import(">")                     # a wildcard overlapping it: the hub filters at delivery
    assert not perms.may_import("other.*")
    assert perms.may_import("$LDS.abc")              # loop detection goes everywhere


def test_local_denies():
    perms = LeafPermissions(None, None, deny_imports=["secret.>"], deny_exports=["private.*"])
    assert not perms.may_import("secret.x") and perms.may_import(">") and perms.may_import("public.x")
    assert not perms.may_receive("secret.x") and perms.may_receive("public.x")
    assert not perms.may_export("private.a") and perms.may_export("private.a.b")
    assert LeafPermissions().may_export("anything") and LeafPermissions().may_import(">")
    # garbage in the INFO is no permission at all, not a crash
    assert LeafPermissions({"allow": "down.>"}, [1]).may_export("x")


def test_hub_interest_matches_and_is_bounded():
    hub = HubInterest(limit=3)
    assert hub.add(b"orders.*", None, 0) and hub.add(b"orders.*", b"wq", 2) and hub.add(b">", b"all", 1)
    assert hub.take_changed() and not hub.take_changed()
    assert hub.match("orders.new") == (True, ["all", "wq"])
    assert hub.add(b"orders.*", b"wq", 5) and not hub.take_changed()   # a weight update changes no route
    assert not hub.add(b"x", None, 0)                                   # over the limit
    hub.remove(b"orders.*", None)
    assert hub.match("orders.new") == (False, ["all", "wq"])
    hub.remove(b"unknown", None)                                        # an LS- for nothing is ignored
    assert hub.add(b"bad..subject", None, 0) and hub.match("bad..subject") == (False, ["all"])
    assert hub.clear() and len(hub) == 0 and hub.match("orders.new") == (False, [])


def test_pick_named_prefers_this_worker():
    members = tuple(sorted([("wq", 0, 1, b"1", None), ("wq", 1, 2, b"1", None), ("wq", 1, 3, b"1", None)]))
    groups = [Group("wq", members), Group("other", (("other", 1, 9, b"1", None),))]
    picked = [GroupTable.pick_named(groups, (b"wq",), 1) for _ in range(4)]
    assert all(list(p) == [1] for p in picked)                          # worker 1 has members: always one of its
    assert {p[1][0][1] for p in picked} == {2, 3}                       # and they take turns
    assert list(GroupTable.pick_named(groups, (b"wq",), 2)) in ([0], [1])   # none here: any worker's
    assert GroupTable.pick_named(groups, (b"nope",), 1) == {}
    both = GroupTable.pick_named(groups, (b"wq", b"other"), 0)
    assert both == {0: [("wq", 1, b"1")], 1: [("other", 9, b"1")]}


class _Link:
    """What forward/forward_run write to: the bytes a hub would read, and the limit it set."""

    def __init__(self, max_payload: int = 1 << 20) -> None:
        self.max_payload = max_payload
        self.sent: list[bytes] = []
        self.oversize = 0

    def send(self, data: bytes, size: int) -> bool:
        if size > self.max_payload:
            self.oversize += 1
            return False
        self.sent.append(data)
        return True

    def send_run(self, data: bytes, n: int, size: int) -> bool:
        self.sent.append(data)
        return True


@pytest.mark.parametrize("queues, reply, expected", [
    (None, None, b"LMSG s 1\r\na\r\nLMSG s 2\r\nbb\r\n"),
    (None, "r.1", b"LMSG s r.1 1\r\na\r\nLMSG s r.1 2\r\nbb\r\n"),
    (b"q1 q2", None, b"LMSG s | q1 q2 1\r\na\r\nLMSG s | q1 q2 2\r\nbb\r\n"),
    (b"q", "r", b"LMSG s + r q 1\r\na\r\nLMSG s + r q 2\r\nbb\r\n"),
])
def test_a_run_to_a_hub_is_what_one_at_a_time_would_be(queues, reply, expected):
    from shardbroker.workers.delivery import Route
    from shardbroker.workers.message import KIND_JSON, KIND_RAW
    from shardbroker.workers.protocols.leaf import codec
    from shardbroker.workers.protocols.leaf.leafnodes import Leafnodes

    for kind, payloads in ((KIND_RAW, [b"a", b"bb"]), (KIND_JSON, [b'"a"', b'"bb"'])):
        route = Route("s", (), (), (), (), False, 0)
        run, single = _Link(), _Link()
        route.leaf = ((run, queues, codec.message_head(b"s", None, queues)),)
        Leafnodes.forward_run(route, kind, payloads, reply)
        route.leaf = ((single, queues, codec.message_head(b"s", None, queues)),)
        for payload in payloads:
            Leafnodes.forward(route, kind, payload, reply, None)
        assert b"".join(run.sent) == b"".join(single.sent) == expected


def test_a_run_with_a_message_over_the_hubs_limit_drops_only_that_one():
    from shardbroker.workers.delivery import Route
    from shardbroker.workers.message import KIND_RAW
    from shardbroker.workers.protocols.leaf import codec
    from shardbroker.workers.protocols.leaf.leafnodes import Leafnodes

    route = Route("s", (), (), (), (), False, 0)
    link = _Link(max_payload=2)
    route.leaf = ((link, None, codec.message_head(b"s", None, None)),)
    Leafnodes.forward_run(route, KIND_RAW, [b"a", b"ccc", b"bb"], None)
    assert b"".join(link.sent) == b"LMSG s 1\r\na\r\nLMSG s 2\r\nbb\r\n" and link.oversize == 1
