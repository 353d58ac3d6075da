"""``brokerctl top`` against a real broker carrying real traffic: ``--once`` as JSON and CSV, the console driven
headless by textual's Pilot, and in a real terminal (tmux).  Its computations on canned answers:
tests/tools/test_top_model.py.

``TOP_SCREENSHOT=1 pytest tests/tools/test_top.py -k pilot`` rewrites the screenshots in docs/ (docs/operations.md)."""

import asyncio
import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from shardbroker.cli.top import endpoint, formatting, model, views

from support.harness import REPO, Broker, Raw


def test_brokerctl_start_does_not_import_textual_and_once_does_not_either():
    code = ("import sys; import shardbroker.cli.main; "
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('textual', 'rich') "
            "or m.startswith('shardbroker.cli.top.')]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=30)


def test_an_unreachable_monitoring_endpoint_is_one_line_and_exit_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for args in (["--once"], []):
        res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "top", "-m", f"127.0.0.1:{port}", *args],
                             capture_output=True, text=True, cwd=REPO, timeout=30, stdin=subprocess.DEVNULL)
        if args:
            assert res.returncode == 1 and res.stdout == ""
            assert res.stderr.count("\n") == 1, res.stderr
            assert f"cannot reach the monitoring endpoint http://127.0.0.1:{port}: Connection refused" in res.stderr
        else:  # the console needs a terminal: said before anything is tried
            assert res.returncode == 2 and "use --once" in res.stderr


# -- against a real broker with real traffic ------------------------------------------------------------------

class Traffic:
    """Subscribers on top.a (one), top.* (one) and top.> (one); a publisher sending to top.a, top.b and top.c in
    turn at about 600 msg/s; a queue with pushes; every delivery read (no slow consumer)."""

    RATE = 600

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.subs = {}
        for pattern in ("top.a", "top.*", "top.>"):
            raw = Raw(port)
            raw.request({"op": "sub", "topic": pattern})
            self.subs[pattern] = raw.request({"op": "info"})["info"]["cid"], raw
        self.pub = Raw(port)
        self.pub_cid = self.pub.request({"op": "info"})["info"]["cid"]
        self.pub.request({"op": "qpush", "queue": "top.jobs", "data": 0})
        self.threads = [threading.Thread(target=self._drain, args=(raw,), daemon=True)
                        for _, raw in self.subs.values()]
        self.threads.append(threading.Thread(target=self._drain, args=(self.pub,), daemon=True))
        self.threads.append(threading.Thread(target=self._publish, daemon=True))
        for t in self.threads:
            t.start()

    def _drain(self, raw: Raw) -> None:
        raw.sock.settimeout(0.5)
        while not self.stop.is_set():
            try:
                if not raw.sock.recv(65536):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def _publish(self) -> None:
        n = 0
        batch = self.RATE // 20
        while not self.stop.is_set():
            lines = [json.dumps({"op": "pub", "topic": f"top.{'abc'[(n + k) % 3]}", "data": "x" * 10})
                     for k in range(batch)]
            if n % (batch * 10) == 0:
                lines.append(json.dumps({"op": "qpush", "queue": "top.jobs", "data": n}))
            try:
                self.pub.send(("\n".join(lines) + "\n").encode())
            except OSError:
                return
            n += batch
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)
        for _, raw in self.subs.values():
            raw.close()
        self.pub.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One 2-worker broker for the module, with traffic running throughout."""
    broker = Broker(tmp_path_factory.mktemp("top"), workers=2).start()
    traffic = Traffic(broker.port)
    time.sleep(2.2)  # subject counters reach their owners once a second: let two shipments happen
    yield broker, traffic
    traffic.close()
    broker.close()


def monitor(broker: Broker) -> str:
    return f"http://127.0.0.1:{broker.ports['monitoring']}"


def top_once(broker: Broker, *args: str) -> subprocess.CompletedProcess:
    """``brokerctl top --once ...`` in a fresh interpreter that then says whether textual was imported."""
    code = ("import sys\nfrom shardbroker.cli.main import cli\n"
            "try:\n    cli(sys.argv[1:], prog_name='brokerctl')\n"
            "except SystemExit as e:\n    code = e.code\n"
            "sys.stderr.write('textual imported\\n' if 'textual' in sys.modules else '')\nsys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code, "top", "--once", "-m", monitor(broker), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def test_once_json_shows_the_workers_subjects_queues_and_connections_with_rates(live):
    broker, traffic = live
    res = top_once(broker, "--format", "json", "-d", "1.5")
    assert res.returncode == 0 and "textual imported" not in res.stderr, res.stderr
    snap = json.loads(res.stdout)
    varz = broker.varz()
    assert sorted(w["pid"] for w in snap["workers"]) == sorted(broker.pids)
    assert [w["worker"] for w in snap["workers"]] == [0, 1]
    assert sum(w["connections"] for w in snap["workers"]) == varz["connections"] == 4
    assert all(w["state"] == "ready" and w["rss"] > 0 for w in snap["workers"])  # RSS: read here, on loopback
    server = snap["server"]
    assert server["workers_ready"] == 2 and server["connections"] == 4
    assert server["msgs_in_rate"] == pytest.approx(Traffic.RATE, rel=0.5)
    # every message reaches two subscribers (top.* and top.>), top.a's a third
    assert server["msgs_out_rate"] == pytest.approx(Traffic.RATE * 7 / 3, rel=0.5)
    subjects = {s["subject"]: s for s in snap["subjects"]}
    assert set(subjects) >= {"top.a", "top.b", "top.c"}
    for name in ("top.a", "top.b", "top.c"):
        assert subjects[name]["msgs_rate"] == pytest.approx(Traffic.RATE / 3, rel=0.7), subjects[name]
    assert [s["subject"] for s in snap["subjects"]][:3] != []  # busiest first
    rates = [s["msgs_rate"] for s in snap["subjects"] if s["msgs_rate"] is not None]
    assert rates == sorted(rates, reverse=True)
    queues = {q["queue"]: q for q in snap["queues"]}
    assert queues["top.jobs"]["visible"] >= 1
    conns = {c["cid"]: c for c in snap["connections"]}
    assert set(conns) == {cid for cid, _ in traffic.subs.values()} | {traffic.pub_cid}
    assert conns[traffic.pub_cid]["msgs_from_rate"] == pytest.approx(Traffic.RATE, rel=0.5)
    assert snap["connections_total"] == 4


def test_once_csv_prints_the_chosen_view_sorted(live):
    broker, traffic = live
    res = top_once(broker, "--format", "csv", "--view", "connections", "--sort", "msgs_to", "-d", "0.5")
    assert res.returncode == 0 and "textual imported" not in res.stderr, res.stderr
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert [c.key for c in views.CONNECTIONS.columns] == list(rows[0].keys())
    assert len(rows) == 4
    msgs_to = [int(r["msgs_to"]) for r in rows]
    assert msgs_to == sorted(msgs_to, reverse=True) and msgs_to[0] > 0
    assert int(rows[0]["cid"]) == traffic.subs["top.>"][0] or int(rows[0]["cid"]) == traffic.subs["top.*"][0]

    res = top_once(broker, "-o", "csv", "--view", "subjects", "-n", "2", "--sort", "subject", "-d", "0")
    assert [r["subject"] for r in csv.DictReader(io.StringIO(res.stdout))] == ["top.a", "top.b"]

    res = top_once(broker, "-o", "csv", "-d", "0")   # one snapshot, no rates: the workers
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert [int(r["pid"]) for r in rows] == [w["pid"] for w in sorted(broker.varz()["workers"],
                                                                      key=lambda w: w["worker"])]
    assert all(r["msgs_in_rate"] == "" for r in rows)


@pytest.mark.slow
def test_a_stuck_worker_shows_as_unresponsive(start_broker):
    broker = start_broker(workers=2, config={"workers": {"heartbeat_timeout": 30}})
    os.kill(broker.pids[1], signal.SIGSTOP)
    try:
        res = top_once(broker, "-o", "csv", "-d", "0")
    finally:
        os.kill(broker.pids[1], signal.SIGCONT)
    assert res.returncode == 0, res.stderr
    rows = {int(r["worker"]): r for r in csv.DictReader(io.StringIO(res.stdout))}
    assert rows[0]["state"] == "ready" and rows[1]["state"] == "unresponsive"
    assert rows[1]["connections"] == ""          # its counters are unknown, not zero


# -- the console, headless (textual's Pilot) ------------------------------------------------------------------

async def until(pilot, check, timeout: float = 15.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pilot.pause(0.1)
        value = check()
        if value:
            return value
    raise AssertionError(f"timed out waiting for {what or check}")


def table_rows(app) -> list[list[str]]:
    from textual.widgets import DataTable

    table = app.query_one(DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def table_header(app) -> list[str]:
    from textual.widgets import DataTable

    return [str(c.label) for c in app.query_one(DataTable).ordered_columns]


def column(app, title: str) -> int:
    """The index of a column, whatever sort arrow its header carries."""
    return [h.rstrip("▲▼") for h in table_header(app)].index(title)


def test_pilot_workers_subjects_drill_down_to_subscribers_and_connections(live):
    pytest.importorskip("textual")
    asyncio.run(pilot_session(*live))


async def pilot_session(broker: Broker, traffic: Traffic) -> None:
    from shardbroker.cli.top.app import TopApp

    poller = model.Poller(endpoint.Client(monitor(broker)), interval=0.5, limit=50)
    app = TopApp(poller)
    shots = os.environ.get("TOP_SCREENSHOT")
    async with app.run_test(size=(160, 24)) as pilot:
        # workers: one row per worker, its pid, rates once two snapshots are in
        rows = await until(pilot, lambda: app.polls >= 2 and table_rows(app), what="worker rows")
        assert [int(r[1]) for r in rows] == sorted(broker.pids)
        header = table_header(app)
        assert header[0].startswith("W") and "MSG/s IN" in header and "CPU%" in header and "RSS" in header
        await until(pilot, lambda: sum(_num(r[column(app, "MSG/s OUT")]) for r in table_rows(app)) > 100,
                    what="out rates")
        if shots:
            await until(pilot, lambda: app.polls >= 6)
            app.save_screenshot("top-workers.svg", str(REPO / "docs"))

        # subjects, busiest first; the cursor on top.a, Enter: its subscribers
        await pilot.press("t")
        await until(pilot, lambda: {"top.a", "top.b", "top.c"} <= {r[0] for r in table_rows(app)}, what="subjects")
        assert table_header(app)[:3] == ["SUBJECT", "OWNER", "MSG/s▼"]
        index = [r[0] for r in table_rows(app)].index("top.a")
        for _ in range(index):
            await pilot.press("down")
        await pilot.press("enter")
        expected = {traffic.subs[p][0] for p in ("top.a", "top.*", "top.>")}
        rows = await until(pilot, lambda: app.subject == "top.a" and len(table_rows(app)) == 3 and table_rows(app),
                           what="subscribers of top.a")
        assert {int(r[0]) for r in rows} == expected
        assert {r[column(app, "MATCHING")] for r in rows} == {"top.a", "top.*", "top.>"}
        title = str(app.query_one("#title").render())
        assert "subscribers of top.a: 3" in title
        if shots:
            await until(pilot, lambda: app.polls >= 10)
            app.save_screenshot("top-subscribers.svg", str(REPO / "docs"))

        # Esc: back to the subjects; c: connections, sorted by cid, then by msgs_to (o moves the sort along)
        await pilot.press("escape")
        await until(pilot, lambda: app.subject is None and "top.b" in {r[0] for r in table_rows(app)})
        # / filters the rows; Esc clears the filter
        await pilot.press("slash", *"top.b", "enter")
        assert [r[0] for r in table_rows(app)] == ["top.b"]
        await pilot.press("escape")
        await until(pilot, lambda: {"top.a", "top.b", "top.c"} <= {r[0] for r in table_rows(app)})
        await pilot.press("c")
        rows = await until(pilot, lambda: len(table_rows(app)) == 4 and table_rows(app), what="connections")
        cids = [int(r[1]) for r in rows]
        assert cids == sorted(cids)
        # the broker sorts before its limit when it knows nats-server's sort= (it refuses a key it does not know)
        assert poller.server_sorts is (broker.http("/connz?sort=bogus")[0] == 400)
        by = "on the broker" if poller.server_sorts else "here"
        assert f"sorted {by}" in str(app.query_one("#title").render())
        app.sorts["connections"] = "msgs_from"
        await pilot.press("O")  # back one column: msgs_to
        assert app.sorts["connections"] == "msgs_to"
        rows = await until(pilot, lambda: "MSGS_TO▼" in table_header(app) and table_rows(app))
        to = [_num(r[column(app, "MSGS_TO")]) for r in rows]
        assert to == sorted(to, reverse=True)

        # q quits
        await pilot.press("q")
    assert poller.client.requests >= 6


def _num(text: str) -> float:
    text = text.strip()
    scale = {"k": 1e3, "M": 1e6, "K": 1024, "B": 1}
    if text in ("-", ""):
        return 0.0
    if text[-1] in scale:
        return float(text[:-1]) * scale[text[-1]]
    return float(text)


# -- the console in a real terminal (tmux) ---------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_in_a_real_terminal_the_table_shows_the_workers(live, tmp_path):
    broker, _ = live
    session = f"top-test-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    socket_name = ["-L", session]   # a private tmux server: nothing of the user's is touched
    cmd = f"{sys.executable} -m shardbroker.cli top -m {monitor(broker)} -d 0.5; echo TOP-EXITED=$?; sleep 30"
    subprocess.run(["tmux", *socket_name, "new-session", "-d", "-s", session, "-x", "160", "-y", "45",
                    "-c", str(REPO), cmd], check=True, env=env, timeout=10)

    def pane() -> str:
        return subprocess.run(["tmux", *socket_name, "capture-pane", "-p", "-t", session], capture_output=True,
                              text=True, env=env, timeout=10).stdout

    def wait_for(check, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = pane()
            if check(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"the pane never showed it:\n{text}")

    try:
        text = wait_for(lambda t: all(str(pid) in t for pid in broker.pids) and "MSG/s IN" in t)
        lines = text.splitlines()
        header = next(line for line in lines if "MSG/s IN" in line)
        assert header.split()[:3] == ["W▲", "PID", "STATE"]
        rows = [line.split() for line in lines if any(f" {pid} " in line for pid in broker.pids)]
        assert sorted((int(r[0]), int(r[1])) for r in rows) == \
            sorted((w["worker"], w["pid"]) for w in broker.varz()["workers"])
        assert all(r[2] == "ready" for r in rows)
        assert "workers 2/2" in text
        subprocess.run(["tmux", *socket_name, "send-keys", "-t", session, "t"], check=True, env=env)
        wait_for(lambda t: "top.a" in t and "SUBJECT" in t)
        subprocess.run(["tmux", *socket_name, "send-keys", "-t", session, "q"], check=True, env=env)
        wait_for(lambda t: "TOP-EXITED=0" in t)
    finally:
        subprocess.run(["tmux", *socket_name, "kill-server"], env=env, timeout=10)


# -- what polling costs the broker ----------------------------------------------------------------------------

def broker_cpu_seconds(broker: Broker) -> float:
    import psutil

    total = 0.0
    for proc in broker.group():
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


@pytest.mark.slow
def test_polling_at_1_hz_costs_the_broker_little(start_broker):
    """The broker's own CPU time (supervisor and workers) while idle, then while polled once a second as the
    console does in its costliest views; the difference must stay under 10 % of one core."""
    broker = start_broker(workers=2)
    conns = [Raw(broker.port) for _ in range(50)]
    for i, c in enumerate(conns):
        c.request({"op": "sub", "topic": f"cost.{i}.>"})
    with Raw(broker.port) as pub:
        for i in range(200):
            pub.request({"op": "pub", "topic": f"cost.{i % 50}.x{i}", "data": i})
    try:
        seconds = 3.0
        costs = {}
        for view in (None, "workers", "connections", "drill"):
            poller = model.Poller(endpoint.Client(monitor(broker)), limit=50)
            before, start = broker_cpu_seconds(broker), time.monotonic()
            while time.monotonic() - start < seconds:
                if view == "drill":
                    poller.poll((), subject="cost.3.x3")
                elif view is not None:
                    poller.poll((view,), conn_sort="msgs_to")
                time.sleep(1.0 - (time.monotonic() - start) % 1.0)
            costs[view] = (broker_cpu_seconds(broker) - before) / (time.monotonic() - start)
        print("broker CPU, share of one core:", {k: round(v, 4) for k, v in costs.items()})
        for view in ("workers", "connections", "drill"):
            assert costs[view] - costs[None] < 0.10, costs
    finally:
        for c in conns:
            c.close()


def test_client_chosen_names_and_subjects_reach_the_terminal_escaped(start_broker):
    """Finding A10: a NATS client's name and a subject may hold ESC; `top --once -o csv` printed them raw (a
    screen clear, an OSC 52 clipboard write).  Every control character is written as \\xNN instead."""
    broker = start_broker(workers=1)
    evil = "svc\x1b[2J\x1b]52;c;cm0gLXJmIH4K\x07"
    s = socket.create_connection(("127.0.0.1", broker.ports["nats"]), timeout=5)
    s.sendall(('CONNECT {"verbose":false,"name":%s}\r\n' % json.dumps(evil)).encode()
              + b"SUB evil.\x1b[31m 1\r\n" + b"PUB evil.\x1b[31m 1\r\nx\r\n" * 3 + b"PING\r\n")
    got = b""
    while b"PONG" not in got:
        got += s.recv(65536)
    time.sleep(1.2)   # the subject counters reach their owner once a second
    try:
        for view in ("connections", "subjects"):
            res = top_once(broker, "--format", "csv", "--view", view, "-d", "0.2")
            assert res.returncode == 0, res.stderr
            assert not any(ch in res.stdout for ch in "\x1b\x07\x9b"), res.stdout
            assert ("svc\\x1b[2J\\x1b]52;c;cm0gLXJmIH4K\\x07" if view == "connections" else "evil.\\x1b[31m") \
                in res.stdout, res.stdout
    finally:
        s.close()
    assert formatting.human("a\x1bb\x00", "str") == "a\\x1bb\\x00"
