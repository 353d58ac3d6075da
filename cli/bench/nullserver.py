"""A server that does nothing but discard what publishers send and stream ready-made deliveries to subscribers:
what the load generator reaches against it is the most it can measure (``brokerctl bench --generator-check``)."""

from __future__ import annotations

import socket
import threading

from shardbroker.cli.bench.wire import WIRES, payload


class NullServer:
    def __init__(self, wire: str, size: int) -> None:
        self.wire = WIRES[wire]
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        delivery = {"nats": b"MSG bench.null 1 %d\r\n%s\r\n",
                    "ndjson": b'{"topic":"bench.null","data":"%s"}\n',
                    "redis": b"*3\r\n$7\r\nmessage\r\n$10\r\nbench.null\r\n$%d\r\n%s\r\n"}[wire]
        data = payload(size)
        one = delivery % data if wire == "ndjson" else delivery % (len(data), data)
        self.block = one * max(1, 65536 // len(one))
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        probe, answer = self.wire.confirm()
        subscribe = self.wire.subscribe("bench.null", 1)[:4]
        try:
            if self.wire.greeting:
                conn.sendall(self.wire.greeting + b"{} \r\n")
            seen = b""
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    return
                seen = (seen + data)[-4096:]
                if subscribe in seen and probe in seen:  # a subscriber, subscribed: stream deliveries at it
                    conn.sendall(answer)
                    while not self._stop.is_set():
                        conn.sendall(self.block)
                    return
        except OSError:
            return
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
