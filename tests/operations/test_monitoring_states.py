"""The monitoring port answers in every state of the broker: starting, ready, lame duck and stopping (T1, T13 of
shared/reference/findings-2026-11/docs-walk.md: in lame duck /varz and /metrics read the closed listeners'
addresses, answered nothing and logged a traceback each, so the state "lame duck" could never be seen).

A thread scrapes every endpoint over and over while the broker goes through its states; each answer is filed
under the state /varz reported just before it."""

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from support.harness import Broker, Raw

ENDPOINTS = ["/", "/healthz", "/varz", "/connz", "/subsz", "/topicz", "/queuez", "/metrics"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class Scraper(threading.Thread):
    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.seen: dict[str, dict[str, list[int]]] = {}   # state -> endpoint -> statuses
        self.broken: list[tuple[str, str, str]] = []      # (state, endpoint, what went wrong)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                status, body = _get(self.port, "/varz")
            except OSError:   # not listening yet, or not any more
                time.sleep(0.02)
                continue
            state = json.loads(body)["state"] if status == 200 else f"varz {status}"
            sweep = []
            for path in ENDPOINTS:
                try:
                    status, body = _get(self.port, path)
                except OSError as exc:
                    if not self.halt.is_set() and state != "stopping":
                        self.broken.append((state, path, repr(exc)))
                    continue
                sweep.append((path, status))
                if path != "/metrics" and status in (200, 503):
                    json.loads(body)   # a whole JSON document, whatever the state
            try:   # a sweep during which the state changed is filed under the change ("starting>ready")
                status, body = _get(self.port, "/varz")
                after = json.loads(body)["state"] if status == 200 else f"varz {status}"
            except OSError:   # gone meanwhile: the last sweep of "stopping"
                after = state
            key = state if after == state else f"{state}>{after}"
            for path, status in sweep:
                self.seen.setdefault(key, {}).setdefault(path, []).append(status)


def _scraped(tmp_path, config: dict, drive) -> tuple[Scraper, Broker]:
    """Start a broker on a monitoring port chosen here (so it is scraped before the ready line says it), run
    ``drive(broker)``, wait for the broker's exit; -> what the scraper saw."""
    mon = _free_port()
    tmp_path.mkdir()
    broker = Broker(tmp_path, workers=2, config=config, args=["--monitor-port", str(mon)])   # the last one wins
    scraper = Scraper(mon)
    scraper.start()
    try:
        broker.start()
        assert broker.ports["monitoring"] == mon
        drive(broker)
        broker.proc.wait(timeout=30)
    finally:
        scraper.halt.set()
        scraper.join(timeout=30)
        broker.close()
    assert not scraper.broken, scraper.broken[:5]
    assert "Traceback" not in broker.log()
    return scraper, broker


def _answered_everything(scraper: Scraper, state: str) -> None:
    assert state in scraper.seen, f"never saw {state!r}: {sorted(scraper.seen)}"
    for path in ENDPOINTS:
        statuses = set(scraper.seen[state].get(path, []))
        allowed = {200, 503} if path == "/healthz" else {200}
        assert statuses and statuses <= allowed, (state, path, statuses)


@pytest.mark.slow
def test_every_endpoint_answers_in_every_state(tmp_path):
    # 10,000,000 iterations: hashing the configured password keeps the broker "starting" for a few seconds
    config = {"security": {"enabled": True, "iterations": 10_000_000,
                           "admin_user": {"username": "admin", "password": "adminpw", "permissions": ["admin"]}},
              "shutdown": {"lame_duck_duration": 2.0, "lame_duck_grace_period": 0.2}}

    def lame_duck(broker: Broker) -> None:
        client = Raw(broker.port)   # the lame duck lasts until it is closed
        time.sleep(0.5)
        broker.send_signal(signal.SIGUSR2)
        broker.proc.wait(timeout=30)
        client.close()

    scraper, _ = _scraped(tmp_path / "a", config, lame_duck)
    for state in ("starting", "ready", "lame duck"):
        _answered_everything(scraper, state)
    assert set(scraper.seen["starting"]["/healthz"]) == {503}

    def stop(broker: Broker) -> None:
        client = Raw(broker.port)   # never closes its side: the worker's close waits for it (2 s), stopping
        assert client.request({"op": "ping"}) == {"ok": True}
        broker.send_signal(signal.SIGTERM)
        broker.proc.wait(timeout=30)
        client.close()

    scraper, _ = _scraped(tmp_path / "b", {}, stop)
    _answered_everything(scraper, "stopping")
    assert set(scraper.seen["stopping"]["/healthz"]) == {503}


def test_a_monitoring_port_in_use_is_one_line_and_exit_1(start_broker, tmp_path):
    """T2: a taken monitoring port printed a traceback (the client ports said one line); now it is refused with the
    others, before any worker starts."""
    first = start_broker(workers=1)
    taken = first.ports["monitoring"]
    second = Broker(tmp_path, workers=1, args=["--monitor-port", str(taken)])
    with pytest.raises(RuntimeError) as failed:
        second.start()
    text = str(failed.value)
    assert "exited with 1" in text and "Traceback" not in text
    assert f"cannot listen for monitoring on 127.0.0.1:{taken}: Address already in use" in text
    assert "worker" not in text.split("cannot listen", 1)[1]   # nothing was started


def test_an_oversized_request_gets_a_status_not_a_silent_close(start_broker):
    """U4: a request head over the limit, or one left unfinished, was closed without a word; an HTTP server says
    431 or 408."""
    broker = start_broker(workers=1)
    with socket.create_connection(("127.0.0.1", broker.ports["monitoring"]), timeout=5) as s:
        s.sendall(b"GET /varz HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:100]
    assert b'"request head over 16 KiB"' in answer


@pytest.mark.slow
def test_an_unfinished_request_times_out_with_408(start_broker):
    broker = start_broker(workers=1)
    with socket.create_connection(("127.0.0.1", broker.ports["monitoring"]), timeout=15) as s:
        s.sendall(b"GET /varz HTTP/1.1\r\n")
        started = time.monotonic()
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:100]
    assert 9 < time.monotonic() - started < 13
