"""A load-generator process: some publisher and subscriber sockets, driven by the benchmark over a pipe.

Phases (one command each, answered when done):
- ``connect``: open the sockets, greet the server, learn each connection's id (for placing them across workers);
- ``subscribe``: subscribe each subscriber socket to its subjects and wait until the server confirms;
- ``run``: publishers send pre-encoded, pipelined frames until the deadline (or at a fixed rate, with send times
  in the payload); subscribers count deliveries by a marker, without decoding them, until the stream has been
  quiet for a moment after the deadline;
- ``close``;
- ``qconnect``, ``qrun``: the same for the work-queue scenarios (``qload``).
Everything is plain non-blocking sockets under ``selectors``: nothing here competes with the broker for the CPU
more than it must.  With ``tls`` (``brokerctl bench --tls``) the sockets are the ssl module's: TLS after NATS'
plaintext INFO, as nats-server does it, and from the first byte for NDJSON.
"""

from __future__ import annotations

import os
import selectors
import socket
import ssl
import time
from multiprocessing.connection import Connection

import orjson

from shardbroker.cli.bench import scale
from shardbroker.cli.bench.qload import QueueLoad
from shardbroker.cli.bench.wire import STAMP, WIRES, Counter, payload

_QUIET = 0.75          # seconds without deliveries, after the publishers stop, that end a run
_MAX_DRAIN = 60.0      # the most a run waits for deliveries after the publishers stop
_BLOCK = 64 * 1024     # bytes of pipelined frames per send


def main(pipe: Connection) -> None:
    scale.raise_fd_limit()   # a generator may hold tens of thousands of connections
    gen = Generator()
    while True:
        cmd = pipe.recv()
        op = cmd.pop("op")
        if op == "exit":
            gen.close()
            return
        try:
            pipe.send(getattr(gen, op)(**cmd))
        except Exception as exc:  # report it: the benchmark decides what to do
            pipe.send({"error": f"{type(exc).__name__}: {exc}"})


class Generator:
    def __init__(self) -> None:
        self.pubs: list[socket.socket] = []
        self.subs: list[socket.socket] = []
        self.wire = None
        # each NATS connection's client_id from its INFO (only that: the whole INFO is a few KiB a connection)
        self._cid_of: dict[socket.socket, int] = {}
        self.queues = QueueLoad()
        self.tls: ssl.SSLContext | None = None

    # -- connect --------------------------------------------------------------------------------------------
    def connect(self, host: str, port: int, wire: str, pubs: int, subs: int, ids: bool,
                tls: dict | None = None, sub_port: int | None = None, first: int = 0) -> dict:
        """``tls``: ``{"ca": PEM file}`` to connect with TLS, verifying the server's certificate with it.
        ``sub_port``: the subscribers' server, where it is not the publishers' (the leaf scenarios: one on the
        hub, the other on the leaf).  ``first``: the run's number of this generator's first connection (the
        generators before it hold the ones before), which picks the source addresses (cli/bench/scale.py)."""
        self.wire = WIRES[wire]
        self.tls = ssl.create_default_context(cafile=tls["ca"]) if tls else None
        self.pubs = [self._open(host, port, first + i) for i in range(pubs)]
        self.subs = [self._open(host, port if sub_port is None else sub_port, first + pubs + i)
                     for i in range(subs)]
        out = {"pubs": [], "subs": []}
        if ids:
            out["pubs"] = [self._cid(s) for s in self.pubs]
            out["subs"] = [self._cid(s) for s in self.subs]
        return out

    def _open(self, host: str, port: int, index: int = 0) -> socket.socket:
        sock = scale.connect(host, port, index, timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cid = None
        if self.wire.greeting:
            line = _read_until(sock, b"\n")
            if not line.startswith(self.wire.greeting):
                raise RuntimeError(f"unexpected greeting {line[:60]!r}")
            cid = orjson.loads(line[len(self.wire.greeting):].strip()).get("client_id")
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_hostname=host)
        if cid is not None:
            self._cid_of[sock] = cid
        hello = self.wire.hello()
        if hello:
            sock.sendall(hello)
        return sock

    def _cid(self, sock: socket.socket) -> int:
        """The server's id of this connection (NATS INFO client_id; NDJSON info op), to place it on a worker."""
        if self.wire.name == "nats":
            return int(self._cid_of[sock])
        sock.sendall(b'{"op":"info"}\n')
        return int(orjson.loads(_read_until(sock, b"\n"))["info"]["cid"])

    # -- subscribe ------------------------------------------------------------------------------------------
    def subscribe(self, subjects: list[list[str]]) -> dict:
        started = time.monotonic()
        sid = 0
        for sock, subs in zip(self.subs, subjects):
            for subject in subs:
                sid += 1
                sock.sendall(self.wire.subscribe(subject, sid))
        probe, answer = self.wire.confirm()
        for sock in self.subs:
            sock.sendall(probe)
        for sock in self.subs:
            _read_until(sock, answer)
        return {"seconds": time.monotonic() - started}

    # -- run ------------------------------------------------------------------------------------------------
    def run(self, subjects: list[str], size: int, start: float, duration: float, rate: float | None = None,
            latency: bool = False, count: int | None = None, drain: bool = True, quiet: float | None = None,
            expect: int | None = None) -> dict:
        """Publish until ``duration`` is over (at full speed, or ``rate`` per second), or exactly ``count``
        messages per publisher at full speed; count deliveries until they stop coming (or, without ``drain``,
        until the end of the duration).  ``quiet``: the seconds without deliveries that a generator with
        subscribers takes for their end (one without waits for nothing: the default); ``expect``: deliveries per
        subscriber that are all there are (a fan-out of ``count`` messages), which end the run when they are in
        (so a long ``quiet`` costs time only where some are lost)."""
        wire = self.wire
        sel = selectors.DefaultSelector()
        frames = [wire.publish(s, payload(size)) for s in subjects]
        blocks = [f * max(1, _BLOCK // len(f)) for f in frames]
        pubs = []
        for i, sock in enumerate(self.pubs):
            sock.setblocking(False)
            state = {"sock": sock, "frame": frames[i], "block": blocks[i], "out": b"", "sent_bytes": 0,
                     "subject": subjects[i], "sent": 0, "writing": rate is None}
            if count is not None:
                state["block"], state["out"] = b"", frames[i] * count
            pubs.append(state)
            # At full speed a publisher always has bytes to write; at a fixed rate it asks to write only when it
            # has some, or select() would return at once and the generator would spin, stealing a CPU.
            sel.register(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if rate is None else 0),
                         ("pub", state))

        def want_write(st: dict, on: bool) -> None:
            if st["writing"] != on and st["sock"] in sel.get_map():
                st["writing"] = on
                sel.modify(st["sock"], selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0), ("pub", st))
        counters = []
        for sock in self.subs:
            sock.setblocking(False)
            counter = Counter(wire.delivery_marker)
            counters.append(counter)
            sel.register(sock, selectors.EVENT_READ, ("sub", counter))
        quiet = _QUIET if quiet is None or not counters else quiet
        outstanding = expect * len(counters) if expect is not None and counters else None
        stamps: list[int] = []
        tails: dict[int, bytes] = {}
        end = start + duration
        while time.monotonic() < start:
            time.sleep(min(0.01, max(0.0, start - time.monotonic())))
        first_recv = last_recv = 0.0
        sending = bool(pubs)
        last_progress = time.monotonic()
        tick = 0.001
        while True:
            now = time.monotonic()
            if sending and (now >= end or (count is not None and all(not st["out"] for st in pubs))):
                sending = False
                for st in pubs:  # finish a frame cut in the middle, then stop writing
                    st["block"] = b""
                    partial = st["sent_bytes"] % len(st["frame"]) if rate is None else 0
                    if partial and not st["out"]:
                        st["out"] = st["frame"][partial:]
            if not sending and all(not st["out"] for st in pubs):
                for st in pubs:
                    want_write(st, False)
                if now - last_progress > quiet or now - end > _MAX_DRAIN or (not drain and now >= end) \
                        or (outstanding is not None and outstanding <= 0):
                    break
            slot = int((now - start) / tick)
            if rate is not None and sending:
                # What is due leaves on a grid of ticks, however often the loop wakes: a protocol that answers
                # each publish (NDJSON's ok, RESP's count) would wake it after each write, and it would send one
                # message at a time, five times the server's and its own CPU of one write a tick (NATS, which
                # answers nothing) at this rate, on cores they share.
                due = int(slot * tick * rate)
                for st in pubs:
                    missing = due - st["sent"]
                    if missing > 0 and not st["out"]:
                        stamp = time.monotonic_ns()
                        st["out"] = wire.publish(st["subject"], payload(size, stamp)) * missing
                        st["sent"] += missing
                        want_write(st, True)
            timeout = max(0.0, start + (slot + 1) * tick - time.monotonic()) if (rate is not None and sending) \
                else 0.05
            for key, mask in sel.select(timeout):
                kind, st = key.data
                sock = key.fileobj
                if mask & selectors.EVENT_READ:
                    try:
                        data = sock.recv(1 << 20)
                        while data and self.tls is not None and sock.pending():
                            # TLS: one record per recv; what is decrypted already is no longer in select's sight
                            data += sock.recv(1 << 20)
                    except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        data = None
                    except OSError:
                        data = b""
                    if data == b"":
                        sel.unregister(sock)
                        continue
                    if data:
                        if b"PING\r\n" in data and wire.name == "nats":
                            sock.send(b"PONG\r\n")
                        if kind == "sub":
                            got = st.feed(data)
                            if got:
                                if outstanding is not None:
                                    outstanding -= got
                                last_recv = time.monotonic()
                                if not first_recv:
                                    first_recv = last_recv
                                last_progress = last_recv
                                if latency:
                                    fd = sock.fileno()
                                    chunk = tails.get(fd, b"") + data
                                    now_ns = time.monotonic_ns()
                                    stamps.extend(now_ns - int(m) for m in STAMP.findall(chunk))
                                    tails[fd] = chunk[-19:]
                if mask & selectors.EVENT_WRITE and kind == "pub":
                    out = st["out"] or (st["block"] if sending and rate is None else b"")
                    if not out:
                        want_write(st, False)
                        continue
                    try:
                        n = sock.send(out)
                    except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        continue
                    except OSError:
                        sel.unregister(sock)
                        continue
                    if st["out"]:
                        st["out"] = st["out"][n:]
                    else:
                        st["out"] = out[n:] if n < len(out) else b""
                    st["sent_bytes"] += n
        sel.close()
        for sock in self.pubs + self.subs:
            sock.setblocking(True)
        sent = [st["sent"] if rate is not None else st["sent_bytes"] // len(st["frame"]) for st in pubs]
        return {"sent": sent, "received": [c.count for c in counters], "first_recv": first_recv,
                "last_recv": last_recv, "latencies": stamps}

    # -- scale ----------------------------------------------------------------------------------------------
    def scale(self, host: str, port: int, wire: str, n: int, prefix: str, first: int = 0) -> dict:
        """Open ``n`` connections and subscribe each (to its own subject); -> seconds until all are confirmed.
        ``first``: as for ``connect``."""
        self.wire = WIRES[wire]
        started = time.monotonic()
        self.subs = [self._open(host, port, first + i) for i in range(n)]
        probe, answer = self.wire.confirm()
        for i, sock in enumerate(self.subs):
            sock.sendall(self.wire.subscribe(f"{prefix}.{os.getpid()}.{i}", 1) + probe)
        for sock in self.subs:
            _read_until(sock, answer)
        return {"seconds": time.monotonic() - started}

    # -- work queues ----------------------------------------------------------------------------------------
    def qconnect(self, **kwargs) -> dict:
        return self.queues.connect(**kwargs)

    def qrun(self, **kwargs) -> dict:
        return self.queues.run(**kwargs)

    def close(self) -> dict:
        self.queues.close()
        for sock in self.pubs + self.subs:
            try:
                sock.close()
            except OSError:
                pass
        self.pubs, self.subs = [], []
        self._cid_of.clear()
        return {}


def _read_until(sock: socket.socket, marker: bytes, timeout: float = 30.0) -> bytes:
    """Read (blocking) until ``marker``; -> everything up to and including it.  Bench sockets carry nothing we
    need after a confirmation, so any surplus is dropped."""
    sock.settimeout(timeout)
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed while waiting for {marker!r}; got {data[-200:]!r}")
        data += chunk
    return data[:data.index(marker) + len(marker)]
