"""Work-queue load for the bench's queue scenarios: producers that push, consumers that receive and ack.

Driven by a ``loadgen`` process (ops ``qconnect``, ``qrun``, ``close``), over the protocols of ``wire.QUEUE_WIRES``:

- ``qconnect``: open the producer and consumer sockets; on this broker, place each on a worker relative to the
  queue's owner (``info`` tells a connection's worker; the acceptor gives a new connection to the least-loaded
  worker, so connections that land elsewhere are kept open until the placement is done, then closed);
- ``qrun``: producers push pre-encoded frames with up to ``window`` pushes unanswered (or, at a fixed ``rate``,
  each stamped with its intended send time; or, with ``push_batch`` > 1, as batch pushes of that many messages
  where the protocol has them), until the duration is over and every push is answered; consumers keep
  one receive outstanding (``batch`` messages at most, long-polling ``wait_ms``) and answer each batch with one
  ack of all its handles, sent with the next receive, until no message came for a while after the duration.
  Everything the protocol's requests are answered with is counted, and the ids of what was pushed, received and
  not acked come back, so the bench can check that every message was acked exactly once.

Plain non-blocking sockets under ``selectors``, as in ``loadgen``: replies are parsed with one regex pass per read.
"""

from __future__ import annotations

import collections
import itertools
import os
import selectors
import socket
import time
import zlib

import orjson

from shardbroker.cli.bench.wire import QUEUE_WIRES, QueueJetStream, QueueProtocolError, nats_frames, payload
from shardbroker.cli.wire import nats, ndjson, resp

_QUIET = 0.75          # seconds without messages, after the producers stop, that end a consumer's run
_MAX_DRAIN = 60.0      # the most a run goes on after the producers' time is up
_PLACE_TRIES = 40      # connections opened per connection placed, at most, in a round
_PLACE_ROUNDS = 3      # rounds of tries, half a second apart


def owner(queue: str, workers: int) -> int:
    """The worker that owns ``queue`` on this broker (docs/queues.md, Placement)."""
    return zlib.crc32(queue.encode()) % workers


class QueueLoad:
    def __init__(self) -> None:
        self.producers: list[socket.socket] = []
        self.consumers: list[socket.socket] = []
        self.wire = None
        self.names: list[str] = []
        self.views: dict[socket.socket, object] = {}   # a connection's own view of the wire (its reply inbox)
        self._inboxes = itertools.count()

    # -- connect --------------------------------------------------------------------------------------------
    def connect(self, host: str, port: int, wire: str, producers: int, consumers: int, owner: int | None = None,
                producer_at: str = "", consumer_at: str = "", prefix: str = "c") -> dict:
        """Open the sockets; with ``owner`` (this broker, more than one worker), put producers and consumers on
        the owner's worker (``"owner"``), on another (``"other"``), or anywhere (``""``).  -> their workers."""
        self.wire = QUEUE_WIRES[wire]
        placing = wire == "ndjson" and owner is not None
        parked: list[socket.socket] = []
        out: dict[str, list] = {"producers": [], "consumers": []}
        try:
            for role, n, where in (("producers", producers, producer_at), ("consumers", consumers, consumer_at)):
                socks = []
                for _ in range(n):
                    sock, worker = self._placed(host, port, owner if placing and where else None, where, parked)
                    socks.append(sock)
                    out[role].append(worker)
                setattr(self, role, socks)
        finally:
            for sock in parked:
                sock.close()
        self.names = [f"{prefix}{i}" for i in range(consumers)]
        return out

    def _placed(self, host: str, port: int, owner: int | None, where: str, parked: list) -> tuple:
        """A connection on (or off) worker ``owner``.  The broker hands each new connection to its least loaded
        worker, so one that lands elsewhere is kept open (``parked``) to weigh on that worker until the placing is
        done.  A round of tries that fails (the broker's counts lagging behind the connections of the scenario
        before, which it has yet to see close, presumably: seen once in a while in a busy test run) is followed
        by another half a second later, the parked connections still open."""
        landed = []
        for round_ in range(_PLACE_ROUNDS):
            if round_:
                time.sleep(0.5)
            for _ in range(_PLACE_TRIES):
                sock = socket.create_connection((host, port), timeout=30)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.wire.name != "ndjson":
                    view = self.views[sock] = self.wire.on(f"_INBOX.bench.{os.getpid()}.{next(self._inboxes)}")
                    if view.hello():
                        sock.sendall(view.hello())
                    return sock, None
                sock.sendall(ndjson.request("info"))
                worker = orjson.loads(_read_line(sock))["info"]["worker"]
                if owner is None or (worker == owner) == (where == "owner"):
                    return sock, worker
                parked.append(sock)
                landed.append(worker)
        raise RuntimeError(f"no connection landed {'on' if where == 'owner' else 'off'} worker {owner} in "
                           f"{_PLACE_ROUNDS} rounds of {_PLACE_TRIES} tries (they landed on {sorted(set(landed))})")

    # -- run ------------------------------------------------------------------------------------------------
    def run(self, queue: str, size: int, start: float, duration: float, rate: float | None = None,
            window: int = 1000, batch: int = 100, wait_ms: int = 1000, count: int | None = None,
            drain: bool = False, push_batch: int = 1) -> dict:
        """Push for ``duration`` (at most ``count`` per producer); with ``drain``, consumers start only then, and
        empty the queue the producers filled.  ``push_batch``: messages per push request (batch producers)."""
        wire = self.wire
        # Paced: select(2), whose timeout is in microseconds (epoll's is in milliseconds), so that each message
        # leaves when it is due rather than up to a millisecond late (a handful of sockets: select is cheap).
        sel = selectors.SelectSelector() if rate is not None else selectors.DefaultSelector()
        end = start + duration
        per_frame = max(1, push_batch)   # messages per frame (a batch push, or pipelined pushes)
        reply_batch = per_frame // wire.push_many(queue, b"", per_frame)[1]   # messages a refusal refuses
        total = int(duration * rate) if rate is not None else 0
        start_ns = int(start * 1e9)
        period_ns = 1e9 / rate if rate else 0.0

        prods = []
        for sock in self.producers:
            sock.setblocking(False)
            view = self.views.get(sock, wire)
            frame = view.push_many(queue, payload(size), per_frame)[0] if per_frame > 1 \
                else view.push(queue, payload(size))
            st = {"sock": sock, "kind": "prod", "out": b"", "writing": False, "buf": b"", "sent": 0, "ids": [],
                  "refused": 0, "first_refusal": b"", "last_reply": 0.0, "w": view,
                  "block": frame * (window // per_frame), "flen": len(frame),
                  "stamped": view.stamped(queue, size) if rate is not None else None}
            prods.append(st)
            sel.register(sock, selectors.EVENT_READ, st)
        cons = []
        for sock, name in zip(self.consumers, self.names):
            sock.setblocking(False)
            st = {"sock": sock, "kind": "cons", "out": b"", "writing": False, "buf": b"",
                  "pending": collections.deque(),   # per request sent: None (a receive) or (ids, handles) (an ack)
                  "c": self.views.get(sock, wire).consumer(queue, name, batch, wait_ms),
                  "ids": [], "acked": 0, "failed": [], "last_msg": 0.0, "last_ack": 0.0, "first_msg": 0.0, "lat": [],
                  "stopped": False}
            cons.append(st)
            sel.register(sock, selectors.EVENT_READ, st)

        def write(st: dict, data: bytes) -> None:
            if st["out"]:
                st["out"] += data
                return
            try:
                n = st["sock"].send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            if n < len(data):
                st["out"] = data[n:]
                if not st["writing"]:
                    st["writing"] = True
                    sel.modify(st["sock"], selectors.EVENT_READ | selectors.EVENT_WRITE, st)

        limit = total if rate is not None else count
        cons_start = end if drain else start
        while time.monotonic() < start:
            time.sleep(min(0.01, max(0.0, start - time.monotonic())))
        receiving = False
        sending = bool(prods)
        while True:
            now = time.monotonic()
            if not receiving and now >= cons_start:
                receiving = True
                for st in cons:
                    st["pending"].append(None)
                    write(st, st["c"].receive())
            # full speed: until the time is up (or the count is pushed); paced: until the whole schedule is sent
            if sending and ((rate is None and now >= end) or (limit is not None
                                                             and all(st["sent"] >= limit for st in prods))):
                sending = False
            # producers: keep the window full (or the schedule: every frame due, stamped with when it was due)
            for st in prods:
                if not sending or st["out"]:
                    continue
                if rate is None:
                    room = window - (st["sent"] - len(st["ids"]) - st["refused"])
                    if count is not None:
                        room = min(room, count - st["sent"])
                    frames = room // per_frame
                    if frames > 0:
                        st["sent"] += frames * per_frame
                        write(st, st["block"][:frames * st["flen"]])
                    elif count is not None and 0 < room == count - st["sent"]:   # the last, short batch
                        st["sent"] += room
                        write(st, st["w"].push_many(queue, payload(size), room)[0])
                else:
                    due = min(total, int((now - start) * rate) + 1)
                    if due > st["sent"]:
                        stamped = st["stamped"]
                        write(st, b"".join(stamped(int(start_ns + k * period_ns)) for k in range(st["sent"], due)))
                        st["sent"] = due
            prods_done = not sending and all(st["sent"] == len(st["ids"]) + st["refused"] for st in prods)
            if now > end:
                for st in cons:
                    if not st["stopped"] and prods_done and now - max(st["last_msg"], end) > _QUIET \
                            and all(p is None for p in st["pending"]):
                        st["stopped"] = True    # its receive may still be waiting: closing the socket ends it
                if prods_done and all(st["stopped"] for st in cons):
                    break
                if now - end > _MAX_DRAIN:
                    break
            timeout = 0.05 if receiving or not cons else max(0.0, min(0.05, cons_start - now))
            if rate is not None and sending:
                timeout = min(timeout, max(0.0, start + min(st["sent"] for st in prods) / rate - time.monotonic()))
            for key, mask in sel.select(timeout):
                st = key.data
                sock = key.fileobj
                if mask & selectors.EVENT_WRITE:
                    try:
                        n = sock.send(st["out"])
                    except (BlockingIOError, InterruptedError):
                        n = 0
                    st["out"] = st["out"][n:]
                    if not st["out"]:
                        st["writing"] = False
                        sel.modify(sock, selectors.EVENT_READ, st)
                if not mask & selectors.EVENT_READ:
                    continue
                try:
                    data = sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    continue
                if not data:
                    raise ConnectionError(f"the server closed a {st['kind']} connection")
                if st["kind"] == "prod":
                    ids, refused, first, st["buf"] = st["w"].push_replies(st["buf"] + data, reply_batch)
                    if ids or refused:
                        st["ids"].extend(ids)
                        st["refused"] += refused
                        st["first_refusal"] = st["first_refusal"] or first
                        st["last_reply"] = time.monotonic()
                    continue
                consumer = st["c"]
                events, st["buf"] = consumer.replies(st["buf"] + data)
                if not events:
                    continue
                now = time.monotonic()
                now_ns = time.monotonic_ns()
                for event in events:
                    asked = st["pending"].popleft()
                    if event[0] == "msgs":
                        if asked is not None:
                            raise QueueProtocolError("a receive's reply where an ack's was expected")
                        _, ids, handles, stamps = event
                        if ids:
                            st["stopped"] = False
                            st["ids"].extend(ids)
                            st["last_msg"] = now
                            st["first_msg"] = st["first_msg"] or now
                            if stamps:
                                st["lat"].extend(now_ns - s for s in stamps)
                            st["pending"].append((ids, handles))
                            st["pending"].append(None)
                            write(st, consumer.ack(handles) + consumer.receive())
                        elif not st["stopped"]:
                            st["pending"].append(None)
                            write(st, consumer.receive())
                    else:
                        if asked is None:
                            raise QueueProtocolError("an ack's reply where a receive's was expected")
                        ids, handles = asked
                        ok = event[1]
                        st["acked"] += ok
                        st["last_ack"] = now
                        if ok < len(handles):
                            st["failed"].extend(ids[i] for i in consumer.ack_failures(event[2], handles))
        sel.close()
        for st in prods + cons:
            st["sock"].setblocking(True)
        push_ids = [i for st in prods for i in st["ids"]]
        recv_ids = [i for st in cons for i in st["ids"]]
        failed = [i for st in cons for i in st["failed"]]
        return {
            "sent": sum(st["sent"] for st in prods), "pushed": len(push_ids),
            "refused": sum(st["refused"] for st in prods),
            "first_refusal": next((st["first_refusal"].decode(errors="replace") for st in prods
                                   if st["first_refusal"]), ""),
            "last_push": max((st["last_reply"] for st in prods), default=0.0),
            "push_ids": b"\n".join(push_ids), "received": len(recv_ids), "recv_ids": b"\n".join(recv_ids),
            "acked": sum(st["acked"] for st in cons), "failed_ids": b"\n".join(failed),
            "first_msg": min((st["first_msg"] for st in cons if st["first_msg"]), default=0.0),
            "last_ack": max((st["last_ack"] for st in cons), default=0.0),
            "latencies": [x for st in cons for x in st["lat"]],
        }

    def close(self) -> None:
        for sock in self.producers + self.consumers:
            try:
                sock.close()
            except OSError:
                pass
        self.producers, self.consumers = [], []
        self.views.clear()


# -- the bench's own requests: set a queue up, check it afterwards, clean up --------------------------------------
class Control:
    """A blocking connection of the bench itself, for the requests around a run (not measured)."""

    def __init__(self, host: str, port: int, wire: str) -> None:
        self.wire = wire
        self.sock = socket.create_connection((host, port), timeout=30)
        self.buf = b""
        self.view = QUEUE_WIRES[wire].on(f"_INBOX.bench.{os.getpid()}.ctl")
        self.sock.sendall(self.view.hello())

    def close(self) -> None:
        self.sock.close()

    def _ndjson(self, req: dict) -> dict:
        self.sock.sendall(ndjson.encode(req))
        line, self.buf = _read_line(self.sock, self.buf, keep=True)
        reply = orjson.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"{req['op']}: {reply}")
        return reply

    def _redis(self, *parts: bytes):
        """One command; -> its reply, decoded (bulk strings as bytes, arrays as lists)."""
        self.sock.sendall(resp.command(*parts))
        reply = self._resp()
        if isinstance(reply, resp.Error):
            raise RuntimeError(f"redis {parts[0].decode()}: {reply}")
        return reply

    def _jetstream(self, subject: bytes, request: dict | None = None) -> dict:
        """One JetStream API request; -> its reply, which must not be an error."""
        body = orjson.dumps(request) if request is not None else b""
        self.sock.sendall(nats.pub(subject, body, self.view.inbox + b".c"))
        while True:
            frames, used = nats_frames(self.buf)
            self.buf = self.buf[used:]
            for _, _, _, data in frames:
                reply = orjson.loads(data)
                if "error" in reply:
                    raise RuntimeError(f"{subject.decode()}: {reply['error']}")
                return reply
            self._fill(len(self.buf) + 1)

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"{self.wire} closed the connection")
            self.buf += chunk

    def _resp(self):
        """One reply, decoded (``cli.wire.resp``: an error reply as a ``resp.Error``)."""
        try:
            while (got := resp.parse(self.buf)) is None:
                self._fill(len(self.buf) + 1)
        except resp.ProtocolError as exc:
            raise RuntimeError(f"unexpected reply from redis: {exc.line[:200]!r}") from None
        reply, end = got
        self.buf = self.buf[end:]
        return reply

    def workers(self) -> int:
        return self._ndjson({"op": "info"})["info"]["workers"] if self.wire == "ndjson" else 1

    def prepare(self, queue: str) -> None:
        if self.wire == "jetstream":
            # Work-queue retention (an acked message leaves the stream) in memory, as the others keep queues;
            # every bench consumer pulls from one durable consumer, with no limit on acks pending.
            stream, durable = QueueJetStream.stream(queue), QueueJetStream.durable
            self._jetstream(b"$JS.API.STREAM.CREATE.%s" % stream, {
                "name": stream.decode(), "subjects": [queue], "retention": "workqueue", "storage": "memory"})
            self._jetstream(b"$JS.API.CONSUMER.DURABLE.CREATE.%s.%s" % (stream, durable), {
                "stream_name": stream.decode(), "config": {
                    "durable_name": durable.decode(), "ack_policy": "explicit", "max_ack_pending": -1,
                    "max_waiting": 512}})
        elif self.wire == "redis":
            self._redis(b"DEL", queue.encode())
            self._redis(b"XGROUP", b"CREATE", queue.encode(), QUEUE_WIRES["redis"].group, b"0", b"MKSTREAM")

    def remaining(self, queue: str) -> dict:
        """What the queue holds after a run: ``stored`` (messages in it; Redis: the stream's length, as XACK leaves
        entries in the stream) and ``pending`` (leased, not acked)."""
        if self.wire == "ndjson":
            stat = self._ndjson({"op": "qstat", "queue": queue})["stat"]
            return {"stored": stat["messages"], "pending": stat["in_flight"]}
        if self.wire == "jetstream":
            return self._jetstream_remaining(queue)
        group = QUEUE_WIRES["redis"].group
        return {"stored": self._redis(b"XLEN", queue.encode()),
                "pending": self._redis(b"XPENDING", queue.encode(), group)[0]}

    def _jetstream_remaining(self, queue: str) -> dict:
        """Acks have no reply, so the last ones may still be on their way into the stream's state when the run
        ends: wait (up to 2 s) until nothing is pending."""
        stream, durable = QueueJetStream.stream(queue), QueueJetStream.durable
        deadline = time.monotonic() + 2.0
        while True:
            consumer = self._jetstream(b"$JS.API.CONSUMER.INFO.%s.%s" % (stream, durable))
            if not consumer["num_ack_pending"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        state = self._jetstream(b"$JS.API.STREAM.INFO.%s" % stream)["state"]
        return {"stored": state["messages"], "pending": consumer["num_ack_pending"]}

    def cleanup(self, queue: str) -> None:
        if self.wire == "ndjson":
            self._ndjson({"op": "qpurge", "queue": queue})
        elif self.wire == "jetstream":
            self._jetstream(b"$JS.API.STREAM.DELETE.%s" % QueueJetStream.stream(queue))
        else:
            self._redis(b"DEL", queue.encode())


def _read_line(sock: socket.socket, buf: bytes = b"", keep: bool = False):
    data = buf
    while b"\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed while waiting for a reply; got {data[-200:]!r}")
        data += chunk
    line, _, rest = data.partition(b"\n")
    return (line, rest) if keep else line
