"""A work queue's rules: what it may hold and how it behaves (``Settings``), what a request it will not do is told
(``QueueError``), and where its dead letters go (``<queue>.dlq``: ``is_dlq``).

Apart from the queue itself (``model``) because the shard, the queue service and the start-up (the configuration's
``queues`` section made into ``Settings``) read them as well, and none of them needs a queue for that.
"""

from __future__ import annotations

from dataclasses import dataclass

DLQ_SUFFIX = ".dlq"


class QueueError(Exception):
    """A request this queue refuses: ``code`` is the wire's error string; ``retry`` says a retry may succeed."""

    def __init__(self, code: str, retry: bool = False, **extra: object) -> None:
        super().__init__(code)
        self.code = code
        self.retry = retry
        self.extra = extra

    def result(self) -> dict:
        """The request's reply: ``{"ok": false, "error": code, ...}``."""
        result = {"ok": False, "error": self.code, **self.extra}
        if self.retry:
            result["retry"] = True
        return result


@dataclass(frozen=True)
class Settings:
    """What one queue may hold and how it behaves; the configuration's ``queues`` section, per queue overridable."""
    visibility_ms: int = 30_000
    max_visibility_ms: int = 12 * 3600 * 1000
    max_lease_ms: int = 12 * 3600 * 1000           # a lease's deadline, extensions included, from its grant
    max_delay_ms: int = 12 * 3600 * 1000
    max_deliveries: int = 20                        # 0: no limit (never dead-lettered for deliveries)
    max_message_bytes: int = 1 << 20
    max_messages: int = 1_000_000
    max_bytes: int = 256 << 20
    dedup_window_s: float = 300.0                   # a push token (dedup_id) is remembered at least this long


def is_dlq(name: str) -> bool:
    return name.endswith(DLQ_SUFFIX)
