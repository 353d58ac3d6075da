"""Bounded memory and fairness under load: slow consumers, many connections."""

import asyncio
import selectors
import socket
import threading
import time

import pytest

from shardbroker.cli.client import AsyncClient

from support.harness import Raw


def test_non_reading_subscriber_is_disconnected_and_others_get_everything(start_broker):
    b = start_broker(workers=2, config={"limits": {"max_pending_bytes": 256 * 1024}})
    n, payload = 5000, "x" * 1000  # 5 MB through a 256 KiB bound

    async def run():
        slow_sock = socket.create_connection(("127.0.0.1", b.port))
        slow_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        slow_sock.sendall(b'{"op":"sub","topic":"flood"}\n')
        good = [await AsyncClient.connect("127.0.0.1", b.port) for _ in range(2)]
        for g in good:
            await g.sub("flood")
        pub = await AsyncClient.connect("127.0.0.1", b.port)

        async def consume(client):
            return [(await client.next_message(timeout=20)).data for _ in range(n)]

        readers = [asyncio.ensure_future(consume(g)) for g in good]
        for i in range(n):
            await pub.pub("flood", payload, wait=False)
            if i % 50 == 49:
                # Publish in windows well under the bound, so the readers (in this same loop) keep up;
                # the publisher is never held up by the slow one: every reply comes back.
                await pub.ping()
        await pub.ping()
        for r in readers:
            assert await r == [payload] * n
        return slow_sock, good, pub

    slow_sock, good, pub = asyncio.run(run())
    # The slow subscriber was cut off (reset): it never gets the whole stream.
    slow_sock.settimeout(10)
    received = 0
    while True:
        try:
            data = slow_sock.recv(1 << 20)
        except ConnectionResetError:
            break
        if not data:
            break
        received += len(data)
    slow_sock.close()
    assert received < n * len(payload)
    varz = b.varz()
    assert varz["slow_consumers"] == 1
    assert "slow consumer" in b.log()


def test_thousand_connections_on_two_workers_all_receive_a_broadcast(start_broker):
    b = start_broker(workers=2)

    async def run():
        clients = await asyncio.gather(*(AsyncClient.connect("127.0.0.1", b.port) for _ in range(1000)))
        await asyncio.gather(*(c.sub("broadcast.all") for c in clients))
        workers = {(await c.info())["worker"] for c in clients[:10]}
        assert workers == {0, 1}
        varz = b.varz()
        assert varz["connections"] == 1000 and varz["subscriptions"] == 1000
        with Raw(b.port) as p:
            assert p.request({"op": "pub", "topic": "broadcast.all", "data": "to everyone"}) == {"ok": True}
        got = await asyncio.gather(*(c.next_message(timeout=20) for c in clients))
        assert all(m.topic == "broadcast.all" and m.data == "to everyone" for m in got)
        await asyncio.gather(*(c.close() for c in clients))

    asyncio.run(run())


@pytest.mark.parametrize("workers", [1, 2], ids=["same-worker", "cross-worker"])
def test_slow_but_steady_subscriber_sets_the_pace_instead_of_being_cut(start_broker, workers):
    """Backpressure: a publisher that outruns a subscriber which does read is slowed down; nothing is lost."""
    b = start_broker(workers=workers, config={"limits": {"max_pending_bytes": 256 * 1024}})
    # 12 MB through a 256 KiB bound, read at a few MB/s: more than the kernel's socket buffers (autotuned up to
    # 4 MB on each side) can absorb, so the broker must slow the publisher down.
    n, payload = 12_000, "s" * 1000
    with Raw(b.port) as sub, Raw(b.port) as pub:
        sub.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        if workers == 2 and sub.request({"op": "info"})["info"]["worker"] == \
                pub.request({"op": "info"})["info"]["worker"]:
            pub.close()
            pub = Raw(b.port)
        sub.request({"op": "sub", "topic": "pace"})
        line = b'{"op":"pub","topic":"pace","data":"%s"}\n' % payload.encode()
        pub.sock.settimeout(None)  # sendall's timeout is a total: the broker slows this publisher down on purpose
        sender = threading.Thread(target=lambda: pub.send(line * n + b'{"op":"ping","id":"end"}\n'), daemon=True)
        sender.start()
        got = 0
        while got < n:
            sub.sock.settimeout(10)
            data = sub.sock.recv(32768)
            assert data, "the subscriber was cut"
            got += data.count(b"\n")  # one line per delivery (a multi-byte marker could straddle two reads)
            time.sleep(0.005)
        sender.join(10)
        while pub.json().get("id") != "end":
            pass
    varz = b.varz()
    assert varz["slow_consumers"] == 0
    assert sum(w["backpressure_episodes"] for w in varz["workers"]) > 0, "the publisher never had to wait"


def test_fan_out_storm_does_not_stall_a_worker(start_broker):
    """7,000 messages to 2,000 subscribers: 14 million deliveries, up to 7 million from a single read.  Work is
    budgeted per event-loop turn, so the workers keep their heartbeat (1 s here) and the monitoring answers."""
    b = start_broker(workers=2, config={"workers": {"heartbeat_timeout": 1}})
    n_subs, n_msgs = 2000, 7000
    subs = []
    try:
        for _ in range(n_subs):
            s = socket.create_connection(("127.0.0.1", b.port))
            s.sendall(b'{"op":"sub","topic":"storm"}\n')
            subs.append(s)
        for s in subs:
            assert s.recv(100) == b'{"ok":true}\n'
        with Raw(b.port) as pub:
            pub.sock.settimeout(None)
            pub.send(b'{"op":"pub","topic":"storm","data":"%d"}\n' * n_msgs % tuple(range(n_msgs)))
            time.sleep(0.3)
            assert b.http("/healthz") == (200, {"status": "ok"})  # every worker answers in the middle of the storm
            counts = [0] * n_subs
            sel = selectors.DefaultSelector()
            for i, s in enumerate(subs):
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ, i)
            deadline = time.monotonic() + 60
            while sum(counts) < n_subs * n_msgs and time.monotonic() < deadline:
                for key, _ in sel.select(1):
                    data = key.fileobj.recv(1 << 20)
                    counts[key.data] += data.count(b"\n")
            assert counts == [n_msgs] * n_subs
    finally:
        for s in subs:
            s.close()
    assert "sent no heartbeat" not in b.log()
