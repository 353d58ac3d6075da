"""The broker as a leaf node among several hubs and under a hub's rules: loops (two hubs, and a fake hub echoing
our $LDS), a two-node hub cluster, the hub's permissions and its max_payload.  Real nats-servers and brokers, as
test_leaf_faults.py's (its helpers: leafprobes.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from leafprobes import (
    assert_no_crash,
    broker_leafz,
    connect,
    connects,
    drain,
    leaf_config,
    leaf_lines,
    nats_url,
    redials,
    remote,
    request_until,
    serves_local_clients,
    until_received,
    wait_hub_interest,
)

pytestmark = pytest.mark.timeout(60)


# -- 4. loops -------------------------------------------------------------------------------------------------------

@pytest.mark.slow   # watches 5 s of the 30 s penalty
def test_two_hubs_in_a_loop_penalise_the_link_30s(nats_servers, start_broker):
    """H2 is a leaf of H1, and the broker joins both: its $LDS comes back to it.  The link that sees it closes and
    waits 30 s (watched for 5 s here).  nats-server does the same: measured, a nats-server leaf soliciting both loses
    both links, whichever it dialled first, and so does this broker (one worker here: one $LDS, two links)."""
    h1 = nats_servers("h1")
    h2 = nats_servers("h2", remotes=[{"url": h1.leaf_url, "ignore_discovered_servers": True}])
    h1.wait_leafs(1)
    broker = start_broker(workers=1, config=leaf_config(remote(h1), remote(h2)))
    loops = []
    deadline = time.monotonic() + 10
    while not loops and time.monotonic() < deadline:
        loops = [m for m in redials(broker) if "loop" in m["what"].lower()]
        time.sleep(0.05)
    assert loops, broker.log()
    time.sleep(0.3)   # the other link's, if it comes
    loops = [m for m in redials(broker) if "loop" in m["what"].lower()]
    assert all(float(m["delay"]) == 30.0 for m in loops), [m[0] for m in loops]
    assert len({m["url"] for m in loops}) == len(loops)   # once per link
    looped = {m["url"] for m in loops}
    mark = len(broker.log())
    connected_before = len(connects(broker))

    serves_local_clients(broker, b"still here")   # all the while
    time.sleep(5)
    assert not [m for m in leaf_lines(broker, after=mark) if m["url"] in looped], broker.log()[mark:]
    assert len(connects(broker)) == connected_before
    for hub in (h1, h2):
        if hub.leaf_url in looped:
            assert not [leaf for leaf in hub.leafz()["leafs"] if leaf["name"].startswith("sb-")], hub.leafz()
    assert "Loop detected" in h1.log() + h2.log()   # the -ERR the broker sent, as the hubs logged it
    assert_no_crash(broker)


class FakeHub:
    """A leafnode port that echoes the spoke's own $LDS back to it.  Each accepted connection gets an INFO (no
    ``info_on_connect``); every line it sends is kept (``sessions``), PINGs answered."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sessions: list[list[str]] = []
        self.closed: list[float] = []   # when each session's EOF came
        self.accepted: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"nats-leaf://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(time.monotonic())
            lines: list[str] = []
            self.sessions.append(lines)
            threading.Thread(target=self._serve, args=(conn, lines), daemon=True).start()

    def _serve(self, conn: socket.socket, lines: list[str]) -> None:
        info = {"server_id": "NFAKEHUB", "server_name": "fake", "version": "2.15.1", "proto": 3, "headers": True,
                "max_payload": 1 << 20, "client_id": 7, "nonce": "abcdefghijklmno", "auth_required": True,
                "leafnode_urls": [f"127.0.0.1:{self.port}"]}
        buf = b""
        with conn:
            conn.settimeout(10)
            conn.sendall(b"INFO " + json.dumps(info).encode() + b"\r\n")
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self.closed.append(time.monotonic())
                    return
                buf += data
                while b"\r\n" in buf:
                    line, buf = buf.split(b"\r\n", 1)
                    text = line.decode(errors="replace")
                    lines.append(text)
                    if text == "PING":
                        conn.sendall(b"PONG\r\n")
                    elif text.startswith("LS+ $LDS."):
                        conn.sendall(line + b"\r\n")   # the echo: the spoke's own loop-detection subject

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.mark.slow   # watches 3 s of the 30 s penalty
def test_an_echo_of_our_own_lds_is_a_loop(start_broker):
    fake = FakeHub()
    try:
        broker = start_broker(workers=1, config=leaf_config(remote(fake.url)))
        deadline = time.monotonic() + 10
        while not fake.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.closed, fake.sessions
        (lines,) = fake.sessions
        connect_line = next(line for line in lines if line.startswith("CONNECT "))
        fields = json.loads(connect_line[8:])
        assert "lang" not in fields and fields["name"] == "sb-w0" and fields["cluster"] == "sb", fields
        lds = next(line for line in lines if line.startswith("LS+ $LDS."))
        errs = [line for line in lines if line.startswith("-ERR")]
        assert errs and errs[0].startswith("-ERR 'Loop detected for leafnode account=\"$G\""), lines
        assert "30s" in errs[0], errs
        assert lines.index(errs[0]) > lines.index(lds)
        (m,) = redials(broker, fake.url)
        assert "loop" in m["what"].lower() and float(m["delay"]) == 30.0, m[0]
        time.sleep(3)
        assert len(fake.accepted) == 1, f"redialled after {fake.accepted[1] - fake.closed[0]:.2f}s"
        assert_no_crash(broker)
    finally:
        fake.close()


# -- 5. a two-node hub cluster ---------------------------------------------------------------------------------------

def test_a_client_of_another_cluster_node_talks_to_a_broker_client(nats_servers, start_broker):
    a = nats_servers("a", cluster={"name": "C"}, start=False)
    b = nats_servers("b", cluster={"name": "C", "routes": [a.route_url]}, start=False)
    a.cluster["routes"] = [b.route_url]
    a.start(), b.start()
    a.wait_routes(1), b.wait_routes(1)
    broker = start_broker(workers=2, config=leaf_config(remote(a)))
    assert {leaf["name"] for leaf in a.wait_leafs(2)} == {"sb-w0", "sb-w1"}

    async def run():
        bn = await connect(nats_url(broker))
        on_b = await connect(b.url)
        # B -> broker: pub/sub
        down = await bn.subscribe("down.*")
        await bn.flush()
        got = await until_received(on_b, "down.1", down, b"from-b")
        assert (got.subject, got.data) == ("down.1", b"from-b")
        # broker -> B: pub/sub, with headers
        up = await on_b.subscribe("up.>")
        await on_b.flush()
        await until_received(bn, "up.probe", up)
        await bn.publish("up.1", b"from-broker", headers={"X-K": "v"})
        got = await up.next_msg(timeout=5)
        while got.subject == "up.probe":
            got = await up.next_msg(timeout=5)
        assert (got.subject, got.data, got.headers) == ("up.1", b"from-broker", {"X-K": "v"})

        # request/reply: a responder on B, a requester on the broker ...
        async def on_b_svc(msg):
            await msg.respond(b"b:" + msg.data)

        await on_b.subscribe("svc.b", cb=on_b_svc)
        await on_b.flush()
        assert (await request_until(bn, "svc.b", b"ping")).data == b"b:ping"

        # ... and a responder on the broker, a requester on B
        async def on_broker_svc(msg):
            await msg.respond(b"broker:" + msg.data)

        await bn.subscribe("svc.broker", cb=on_broker_svc, queue="q")
        await bn.flush()
        assert (await request_until(on_b, "svc.broker", b"ping")).data == b"broker:ping"
        for i in range(20):   # every one answered, once
            assert (await on_b.request("svc.broker", b"%d" % i, timeout=2)).data == b"broker:%d" % i
        await bn.close()
        await on_b.close()

    asyncio.run(run())
    assert len(connects(broker)) == 2 and not redials(broker), broker.log()
    assert_no_crash(broker)


# -- 7. the hub's permissions ----------------------------------------------------------------------------------------

PERMS = """authorization {
  users = [
    {user: "lf", password: "lfpw", permissions: {publish: "up.>", subscribe: "down.>"}}
    {user: "admin", password: "adminpw"}
  ]
}"""


def test_the_hubs_permissions_are_kept_without_a_violation(nats_servers, start_broker):
    hub = nats_servers("hub", extra=PERMS)
    broker = start_broker(workers=2, config=leaf_config(remote(hub, user="lf", password="lfpw")))
    hub.wait_leafs(2)

    async def run():
        bn = await connect(nats_url(broker))
        hn = await connect(hub.url, user="admin", password="adminpw")
        down = await bn.subscribe("down.x")
        other = await bn.subscribe("other.x")   # a literal the hub forbids: never advertised
        everything = await bn.subscribe(">")     # a wildcard that overlaps: advertised, the hub filters
        await bn.flush()
        wait_hub_interest(hub, "down.x")
        wait_hub_interest(hub, ">")
        # hub -> broker: down.x arrives, other.x does not (the hub keeps it)
        await hn.publish("other.x", b"forbidden")
        got = await until_received(hn, "down.x", down, b"allowed")
        assert got.data == b"allowed"
        assert [m.data for m in await drain(other)] == []
        seen = [(m.subject, m.data) for m in await drain(everything)]
        assert ("down.x", b"allowed") in seen and ("other.x", b"forbidden") not in seen, seen

        # broker -> hub: up.a reaches a hub subscriber; other.b does not, not even a hub subscriber on ">"
        up = await hn.subscribe("up.a")
        other_b = await hn.subscribe("other.b")
        all_hub = await hn.subscribe(">")
        await hn.flush()
        await until_received(bn, "up.a", up, b"first")
        await bn.publish("other.b", b"forbidden")
        await bn.publish("up.a", b"after")
        await bn.flush()
        assert (await up.next_msg(timeout=5)).data in (b"first", b"after")
        await asyncio.sleep(0.3)
        assert [m.data for m in await drain(other_b)] == []
        assert [m for m in await drain(all_hub) if m.subject == "other.b"] == []
        await bn.close()
        await hn.close()

    asyncio.run(run())
    time.sleep(0.3)
    assert "Permissions Violation" not in hub.log(), hub.log()[-3000:]
    assert sorted(connects(broker)) == ["sb-w0", "sb-w1"] and not redials(broker), broker.log()
    assert {leaf["name"] for leaf in hub.wait_leafs(2)} == {"sb-w0", "sb-w1"}
    assert_no_crash(broker)


# -- 8. the hub's max_payload ----------------------------------------------------------------------------------------

def test_a_message_over_the_hubs_max_payload_is_dropped_not_the_link(nats_servers, start_broker):
    hub = nats_servers("hub", extra="max_payload: 1024")
    broker = start_broker(workers=1, config=leaf_config(remote(hub)))
    hub.wait_leafs(1)

    async def run():
        bn = await connect(nats_url(broker))
        hn = await connect(hub.url)
        sub = await hn.subscribe("big.x")
        await hn.flush()
        await until_received(bn, "big.x", sub, b"probe")
        await drain(sub)
        await bn.publish("big.x", b"b" * 2000)    # over the hub's 1024: dropped (oversize)
        await bn.publish("big.x", b"s" * 1000)    # under it: delivered, over the same link, after it
        await bn.publish("big.x", b"h" * 1010, headers={"X": "y"})   # headers count: 1028 in all
        await bn.publish("big.x", b"end")
        await bn.flush()
        got = [m.data for m in [await sub.next_msg(timeout=5), await sub.next_msg(timeout=5)]]
        assert got == [b"s" * 1000, b"end"], [len(g) for g in got]
        assert await drain(sub) == []
        await bn.close()
        await hn.close()

    asyncio.run(run())
    assert "Maximum Payload" not in hub.log(), hub.log()[-3000:]
    assert connects(broker) == ["sb-w0"] and not redials(broker), broker.log()
    hub.wait_leafs(1)
    leafz = broker_leafz(broker)
    if leafz is not None:
        assert sum(link.get("oversize", 0) for link in leafz) == 2, leafz
    assert_no_crash(broker)
