"""Network fuzz: mutated frames of every protocol sent to a running broker, split and paced at random, while a
well-behaved client's stream crosses between the workers.  No worker may die, the well-behaved client must get
every message in order, and the broker must still answer everyone afterwards.

``NETFUZZ_INPUTS`` sets how many mutated connections are sent (default 400, a few seconds); ``NETFUZZ_SEED`` the
seed (printed, so a failure can be replayed).  docs/reliability.md records a long run.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

from support.harness import Raw

INPUTS = int(os.environ.get("NETFUZZ_INPUTS", "400"))
SEED = int(os.environ.get("NETFUZZ_SEED", str(random.randrange(1 << 30))))


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


CORPUS = {
    "ndjson": [b'{"op":"sub","topic":"fz.a"}\n{"op":"pub","topic":"fz.a","data":{"k":[1,2,3]}}\n',
               b'{"op":"auth","user":"u","pass":"p"}\n{"op":"ping","id":1}\n',
               b'{"op":"qpush","queue":"fzq","data":"x"}\n{"op":"qrecv","queue":"fzq","wait_ms":50}\n',
               b'{"op":"unsub","topic":"fz.*"}\n{"op":"info"}\n{"op":"admin.list_users"}\n'],
    "nats": [b'CONNECT {"verbose":true,"pedantic":true,"headers":true}\r\nSUB fz.a 1\r\nPUB fz.a 5\r\nhello\r\n'
             b'PING\r\n',
             b'CONNECT {}\r\nHPUB fz.h 12 14\r\nNATS/1.0\r\n\r\nhi\r\nUNSUB 1 3\r\n',
             b'SUB _INBOX.x 2\r\nPUB $Q.PUSH.fzq 3\r\nabc\r\nPUB $Q.RECV.fzq _INBOX.x 13\r\n{"batch":1}\r\n',
             b'PUB fz.b reply 0\r\n\r\nPONG\r\nINFO {}\r\n'],
    "bridge": [b"Sfz     Ufz     Pfz     some data", b"Sabc    Sdef    ", b"Pbig    " + b"y" * 300],
    "qlite": [_frame(b"\x00alice;$2b$04$" + b"a" * 53) + _frame(b"PUSH;hello"),
              _frame(b"\x01bob;x") + _frame(b"POLL;\x01\x00\x00\x00\x01\x00\x00\x00"),
              _frame(b"LEN;") + _frame(b"DEL;" + b"r" * 16)],
}


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        kind = rng.randrange(7)
        pos = rng.randrange(len(out) + 1)
        if kind == 0 and out:       # flip a bit
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif kind == 1:             # insert random bytes
            out[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif kind == 2 and out:     # delete a run
            del out[pos:pos + rng.randint(1, 16)]
        elif kind == 3:             # truncate
            del out[pos:]
        elif kind == 4 and out:     # duplicate a run
            run = out[pos:pos + rng.randint(1, 64)]
            out[pos:pos] = run * rng.randint(1, 8)
        elif kind == 5:             # a number in the text made huge, or a length field maxed out
            out[pos:pos] = rng.choice([b"99999999999", b"-1", b"\xff\xff\xff\xff", b"4294967295", b"\r\n", b"\n"])
        else:                       # splice in another input of the corpus
            other = rng.choice([x for xs in CORPUS.values() for x in xs])
            out[pos:pos] = other[rng.randrange(len(other)):]
    return bytes(out)


def fuzz_one(port: int, data: bytes, rng: random.Random) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pos = 0
            while pos < len(data):
                n = rng.randint(1, max(1, len(data) // 3))
                s.sendall(data[pos:pos + n])
                pos += n
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 0.01)
            if rng.random() < 0.5:
                s.shutdown(socket.SHUT_WR)
            s.settimeout(0.05 + rng.random() * 0.2)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
    except OSError:
        pass


@pytest.mark.slow
def test_mutated_frames_kill_no_worker_and_a_good_client_gets_everything(start_broker):
    b = start_broker(workers=2, args=["--bridge-port", "0", "--qlite-port", "0"],
                     config={"limits": {"handshake_timeout": 2, "max_line_bytes": 8192},
                             "nats": {"max_payload": 8192}, "bridge": {"max_publish_bytes": 8192}})
    pids = sorted(b.worker_pids())
    ports = {"ndjson": b.port, "nats": b.ports["nats"], "bridge": b.ports["bridge"], "qlite": b.ports["qlite"]}
    # the well-behaved client: a publisher and a subscriber, on two different workers
    sub = Raw(b.port)
    workers_of = {sub.request({"op": "info"})["info"]["worker"]}
    assert sub.request({"op": "sub", "topic": "good.stream.7c1"}) == {"ok": True}
    pub = Raw(b.port)
    assert pub.request({"op": "info"})["info"]["worker"] not in workers_of
    sent, got, stop = [0], [], threading.Event()

    def publish() -> None:
        while not stop.is_set():
            pub.send(b'{"op":"pub","topic":"good.stream.7c1","data":%d}\n' % sent[0])
            assert pub.json() == {"ok": True}
            sent[0] += 1
            time.sleep(0.002)

    def read() -> None:
        while not (stop.is_set() and len(got) >= sent[0]):
            try:
                got.append(sub.json(timeout=5)["data"])
            except TimeoutError:
                return

    threads = [threading.Thread(target=publish), threading.Thread(target=read)]
    for t in threads:
        t.start()
    rng = random.Random(SEED)
    jobs = []
    for _ in range(INPUTS):
        proto = rng.choice(sorted(CORPUS))
        data = mutate(rng, rng.choice(CORPUS[proto]))
        jobs.append((ports[proto], data, random.Random(rng.random())))
    lanes = 16
    workers = [threading.Thread(target=lambda k=k: [fuzz_one(*job) for job in jobs[k::lanes]]) for k in range(lanes)]
    t0 = time.monotonic()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    fuzz_s = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(15)
    print(f"\nnetwork fuzz: {INPUTS} mutated connections in {fuzz_s:.1f}s (seed {SEED}); good stream {sent[0]}")
    assert got == list(range(sent[0])), f"seed {SEED}: the good client lost or reordered messages"
    assert sorted(b.worker_pids()) == pids, f"seed {SEED}: a worker died:\n{b.log()[-3000:]}"
    varz = b.varz()
    assert all(w.get("restarts", 0) == 0 and w["state"] == "ready" for w in varz["workers"]), varz["workers"]
    assert b.http("/healthz")[0] == 200
    with Raw(b.port) as late:
        assert late.request({"op": "ping"}) == {"ok": True}
    assert "Traceback" not in b.log(), f"seed {SEED}: {b.log()[-3000:]}"
    sub.close()
    pub.close()
