"""The broker as a leaf node when things go wrong: a hub restarted, a hub frozen (SIGSTOP) under a flood, loops (two
hubs, and a fake hub echoing our $LDS), a hub cluster, a worker killed, the hub's permissions and max_payload.

Real nats-servers (tests/support/natshub.py) and real brokers (tests/support/harness.py), nats-py on both sides;
loopback and ephemeral ports only.  What the broker did is read from its log (workers/protocols/leaf/link.py's lines)
and from the hubs' /leafz.  The helpers here are test_leaf_auth.py's too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time

import nats
import nats.errors
import psutil
import pytest

from support.harness import NatsFrames, nats_on_worker
from support.natshub import NatsServer

pytestmark = pytest.mark.timeout(60)

RECONNECT = 0.2
# workers/protocols/leaf/link.py: "leafnode <url> (<name>): <what>[; redialling in <s>s]"
LINE = re.compile(r"^\S+ \S+ \[worker (?P<w>\d+)\] (?P<level>\w+) broker\.leaf: leafnode (?P<url>\S+) "
                  r"\((?P<name>[^)]+)\): (?P<what>.*?)(?:; redialling in (?P<delay>[\d.]+)s)?$", re.M)


# -- helpers --------------------------------------------------------------------------------------------------------

def leaf_config(*remotes: dict, **settings) -> dict:
    """The broker's configuration: instance name ``sb`` (its links are sb-w0, sb-w1, ...), a quick redial."""
    return {"leafnodes": {"name": "sb", "remotes": list(remotes), "reconnect": RECONNECT, "ping_interval": 0.5,
                          **settings}}


def remote(*hubs: NatsServer | str, **more) -> dict:
    return {"urls": [h if isinstance(h, str) else h.leaf_url for h in hubs], **more}


def leaf_lines(broker, url: str | None = None, after: int = 0) -> list[re.Match]:
    return [m for m in LINE.finditer(broker.log(), after) if url is None or m["url"] == url]


def connects(broker, url: str | None = None, after: int = 0) -> list[str]:
    """The link names that logged "connected to <hub>", in order."""
    return [m["name"] for m in leaf_lines(broker, url, after) if m["what"].startswith("connected to ")]


def redials(broker, url: str | None = None, after: int = 0) -> list[re.Match]:
    return [m for m in leaf_lines(broker, url, after) if m["delay"] is not None]


def assert_no_crash(broker) -> None:
    """No traceback in the broker's log (an exception in a protocol callback is logged by asyncio, not raised)."""
    log = broker.log()
    assert "Traceback" not in log and "Fatal error" not in log, log[-6000:]


def broker_leafz(broker) -> list[dict] | None:
    """The broker's own /leafz (its leaf connections), or None where the endpoint does not exist (yet)."""
    try:
        status, body = broker.http("/leafz?subs=1")
    except Exception:   # noqa: BLE001 - not there, not JSON
        return None
    return body.get("leafs") if status == 200 and isinstance(body, dict) else None


def nats_url(broker) -> str:
    return f"nats://127.0.0.1:{broker.ports['nats']}"


async def connect(url: str, **kw) -> nats.NATS:
    """A nats-py client that fails instead of reconnecting (a test sees what broke)."""
    async def quiet(exc):   # nats-py prints errors from its callbacks otherwise
        pass

    return await nats.connect(url, allow_reconnect=False, connect_timeout=5, error_cb=quiet, **kw)


async def until_received(pub: nats.NATS, subject: str, sub, data: bytes = b"probe", timeout: float = 5.0):
    """Publish ``data`` to ``subject`` every 0.1 s until ``sub`` receives something (interest takes a moment to
    cross a hub); -> that message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pub.publish(subject, data)
        await pub.flush()
        try:
            return await sub.next_msg(timeout=0.1)
        except nats.errors.TimeoutError:
            pass
    raise AssertionError(f"nothing on {subject!r} within {timeout}s")


async def request_until(nc: nats.NATS, subject: str, data: bytes, timeout: float = 5.0):
    """A request, retried while nobody answers yet (no responders, or a timeout while interest travels)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await nc.request(subject, data, timeout=0.5)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def drain(sub) -> list:
    out = []
    while True:
        try:
            out.append(await sub.next_msg(timeout=0.05))
        except nats.errors.TimeoutError:
            return out


def wait_hub_interest(hub: NatsServer, subject: str, timeout: float = 5.0, name: str | None = None) -> dict:
    """Poll the hub's /leafz until a leaf (``name``, or any) advertised ``subject``; -> that leaf."""
    deadline = time.monotonic() + timeout
    leafs: list = []
    while time.monotonic() < deadline:
        leafs = hub.leafz()["leafs"] or []
        for leaf in leafs:
            if (name is None or leaf["name"] == name) and subject in (leaf.get("subscriptions_list") or []):
                return leaf
        time.sleep(0.05)
    raise AssertionError(f"{hub.name}: no leaf advertised {subject!r}: {leafs}")


def hub_subs(hub: NatsServer) -> dict[str, list[str]]:
    """Each leaf's advertised subjects, sorted, by the leaf's name."""
    return {leaf["name"]: sorted(leaf.get("subscriptions_list") or []) for leaf in hub.leafz()["leafs"] or []}


def worker_index(pid: int) -> int:
    """A worker's index, from its command line (``... broker-worker <index> ...``: cluster/supervisor/launch.py)."""
    cmd = psutil.Process(pid).cmdline()
    return int(cmd[cmd.index("broker-worker") + 1])


# -- 2. hub restart -------------------------------------------------------------------------------------------------

@pytest.mark.exclusive   # the reconnect has a deadline
def test_hub_restart_reconnects_with_the_same_interest(nats_hub, start_broker):
    broker = start_broker(workers=2, config=leaf_config(remote(nats_hub)))
    nats_hub.wait_leafs(2)

    async def run():
        bn = await connect(nats_url(broker))
        down = await bn.subscribe("down.>")
        work = await bn.subscribe("work", queue="wq")
        await bn.flush()
        wait_hub_interest(nats_hub, "down.>")
        wait_hub_interest(nats_hub, "work")
        before = hub_subs(nats_hub)
        assert set(before) == {"sb-w0", "sb-w1"}

        nats_hub.restart()
        ready = time.monotonic()
        leafs = nats_hub.wait_leafs(2, timeout=2.5)   # reconnect 0.2 s (+ up to 0.2 s, doubling while it fails)
        took = time.monotonic() - ready
        assert {leaf["name"] for leaf in leafs} == {"sb-w0", "sb-w1"}
        deadline = time.monotonic() + 2
        while hub_subs(nats_hub) != before and time.monotonic() < deadline:   # the interest follows the CONNECT
            await asyncio.sleep(0.05)
        assert hub_subs(nats_hub) == before, (before, hub_subs(nats_hub))

        # traffic both ways, with a new hub client (the old one went with the hub)
        hn = await connect(nats_hub.url)
        up = await hn.subscribe("up.x")
        await hn.flush()
        got = await until_received(bn, "up.x", up, b"after-restart-up")
        assert got.data == b"after-restart-up"
        await hn.publish("down.y", b"after-restart-down")
        await hn.publish("work", b"job")
        await hn.flush()
        assert (await down.next_msg(timeout=5)).data == b"after-restart-down"
        assert (await work.next_msg(timeout=5)).data == b"job"
        await hn.close()
        await bn.close()
        return took

    took = asyncio.run(run())
    assert took < 2.5
    # each link: connected, lost, (maybe refused while the hub was down), connected again, for the same names
    assert sorted(connects(broker)) == ["sb-w0", "sb-w0", "sb-w1", "sb-w1"], broker.log()
    assert_no_crash(broker)


# -- 3. hub frozen while a broker client floods it ------------------------------------------------------------------

def test_frozen_hub_bounded_memory_drops_counted_and_recovery(nats_hub, start_broker):
    broker = start_broker(workers=1, config=leaf_config(remote(nats_hub), max_pending_bytes=1 << 20,
                                                        ping_interval=1.0))
    nats_hub.wait_leafs(1)
    workers = [psutil.Process(pid) for pid in broker.worker_pids()]

    def rss() -> int:
        return sum(p.memory_info().rss for p in workers)

    async def run():
        hn = await connect(nats_hub.url, pending_size=1 << 26)
        seen = {"n": 0, "after": 0}

        async def count(msg):
            seen["n"] += 1
            seen["after"] += msg.data.startswith(b"after")

        await hn.subscribe("flood.x", cb=count, pending_msgs_limit=1 << 22, pending_bytes_limit=1 << 30)
        await hn.flush()
        bn = await connect(nats_url(broker))
        probe = await hn.subscribe("flood.probe")
        await until_received(bn, "flood.probe", probe)
        base = rss()

        stop = asyncio.Event()
        payload = b"x" * 1024

        async def flood():   # ~20k messages/s (20 MB/s): fills 1 MiB and the sockets' buffers well before it is
            # stale (3 PINGs 1 s apart), and not more than the hub's nats-py client keeps up with
            while not stop.is_set():
                for _ in range(200):
                    await bn.publish("flood.x", payload)
                await asyncio.sleep(0.01)

        task = asyncio.create_task(flood())
        await asyncio.sleep(0.5)
        nats_hub.pause()
        peak = 0
        frozen = time.monotonic()
        while time.monotonic() - frozen < 5:
            await asyncio.sleep(0.2)
            peak = max(peak, rss())
        nats_hub.resume()
        stop.set()
        await task
        # after the thaw: new messages arrive (the broker has redialled: its old link went stale)
        deadline = time.monotonic() + 10
        i = 0
        while not seen["after"] and time.monotonic() < deadline:
            await bn.publish("flood.x", b"after-%d" % i)
            await bn.flush()
            i += 1
            await asyncio.sleep(0.1)
        assert seen["after"], (seen, broker.log()[-3000:])
        await bn.close()
        await hn.close()
        return base, peak

    base, peak = asyncio.run(run())
    log = broker.log()
    assert "slow_consumer" in log, log[-3000:]
    assert "Stale Leaf Node Connection" in log, log[-3000:]   # 1 s pings, 2 unanswered
    # 1 MiB of pending messages per link: the workers' memory stays within a few MiB of where it was
    assert peak - base < 32 << 20, f"worker RSS {base >> 20} MiB before, {peak >> 20} MiB at the peak"
    leafz = broker_leafz(broker)
    if leafz is not None:
        assert sum(link.get("slow_consumers", 0) for link in leafz) > 0, leafz
    assert_no_crash(broker)


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

    async def local():   # the broker serves its own clients all the while
        nc = await connect(nats_url(broker))
        sub = await nc.subscribe("local.x")
        await nc.publish("local.x", b"still here")
        assert (await sub.next_msg(timeout=2)).data == b"still here"
        await nc.close()

    asyncio.run(local())
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


# -- 6. a worker killed ----------------------------------------------------------------------------------------------

def test_a_killed_worker_is_replaced_and_its_replacement_rejoins(nats_hub, start_broker):
    broker = start_broker(workers=2, config=leaf_config(remote(nats_hub)))
    nats_hub.wait_leafs(2)
    by_index = {worker_index(pid): pid for pid in broker.worker_pids()}
    keep = nats_on_worker(broker, 0, "keep")   # a subscription on the worker that survives (raw NATS, sid 1)
    try:
        wait_hub_interest(nats_hub, "keep.*", name="sb-w0")

        os.kill(by_index[1], signal.SIGKILL)
        broker.wait_log(r"worker 1 \(pid %d\) died .*; replacing it" % by_index[1])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pids = broker.worker_pids()
            if len(pids) == 2 and by_index[1] not in pids:
                break
            time.sleep(0.05)
        new = {worker_index(pid): pid for pid in broker.worker_pids()}
        assert new[0] == by_index[0] and new[1] != by_index[1], (by_index, new)
        leafs = nats_hub.wait_leafs(2, timeout=15)
        assert {leaf["name"] for leaf in leafs} == {"sb-w0", "sb-w1"}

        async def run():
            hn = await connect(nats_hub.url)
            # the survivor's subscription still works
            await hn.publish("keep.1", b"to-survivor")
            await hn.flush()
            keep.settimeout(5)
            assert NatsFrames(keep).take(1) == [("1", b"", b"to-survivor")]
            # a new subscription on the replacement: its interest reaches the hub, and messages come
            fresh = nats_on_worker(broker, 1, "fresh")
            try:
                wait_hub_interest(nats_hub, "fresh.*", name="sb-w1")
                await hn.publish("fresh.2", b"to-replacement")
                await hn.flush()
                fresh.settimeout(5)
                assert NatsFrames(fresh).take(1) == [("2", b"", b"to-replacement")]
            finally:
                fresh.close()
            await hn.close()

        asyncio.run(run())
    finally:
        keep.close()
    assert connects(broker).count("sb-w1") == 2 and connects(broker).count("sb-w0") == 1, broker.log()


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


# -- a burst from the hub -------------------------------------------------------------------------------------------

def test_a_burst_from_the_hub_bigger_than_a_turn_keeps_the_link(nats_hub, start_broker):
    """More messages from the hub than a worker's turn budget (workers/turn.py: 20,000) in one go: the link pauses
    its reading until the next turn (Leafnodes.read_done) and goes on, every message delivered."""
    broker = start_broker(workers=1, config=leaf_config(remote(nats_hub)))
    nats_hub.wait_leafs(1)
    count = 60_000

    async def run():
        bn = await connect(nats_url(broker))
        hn = await connect(nats_hub.url)
        got = 0
        done = asyncio.Event()

        async def cb(msg):
            nonlocal got
            got += 1
            if got >= count:
                done.set()

        probe = await bn.subscribe("burst.probe")
        await bn.subscribe("burst.x", cb=cb, pending_msgs_limit=1 << 22, pending_bytes_limit=1 << 30)
        await bn.flush()
        wait_hub_interest(nats_hub, "burst.x")
        await until_received(hn, "burst.probe", probe)
        for _ in range(count):
            await hn.publish("burst.x", b"m")
        await hn.flush()
        try:
            await asyncio.wait_for(done.wait(), 10)
        except TimeoutError:
            pass
        await bn.close()
        await hn.close()
        return got

    got = asyncio.run(run())
    assert_no_crash(broker)
    assert connects(broker) == ["sb-w0"] and not redials(broker), broker.log()[-3000:]
    assert got == count
