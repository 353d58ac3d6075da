"""Jolt's NDJSON protocol (docs/protocol.md): pub/sub, work queues (``q*`` ops), the admin operations, and the
move of a connection to its queue's owner (``moves``)."""
