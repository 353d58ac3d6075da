"""The leaf tests' harness itself: a real nats-server hub, nats-py against it, and the raw spoke's handshake."""

import asyncio
import os
import sys
import urllib.error

import nats
import pytest

from support import natshub
from support.natshub import NatsServer, RawLeaf, free_port, nats_server_path, nats_server_version

pytestmark = pytest.mark.timeout(30)


def test_the_nats_server_is_the_venvs_and_new_enough():
    path = nats_server_path()
    assert os.path.dirname(path) == os.path.dirname(sys.executable)
    assert nats_server_version(path) >= (2, 10)
    port = free_port()
    assert 0 < port < 65536


def test_a_missing_nats_server_skips(monkeypatch, tmp_path):
    monkeypatch.setattr(natshub, "nats_server_path", lambda: str(tmp_path / "nats-server"))
    with pytest.raises(pytest.skip.Exception, match="no nats-server"):
        NatsServer(tmp_path).start()
    old = tmp_path / "nats-server"
    old.write_text("#!/bin/sh\necho 'nats-server: v2.9.10'\n")
    old.chmod(0o755)
    with pytest.raises(pytest.skip.Exception, match="2.9.10"):
        natshub.require_nats_server()


def test_hub_pub_sub_round_trip(nats_hub):
    async def run():
        nc = await nats.connect(nats_hub.url, allow_reconnect=False)
        sub = await nc.subscribe("hub.x")
        await nc.publish("hub.x", b"hello", headers={"K": "V"})
        msg = await sub.next_msg(timeout=5)
        assert (msg.data, msg.headers) == (b"hello", {"K": "V"})
        await nc.close()

    asyncio.run(run())
    varz = nats_hub.varz()
    assert varz["server_name"] == "hub" and varz["leaf"]["port"] == nats_hub.leaf_port


def test_raw_leaf_handshake_interest_and_messages(nats_hub):
    async def run():
        nc = await nats.connect(nats_hub.url, allow_reconnect=False)
        sub = await nc.subscribe("hub.x")
        await nc.flush()
        with RawLeaf(nats_hub.leaf_port) as leaf:
            assert leaf.info["server_name"] == "hub" and "nonce" in leaf.info
            info = leaf.handshake("sb-w0", cluster="sb")
            assert info["connect_info"] is True and info["remote_account"] == "$G"
            assert leaf.lds and leaf.lds.startswith("$LDS.")
            assert any(line.startswith("LS+ $LDS.") for line in leaf.history if isinstance(line, str))
            assert leaf.wait_interest("hub.x") == 1
            # the hub's /leafz: one leaf, ours, with what it advertised
            leaf.sub("leaf.>")
            leaf.sub("work", "wq", 3)
            leaf.flush()
            (one,) = nats_hub.wait_leafs(1)
            assert one["name"] == "sb-w0" and one["account"] == "$G"
            assert "leaf.>" in one["subscriptions_list"] and "work" in one["subscriptions_list"]
            # spoke -> hub: LMSG, HMSG
            leaf.pub("hub.x", b"plain")
            leaf.pub("hub.x", b"hdr", headers=b"NATS/1.0\r\nX-Test: 1\r\n\r\n")
            first, second = await sub.next_msg(timeout=5), await sub.next_msg(timeout=5)
            assert first.data == b"plain" and (second.data, second.headers) == (b"hdr", {"X-Test": "1"})
            # hub -> spoke: a reply subject, a queue group
            await nc.publish("leaf.a", b"to-leaf", reply="back.1")
            await nc.publish("work", b"job")
            await nc.flush()
            got = leaf.msg()
            assert (got.kind, got.subject, got.reply, got.payload) == ("LMSG", "leaf.a", "back.1", b"to-leaf")
            got = leaf.msg()
            assert (got.subject, got.queues, got.payload) == ("work", ["wq"], b"job")
        nats_hub.wait_leafs(0)
        await nc.close()

    asyncio.run(run())


def test_a_leaf_echoing_the_hubs_lds_is_a_loop(nats_hub):
    with RawLeaf(nats_hub.leaf_port) as leaf:
        leaf.handshake("sb-loop")
        leaf.sub(leaf.lds)
        assert "Loop detected" in leaf.expect("-ERR")
        assert leaf.closed()


def test_restart_keeps_the_ports(nats_hub):
    ports = (nats_hub.port, nats_hub.http_port, nats_hub.leaf_port)
    leaf = RawLeaf(nats_hub.leaf_port)
    leaf.handshake("sb-w0")
    old_lds, old_id = leaf.lds, nats_hub.varz()["server_id"]
    nats_hub.restart()
    assert leaf.closed()
    leaf.close()
    assert (nats_hub.port, nats_hub.http_port, nats_hub.leaf_port) == ports
    assert nats_hub.varz()["server_id"] != old_id
    with RawLeaf(nats_hub.leaf_port) as leaf:
        leaf.handshake("sb-w0")
        assert leaf.lds != old_lds   # a new process, a new $LDS
        assert nats_hub.wait_leafs(1)[0]["name"] == "sb-w0"
    assert nats_hub.log().count("Server is ready") == 2


def test_pause_and_resume(nats_hub):
    nats_hub.pause()
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        nats_hub.http("/varz", timeout=0.5)
    with pytest.raises(TimeoutError):   # the kernel accepts; nobody sends the INFO
        RawLeaf(nats_hub.leaf_port, timeout=0.5)
    nats_hub.resume()
    assert nats_hub.varz()["server_name"] == "hub"
    with RawLeaf(nats_hub.leaf_port) as leaf:
        leaf.handshake("sb-after")


def test_a_paused_server_still_stops(tmp_path):
    server = NatsServer(tmp_path, "stopped").start()
    try:
        server.pause()
        server.stop(timeout=5)
        assert not server.running()
    finally:
        server.close()


def test_a_nats_server_leaf_and_a_two_node_cluster(nats_servers, nats_hub):
    leaf = nats_servers("leaf1", leaf_listen=False, remotes=[{"url": nats_hub.leaf_url,
                                                              "ignore_discovered_servers": True}])
    (one,) = nats_hub.wait_leafs(1)
    assert one["name"] == "leaf1"

    async def run():   # a client of the leaf reaches a client of the hub
        hub_nc = await nats.connect(nats_hub.url, allow_reconnect=False)
        leaf_nc = await nats.connect(leaf.url, allow_reconnect=False)
        sub = await hub_nc.subscribe("up.x")
        await hub_nc.flush()
        for _ in range(100):   # until the leaf has learned the hub's interest
            if "up.x" in (leaf.leafz()["leafs"][0].get("subscriptions_list") or []):
                break
            await asyncio.sleep(0.05)
        await leaf_nc.publish("up.x", b"via-leaf")
        assert (await sub.next_msg(timeout=5)).data == b"via-leaf"
        await hub_nc.close()
        await leaf_nc.close()

    asyncio.run(run())

    a = nats_servers("a", cluster={"name": "C"}, start=False)
    b = nats_servers("b", cluster={"name": "C", "routes": [a.route_url]}, start=False)
    a.cluster["routes"] = [b.route_url]
    a.start(), b.start()
    assert {r["remote_name"] for r in a.wait_routes(1)} == {"b"}
    assert {r["remote_name"] for r in b.wait_routes(1)} == {"a"}
