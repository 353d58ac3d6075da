"""Lame duck mode (SIGUSR2, brokerctl lameduck): no new connections, NATS clients told at once (nats-py's
lame_duck_mode_cb), every client closed spread over shutdown.lame_duck_duration after its grace period, then the
process exits; SIGTERM meanwhile does not cut it short."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import nats
import pytest

from support.harness import REPO
from support.systemd_fakes import NotifyReceiver

DURATION, GRACE = 3.0, 0.5
LDM = {"shutdown": {"lame_duck_duration": DURATION, "lame_duck_grace_period": GRACE}}


_watching: set[asyncio.Task] = set()   # asyncio holds tasks weakly


async def _ndjson_client(port: int, closed: list[float]) -> asyncio.StreamReader:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b'{"op":"ping"}\n')
    assert await reader.readline() == b'{"ok":true}\n'

    async def watch() -> None:
        await reader.read()   # EOF: the broker closed it
        closed.append(time.monotonic())
        writer.close()   # as a client does: its close lets the broker's lingering close complete at once
    task = asyncio.ensure_future(watch())
    _watching.add(task)
    task.add_done_callback(_watching.discard)
    return reader


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.slow
def test_lame_duck_tells_nats_clients_and_closes_everyone_spread_over_the_duration(start_broker, tmp_path):
    rx = NotifyReceiver(tmp_path)
    b = start_broker(workers=2, config=LDM, env=rx.env())
    told: list[float] = []
    closed: list[float] = []

    async def run() -> float:
        async def nats_client(i: int):
            async def ldm() -> None:
                told.append(time.monotonic())

            async def gone() -> None:
                closed.append(time.monotonic())
            nc = await nats.connect(f"nats://127.0.0.1:{b.ports['nats']}", name=f"c{i}", allow_reconnect=False,
                                    lame_duck_mode_cb=ldm, closed_cb=gone)
            await nc.flush()
            return nc
        ncs = [await nats_client(i) for i in range(6)]
        for _ in range(4):
            await _ndjson_client(b.port, closed)
        t0 = time.monotonic()
        os.kill(b.proc.pid, signal.SIGUSR2)
        deadline = t0 + DURATION + 5
        while len(closed) < 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for nc in ncs:
            await nc.close()
        return t0

    t0 = asyncio.run(run())
    assert b.proc.wait(10) == 0   # it exits once the last client is gone
    exited = time.monotonic() - t0
    assert len(told) == 6 and max(told) - t0 < GRACE   # every NATS client told, before the first close
    closes = sorted(t - t0 for t in closed)
    assert len(closes) == 10, closes
    assert closes[0] >= GRACE - 0.05 and closes[-1] <= DURATION + 0.3, closes
    assert closes[-1] - closes[0] > 1.2, closes   # spread: 10 clients over the 2.5 s window, not all at once
    assert max(sum(1 for c in closes if a <= c < a + 0.1) for a in closes) <= 3, closes
    assert exited < DURATION + 2.5
    log = b.log()
    assert "SIGUSR2: entering lame duck mode: no new connections; 10 client(s) to close over 2.5s" in log
    _, stopping = rx.wait_for("STOPPING", "1")
    assert stopping["STATUS"] == "lame duck: 10 clients left"
    assert rx.with_key("EXTEND_TIMEOUT_USEC")
    rx.close()


@pytest.mark.slow
def test_sigterm_does_not_cut_a_lame_duck_short_and_no_one_gets_in(start_broker):
    b = start_broker(workers=2, config={"shutdown": {"lame_duck_duration": 2.5, "lame_duck_grace_period": 1.0}})
    closed: list[float] = []

    async def run() -> float:
        for _ in range(4):
            await _ndjson_client(b.port, closed)
        t0 = time.monotonic()
        os.kill(b.proc.pid, signal.SIGUSR2)
        await asyncio.sleep(0.2)
        os.kill(b.proc.pid, signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert _refused(b.port) and _refused(b.ports["nats"])   # listeners closed at once
        assert closed == []                                      # nothing cut short by the SIGTERM
        while len(closed) < 4 and time.monotonic() < t0 + 6:
            await asyncio.sleep(0.02)
        return t0

    t0 = asyncio.run(run())
    assert b.proc.wait(10) == 0
    closes = sorted(t - t0 for t in closed)
    assert len(closes) == 4 and closes[0] >= 0.95 and closes[-1] <= 2.8, closes
    assert "SIGTERM: in lame duck mode, " in b.log()


def test_brokerctl_lameduck_waits_for_the_exit(start_broker):
    b = start_broker(workers=1, config=LDM)
    res = subprocess.run([sys.executable, "-m", "shardbroker.cli", "lameduck", "--pid", str(b.proc.pid), "--wait"], cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (f"lame duck mode: 0 client(s) to close within {DURATION:g}s (the first after {GRACE:g}s); "
                          f"pid {b.proc.pid} exits then\npid {b.proc.pid} exited\n")
    assert b.proc.wait(5) == 0
    assert "brokerctl lameduck: entering lame duck mode" in b.log()
