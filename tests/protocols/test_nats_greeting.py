"""The acceptor greets: a plain-TCP NATS client gets its INFO from the supervisor the moment it is accepted (as
nats-server's accept loop sends it), before its worker has adopted the socket; the worker then speaks with it as if
it had greeted it itself (cluster/supervisor/handoff.py, workers/protocols/nats/greeting.py)."""

import json
import os
import signal
import time

from test_security import secure_config

from support.harness import Raw


def _info(raw: Raw) -> dict:
    line = raw.line()
    assert line.startswith(b"INFO {") and line.endswith(b"} \r\n"), line
    return json.loads(line[5:-3])


def test_info_comes_while_the_worker_is_stopped_and_the_worker_carries_on_from_it(start_broker):
    broker = start_broker(workers=1)
    worker = broker.worker_pids()[0]
    os.kill(worker, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with Raw(broker.ports["nats"]) as a, Raw(broker.ports["nats"]) as b:
            infos = [_info(a), _info(b)]
            assert time.monotonic() - started < 2.0   # the worker could not have sent them: it is stopped
            os.kill(worker, signal.SIGCONT)
            assert infos[1]["client_id"] == infos[0]["client_id"] + 1
            assert infos[0]["client_ip"] == "127.0.0.1" and "auth_required" not in infos[0]
            assert infos[0]["port"] == broker.ports["nats"] and infos[0]["headers"] is True
            # no second INFO from the worker: the first thing after CONNECT is the answer to it
            a.send(b'CONNECT {"verbose":true}\r\nSUB greet 1\r\nPING\r\n')
            assert [a.line(), a.line(), a.line()] == [b"+OK\r\n", b"+OK\r\n", b"PONG\r\n"]
            b.send(b'CONNECT {"verbose":false}\r\nPUB greet 2\r\nhi\r\nPING\r\n')
            assert b.line() == b"PONG\r\n"
            assert a.line() == b"MSG greet 1 2\r\n" and a.line() == b"hi\r\n"
    finally:
        os.kill(worker, signal.SIGCONT)


def test_the_acceptors_info_says_auth_required_when_security_is_on(start_broker):
    broker = start_broker(workers=1, config=secure_config())
    with Raw(broker.ports["nats"]) as c:
        assert _info(c)["auth_required"] is True
        c.send(b'CONNECT {"verbose":false,"user":"chatuser","pass":"secret3"}\r\nPING\r\n')
        assert c.line() == b"PONG\r\n"
    with Raw(broker.ports["nats"]) as c:
        _info(c)
        c.send(b'CONNECT {"verbose":false,"user":"chatuser","pass":"wrong"}\r\nPING\r\n')
        assert c.line() == b"-ERR 'Authorization Violation'\r\n"
