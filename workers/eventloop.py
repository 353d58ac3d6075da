"""Which event loop runs a process: uvloop where it is installed (``workers.event_loop``: ``"auto"``), or where
the configuration insists (``"uvloop"``), else asyncio's own.  The workers run on it, and so does the supervisor,
whose loop accepts every client and hands it over: uvloop's turn costs a fraction of asyncio's selector loop's,
and a storm of connections is a turn per client.  Nothing else is imported here: the supervisor imports it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(coro: Coroutine[Any, Any, int], event_loop: str) -> int:
    if event_loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)
