#!/usr/bin/env python3
"""CPU per message of each stage of a publish, per protocol: the inputs to the scaling model of
docs/performance-notes.md ("A model for 8 and 16 cores").

    .venv/bin/python scripts/measure/stages.py --json > stages.json    # everything (~3 minutes on 2 cores)
    .venv/bin/python scripts/measure/stages.py --model stages.json     # the model: msg/s against workers and cores
    .venv/bin/python scripts/measure/stages.py --model stages.json --cores 16 --gen-us 0.3,0.3   # generators beside
    .venv/bin/python scripts/measure/stages.py --only python --paths compiled --protocols nats
    .venv/bin/python scripts/measure/stages.py --only zmq --frame-msgs 1,64,440,1760
    .venv/bin/python scripts/measure/stages.py --only whole,live --workers 1,2

Every figure is CPU time (a thread's, or a process's), never wall time: the machine is shared.  Each is measured
``--rounds`` times and printed as the median with the range in brackets.

- ``python``: the stages on the real code, in-process, on a realistic input: a stream of publishes as the bench's
  generator writes them (``cli/bench/wire.py``), cut into reads of ``--read`` bytes (uvloop reads 256,000 at most,
  and does when the client outpaces the worker).  parse: the protocol's parser on each read (NATS ``Parser.feed``,
  NDJSON ``split_lines`` + ``ndjson_runs``).  route: the session executing what was parsed on a hub where nobody
  is subscribed (the route cache's lookup, the permission check, ``publish_run``'s counting, NDJSON's ``ok``
  replies queued), and the end of each turn.  fabric encode / decode: ``router.frames.encode`` / ``decode`` of the
  frame a turn of one read makes.  delivery: what the inbox does with a received run (``run_room``,
  ``deliver_run``: the batch, its join per subscriber, ``deliver_batch``) and the end of the turn (the
  connection's ``flush`` into a transport that takes every write), per delivery, for ``--fanouts`` subscribers on
  the worker.  Compiled and pure (``--paths``: each in a subprocess, the pure one with
  ``SHARDBROKER_NO_EXTENSIONS=1``), the collector set as a worker sets it.
- ``whole``: the real in-process hubs of ``tests/support/inprocess.py`` (as ``tests/unit/test_inprocess_hub.py``),
  joined by the real ZeroMQ fabric at 2 workers, under uvloop: a publisher on worker 0 and a subscriber on the last
  worker, fed the same reads, one a loop turn; the main thread's CPU (both hubs, the loop) and the I/O threads', per
  message, to set against the sum of the ``python`` stages.  No sockets to clients: their reads and writes are
  ``kernel``'s.
- ``kernel``: a uvloop transport on loopback TCP, the client in another process (its CPU is not counted): the
  worker's reads of a client's stream of publishes, and its ``writelines`` of what a turn writes to a subscriber
  (one message; a wide fan-out's batch to each of thousands of subscribers; a 64 KiB batch; four), each followed by
  a turn of the loop, and of NDJSON's ``ok`` replies.  The sender's CPU includes the loopback's receive processing,
  which Linux runs in the sender's context.
- ``zmq``: a fabric hop between two processes (PUB over ``ipc://``, SUB subscribed to the destination's prefix,
  each with its own context of one I/O thread, as ``router/fabric.py``) at ``--frame-msgs`` messages a frame: the
  sender's ``send`` and the receiver's ``recv`` (their threads' CPU), and each side's ZeroMQ I/O thread (read from
  its CPU clock), per frame and per message, and a fit ``a + b × KiB`` a frame.
- ``live``: the real broker (``brokerctl start --workers N``), a subscriber, then a publisher writing 64 KiB blocks
  at full speed: each worker's main thread and I/O thread (``/proc``), the publisher's worker and the subscriber's
  apart, per message delivered.  Everything the other parts leave out is in, and so is the crowding of the cores.

``--model`` reads a ``--json`` output and prints the model's inputs and its msg/s for ``--cores`` and
``--model-workers``: on the stages' costs and on the ``live`` ones, for one publisher and one subscriber (1→1), many
pairs (N→N) and a fan-out to 5,000 connections (wide); its assumptions are in the notes.

A measurement, not a test, and not a benchmark of the broker (``brokerctl bench`` is).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import zmq
from hotpath import NullTransport  # scripts/measure, this script's folder

from shardbroker.cli.wire import nats as wire_nats
from shardbroker.cli.wire import ndjson as wire_ndjson
from shardbroker.cluster.config import load
from shardbroker.router import frames
from shardbroker.workers import speedups
from shardbroker.workers.auth import Authenticator
from shardbroker.workers.fanout import BATCH_BYTES
from shardbroker.workers.hub import Hub
from shardbroker.workers.message import KIND_JSON, KIND_RAW
from shardbroker.workers.protocols.nats import codec as nats_codec
from shardbroker.workers.protocols.nats.session import NatsSession
from shardbroker.workers.protocols.ndjson import codec as ndjson_codec
from shardbroker.workers.protocols.ndjson.session import NdjsonSession
from shardbroker.workers.turn import TURN_BUDGET

REPO = Path(__file__).resolve().parents[2]
SUBJECT = "bench.stages"
SESSIONS = {"nats": NatsSession, "ndjson": NdjsonSession}
KINDS = {"nats": KIND_RAW, "ndjson": KIND_JSON}
NATS_CONNECT = b'CONNECT {"verbose":false,"pedantic":false,"echo":false}\r\n'


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def thread_cpu(tid: int) -> float:
    """The CPU seconds of thread ``tid`` of this process (Linux's per-thread CPU clock, in ns)."""
    return time.clock_gettime_ns(((~tid) << 3) | 4 | 2) / 1e9


def threads_named(prefix: str, besides: set[int] | None = None) -> set[int]:
    """This process's threads whose name starts with ``prefix``; with ``besides``, the new ones (waiting up to a
    second for one: a thread names itself once it runs)."""
    if besides is not None:
        for _ in range(100):
            new = threads_named(prefix) - besides
            if new:
                return new
            time.sleep(0.01)
        return set()
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(prefix):
                    out.add(int(tid))
        except OSError:
            pass
    return out


# -- the input: what the bench's generator writes ------------------------------------------------------------------

def publish_frame(protocol: str, size: int) -> bytes:
    data = b"x" * size
    if protocol == "nats":
        return wire_nats.pub(SUBJECT, data)
    return wire_ndjson.request("pub", topic=SUBJECT, data=data.decode())


def delivery_line(protocol: str, size: int) -> bytes:
    data = b"x" * size
    if protocol == "nats":
        return b"MSG %s 1 %d\r\n%s\r\n" % (SUBJECT.encode(), size, data)
    return b'{"topic":"%s","data":"%s"}\n' % (SUBJECT.encode(), data)


def cycle_of(frame: bytes, read_bytes: int) -> list[bytes]:
    """About a mebibyte of whole publishes (two reads at least) cut into reads of ``read_bytes``, the last a frame
    shorter at most: repeated, they are one continuous stream, not cut at message boundaries, and what a round
    touches stays warm in the caches, as a worker's read is (just copied out of uvloop's buffer, its payloads freed
    at the turn's end).  A round of tens of megabytes of input held at once measured twice these costs."""
    stream = frame * (max(2, (1 << 20) // read_bytes) * read_bytes // len(frame))
    return [stream[i:i + read_bytes] for i in range(0, len(stream), read_bytes)]


def as_worker() -> None:
    """The collector as a worker runs it (``workers.workqueues.start``): what exists now frozen, threshold 2,000."""
    from shardbroker.workers.workqueues import GC_THRESHOLD

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])


# -- the Python stages ---------------------------------------------------------------------------------------------

def parse_reads(protocol: str, reads: list[bytes], cfg) -> list[list]:
    """The real parser on each read -> the items of each read."""
    if protocol == "nats":
        feed = nats_codec.Parser(cfg.nats.max_control_line, cfg.nats.max_payload).feed
        return [feed(r) for r in reads]
    out, tail, limit = [], b"", cfg.limits.max_line_bytes
    for r in reads:
        lines, tail = ndjson_codec.split_lines(tail, r, limit)
        out.append(speedups.ndjson_runs(lines))
    return out


def runs_of(protocol: str, items: list) -> list[list[bytes]]:
    """The runs of payloads among a read's items (single messages as runs of one)."""
    runs = []
    for item in items:
        if protocol == "nats":
            if item[0] == nats_codec.OP_PUBS:
                runs.append(item[3])
            elif item[0] == nats_codec.OP_PUB:
                runs.append([item[4]])
        elif type(item) is tuple:
            runs.append(item[1])
        elif item:
            runs.append([orjson_data(item)])
    return runs


def orjson_data(line: bytes) -> bytes:
    return ndjson_codec.encode_data(line, ndjson_codec.parse(line)["data"])


async def session_on(hub: Hub, protocol: str, cid: int, subscribe: bool):
    s = SESSIONS[protocol](hub, cid)
    s.connection_made(NullTransport())
    if protocol == "nats":
        s.data_received(NATS_CONNECT + (b"SUB %s %d\r\n" % (SUBJECT.encode(), cid) if subscribe else b""))
    elif subscribe:
        s.data_received(b'{"op":"sub","topic":"%s"}\n' % SUBJECT.encode())
    for _ in range(5):
        await asyncio.sleep(0)
    hub.flush_now()
    return s


def deliver_runs(hub: Hub, route, kind: int, runs: list[list[bytes]]) -> None:
    """What ``Inbox._work`` does with a frame's runs: as much as the turn has room for, then the turn's end."""
    for payloads in runs:
        start, n = 0, len(payloads)
        while start < n:
            take = hub.run_room(route, payloads, start)
            hub.deliver_run(route, kind, payloads if take == n else payloads[start:start + take], None, None)
            start += take
            if hub.turn_work >= TURN_BUDGET:
                hub.flush_now()
    hub.flush_now()


async def python_stages(protocol: str, size: int, read_bytes: int, messages: int, rounds: int,
                        fanouts: list[int]) -> dict:
    cfg = load(None)
    reads = cycle_of(publish_frame(protocol, size), read_bytes)
    kind = KINDS[protocol]
    items_per_read = parse_reads(protocol, reads, cfg)
    runs_per_read = [runs_of(protocol, items) for items in items_per_read]
    per_cycle = sum(len(p) for runs in runs_per_read for p in runs)
    reps = max(1, messages // per_cycle)
    n = reps * per_cycle
    out: dict = {"messages": n, "read_bytes": read_bytes, "messages_per_read": per_cycle / len(reads)}
    hub = Hub(0, 1, cfg, Authenticator(cfg.security, []))
    hub.server_info = {"server_id": "stages"}
    pub = await session_on(hub, protocol, 1, subscribe=False)
    msgs = [[(SUBJECT, kind, p, None, None, None) for p in runs] for runs in runs_per_read]
    encoded = [frames.encode(1, 0, 1, seq, 0, 0, 1, m, [], 0) for seq, m in enumerate(msgs, 1)]
    out["frame_bytes"] = statistics.mean(map(len, encoded))
    as_worker()
    times: dict[str, list[float]] = {"parse": [], "route": [], "encode": [], "decode": []}
    for r in range(rounds + 1):   # the first round warms up
        t = time.thread_time()
        if protocol == "nats":
            feed = nats_codec.Parser(cfg.nats.max_control_line, cfg.nats.max_payload).feed
            for _ in range(reps):
                for data in reads:
                    feed(data)
        else:
            split, runs, tail, limit = ndjson_codec.split_lines, speedups.ndjson_runs, b"", cfg.limits.max_line_bytes
            for _ in range(reps):
                for data in reads:
                    lines, tail = split(tail, data, limit)
                    runs(lines)
        times["parse"].append(time.thread_time() - t)
        # route: the session executes what was parsed, on a hub where nobody is subscribed; then the turn ends
        t = time.thread_time()
        for _ in range(reps):
            for items in items_per_read:
                pub.process(items)
                while pub._held is not None:   # the turn's budget was spent (a read of small messages)
                    hub.flush_now()
                    pub.resume_held()
                hub.flush_now()
        times["route"].append(time.thread_time() - t)
        # fabric encode and decode: the frame of one turn (one read), as Fabric.flush makes it
        t = time.thread_time()
        for _ in range(reps):
            for seq, m in enumerate(msgs, 1):
                frames.encode(1, 0, 1, seq, 0, 0, 1, m, [], 0)
        times["encode"].append(time.thread_time() - t)
        t = time.thread_time()
        for _ in range(reps):
            for f in encoded:
                frames.decode(f)
        times["decode"].append(time.thread_time() - t)
        if not r:
            gc.collect()
    for stage, ts in times.items():
        out[stage] = summary([t / n * 1e6 for t in ts[1:]])

    # delivery, per delivery, at each fan-out
    out["delivery"] = {}
    for fanout in fanouts:
        dhub = Hub(0, 1, cfg, Authenticator(cfg.security, []))
        dhub.server_info = {"server_id": "stages"}
        subs = [await session_on(dhub, protocol, cid, subscribe=True) for cid in range(2, fanout + 2)]
        dhub.route_for(SUBJECT)
        route = dhub.route_for(SUBJECT)   # cached from its second use
        # about as many deliveries a round as ``messages`` (10 times more at 100 subscribers and more)
        want = max(200, messages // fanout * (10 if fanout >= 100 else 1))
        dreps, todo = max(1, want // per_cycle), runs_per_read
        if want < per_cycle:   # the first ``want`` messages of the cycle
            todo, left = [], want
            for runs in runs_per_read:
                todo.append([p[:left] for p in runs])
                left -= sum(map(len, todo[-1]))
                if left <= 0:
                    break
        count = dreps * sum(len(p) for runs in todo for p in runs)
        dtimes = []
        as_worker()
        for _ in range(rounds + 1):
            before = [s.transport.writes for s in subs], [s.transport.written for s in subs]
            t = time.thread_time()
            for _ in range(dreps):
                for runs in todo:
                    deliver_runs(dhub, route, kind, runs)
            dtimes.append(time.thread_time() - t)
        writes = sum(s.transport.writes for s in subs) - sum(before[0])
        written = sum(s.transport.written for s in subs) - sum(before[1])
        out["delivery"][str(fanout)] = {
            **summary([t / (count * fanout) * 1e6 for t in dtimes[1:]]),
            "messages_per_write": count * fanout / writes, "bytes_per_write": written / writes}
    return out


# -- the whole path, in-process hubs -----------------------------------------------------------------------------

async def whole_path(protocol: str, size: int, read_bytes: int, messages: int, workers: int) -> dict:
    from support.inprocess import Broker, Client, FakeTransport, turns, until

    class Counting(FakeTransport):
        """Records what is written until ``counting``, then only counts it."""
        counting = False

        def write(self, data: bytes) -> None:
            if not self.counting:
                return super().write(data)
            self.written += len(data)
            self.writes += 1

        def writelines(self, chunks) -> None:
            if not self.counting:
                return super().writelines(chunks)
            self.written += sum(map(len, chunks))
            self.writes += 1

    cycle = cycle_of(publish_frame(protocol, size), read_bytes)
    reads = cycle * max(1, messages // (len(cycle) * read_bytes // len(publish_frame(protocol, size))))
    io_before = threads_named("ZMQbg/IO")
    with tempfile.TemporaryDirectory() as tmp:
        broker = await Broker.start(tmp, workers=workers)
        io = threads_named("ZMQbg/IO", io_before) if workers > 1 else set()
        try:
            cls = SESSIONS[protocol]
            pub = Client(cls(broker.hubs[0], 1), Counting())
            sub = Client(cls(broker.hubs[-1], 2), Counting())
            if protocol == "nats":
                pub.send(NATS_CONNECT)
                sub.send(NATS_CONNECT + b"SUB %s 1\r\nPING\r\n" % SUBJECT.encode())
                await until(lambda: b"PONG" in sub.transport.data, what="PONG: the subscription in force")
            else:
                sub.send(b'{"op":"sub","topic":"%s"}\n' % SUBJECT.encode())
                await until(lambda: b"ok" in sub.transport.data, what="ok: the subscription in force")
            await turns(20)
            pub.transport.counting = sub.transport.counting = True

            async def feed(chunk: list[bytes]) -> None:
                for r in chunk:
                    pub.session.data_received(r)
                    await asyncio.sleep(0)
                    while pub.session._held is not None:
                        await asyncio.sleep(0.0002)   # held back (the fabric's window): wait without spinning

            await feed(cycle)   # warm up (a whole cycle: the stream goes on where it ends): routes cached, the fabric
            hub0 = broker.hubs[0]
            await until(lambda: sub.session.msgs_out >= hub0.msgs_in, timeout=30, what="the warm-up's deliveries")
            await turns(20)
            link = hub0.fabric.links[workers - 1] if workers > 1 else None
            frames_before = (link.frames_out, link.messages_out) if link else (0, 0)
            start_msgs = sub.session.msgs_out
            published = hub0.msgs_in
            io0 = {tid: thread_cpu(tid) for tid in io}
            main0, proc0 = time.thread_time(), time.process_time()
            await feed(reads)
            n = hub0.msgs_in - published
            await until(lambda: sub.session.msgs_out - start_msgs >= n, timeout=60, what="the deliveries")
            main, proc = time.thread_time() - main0, time.process_time() - proc0
            io_cpu = sum(thread_cpu(tid) - io0[tid] for tid in io)
            res = {"messages": n, "main_us": main / n * 1e6, "io_us": io_cpu / n * 1e6,
                   "process_us": proc / n * 1e6,
                   "writes_per_read": (sub.transport.writes and sub.transport.writes / len(reads))}
            if link:
                f, m = link.frames_out - frames_before[0], link.messages_out - frames_before[1]
                res["messages_per_frame"] = m / f if f else 0.0
            return res
        finally:
            await broker.close()


# -- the kernel's part: a uvloop transport on loopback TCP ----------------------------------------------------------

def _drain(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = bytearray(1 << 20)
        while s.recv_into(buf):
            pass


def _feed(port: int, block: bytes, total: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = 0
        while sent < total:
            s.sendall(block)
            sent += len(block)


def _uvloop_run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _accept_one(child, *args) -> tuple[asyncio.Transport, asyncio.Protocol, object]:
    """A connection from a child process running ``child(port, *args)``, on a uvloop server, as a worker has its
    clients' (TCP_NODELAY set: the broker's listeners set it, uvloop too)."""
    loop = asyncio.get_running_loop()
    made = loop.create_future()

    class Peer(asyncio.Protocol):
        def __init__(self) -> None:
            self.reads = self.got = 0
            self.done = loop.create_future()
            self.writable = asyncio.Event()
            self.writable.set()

        def connection_made(self, transport) -> None:
            made.set_result((transport, self))

        def data_received(self, data: bytes) -> None:
            self.reads += 1
            self.got += len(data)

        def connection_lost(self, exc) -> None:
            if not self.done.done():
                self.done.set_result(time.thread_time())

        def pause_writing(self) -> None:
            self.writable.clear()

        def resume_writing(self) -> None:
            self.writable.set()

    server = await loop.create_server(Peer, "127.0.0.1", 0)
    proc = multiprocessing.get_context("spawn").Process(target=child,
                                                        args=(server.sockets[0].getsockname()[1], *args))
    proc.start()
    transport, peer = await made
    server.close()
    return transport, peer, proc


def kernel_read(block: bytes, total: int) -> tuple[float, float]:
    """-> (CPU seconds per byte, mean bytes per read) of a uvloop transport reading a client that writes ``block``
    after ``block`` (uvloop reads up to 256,000 bytes at a time, a new ``bytes`` each, then ``data_received``):
    the system calls, uvloop's polling and its callbacks; nothing parses."""
    async def main():
        transport, peer, proc = await _accept_one(_feed, block, total)
        t0 = time.thread_time()
        end = await peer.done
        proc.join(10)
        return (end - t0) / peer.got, peer.got / peer.reads
    return _uvloop_run(main())


def kernel_write(chunks: list[bytes], seconds_cpu: float) -> tuple[float, float]:
    """-> (CPU seconds of one ``writelines(chunks)`` and the loop's turn after it, CPU seconds of a bare turn) on a
    uvloop transport to a client that reads everything (in another process), with the worker's high-water mark:
    where the client falls behind, the transport waits for it as a worker's does."""
    async def main():
        transport, peer, proc = await _accept_one(_drain)
        stall = load(None).limits.max_pending_bytes // 4
        transport.set_write_buffer_limits(high=stall, low=stall // 2)
        calls = 0
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds_cpu or calls < 50:
            transport.writelines(chunks)
            calls += 1
            await asyncio.sleep(0)
            if not peer.writable.is_set():
                await peer.writable.wait()
        cpu = time.thread_time() - t0
        t0 = time.thread_time()
        for _ in range(20_000):
            await asyncio.sleep(0)
        turn = (time.thread_time() - t0) / 20_000
        transport.close()
        await peer.done   # what was buffered is sent first: the client reads it, then its end
        proc.join(10)
        return cpu / calls, turn
    return _uvloop_run(main())


def kernel_stages(protocols: list[str], size: int, read_bytes: int, rounds: int, per_read: dict) -> dict:
    out: dict = {}
    points = []
    for protocol in protocols:
        frame, line = publish_frame(protocol, size), delivery_line(protocol, size)
        block = frame * (65536 // len(frame))   # the generator's 64 KiB blocks
        res: dict = {}
        per_msg, sizes = [], []
        for _ in range(rounds):
            b, mean = kernel_read(block, 64 << 20)
            per_msg.append(b * len(frame) * 1e6)
            sizes.append(mean)
        res["read"] = {**summary(per_msg), "bytes_per_read": statistics.median(sizes)}
        # a turn's chunk to one subscriber: one message; a fan-out's batch to each of thousands of subscribers (16,
        # 36 and 144 messages: 5,000, 2,500 and 625 of them on the worker); a whole batch (64 KiB of messages:
        # workers.fanout.BATCH_BYTES); four of them, one writelines (a turn of a 256,000-byte read)
        k = -(-BATCH_BYTES // len(line))
        shapes = {"1": [line], "16": [line * 16], "36": [line * 36], "144": [line * 144], str(k): [line * k],
                  str(4 * k): [line * k] * 4}
        res["write"] = {}
        turns = []
        for label, chunks in shapes.items():
            calls = [kernel_write(chunks, 0.3) for _ in range(rounds)]
            turns += [t for _, t in calls]
            per_call = [c for c, _ in calls]
            res["write"][label] = {**summary([c / int(label) * 1e6 for c in per_call]),
                                   "per_call_us": statistics.median(per_call) * 1e6,
                                   "bytes": sum(map(len, chunks))}
            points += [(sum(map(len, chunks)), c * 1e6) for c in per_call]
        res["loop_turn_us"] = statistics.median(turns) * 1e6
        if protocol == "ndjson":   # the publisher's replies: one ``ok`` a publish, one chunk a run
            k = max(1, round(per_read.get(protocol, read_bytes / len(frame))))
            calls = [kernel_write([ndjson_codec.OK * k], 0.3)[0] for _ in range(rounds)]
            res["write_ok"] = {**summary([c / k * 1e6 for c in calls]), "per_call_us": statistics.median(calls) * 1e6,
                               "messages": k}
        out[protocol] = res
    # a write's cost against its bytes, both protocols' writes together (the kernel does not care which)
    slope, intercept = statistics.linear_regression([b for b, _ in points], [c for _, c in points])
    out["write_fit"] = {"per_call_us": intercept, "per_kib_us": slope * 1024}
    return out


# -- ZeroMQ: the fabric's hop, and its I/O threads ---------------------------------------------------------------

def _zmq_side(role: str, endpoint: str, frame: bytes, count: int, window: int, credits, result) -> None:
    """One worker's side of a link: PUB (bind) or SUB (connect).  Reports its thread's and its I/O thread's CPU.
    The receiver grants the sender ``window // 2`` frames at a time (``credits``, a pipe): PUB drops at its
    high-water mark, and the fabric's flow control never lets it get there either."""
    io_before = threads_named("ZMQbg/IO")
    ctx = zmq.Context(io_threads=1)
    hwm = load(None).fabric.hwm
    if role == "pub":
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.bind(endpoint)
    else:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.SUBSCRIBE, frames.prefix(1))
        sock.connect(endpoint)
    io = threads_named("ZMQbg/IO", io_before)
    if role == "pub":   # ZeroMQ's slow joiner: probes until the receiver has one
        while True:
            sock.send(frames.prefix(1) + b"probe", zmq.NOBLOCK)
            if credits.poll(0.01):
                credits.recv_bytes()
                break
    else:
        sock.recv()
        credits.send_bytes(b"r")
        while sock.poll(200):   # the probes' stragglers
            sock.recv(zmq.NOBLOCK)
        credits.send_bytes(b"go")
    if role == "pub":
        credits.recv_bytes()
    io0 = {tid: thread_cpu(tid) for tid in io}
    t0 = time.thread_time()
    if role == "pub":
        have = window
        for _ in range(count):
            while not have:
                credits.recv_bytes()
                have += window // 2
            sock.send(frame, zmq.NOBLOCK)   # copied, as Fabric.flush sends
            have -= 1
    else:
        half = window // 2
        for i in range(1, count + 1):
            sock.recv()
            if i % half == 0:
                credits.send_bytes(b"c")
    main = time.thread_time() - t0
    io_cpu = sum(thread_cpu(tid) - io0[tid] for tid in io)
    result.send((main, io_cpu))
    if role == "sub":
        credits.send_bytes(b"done")
    else:
        while credits.recv_bytes() != b"done":   # close only once the receiver has everything
            pass
    sock.close(linger=0)
    ctx.term()


def zmq_hop(frame: bytes, count: int, window: int = 64) -> dict:
    mp = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/fabric-1.ipc"
        pub_credits, sub_credits = mp.Pipe()
        pub_rx, pub_tx = mp.Pipe(False)
        sub_rx, sub_tx = mp.Pipe(False)
        pub = mp.Process(target=_zmq_side, args=("pub", endpoint, frame, count, window, pub_credits, pub_tx))
        pub.start()
        time.sleep(0.2)
        sub = mp.Process(target=_zmq_side, args=("sub", endpoint, frame, count, window, sub_credits, sub_tx))
        sub.start()
        (send, io_send), (recv, io_recv) = pub_rx.recv(), sub_rx.recv()
        pub.join(10)
        sub.join(10)
    return {"send": send / count, "io_send": io_send / count, "io_recv": io_recv / count, "recv": recv / count}


def zmq_stages(frame_msgs: list[int], size: int, rounds: int) -> dict:
    out: dict = {"frames": {}}
    points = []
    for k in frame_msgs:
        # distinct payloads, as a read's slices are (marshal writes a repeated object once, then references)
        payloads = [b"%08d" % i + b"x" * (size - 8) for i in range(k)]
        frame = frames.encode(1, 0, 1, 1, 0, 0, 1, [(SUBJECT, KIND_RAW, payloads, None, None, None)], [])
        count = max(2000, min(100_000, 300_000 // k))
        runs = [zmq_hop(frame, count) for _ in range(rounds)]
        row = {"bytes": len(frame), "messages": k}
        for key in ("send", "io_send", "io_recv", "recv"):
            per_frame = [r[key] * 1e6 for r in runs]
            row[key] = {"per_frame": summary(per_frame), "per_message": summary([x / k for x in per_frame])}
            points.append((key, len(frame), statistics.median(per_frame)))
        out["frames"][str(k)] = row
    # a + b * bytes per frame, least squares over the frame sizes
    out["fit"] = {}
    for key in ("send", "io_send", "io_recv", "recv"):
        xs = [b for k, b, _ in points if k == key]
        ys = [y for k, _, y in points if k == key]
        if len(xs) >= 2:
            slope, intercept = statistics.linear_regression(xs, ys)
            out["fit"][key] = {"per_frame_us": intercept, "per_kib_us": slope * 1024}
    return out


# -- the real broker: its workers' CPU per message, one publisher and one subscriber ---------------------------------

READY = re.compile(rb"ready: ndjson=[\d.]+:(\d+) nats=[\d.]+:(\d+) monitoring=[\d.]+:(\d+) workers=\d+ pids=([\d,]+)")


def _task_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of process ``pid``, by kind: its main thread, ZeroMQ's I/O threads, the rest."""
    out = {"main": 0.0, "io": 0.0, "other": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read()
        except OSError:
            continue
        kind = "main" if int(tid) == pid else "io" if comm.startswith("ZMQbg/IO") else "other"
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _live_sub(port: int, protocol: str, ready, result) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        if protocol == "nats":
            s.sendall(NATS_CONNECT + b"SUB %s 1\r\nPING\r\n" % SUBJECT.encode())
            want, marker = b"PONG", b"MSG "
        else:
            s.sendall(b'{"op":"sub","topic":"%s"}\n' % SUBJECT.encode())
            want, marker = b"ok", b'{"topic"'
        buf = b""
        while want not in buf:
            buf += s.recv(65536)
        ready.send(True)
        count, tail = 0, b""
        s.settimeout(1.0)
        try:
            while True:
                data = s.recv(1 << 20)
                if not data:
                    break
                chunk = tail + data
                count += chunk.count(marker)
                tail = chunk[-(len(marker) - 1):]
        except TimeoutError:
            pass
        result.send(count)


def _live_pub(port: int, protocol: str, seconds: float, result) -> None:
    frame = publish_frame(protocol, 128)
    block = frame * (65536 // len(frame))   # the bench's generator writes such blocks
    with socket.create_connection(("127.0.0.1", port)) as s:
        if protocol == "nats":
            s.sendall(NATS_CONNECT)
        else:   # the ok replies, read and dropped
            threading.Thread(target=lambda: all(iter(lambda: s.recv(1 << 20), b"")), daemon=True).start()
        end = time.monotonic() + seconds
        sent = 0
        while time.monotonic() < end:
            s.sendall(block)
            sent += 65536 // len(frame)
        result.send(sent)
        time.sleep(2)


def live(protocol: str, workers: int, seconds: float) -> dict:
    """``brokerctl start --workers N``, a subscriber, then a publisher at full speed for ``seconds``: the workers'
    CPU per message delivered, the subscriber's worker and the publisher's apart (``/connz``), each's main thread
    and ZeroMQ I/O thread apart, and the system calls (``/proc/<pid>/io``)."""
    cmd = [str(REPO / ".venv/bin/brokerctl"), "start", "--workers", str(workers), "--port", "0", "--nats-port", "0",
           "--monitor-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        buf = b""
        while (m := READY.search(buf)) is None:
            chunk = os.read(proc.stderr.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the broker did not start: {buf.decode(errors='replace')}")
            buf += chunk
        ndjson_port, nats_port, monitor, pids = int(m[1]), int(m[2]), int(m[3]), [int(x) for x in m[4].split(b",")]
        port = nats_port if protocol == "nats" else ndjson_port
        mp = multiprocessing.get_context("spawn")
        ready_rx, ready_tx = mp.Pipe(False)
        sub_rx, sub_tx = mp.Pipe(False)
        pub_rx, pub_tx = mp.Pipe(False)
        sub = mp.Process(target=_live_sub, args=(port, protocol, ready_tx, sub_tx))
        sub.start()
        ready_rx.recv()
        pub = mp.Process(target=_live_pub, args=(port, protocol, seconds, pub_tx))
        pub.start()
        for _ in range(100):   # both connections placed (the supervisor hands each to a worker)
            time.sleep(0.05)
            with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/connz") as r:
                conns = json.load(r)["connections"]
            if len(conns) == 2:
                break
        sub_worker = next(c["worker"] for c in conns if c.get("subscriptions"))
        pub_worker = next(c["worker"] for c in conns if not c.get("subscriptions"))
        io0 = {pid: _proc_io(pid) for pid in pids}
        cpu0 = {pid: _task_cpu(pid) for pid in pids}
        sent = pub_rx.recv()
        got = sub_rx.recv()
        cpu1 = {pid: _task_cpu(pid) for pid in pids}
        io1 = {pid: _proc_io(pid) for pid in pids}
        pub.join(10)
        sub.join(10)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    per = lambda pid, kind: (cpu1[pid][kind] - cpu0[pid][kind]) / got * 1e6  # noqa: E731
    res = {"sent": sent, "delivered": got, "rate": got / seconds,
           "cpu_us": sum(per(pid, k) for pid in pids for k in ("main", "io", "other"))}
    for side, pid in (("sub", pids[sub_worker]), ("pub", pids[pub_worker])):
        res[side] = {k: per(pid, k) for k in ("main", "io", "other")}
    pub_pid = pids[pub_worker]
    reads = io1[pub_pid]["syscr"] - io0[pub_pid]["syscr"]
    res["pub_bytes_per_read"] = (io1[pub_pid]["rchar"] - io0[pub_pid]["rchar"]) / max(1, reads)
    return res


def _proc_io(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


# -- the model: throughput against workers and cores ---------------------------------------------------------------

def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through ``points``, flat beyond the ends."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


class Costs:
    """One protocol's CPU µs per message, by stage, from a run's JSON (compiled path): the model's inputs."""

    def __init__(self, res: dict, protocol: str, size: int) -> None:
        py = res["paths"]["compiled"]["python"][protocol]
        whole = res["paths"]["compiled"]["whole"][protocol]
        kern, fit = res["kernel"][protocol], res["zmq"]["fit"]
        self._write_fit = res["kernel"]["write_fit"]
        self.loop_turn = kern["loop_turn_us"]
        self.size = size
        self.per_read = py["messages_per_read"]
        self.msg_bytes = py["frame_bytes"] / self.per_read
        self.read, self.parse, self.route = kern["read"]["median"], py["parse"]["median"], py["route"]["median"]
        self.encode, self.decode = py["encode"]["median"], py["decode"]["median"]
        self.ok = kern["write_ok"]["median"] if "write_ok" in kern else 0.0   # NDJSON's replies to the publisher
        self._fan = sorted((int(f), v) for f, v in py["delivery"].items())
        self._fit = fit
        # What the in-process whole path spends beyond the stages: per message at one worker (the turn, the
        # loop), and per frame beyond that at two (the fabric's and the inbox's bookkeeping, the fabric's wake-ups).
        self.rest = max(0.0, whole["1"]["main_us"]["median"] - (self.parse + self.route + self.delivery(1)))
        n = whole["2"]["messages_per_frame"] or self.per_read
        cross = (self.parse + self.route + self.encode + self.decode + self.delivery(1) + self.zmq("send", n)
                 + self.zmq("recv", n))
        self.rest_frame = max(0.0, whole["2"]["main_us"]["median"] - cross - self.rest) * n
        # ZeroMQ's I/O threads: per KiB as the hop measured them; per frame as the whole path did (a frame a turn,
        # each a wake-up of both I/O threads, where the hop's back-to-back frames shared them)
        self._io_kib = fit["io_send"]["per_kib_us"] + fit["io_recv"]["per_kib_us"]
        self._io_frame = max(fit["io_send"]["per_frame_us"] + fit["io_recv"]["per_frame_us"],
                             whole["2"]["io_us"]["median"] * n - self._io_kib * n * self.msg_bytes / 1024)

    def delivery(self, fanout: float) -> float:
        """Python's part of one delivery, ``fanout`` subscribers on the worker."""
        return _interp([(f, v["median"]) for f, v in self._fan], fanout)

    def write(self, fanout: float) -> float:
        """The kernel's part of one delivery: a write per subscriber per batch, of the batch's size."""
        per_write = _interp([(f, v["messages_per_write"]) for f, v in self._fan], fanout)
        nbytes = _interp([(f, v["bytes_per_write"]) for f, v in self._fan], fanout)
        f = self._write_fit
        # the fit counts a turn of the loop a write; with many subscribers a turn has as many writes
        return (f["per_call_us"] + f["per_kib_us"] * nbytes / 1024 - self.loop_turn * (1 - 1 / fanout)) / per_write

    def zmq(self, key: str, n: float) -> float:
        """A ZeroMQ side (send, io_send, io_recv, recv) per message, ``n`` messages a frame."""
        f = self._fit[key]
        return (max(0.0, f["per_frame_us"]) + f["per_kib_us"] * n * self.msg_bytes / 1024) / n

    # the three kinds of work: a publish delivered on its own worker, and a cross-worker one's two halves
    def local(self) -> float:
        return self.read + self.parse + self.route + self.ok + self.delivery(1) + self.write(1) + self.rest

    def publisher(self, n: float, copies: int = 1) -> float:
        return (self.read + self.parse + self.route + self.ok + self.rest / 2
                + copies * (self.encode + self.zmq("send", n) + self.rest_frame / n / 2))

    def subscriber(self, n: float, fanout: float = 1) -> float:
        return (self.zmq("recv", n) + self.decode + self.rest / 2 + self.rest_frame / n / 2
                + fanout * (self.delivery(fanout) + self.write(fanout)))

    def io(self, n: float) -> float:
        return (self._io_frame + self._io_kib * n * self.msg_bytes / 1024) / n


class LiveCosts(Costs):
    """The same, but a publish's three kinds of work as the real broker's workers spent them here (``live``, 1 and
    2 workers): every cost the stages leave out is in, and so is what two busy cores shared with the generators
    and other tenants add to each.  No fan-out to many connections (``wide``): not measured live."""

    def __init__(self, res: dict, protocol: str, size: int) -> None:
        super().__init__(res, protocol, size)
        lv = res["live"][protocol]
        self._local = lv["1"]["cpu_us"]["median"]
        two = lv["2"]
        self._pub = two["pub_main"]["median"] + two["pub_other"]["median"]
        self._sub = two["sub_main"]["median"] + two["sub_other"]["median"]
        self._io = two["pub_io"]["median"] + two["sub_io"]["median"]

    def local(self) -> float:
        return self._local

    def publisher(self, n: float, copies: int = 1) -> float:
        return self._pub

    def subscriber(self, n: float, fanout: float = 1) -> float:
        return self._sub

    def io(self, n: float) -> float:
        return self._io


def predict(c: Costs, scenario: str, workers: int, cores: int, gen: float = 0.0, nn: int = 64,
            wide: int = 5000) -> float:
    """Messages (deliveries, for ``wide``) a second.  ``gen``: the load generators' CPU µs per delivery when they
    share the cores (0: they run elsewhere).  A worker's thread is one core at most; the ZeroMQ I/O threads and
    the generators take what cores are left; frames carry one read's run (saturation)."""
    n, w = c.per_read, workers
    if scenario in ("1→1", "1→1 random"):   # one publisher, one subscriber: at most two workers' threads
        local = min(1 / c.local(), cores / (c.local() + gen))
        if w == 1:
            return local * 1e6
        pub, sub, io = c.publisher(n), c.subscriber(n), c.io(n)
        cross = min(1 / pub, 1 / sub, cores / (pub + sub + io + gen))
        if scenario == "1→1":   # the bench: the two connections on the two least loaded workers, never one
            return cross * 1e6
        return (local / w + cross * (w - 1) / w) * 1e6
    if scenario in ("N→N", "N→N random"):   # nn pairs, spread evenly; cross-worker: all (bench) or (W-1)/W
        f = 0.0 if w == 1 else 1.0 if scenario == "N→N" else (w - 1) / w
        per = (1 - f) * c.local() + f * (c.publisher(n) + c.subscriber(n))
        busiest = per / min(w, nn)   # each worker's share of one message's thread time
        return min(1 / busiest, cores / (per + f * c.io(n) + gen)) * 1e6
    if scenario == "wide":   # one publisher, ``wide`` subscribers spread over the workers
        if isinstance(c, LiveCosts):
            return float("nan")
        fan = wide / w
        # the publisher's worker also delivers to its own share: a turn's budget holds that many messages, the
        # frames to the others as many
        m = min(n, TURN_BUDGET / (1 + (c.size + 64) * fan / 1024))
        pub = c.publisher(m, copies=w - 1) + fan * (c.delivery(fan) + c.write(fan)) if w > 1 else \
            c.read + c.parse + c.route + c.ok + c.rest + fan * (c.delivery(fan) + c.write(fan))
        other = c.subscriber(m, fan) if w > 1 else 0.0
        io = (w - 1) * c.io(m)
        per_msg = min(1 / pub, 1 / other if other else float("inf"), cores / (pub + (w - 1) * other + io
                                                                               + gen * wide))
        return per_msg * wide * 1e6
    raise ValueError(scenario)


SCENARIOS = ("1→1", "1→1 random", "N→N", "N→N random", "wide")


def model_report(res: dict, cores: list[int], workers: list[int], gen: dict[str, float]) -> dict:
    size = res["args"]["size"]
    out: dict = {}
    for protocol in res["args"]["protocols"]:
        c = Costs(res, protocol, size)
        parts = {"read": c.read, "parse": c.parse, "route": c.route, "ok replies (write)": c.ok,
                 "encode": c.encode, "ZeroMQ send call": c.zmq("send", c.per_read),
                 "ZeroMQ I/O threads": c.io(c.per_read), "ZeroMQ recv call": c.zmq("recv", c.per_read),
                 "decode": c.decode, "delivery 1→1": c.delivery(1), "write 1→1": c.write(1),
                 "rest, per message": c.rest, f"rest, per frame of {c.per_read:.0f}": c.rest_frame / c.per_read}
        print(f"\n{protocol}: model inputs, CPU µs per message (compiled path)")
        for k, v in parts.items():
            print(f"  {k:32s} {v:7.3f}")
        bases = {"stages": c}
        if "live" in res:
            bases["live"] = LiveCosts(res, protocol, size)
        for name, b in bases.items():
            print(f"  {name}: local (one worker) {b.local():.3f}; across workers: the publisher's worker "
                  f"{b.publisher(c.per_read):.3f}, the subscriber's {b.subscriber(c.per_read):.3f}, "
                  f"the I/O threads {b.io(c.per_read):.3f}")
        print("  stages, wide, per delivery at 5,000/W: " + "  ".join(
            f"W={w}: {c.delivery(5000 / w) + c.write(5000 / w):.3f}" for w in workers))
        out[protocol] = {}
        for cc in cores:
            g = gen.get(protocol, 0.0) if cc == min(cores) and gen else 0.0
            print(f"\n{protocol}, {cc} cores" + (f", generators on them ({g} µs a message)" if g else
                                                  ", generators elsewhere") + ": msg/s (wide: deliveries/s)")
            print(f"  {'workers':22s}" + "".join(f"{w:>10d}" for w in workers))
            for name, b in bases.items():
                for sc in SCENARIOS:
                    row = [predict(b, sc, w, cc, g) for w in workers]
                    if all(x != x for x in row):   # nan: not on this basis
                        continue
                    out[protocol][f"{cc}/{name}/{sc}"] = row
                    print(f"  {name + ' ' + sc:22s}" + "".join(f"{x / 1e6:>9.2f}M" for x in row))
    return out


# -- running it all --------------------------------------------------------------------------------------------

def python_part(args) -> dict:
    """The ``python`` and ``whole`` parts in this process (on the path it was started with)."""
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    sys.path.insert(0, str(REPO / "tests"))   # support.inprocess
    res: dict = {"implementation": speedups.IMPLEMENTATION, "python": {}, "whole": {}}
    for protocol in args.protocols:
        if "python" in args.only:
            res["python"][protocol] = run(python_stages(protocol, args.size, args.read, args.messages, args.rounds,
                                                        args.fanouts))
        if "whole" in args.only:
            res["whole"][protocol] = {}
            for w in args.workers:
                rounds = [run(whole_path(protocol, args.size, args.read, args.messages, w))
                          for _ in range(args.rounds)]
                res["whole"][protocol][str(w)] = {
                    "main_us": summary([r["main_us"] for r in rounds]),
                    "io_us": summary([r["io_us"] for r in rounds]),
                    "process_us": summary([r["process_us"] for r in rounds]),
                    "messages_per_frame": statistics.median([r.get("messages_per_frame", 0) for r in rounds]),
                    "writes_per_read": statistics.median([r["writes_per_read"] for r in rounds])}
    return res


def on_path(path: str, args) -> dict:
    env = dict(os.environ)
    env.pop("SHARDBROKER_NO_EXTENSIONS", None)
    if path == "pure":
        env["SHARDBROKER_NO_EXTENSIONS"] = "1"
    cmd = [sys.executable, __file__, "--emit", "--only", ",".join(o for o in args.only if o in ("python", "whole")),
           "--protocols", ",".join(args.protocols), "--size", str(args.size), "--read", str(args.read),
           "--messages", str(args.messages), "--rounds", str(args.rounds),
           "--fanouts", ",".join(map(str, args.fanouts)), "--workers", ",".join(map(str, args.workers))]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout)


def fmt(s: dict, digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def report(res: dict) -> None:
    paths = res.get("paths", {})
    for path, pres in paths.items():
        if pres.get("python"):
            print(f"\n{path} path ({pres['implementation']}), CPU µs per message, median (range):")
            protos = list(pres["python"])
            print(f"{'stage':24s}" + "".join(f"{p:>30s}" for p in protos))
            for stage in ("parse", "route", "encode", "decode"):
                print(f"{stage:24s}" + "".join(f"{fmt(pres['python'][p][stage]):>30s}" for p in protos))
            for fanout in pres["python"][protos[0]]["delivery"]:
                label = f"delivery (1→{fanout}, each)"
                print(f"{label:24s}" + "".join(f"{fmt(pres['python'][p]['delivery'][fanout]):>30s}" for p in protos))
            for p in protos:
                d = pres["python"][p]
                print(f"  {p}: {d['messages_per_read']:.0f} messages a read of {d['read_bytes']} B, frame of one read "
                      f"{d['frame_bytes']:.0f} B; writes: " + ", ".join(
                          f"1→{f} {v['messages_per_write']:.1f} msgs / {v['bytes_per_write']:.0f} B"
                          for f, v in d["delivery"].items()))
        if pres.get("whole"):
            print(f"\n{path} path, whole path in-process (tests/support/inprocess.py), CPU µs per message:")
            for p, by_w in pres["whole"].items():
                for w, r in by_w.items():
                    print(f"  {p} {w} worker(s): main thread {fmt(r['main_us'])}, ZeroMQ I/O threads "
                          f"{fmt(r['io_us'])}, process {fmt(r['process_us'])}; {r['messages_per_frame']:.0f} msgs "
                          f"a frame, {r['writes_per_read']:.2f} writes a read")
    if res.get("kernel"):
        print("\nkernel: a uvloop transport on loopback TCP (the client in another process), CPU µs per message:")
        for p, r in res["kernel"].items():
            if p == "write_fit":
                continue
            print(f"  {p} read ({r['read']['bytes_per_read']:.0f} B a read): {fmt(r['read'])}")
            for label, w in r["write"].items():
                print(f"  {p} write, {label} message(s) a writelines ({w['bytes']} B, {w['per_call_us']:.1f} µs a call "
                      f"and its turn): {fmt(w)}")
            if "write_ok" in r:
                print(f"  {p} write of the ok replies, one chunk a read ({r['write_ok']['per_call_us']:.1f} µs a "
                      f"call): {fmt(r['write_ok'])}")
            print(f"  {p}: a bare turn of the loop {r['loop_turn_us']:.2f} µs")
        f = res["kernel"]["write_fit"]
        print(f"  fit, a write and its turn: {f['per_call_us']:.2f} µs + {f['per_kib_us']:.3f} µs a KiB")
    if res.get("live"):
        print("\nlive: brokerctl start --workers N, one publisher and one subscriber (the subscriber's worker first), "
              "CPU µs per message delivered:")
        for p, by_w in res["live"].items():
            for w, r in by_w.items():
                sides = "" if w == "1" else (
                    f"; publisher's worker {fmt(r['pub_main'])} + I/O {fmt(r['pub_io'])}, subscriber's worker "
                    f"{fmt(r['sub_main'])} + I/O {fmt(r['sub_io'])}")
                print(f"  {p} {w} worker(s): all {fmt(r['cpu_us'])} at {r['rate']['median'] / 1e6:.2f}M msg/s"
                      f"{sides}; {r['pub_bytes_per_read']:.0f} B a read (the publisher's worker, all its threads)")
    if res.get("zmq"):
        print("\nZeroMQ hop (PUB/SUB over ipc://, one I/O thread a side), CPU µs per frame / per message:")
        print(f"{'msgs a frame':>12s} {'bytes':>9s}" + "".join(f"{k:>24s}" for k in ("send", "I/O send", "I/O recv",
                                                                                     "recv")))
        for k, row in res["zmq"]["frames"].items():
            cells = "".join(f"{row[key]['per_frame']['median']:>11.2f} / {row[key]['per_message']['median']:<10.4f}"
                            for key in ("send", "io_send", "io_recv", "recv"))
            print(f"{k:>12s} {row['bytes']:>9d}" + cells)
        for key, f in res["zmq"]["fit"].items():
            print(f"  fit {key}: {f['per_frame_us']:.2f} µs a frame + {f['per_kib_us']:.3f} µs a KiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda cast: lambda s: [cast(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--only", type=csv(str), default=["python", "whole", "kernel", "zmq", "live"],
                    help="parts: python, whole, kernel, zmq, live (all)")
    ap.add_argument("--live-seconds", type=float, default=3.0, help="seconds of publishing a live run (3)")
    ap.add_argument("--protocols", type=csv(str), default=["nats", "ndjson"])
    ap.add_argument("--paths", type=csv(str), default=["compiled", "pure"], help="compiled, pure (both)")
    ap.add_argument("--size", type=int, default=128, help="payload bytes (128, as the bench)")
    ap.add_argument("--read", type=int, default=256_000,
                    help="bytes a read (256,000: what uvloop reads at most, and does from a client that outpaces it)")
    ap.add_argument("--messages", type=int, default=200_000, help="messages a round (200,000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fanouts", type=csv(int), default=[1, 100, 312, 625, 1250, 2500, 5000],
                    help="subscribers on the worker (1,100 and 5,000 over 16, 8, 4, 2, 1 workers)")
    ap.add_argument("--workers", type=csv(int), default=[1, 2], help="the whole path's workers (1,2)")
    ap.add_argument("--frame-msgs", type=csv(int), default=[1, 16, 64, 440, 1760, 4096],
                    help="messages a fabric frame, for the ZeroMQ hop")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--model", metavar="FILE", help="no measuring: the model from a run's --json output")
    ap.add_argument("--cores", type=csv(int), default=[2, 8, 16], help="the model's cores (2,8,16)")
    ap.add_argument("--model-workers", type=csv(int), default=[1, 2, 4, 8, 16], help="the model's workers")
    ap.add_argument("--gen-us", type=csv(float), default=[],
                    help="the generators' CPU µs a message (NATS,NDJSON) on the fewest cores, from `brokerctl "
                         "bench` (gen µs/msg) where they share them; otherwise elsewhere")
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)   # a path's subprocess
    args = ap.parse_args()
    if args.emit:
        print(json.dumps(python_part(args)))
        return
    if args.model:
        with open(args.model) as f:
            res = json.load(f)
        model_report(res, args.cores, args.model_workers, dict(zip(res["args"]["protocols"], args.gen_us)))
        return
    res: dict = {"args": {k: v for k, v in vars(args).items() if k != "emit"}, "paths": {}}
    if "python" in args.only or "whole" in args.only:
        for path in args.paths:
            res["paths"][path] = on_path(path, args)
    if "kernel" in args.only:
        compiled = res["paths"].get("compiled", {}).get("python", {})
        per_read = {p: v["messages_per_read"] for p, v in compiled.items()}
        res["kernel"] = kernel_stages(args.protocols, args.size, args.read, args.rounds, per_read)
    if "zmq" in args.only:
        res["zmq"] = zmq_stages(args.frame_msgs, args.size, args.rounds)
    if "live" in args.only:
        res["live"] = {}
        for protocol in args.protocols:
            res["live"][protocol] = {}
            for w in args.workers:
                runs = [live(protocol, w, args.live_seconds) for _ in range(args.rounds)]
                row = {"cpu_us": summary([r["cpu_us"] for r in runs]), "rate": summary([r["rate"] for r in runs]),
                       "pub_bytes_per_read": statistics.median([r["pub_bytes_per_read"] for r in runs])}
                for side in ("pub", "sub"):
                    for kind in ("main", "io", "other"):
                        row[f"{side}_{kind}"] = summary([r[side][kind] for r in runs])
                res["live"][protocol][str(w)] = row
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        report(res)


if __name__ == "__main__":
    main()
