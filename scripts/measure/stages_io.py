"""The parts of scripts/measure/stages.py that measure on real sockets and processes: ``kernel`` (a uvloop
transport on loopback TCP), ``zmq`` (the fabric's hop between two processes) and ``live`` (the real broker); and
what every part shares: the input the bench's generator writes, the CPU clocks, the medians.  Its docstring says
what each part measures; run that script, not this one (it imports this, from its own folder)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import zmq

from shardbroker.cli.wire import nats as wire_nats
from shardbroker.cli.wire import ndjson as wire_ndjson
from shardbroker.cluster.config import load
from shardbroker.router import frames
from shardbroker.workers.fanout import BATCH_BYTES
from shardbroker.workers.message import KIND_RAW
from shardbroker.workers.protocols.ndjson import codec as ndjson_codec

REPO = Path(__file__).resolve().parents[2]
SUBJECT = "bench.stages"
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


def live_stages(protocols: list[str], workers: list[int], seconds: float, rounds: int) -> dict:
    """The ``live`` part: ``rounds`` runs of each protocol at each number of workers, and their medians."""
    out: dict = {}
    for protocol in protocols:
        out[protocol] = {}
        for w in workers:
            runs = [live(protocol, w, seconds) for _ in range(rounds)]
            row = {"cpu_us": summary([r["cpu_us"] for r in runs]), "rate": summary([r["rate"] for r in runs]),
                   "pub_bytes_per_read": statistics.median([r["pub_bytes_per_read"] for r in runs])}
            for side in ("pub", "sub"):
                for kind in ("main", "io", "other"):
                    row[f"{side}_{kind}"] = summary([r[side][kind] for r in runs])
            out[protocol][str(w)] = row
    return out


def _proc_io(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}

