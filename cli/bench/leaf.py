"""The leaf scenarios' waits: publishing begins only once the interest of the run's subscribers has reached the
side the publisher is on, so that nothing is published where no one is known to want it (and counted lost).

- The links (once, at the start): the hub's /leafz shows this broker's leaf connections, one per worker, and the
  nats-server leaf's.
- ``leafin`` (publisher on the hub, subscribers on the leaf): the hub's /leafz?subs=1 lists the run's subject on
  the nats-server leaf's connection, or on this broker's connection of every worker that has a subscriber of it
  (the broker's /connz?subs=1 says which workers those are).
- ``leafout`` (publisher on the leaf, subscribers on the hub): the hub's interest reaches a leaf over its link,
  which no endpoint of this broker's shows.  So a probe, the same for both leaves: after the run's subscribers
  (their SUB confirmed by the hub), a probe client subscribes on the hub to ``<subject>.ready``, and a probe on the
  leaf publishes there until one arrives.  The hub sends its LS+ over a link in the order its subscriptions came,
  and a leaf reads them in that order: a leaf that forwarded the probe's subject knows the run's.  On this broker
  each worker has a link of its own: the probe publishes from a connection on each worker the run's publishers
  are on.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

from shardbroker.cli.bench.servers import NATS_LEAF_NAME, Server
from shardbroker.cli.wire import nats


def http_json(port: int, path: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return json.load(resp)


def hub_links(hub: Server, subs: bool = False) -> list[dict]:
    """The hub's leaf connections, as its /leafz lists them."""
    return http_json(hub.monitor_port, "/leafz?subs=1" if subs else "/leafz").get("leafs") or []


def _split(links: list[dict]) -> tuple[list[dict], list[dict]]:
    """(this broker's connections, the nats-server leaf's): the hub has no other leaves."""
    theirs = [link for link in links if link.get("name") == NATS_LEAF_NAME]
    return [link for link in links if link.get("name") != NATS_LEAF_NAME], theirs


def wait_links(hub: Server, broker_links: int, nats_leaf: bool, timeout: float = 30.0) -> dict:
    """Until the hub has ``broker_links`` connections of this broker's and (``nats_leaf``) one of the nats-server
    leaf's; -> how each connection's compression reads in /leafz (by connection name)."""
    deadline = time.monotonic() + timeout
    links: list[dict] = []
    while time.monotonic() < deadline:
        links = hub_links(hub)
        ours, theirs = _split(links)
        if len(ours) == broker_links and len(theirs) == (1 if nats_leaf else 0):
            return {link.get("name", "?"): link.get("compression", "") for link in links}
        time.sleep(0.1)
    raise RuntimeError(f"the hub's /leafz shows {[link.get('name') for link in links]} after {timeout:g}s: "
                       f"expected {broker_links} connection(s) of this broker's"
                       f"{' and the nats-server leaf' if nats_leaf else ''}")


def link_state(hub: Server, ours: bool) -> tuple[set, int]:
    """(the ids of the leaf's connections on the hub, the hub's slow consumers among its leaf connections so far):
    taken before and after a run, they say whether a link was cut or redialled meanwhile, and whether the hub found
    the leaf too slow (nats-server drops what it cannot write to one, and may close the connection)."""
    mine, theirs = _split(hub_links(hub))
    varz = http_json(hub.monitor_port, "/varz")
    slow = (varz.get("slow_consumer_stats") or {}).get("leafs", varz.get("slow_consumers", 0))
    return {link.get("id") for link in (mine if ours else theirs)}, slow


def wait_hub_interest(hub: Server, leaf: Server, subject: str, ours: bool, timeout: float = 15.0) -> float:
    """``leafin``: until the hub's /leafz?subs=1 lists ``subject`` on the leaf's connections that must carry it (on
    this broker: those of the workers with a subscriber of it); -> seconds waited."""
    started = time.monotonic()
    deadline = started + timeout
    want = 1
    if ours:
        conns = http_json(leaf.monitor_port, "/connz?subs=1&limit=100000")["connections"]
        want = len({c["worker"] for c in conns if subject in (c.get("subscriptions_list") or ())})
    have = 0
    while time.monotonic() < deadline:
        mine, theirs = _split(hub_links(hub, subs=True))
        have = sum(subject in (link.get("subscriptions_list") or ()) for link in (mine if ours else theirs))
        if have >= want:
            return time.monotonic() - started
        time.sleep(0.02)
    raise RuntimeError(f"{subject}: the hub's /leafz lists it on {have} of the {want} leaf connection(s) that "
                       f"should carry it after {timeout:g}s")


class _Client:
    """A bare NATS client for the probe."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""
        line = self._line()
        self.info = nats.info(line)
        self.sock.sendall(nats.connect({"verbose": False, "pedantic": False, "echo": False}))

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._recv(5.0)
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def _recv(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return False
        if not data:
            raise ConnectionError("the server closed the probe's connection")
        self.buf += data
        return True

    def flush(self) -> None:
        self.sock.sendall(nats.PING)
        while True:
            frames, used = nats.parse(self.buf, controls=True)
            self.buf = self.buf[used:]
            if b"PONG" in frames:
                return
            self._recv(5.0)

    def payloads(self, wait: float) -> list[bytes]:
        """The payloads of the messages that arrive within ``wait`` seconds (answering the server's PINGs)."""
        self._recv(wait)
        frames, used = nats.parse(self.buf, controls=True)
        self.buf = self.buf[used:]
        if b"PING" in frames:
            self.sock.sendall(nats.PONG)
        return [f[3] for f in frames if isinstance(f, tuple)]

    def close(self) -> None:
        self.sock.close()


def probe_leaf_interest(hub_port: int, leaf: Server, subject: str, ours: bool, pub_cids: list[int],
                        timeout: float = 15.0) -> float:
    """``leafout``: until a probe published on the leaf (from each worker of the publishers', ``pub_cids``, on this
    broker) reaches a probe subscriber on the hub, both on ``<subject>.ready``; -> seconds waited."""
    started = time.monotonic()
    probe = subject + ".ready"
    opened: list[_Client] = []

    def client(port: int) -> _Client:
        opened.append(_Client(port))
        return opened[-1]

    try:
        sub = client(hub_port)
        sub.sock.sendall(nats.sub(probe, 1))
        sub.flush()
        if ours:   # a probe connection on each worker a publisher of the run is on
            worker_of = {c["cid"]: c["worker"]
                         for c in http_json(leaf.monitor_port, "/connz?limit=100000")["connections"]}
            wanted = {worker_of.get(cid) for cid in pub_cids} - {None}
            placed: dict[int, _Client] = {}
            for _ in range(8 * max(1, len(wanted))):
                if wanted <= set(placed):
                    break
                pub = client(leaf.ports["nats"])
                pub.flush()
                found = http_json(leaf.monitor_port, f"/connz?cid={int(pub.info['client_id'])}")["connections"]
                where = found[0]["worker"] if found else None
                if where in wanted and where not in placed:
                    placed[where] = pub
            if not wanted <= set(placed):
                raise RuntimeError(f"no probe connection landed on worker(s) {sorted(wanted - set(placed))}")
            pubs = list(placed.values())
        else:
            pubs = [client(leaf.ports["nats"])]
        deadline = started + timeout
        waiting = {str(i).encode(): pub for i, pub in enumerate(pubs)}
        while waiting and time.monotonic() < deadline:
            for tag, pub in waiting.items():
                pub.sock.sendall(nats.pub(probe, tag))
            for tag in sub.payloads(0.05):
                waiting.pop(tag, None)
        if waiting:
            raise RuntimeError(f"{subject}: the hub's interest did not reach {len(waiting)} of the leaf's "
                               f"{len(pubs)} probe connection(s) in {timeout:g}s")
        return time.monotonic() - started
    finally:
        for each in opened:
            each.close()
