"""The monitoring endpoint ``brokerctl top`` reads: its address from ``--monitor``/``--host``, and the HTTP client
that GETs its JSON, with the two ways a request fails (the endpoint did not answer, or refused a query).

Apart from the data model (cli/top/model.py) because this is all of top's talk with the broker; the model makes
the rows out of what it answers.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlencode, urlsplit

import orjson

DEFAULT_URL = "http://127.0.0.1:8222"


class Unreachable(Exception):
    """The monitoring endpoint did not answer; ``str()`` is one line for the operator."""


class BadRequest(Exception):
    """The endpoint answered 4xx (a query parameter this broker does not know)."""


def monitor_url(monitor: str | None, host: str | None) -> str:
    """``--monitor`` (a URL, HOST:PORT or a port) and ``--host`` (the host alone) as a base URL."""
    url = monitor or DEFAULT_URL
    if url.isdigit():
        url = f"127.0.0.1:{url}"
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http URL: {monitor}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 8222)
    except ValueError:
        raise ValueError(f"bad port in {monitor}") from None
    hostname = host or parts.hostname
    if ":" in hostname:
        hostname = f"[{hostname}]"
    return f"{parts.scheme}://{hostname}:{port}{parts.path.rstrip('/')}"


def is_local(url: str) -> bool:
    """Whether the monitoring address is on this machine (then the worker PIDs it reports are ours to read)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Client:
    """GET JSON from the monitoring port.  No proxy: the monitoring port is an internal address, and an
    ``http_proxy`` set for the outside world would otherwise swallow ``127.0.0.1``."""

    def __init__(self, base: str, timeout: float = 5.0) -> None:
        self.base = base
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.requests = 0

    def get(self, path: str, **query: Any) -> dict:
        q = {k: v for k, v in query.items() if v is not None}
        url = self.base + path + ("?" + urlencode(q) if q else "")
        self.requests += 1
        try:
            with self._opener.open(url, timeout=self.timeout) as resp:
                return orjson.loads(resp.read())
        except urllib.error.HTTPError as err:
            try:
                reason = orjson.loads(err.read()).get("error", "")
            except (orjson.JSONDecodeError, AttributeError):
                reason = ""
            if 400 <= err.code < 500 and err.code != 404:
                raise BadRequest(f"{err.code} {reason}".strip()) from None
            raise Unreachable(f"{self.base}{path} answered HTTP {err.code} {reason}".strip()
                              + ": is it a shardbroker monitoring port?") from None
        except http.client.HTTPException:  # something that does not speak HTTP (a client port, say)
            raise Unreachable(f"{self.base} does not answer HTTP: is it a shardbroker monitoring port?") from None
        except (TimeoutError, urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, (TimeoutError, socket.timeout)) or isinstance(err, TimeoutError):
                reason = f"no answer within {self.timeout:g}s"
            elif isinstance(reason, OSError):
                reason = reason.strerror or reason
            raise Unreachable(f"cannot reach the monitoring endpoint {self.base}: {reason}") from None
        except orjson.JSONDecodeError:
            raise Unreachable(f"{self.base}{path} did not answer JSON: is it a shardbroker monitoring port?") \
                from None
