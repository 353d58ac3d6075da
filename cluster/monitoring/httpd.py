"""A minimal HTTP/1.1 GET server for the monitoring endpoints (JSON out, one request per connection).

Monitoring is a handful of GETs a second at most, so asyncio streams are fine here; the bounds below keep a
misbehaving client from holding memory or a connection.  A handler returns a JSON-able object, or a ``Body`` for
another format (/metrics); it sees the request's headers (Accept), and a ``Body`` is gzipped for a client that
asks for it (Prometheus does).

HTTPS (``monitoring.tls``): the server accepts itself and asks ``tls()`` for the context of each new connection,
so that a reload's certificates serve the next request.  The handshake runs here, in the supervisor
(cluster.security.tls:
on its event loop, never blocking it): a handful of scrapes a minute cost it nothing worth moving elsewhere.
A plain HTTP request to an HTTPS port gets a plain ``400`` that says so.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import orjson

from shardbroker.cluster.security import tls as tlsaccept

log = logging.getLogger("broker.http")

Handler = Callable[[str, dict[str, str], dict[str, str]], Awaitable[tuple[int, object]]]

_MAX_HEAD = 16 * 1024
_READ_TIMEOUT = 10.0
_CLOSE_WAIT = 3.0     # seconds a closing server waits for the requests under way (a worker answers within 2)
_GZIP_FROM = 1024   # smaller bodies are not worth compressing
_ACCEPT_PAUSE = 0.1   # seconds the listener rests after an accept failed for want of descriptors
_PLAIN_TO_TLS = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
                 b"This port serves HTTPS: use https://\n")


@dataclass(frozen=True)
class Body:
    data: bytes
    content_type: str


class HttpServer:
    def __init__(self, handler: Handler,
                 tls: Callable[[], tuple[ssl.SSLContext, float] | None] = lambda: None) -> None:
        """``tls()``: the context and handshake timeout a new connection gets, or None for plain HTTP."""
        self._handler = handler
        self._tls = tls
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resting: asyncio.TimerHandle | None = None
        # TLS handshakes by outcome (cluster.security.tls.accept), for /varz and /metrics
        self.tls_counts = {"ok": 0, "plaintext": 0, "timeout": 0, "failed": 0}
        self._serving: set[asyncio.Task] = set()   # requests being answered (close waits for them)

    async def start(self, host: str, port: int, sock=None) -> tuple[str, int]:
        """Listen on host:port, or on ``sock`` (a listener passed by systemd) if given."""
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=128)
        sock.setblocking(False)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept)
        return sock.getsockname()[:2]

    def _accept(self) -> None:
        for _ in range(32):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # the connection stays in the backlog, and the listener readable: rest, or spin
                    log.error("monitoring: accept failed: %s", exc.strerror)
                    self._loop.remove_reader(self._sock.fileno())
                    self._resting = self._loop.call_later(_ACCEPT_PAUSE, self._wake)
                return
            asyncio.ensure_future(self._connection(conn))

    def _wake(self) -> None:
        self._resting = None
        if self._sock is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    async def _connection(self, conn: socket.socket) -> None:
        def factory() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=_MAX_HEAD), self._serve)

        secure = self._tls()
        try:
            if secure is None:
                await self._loop.connect_accepted_socket(factory, conn)
                return
            outcome, why = await tlsaccept.accept(conn, secure[0], secure[1], factory, _PLAIN_TO_TLS)
        except OSError:
            conn.close()
            return
        if outcome in self.tls_counts:
            self.tls_counts[outcome] += 1
        if outcome not in ("ok", "closed"):
            log.info("monitoring: TLS handshake %s: %s; closed", outcome, why)

    async def close(self) -> None:
        """Stop listening, and let the requests under way finish (their answers wait on the workers for 2 s at
        most): cancelled at the loop's end, each would leave a traceback in the log instead of an answer."""
        if self._sock is not None:
            if self._resting is not None:
                self._resting.cancel()
            else:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._serving:
            await asyncio.wait(list(self._serving), timeout=_CLOSE_WAIT)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._serving.add(task)
        try:
            await self._answer(reader, writer)
        except asyncio.CancelledError:
            # The server's end (the loop cancels what is left): asyncio's stream callback would log a traceback for
            # a task that ended cancelled, so this one ends quietly, its connection closed.
            writer.close()
        finally:
            self._serving.discard(task)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            except asyncio.LimitOverrunError:   # as an HTTP server says it, not a silent close
                _status_only(writer, 431, f"request head over {_MAX_HEAD // 1024} KiB")
                return
            except TimeoutError:
                _status_only(writer, 408, f"no complete request head within {_READ_TIMEOUT:g}s")
                return
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in header_lines:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            parts = request_line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                status, body = 400, {"error": "bad request line"}
            elif parts[0] not in ("GET", "HEAD"):
                status, body = 405, {"error": "only GET is supported"}
            else:
                url = urlsplit(parts[1])
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                try:
                    status, body = await self._handler(url.path, query, headers)
                except ValueError as exc:  # a query parameter of the wrong form
                    status, body = 400, {"error": str(exc)}
            extra = ""
            if isinstance(body, Body):
                payload, content_type = body.data, body.content_type
                if len(payload) >= _GZIP_FROM and _accepts_gzip(headers.get("accept-encoding", "")):
                    payload = gzip.compress(payload, compresslevel=1)
                    extra = "Content-Encoding: gzip\r\n"
            else:
                payload, content_type = orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n", "application/json"
            phrase = HTTPStatus(status).phrase
            writer.write(
                f"HTTP/1.1 {status} {phrase}\r\nContent-Type: {content_type}\r\n{extra}"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode())
            if parts and parts[0] != "HEAD":
                writer.write(payload)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            log.exception("monitoring request failed")
        finally:
            writer.close()


def _status_only(writer: asyncio.StreamWriter, status: int, error: str) -> None:
    payload = orjson.dumps({"error": error}) + b"\n"
    writer.write(f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)


def _accepts_gzip(accept_encoding: str) -> bool:
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        if coding.strip().lower() == "gzip":
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False
