"""What the leaf-node fault tests share (test_leaf_faults.py, test_leaf_topology.py, test_leaf_auth.py): a
broker configured to join hubs, the leaf lines of its log (workers/protocols/leaf/dial.py and link.py), the
hubs' interest as /leafz shows it, and nats-py probes that wait for traffic to cross."""

from __future__ import annotations

import asyncio
import re
import time

import nats
import nats.errors
import psutil

from support.natshub import NatsServer

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


def serves_local_clients(broker, data: bytes) -> None:
    """The broker's own clients are served whatever its leaf links are doing: ``data`` published on ``local.x``
    reaches its subscriber."""
    async def local():
        nc = await connect(nats_url(broker))
        sub = await nc.subscribe("local.x")
        await nc.publish("local.x", data)
        assert (await sub.next_msg(timeout=2)).data == data
        await nc.close()

    asyncio.run(local())


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
