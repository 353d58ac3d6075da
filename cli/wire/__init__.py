"""The client side of the wire protocols, sans I/O: what a client sends, as bytes, and what a server sends, read from
a buffer.  No sockets, no event loop: the callers (``cli.client``, the bench's load generator, the load test's
connections, the tests' harness) own the reading and writing, and keep what a parser leaves of a buffer.

- ``ndjson``: Jolt's NDJSON (this broker's own protocol): requests, line framing, replies and deliveries;
- ``nats``: NATS core: CONNECT, PUB, SUB, PING/PONG out; MSG, HMSG and the server's control lines in;
- ``resp``: Redis' RESP2 (the bench and the load test compare this broker with Redis): commands out, replies in.

This is the client's layer: it ships with ``cli`` and imports nothing of the broker (``workers``, ``router``,
``cluster``), whose server-side codecs read what these write (tests/tools/test_client_wire.py checks both ends agree).
Hot paths are written for the load generators: byte prefixes and slices, no decoding of what need not be decoded.
"""
