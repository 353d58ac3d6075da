"""Bridge's binary protocol: chunking, the end marker, unsubscribe, several commands per connection."""

import asyncio
import socket
import time

import nats
import pytest
from test_security import secure_config

from shardbroker.cli.client import AsyncClient
from shardbroker.workers.protocols.bridge import codec as bridge_codec

from support.harness import Raw


@pytest.fixture
def bb(start_broker):
    return start_broker(workers=2, args=["--bridge-port", "0"])


def bridge(broker) -> Raw:
    return Raw(broker.ports["bridge"])


def read_n(conn: Raw, n: int, timeout: float = 5.0) -> bytes:
    deadline = time.monotonic() + timeout
    while len(conn.buf) < n:
        conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = conn.sock.recv(65536)
        if not data:
            break
        conn.buf += data
    out, conn.buf = conn.buf[:n], conn.buf[n:]
    return out


def publish(broker, topic: bytes, data: bytes) -> bytes:
    """P, the data, half-close; -> the publisher's replies until the broker closes."""
    with bridge(broker) as p:
        p.send(b"P" + topic + data)
        p.sock.shutdown(socket.SHUT_WR)
        assert p.closed()
        return p.buf


def test_300_byte_publish_is_chunked_with_end_marker(bb):
    data = bytes(range(256)) + b"y" * 44
    with bridge(bb) as sub:
        sub.send(b"Schat   ")
        assert read_n(sub, 1) == b"O"
        assert publish(bb, b"chat   ", data) == b"OOO"  # one O per chunk
        expected = (b"\x80\x00" + data[:128] + b"\x80\x00" + data[128:256] + b"\x2c\x00" + data[256:]
                    + b"\x04\x00\r\n\r\n")
        assert read_n(sub, len(expected)) == expected
        assert sub.nothing()


def test_several_commands_per_connection_and_unsubscribe(bb):
    with bridge(bb) as sub:
        sub.send(b"Sone    Stwo    Sthree  ")
        assert read_n(sub, 3) == b"OOO"
        sub.send(b"Utwo    ")
        assert read_n(sub, 1) == b"O"
        for topic in (b"one    ", b"two    ", b"three  "):
            assert publish(bb, topic, topic.strip()) == b"O"
        expected = b"\x03\x00one" + bridge_codec.END + b"\x05\x00three" + bridge_codec.END
        assert read_n(sub, len(expected)) == expected
        assert sub.nothing()


def test_topic_normalisation(bb):
    assert bridge_codec.normalise(b"c-h.a_t") == "chat   "
    assert bridge_codec.subject(b"c-h.a_t") == "bridge.chat"
    assert bridge_codec.subject(b"a b    ") == "bridge.a_b"
    assert bridge_codec.subject(b"-------") == "bridge._"
    with bridge(bb) as sub:
        sub.send(b"Sc-h.a_t")
        assert read_n(sub, 1) == b"O"
        publish(bb, b"chat!!!", b"hi")
        assert read_n(sub, 4 + 6) == b"\x02\x00hi" + bridge_codec.END


def test_unknown_command_gets_F_and_close(bb):
    with bridge(bb) as c:
        c.send(b"Xchat   ")
        assert read_n(c, 1) == b"F"
        assert c.closed()


def test_empty_publish_is_just_the_end_marker(bb):
    with bridge(bb) as sub:
        sub.send(b"Sempty  ")
        assert read_n(sub, 1) == b"O"
        assert publish(bb, b"empty  ", b"") == b""
        assert read_n(sub, 6) == bridge_codec.END


def test_publish_limit(start_broker):
    b = start_broker(workers=1, args=["--bridge-port", "0"], config={"bridge": {"max_publish_bytes": 1000}})
    with bridge(b) as p:
        p.send(b"Pbig    " + b"z" * 1200)
        assert read_n(p, 8) == b"OOOOOOOF"
        assert p.closed()


def test_a_subscriber_that_never_reads_does_not_stall_publishers(bb):
    stuck = socket.create_connection(("127.0.0.1", bb.ports["bridge"]))
    try:
        stuck.sendall(b"Sstall  ")
        started = time.monotonic()
        for _ in range(20):
            assert publish(bb, b"stall  ", b"x" * 300) == b"OOO"
        assert time.monotonic() - started < 10  # the original waited 3 s per publish for a heartbeat answer
    finally:
        stuck.close()


def test_half_closed_subscriber_keeps_receiving(bb):
    with bridge(bb) as sub:
        sub.send(b"Shalf   ")
        sub.sock.shutdown(socket.SHUT_WR)
        assert read_n(sub, 1) == b"O"
        publish(bb, b"half   ", b"still")
        assert read_n(sub, 7 + 6) == b"\x05\x00still" + bridge_codec.END


def test_bridge_is_part_of_the_shared_subject_space(bb):
    async def run():
        nd = await AsyncClient.connect("127.0.0.1", bb.port)
        await nd.sub("bridge.>")
        nc = await nats.connect(f"nats://127.0.0.1:{bb.ports['nats']}", allow_reconnect=False)
        ns = await nc.subscribe("bridge.news")
        await asyncio.sleep(0)
        await nc.flush()
        await asyncio.to_thread(publish, bb, b"news   ", b"\xff\xfebinary")
        m = await nd.next_message(timeout=5)
        assert (m.topic, m.data, m.extra) == ("bridge.news", "//5iaW5hcnk=", {"encoding": "base64"})
        assert (await ns.next_msg(timeout=5)).data == b"\xff\xfebinary"
        with bridge(bb) as sub:
            sub.send(b"Sfrom   ")
            assert read_n(sub, 1) == b"O"
            # One publisher at a time: two publishers on different workers have no order between them.
            await nd.pub("bridge.from", "ndjson text")
            expected = b"\x0b\x00ndjson text" + bridge_codec.END
            assert read_n(sub, len(expected)) == expected
            await nc.publish("bridge.from", b"nats bytes")
            await nc.flush()
            expected = b"\x0a\x00nats bytes" + bridge_codec.END
            assert read_n(sub, len(expected)) == expected
        await nd.close()
        await nc.close()

    asyncio.run(run())


def test_bridge_under_security_acts_as_its_configured_user(start_broker):
    config = secure_config()
    config["security"]["users"].append({"username": "bridge", "password": "unused",
                                        "permissions": ["subscribe:bridge.open", "publish:bridge.open"]})
    config["bridge"] = {"user": "bridge"}
    b = start_broker(workers=1, config=config, args=["--bridge-port", "0"])
    with bridge(b) as c:
        c.send(b"Sopen   ")
        assert read_n(c, 1) == b"O"
    with bridge(b) as c:
        c.send(b"Sclosed ")
        assert read_n(c, 1) == b"F" and c.closed()
