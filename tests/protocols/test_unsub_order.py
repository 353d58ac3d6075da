"""An UNSUB is in force for everything the same connection sends after it, however the input is split into reads
and however many workers there are (nats-server's behaviour; nats.py's own ``test_unsubscribe`` relies on it).

With more than one worker the unsubscribe completes only once what the other workers already read is delivered;
a PUB read in the same read as the UNSUB used to be routed meanwhile, and reached the subscription it followed.
"""

import socket
import time

import pytest

TRANSCRIPTS = [
    # (what the client sends, what it must read back up to and including the PONG)
    (b"SUB c 1\r\nUNSUB 1\r\nPUB c 1\r\nX\r\nPING\r\n", b"PONG\r\n"),
    (b"SUB d 1\r\nPUB d 1\r\nX\r\nUNSUB 1\r\nPUB d 1\r\nY\r\nPING\r\n", b"MSG d 1 1\r\nX\r\nPONG\r\n"),
    # a queue-group subscription takes the same way out
    (b"SUB e g 1\r\nPUB e 1\r\nX\r\nUNSUB 1\r\nPUB e 1\r\nY\r\nPING\r\n", b"MSG e 1 1\r\nX\r\nPONG\r\n"),
]


def _until_pong(s: socket.socket) -> bytes:
    """What arrives up to and including the PONG, less the server's own PINGs (answered): its first comes 2 s after
    CONNECT, wherever the test has got to by then (further on the slower the machine)."""
    got = b""
    deadline = time.monotonic() + 5
    while not got.endswith(b"PONG\r\n"):
        assert time.monotonic() < deadline, f"no PONG; have {got!r}"
        chunk = s.recv(65536)
        assert chunk, f"closed; have {got!r}"
        got += chunk
        if b"PING\r\n" in got:   # no line of a transcript is one (the client's PINGs come back as PONGs)
            s.sendall(b"PONG\r\n" * got.count(b"PING\r\n"))
            got = got.replace(b"PING\r\n", b"")
    return got


@pytest.mark.parametrize("workers", [2, 3])
def test_unsub_is_in_force_for_everything_sent_after_it_at_every_split(start_broker, workers):
    broker = start_broker(workers=workers)
    conns = []
    for _ in range(workers):   # the acceptor spreads them: every worker gets one
        s = socket.create_connection(("127.0.0.1", broker.ports["nats"]), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        assert _until_pong(s).startswith(b"INFO ")
        conns.append(s)
    wrong = []
    for s in conns:
        for sent, expected in TRANSCRIPTS:
            for cut in range(len(sent) + 1):
                s.sendall(sent[:cut])
                time.sleep(0.002)   # its own read, most of the time
                s.sendall(sent[cut:])
                got = _until_pong(s)
                if got != expected:
                    wrong.append((sent, cut, got))
    assert not wrong, f"{len(wrong)} transcripts differ, the first: {wrong[:3]}"
    for s in conns:
        s.close()
