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

A measurement, not a test, and not a benchmark of the broker (``brokerctl bench`` is).  The ``kernel``, ``zmq``
and ``live`` parts are in stages_io.py, the model in stages_model.py, both beside this script.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import stages_io  # scripts/measure, this script's folder, as are hotpath and stages_model
from hotpath import NullTransport
from stages_io import NATS_CONNECT, REPO, SUBJECT, cycle_of, publish_frame, summary, thread_cpu, threads_named
from stages_model import model_report

from shardbroker.cluster.config import load
from shardbroker.router import frames
from shardbroker.workers import speedups
from shardbroker.workers.auth import Authenticator
from shardbroker.workers.hub import Hub
from shardbroker.workers.message import KIND_JSON, KIND_RAW
from shardbroker.workers.protocols.nats import codec as nats_codec
from shardbroker.workers.protocols.nats.session import NatsSession
from shardbroker.workers.protocols.ndjson import codec as ndjson_codec
from shardbroker.workers.protocols.ndjson.session import NdjsonSession
from shardbroker.workers.turn import TURN_BUDGET

SESSIONS = {"nats": NatsSession, "ndjson": NdjsonSession}
KINDS = {"nats": KIND_RAW, "ndjson": KIND_JSON}


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
            take, nbytes = hub.run_room(route, payloads, start)
            hub.deliver_run(route, kind, payloads if take == n else payloads[start:start + take], nbytes, None, None)
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
        res["kernel"] = stages_io.kernel_stages(args.protocols, args.size, args.read, args.rounds, per_read)
    if "zmq" in args.only:
        res["zmq"] = stages_io.zmq_stages(args.frame_msgs, args.size, args.rounds)
    if "live" in args.only:
        res["live"] = stages_io.live_stages(args.protocols, args.workers, args.live_seconds, args.rounds)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        report(res)


if __name__ == "__main__":
    main()
