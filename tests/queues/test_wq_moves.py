"""A connection whose first work-queue request is for a queue another worker owns moves to that owner
(workers/protocols/ndjson/moves.py): the client sees one ordered stream of replies, keeps its identity and permissions,
and the
supervisor's counts follow it.  Connections that hold something on their worker stay."""

import os
import signal
import time
import zlib

import psutil

from support.harness import Raw, on_worker

USERS = [{"username": "worker", "password": "pw", "permissions": ["publish:jobs", "subscribe:jobs"]}]


def owner(queue: str, workers: int = 2) -> int:
    return zlib.crc32(queue.encode()) % workers


def lines(conn: Raw, n: int) -> list[dict]:
    return [conn.json() for _ in range(n)]


def worker_stats(broker) -> dict[int, dict]:
    return {w["worker"]: w for w in broker.varz()["workers"]}


def test_the_first_queue_request_moves_the_connection_and_every_reply_comes_in_order(start_broker):
    b = start_broker(workers=2)
    home = owner("jobs")
    conn = on_worker(b.port, 1 - home)
    cid = conn.request({"op": "info"})["info"]["cid"]
    # the request that decides, and what was pipelined after it, in one write, with a partial line at the end
    conn.send(b"".join(b'{"op":"qpush","queue":"jobs","data":%d}\n' % i for i in range(3))
              + b'{"op":"qrecv","queue":"jobs","max":10}\n{"op":"qstat","queue":"jobs"}\n{"op":"in')
    time.sleep(0.1)
    conn.send(b'fo"}\n')
    pushed = lines(conn, 3)
    got, stat, info = lines(conn, 3)
    assert all(r["ok"] for r in pushed), pushed
    assert [m["data"] for m in got["messages"]] == [0, 1, 2]
    assert stat["stat"]["in_flight"] == 3 and stat["stat"]["owner"] == home
    assert info["info"]["worker"] == home and info["info"]["cid"] == cid   # the same connection, on the owner
    acked = conn.request({"op": "qack", "queue": "jobs", "receipts": [m["receipt"] for m in got["messages"]]})
    assert acked["ok"] and all(r == {"ok": True} for r in acked["results"])
    status, page = b.http(f"/connz?cid={cid}")
    assert status == 200 and [c["worker"] for c in page["connections"]] == [home]
    stats = worker_stats(b)
    assert stats[home]["moved_in"] == 1 and stats[1 - home]["moved_out"] == 1
    assert stats[home]["connections"] == 1 and stats[1 - home]["connections"] == 0
    conn.close()


def test_a_connection_moves_with_a_first_request_larger_than_a_control_datagram(start_broker):
    """The move carries what the connection sent and the worker had not handled yet; past 60 KB that crosses the
    control channel in several datagrams, with the client's socket on the first: it used to be closed there."""
    b = start_broker(workers=2)
    conn = on_worker(b.port, 1 - owner("jobs"))
    batch = [{"data": "x" * 100}] * 1000   # ~115 KB in one line
    for i in range(3):
        reply = conn.request({"op": "qpush", "queue": "jobs", "messages": batch, "dedup_id": f"big-{i}"})
        assert reply["ok"] and len(reply["ids"]) == 1000
    assert conn.request({"op": "info"})["info"]["worker"] == owner("jobs")
    assert "partial control message" not in b.log()


def test_a_long_poll_that_moves_is_served_on_the_owner(start_broker):
    b = start_broker(workers=2)
    home = owner("jobs")
    consumer = on_worker(b.port, 1 - home)
    consumer.send(b'{"op":"qrecv","queue":"jobs","wait_ms":5000}\n')
    time.sleep(0.3)
    with Raw(b.port) as producer:
        assert producer.request({"op": "qpush", "queue": "jobs", "data": "late"})["ok"]
    reply = consumer.json()
    assert [m["data"] for m in reply["messages"]] == ["late"]
    assert consumer.request({"op": "info"})["info"]["worker"] == home
    consumer.close()


def test_a_moved_connection_keeps_its_user_and_permissions(start_broker):
    b = start_broker(workers=2, config={"security": {
        "enabled": True, "iterations": 1000, "users": USERS,
        "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]}}})
    home = owner("jobs")
    conn = on_worker(b.port, 1 - home, user="worker", password="pw")
    assert conn.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"]
    info = conn.request({"op": "info"})["info"]
    assert info["worker"] == home and info["user"] == "worker"
    assert conn.request({"op": "qpush", "queue": "other", "data": 1})["error"] == "permission_denied"
    assert conn.request({"op": "qrecv", "queue": "jobs"})["messages"][0]["data"] == 1
    conn.close()


def test_release_on_close_returns_the_leases_of_a_moved_connection(start_broker):
    b = start_broker(workers=2)
    home = owner("jobs")
    with Raw(b.port) as producer:
        assert producer.request({"op": "qpush", "queue": "jobs", "data": "x"})["ok"]
        consumer = on_worker(b.port, 1 - home)
        got = consumer.request({"op": "qrecv", "queue": "jobs", "release_on_close": True})
        assert got["messages"][0]["data"] == "x"
        assert consumer.request({"op": "info"})["info"]["worker"] == home
        consumer.close()
        deadline = time.monotonic() + 5
        while producer.request({"op": "qstat", "queue": "jobs"})["stat"]["visible"] != 1:
            assert time.monotonic() < deadline, "the lease was not returned when its connection closed"
            time.sleep(0.05)


def test_connections_that_hold_something_on_their_worker_stay(start_broker):
    b = start_broker(workers=2)
    home = owner("jobs")
    subscriber = on_worker(b.port, 1 - home)             # a subscription
    assert subscriber.request({"op": "sub", "topic": "news"})["ok"]
    assert subscriber.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"]
    assert subscriber.request({"op": "info"})["info"]["worker"] == 1 - home
    second = on_worker(b.port, 1 - home)                 # its first queue was local: it stays for the next ones
    local = next(q for q in (f"q{i}" for i in range(100)) if owner(q) == 1 - home)
    assert second.request({"op": "qpush", "queue": local, "data": 1})["ok"]
    assert second.request({"op": "qpush", "queue": "jobs", "data": 2})["ok"]
    assert second.request({"op": "info"})["info"]["worker"] == 1 - home
    for c in (subscriber, second):
        c.close()


def test_moving_can_be_turned_off(start_broker):
    b = start_broker(workers=2, config={"queues": {"move_connections": False}})
    home = owner("jobs")
    conn = on_worker(b.port, 1 - home)
    assert conn.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"]
    assert conn.request({"op": "info"})["info"]["worker"] == 1 - home
    conn.close()


def admitted(port: int) -> tuple[Raw, bool]:
    conn = Raw(port)
    return conn, conn.request({"op": "ping"}).get("ok", False)


def wait_admitted(port: int, n: int) -> list[Raw]:
    """``n`` connections at once, all admitted (closed connections' places come free at the end of a turn)."""
    deadline = time.monotonic() + 5
    while True:
        conns = [admitted(port) for _ in range(n)]
        if all(ok for _, ok in conns):
            return [c for c, _ in conns]
        for c, _ in conns:
            c.close()
        assert time.monotonic() < deadline, f"{n} connection(s) were never admitted together"
        time.sleep(0.05)


def test_the_supervisors_counts_follow_a_moved_connection(start_broker):
    """Per-address limit 2: a moved connection counts once (not twice, not never), and its close frees its place
    on the worker it moved to."""
    b = start_broker(workers=2, config={"limits": {"max_connections_per_address": 2}})
    home = owner("jobs")
    conn = on_worker(b.port, 1 - home)
    assert conn.request({"op": "qpush", "queue": "jobs", "data": 1})["ok"]
    assert conn.request({"op": "info"})["info"]["worker"] == home
    (other,) = wait_admitted(b.port, 1)
    third, ok = admitted(b.port)
    assert not ok and third.closed()
    for c in (conn, other):
        c.close()
    for c in wait_admitted(b.port, 2):
        c.close()


def dead_but_unnoticed(broker, worker: int):
    """Kill ``worker`` while the supervisor is stopped, so that it has not noticed yet when it resumes (what
    follows competes with the death's news, as it does when a worker dies under load); returns a resume()."""
    pid = {w["worker"]: w["pid"] for w in broker.varz()["workers"]}[worker]
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:   # its sockets are closed now
            assert time.monotonic() < deadline
            time.sleep(0.01)
    except BaseException:
        os.kill(broker.proc.pid, signal.SIGCONT)
        raise
    return lambda: os.kill(broker.proc.pid, signal.SIGCONT)


def test_a_connection_moving_to_an_owner_that_just_died_stays_and_is_answered(start_broker):
    b = start_broker(workers=2)
    home = owner("jobs")
    conn = on_worker(b.port, 1 - home)
    resume = dead_but_unnoticed(b, home)
    conn.send(b'{"op":"qstat","queue":"jobs"}\n')   # its worker asks the stopped supervisor to move it
    time.sleep(0.2)
    resume()
    assert conn.json()["stat"]["owner"] == home      # answered by the replacement
    assert conn.request({"op": "ping"})["ok"]
    conn.close()


def test_connections_accepted_as_a_worker_dies_go_to_the_living(start_broker):
    b = start_broker(workers=2)
    resume = dead_but_unnoticed(b, 1)
    waiting = [Raw(b.port) for _ in range(6)]   # in the listen backlog
    resume()
    for conn in waiting:
        assert conn.request({"op": "ping"})["ok"]
        conn.close()
