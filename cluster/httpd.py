"""A minimal HTTP/1.1 GET server for the monitoring endpoints (JSON out, one request per connection).

Monitoring is a handful of GETs a second at most, so asyncio streams are fine here; the bounds below keep a
misbehaving client from holding memory or a connection.  A handler returns a JSON-able object, or a ``Body`` for
another format (/metrics); it sees the request's headers (Accept), and a ``Body`` is gzipped for a client that
asks for it (Prometheus does).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

import orjson

log = logging.getLogger("broker.http")

Handler = Callable[[str, dict[str, str], dict[str, str]], Awaitable[tuple[int, object]]]

_MAX_HEAD = 16 * 1024
_READ_TIMEOUT = 10.0
_GZIP_FROM = 1024   # smaller bodies are not worth compressing


@dataclass(frozen=True)
class Body:
    data: bytes
    content_type: str


class HttpServer:
    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, sock=None) -> tuple[str, int]:
        """Listen on host:port, or on ``sock`` (a listener passed by systemd) if given."""
        if sock is not None:
            self._server = await asyncio.start_server(self._serve, sock=sock, limit=_MAX_HEAD)
        else:
            self._server = await asyncio.start_server(self._serve, host, port, limit=_MAX_HEAD)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
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
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("monitoring request failed")
        finally:
            writer.close()


def _accepts_gzip(accept_encoding: str) -> bool:
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        if coding.strip().lower() == "gzip":
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False
