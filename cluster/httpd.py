"""A minimal HTTP/1.1 GET server for the monitoring endpoints (JSON out, one request per connection).

Monitoring is a handful of GETs a second at most, so asyncio streams are fine here; the bounds below keep a
misbehaving client from holding memory or a connection.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

import orjson

log = logging.getLogger("broker.http")

Handler = Callable[[str, dict[str, str]], Awaitable[tuple[int, object]]]

_MAX_HEAD = 16 * 1024
_READ_TIMEOUT = 10.0


class HttpServer:
    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port, limit=_MAX_HEAD)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                status, body = 400, {"error": "bad request line"}
            elif parts[0] not in ("GET", "HEAD"):
                status, body = 405, {"error": "only GET is supported"}
            else:
                url = urlsplit(parts[1])
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                try:
                    status, body = await self._handler(url.path, query)
                except ValueError as exc:  # a query parameter of the wrong form
                    status, body = 400, {"error": str(exc)}
            payload = orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n"
            phrase = HTTPStatus(status).phrase
            writer.write(
                f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n"
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
