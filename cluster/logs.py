"""Logging for every process of the broker: one line per record on stderr, tagged with the process's role.

stderr is what systemd's journal and a terminal both collect; the tag says which process spoke (``supervisor``,
``worker 3``).  Three shapes, for three readers:

- ``text``, for a terminal or a file: ``2026-11-21 10:40:29.436 [worker 3] WARNING broker.hub: ...``.
- the same lines for the journal, when stderr *is* the journal (``$JOURNAL_STREAM`` names the device and inode of
  stderr, as systemd sets it for a unit's output): ``<4>[worker 3] broker.hub: ...``.  journald takes the priority
  from the ``<N>`` prefix (so ``journalctl -p warning`` works) and stamps every line itself, so the line carries
  neither a level word nor a second timestamp.
- ``json`` (``logging.format``), one object per line for log shippers: ``ts``, ``level``, ``role``, ``worker``,
  ``pid``, ``logger``, ``msg`` and the record's context (``cid``, ``peer``, ``reason``...).  Under the journal it
  gets the ``<N>`` prefix too: journald strips it and the object stays whole.

Floods of one message are aggregated (cluster.floods) so that journald's rate limit never drops the line that
mattered.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

import orjson

from shardbroker.cluster.floods import FloodFilter

if TYPE_CHECKING:
    from shardbroker.cluster.config import LoggingConfig

# syslog priorities, which journald reads from a "<N>" prefix (sd-daemon(3))
_PRIORITY = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
# what every LogRecord has: anything else on a record is context passed with extra= (cid, peer, ...)
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def priority(levelno: int) -> int:
    for level, prio in _PRIORITY:
        if levelno >= level:
            return prio
    return 7


def stderr_is_journal() -> bool:
    """Whether stderr is connected to journald: ``$JOURNAL_STREAM`` is ``<device>:<inode>`` of the stream systemd
    connected, and only a match proves it is still ours (a shell started from the unit inherits the variable)."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (int(dev), int(ino)) == (st.st_dev, st.st_ino)
    except (ValueError, OSError, AttributeError):
        return False


class JournalFormatter(logging.Formatter):
    """``<N>[role] logger: message``, each line of a multi-line record (a traceback) prefixed: journald splits the
    stream at newlines and reads each line's priority on its own."""

    def __init__(self, role: str) -> None:
        super().__init__(f"[{role}] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str, journal: bool = False) -> None:
        super().__init__()
        kind, _, index = role.partition(" ")
        self._base = {"role": kind, "worker": int(index)} if index.isdigit() else {"role": kind}
        self._journal = journal

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        obj = {"ts": ts, "level": record.levelname.lower(), **self._base, "pid": record.process,
               "logger": record.name, "msg": record.getMessage()}
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in obj:
                obj[key] = value
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        line = orjson.dumps(obj, default=str).decode()
        return f"<{priority(record.levelno)}>{line}" if self._journal else line


def text_formatter(role: str) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s.%(msecs)03d [{role}] %(levelname)s %(name)s: %(message)s",
                             "%Y-%m-%d %H:%M:%S")


def setup_logging(config: LoggingConfig | str, role: str) -> None:
    """Log to stderr at ``config.level`` in ``config.format`` (a bare level string: text, no aggregation)."""
    level = config if isinstance(config, str) else config.level
    fmt = "text" if isinstance(config, str) else config.format
    journal = stderr_is_journal()
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role, journal))
    elif journal:
        handler.setFormatter(JournalFormatter(role))
    else:
        handler.setFormatter(text_formatter(role))
    if not isinstance(config, str):
        handler.addFilter(FloodFilter(handler.handle, config.flood_interval, config.flood_burst))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    atexit.register(flush_floods)


def flush_floods() -> None:
    """Write the counts of floods still being counted: at exit (a worker calls it before ``os._exit``)."""
    for handler in logging.getLogger().handlers:
        for f in handler.filters:
            if isinstance(f, FloodFilter):
                f.flush(everything=True)
