"""/connz sort=: nats-server's keys and orders, applied on the workers before the page is cut."""

import random
import socket
import time

from shardbroker.cluster.monitoring import connz

from support.harness import Raw

KEYS = ["cid", "start", "subs", "pending", "msgs_to", "msgs_from", "bytes_to", "bytes_from", "last", "idle",
        "uptime", "rtt"]


def cids(b, query: str) -> list[int]:
    status, body = b.http(f"/connz?{query}")
    assert status == 200, body
    return [c["cid"] for c in body["connections"]]


def expected(rows: list[dict], key: str) -> list[int]:
    """nats-server's order (server/monitor.go), ties by cid, from one unsorted listing."""
    field, descending = {
        "cid": ("cid", False), "start": ("cid", False), "subs": ("subscriptions", True),
        "pending": ("pending_bytes", True), "msgs_to": ("out_msgs", True), "msgs_from": ("in_msgs", True),
        "bytes_to": ("out_bytes", True), "bytes_from": ("in_bytes", True), "last": ("last_activity", True),
        "idle": ("last_activity", False), "uptime": ("start", True), "rtt": ("rtt_s", True),
    }[key]
    return [r["cid"] for r in sorted(rows, key=lambda r: ((-r[field] if descending else r[field]), r["cid"]))]


def test_every_nats_sort_key_orders_across_workers_and_pages(start_broker):
    b = start_broker(workers=2)
    clients = []
    try:
        for _ in range(8):   # one at a time: start times in cid order
            clients.append(Raw(b.port))
            clients[-1].request({"op": "ping"})
        infos = [c.request({"op": "info"})["info"] for c in clients]
        assert {i["worker"] for i in infos} == {0, 1}
        for n, c in enumerate(clients):   # client n: n subscriptions, publishes 7 - n messages of n bytes
            for k in range(n):
                c.request({"op": "sub", "topic": f"s.{n}.{k}"})
            for _ in range(7 - n):
                c.request({"op": "pub", "topic": "s.0.0", "data": "x" * n})
            time.sleep(0.02)   # distinct last activity, in client order
        clients[3].request({"op": "pub", "topic": "nobody", "data": 1})   # the most recent activity
        time.sleep(0.1)
        status, full = b.http("/connz?limit=100")
        rows = full["connections"]
        assert status == 200 and full["total"] == 8 and len(rows) == 8
        # the unsorted listing's timestamps, back to numbers for the expected orders
        by_cid = {c["cid"]: c for c in rows}
        for r in rows:
            r["start"] = _epoch(r["start"])
            r["last_activity"] = _epoch(r["last_activity"])
            r["rtt_s"] = 0
        for key in KEYS:
            want = expected(rows, key)
            assert cids(b, f"sort={key}&limit=100") == want, key
            assert cids(b, f"sort={key}&limit=3&offset=2") == want[2:5], key
        assert cids(b, "sort=last&limit=1") == [infos[3]["cid"]]
        assert cids(b, "sort=idle&limit=100")[-1] == infos[3]["cid"]
        assert cids(b, "sort=uptime&limit=100") == sorted(by_cid, reverse=True)   # the newest first, as nats
        top = b.http("/connz?sort=msgs_from&limit=1")[1]
        assert top["num_connections"] == 1 and top["total"] == 8 and top["limit"] == 1
        assert top["connections"][0]["cid"] == infos[0]["cid"] and top["connections"][0]["in_msgs"] == 7
        entry = top["connections"][0]
        assert entry["last_activity"].endswith("Z") and entry["idle"].endswith("s")
        one = b.http(f"/connz?cid={infos[5]['cid']}")[1]
        assert [c["cid"] for c in one["connections"]] == [infos[5]["cid"]] and one["total"] == 1
    finally:
        for c in clients:
            c.sock.close()


def test_bad_sort_keys_get_nats_server_errors(start_broker):
    b = start_broker(workers=2)
    assert b.http("/connz?sort=bogus") == (400, {"error": "invalid sorting option: bogus"})
    assert b.http("/connz?sort=stop") == (400, {"error": "sort by stop only valid on closed connections"})
    assert b.http("/connz?sort=reason") == (400, {"error": "sort by reason only valid on closed connections"})
    assert b.http("/connz?sort=")[0] == 200   # empty: by cid, as nats-server


def test_nats_clients_get_an_rtt_from_the_first_ping(start_broker):
    b = start_broker(workers=1)
    with socket.create_connection(("127.0.0.1", b.ports["nats"]), timeout=5) as s:
        s.recv(4096)  # INFO
        s.sendall(b'CONNECT {"verbose":false}\r\n')
        buf = b""
        while b"PING\r\n" not in buf:   # the server's first RTT ping, 2 s after CONNECT
            buf += s.recv(4096)
        s.sendall(b"PONG\r\n")
        time.sleep(0.2)
        (conn,) = b.http("/connz")[1]["connections"]
        with Raw(b.port):
            time.sleep(0.1)
            assert cids(b, "sort=rtt")[0] == conn["cid"]
    assert conn["rtt"] != "0s" and conn["rtt"][-2:] in ("µs", "ms"), conn["rtt"]


def test_merging_each_workers_top_is_one_global_sort():
    """What the supervisor does with the workers' replies: each worker's first n, merged, cut."""
    rng = random.Random(7)
    rows = [{"cid": i, "out_msgs": rng.randrange(5), "start": rng.random()} for i in range(1, 200)]
    workers = [rows[i::3] for i in range(3)]
    get = lambda r, f: r[f]  # noqa: E731
    for key in ("msgs_to", "uptime", "cid"):
        for offset, limit in ((0, 10), (15, 7), (190, 50)):
            tops = [r for w in workers for r in connz.top(w, key, offset + limit, get, lambda r: r["cid"])]
            page = connz.top(tops, key, offset + limit, get, lambda r: r["cid"])[offset:]
            assert page == connz.top(rows, key, None, get, lambda r: r["cid"])[offset:offset + limit]


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
