"""The INFO a NATS client is greeted with: the server's fields and the client's own, as bytes.

Two places greet: the supervisor's acceptor, for a plain-TCP client the moment it is accepted (as nats-server's
accept loop does, before the socket has a worker: the client's CONNECT is on its way while the socket is handed
over, instead of waiting for the worker to adopt it, which is what bounds how fast thousands of clients connect
one after another), and a worker, for a TLS client (INFO in plaintext before the handshake) and the lame duck
INFO.  Both build it here, so a client cannot tell which one greeted it.  orjson alone: the supervisor imports this.
"""

from __future__ import annotations

import orjson


def info_fields(server_info: dict, cid: int, client_ip: str, auth_required: bool, tls_required: bool = False,
                tls_verify: bool = False) -> dict:
    info = dict(server_info, client_id=cid, client_ip=client_ip)
    if auth_required:
        info["auth_required"] = True
    if tls_required:
        info["tls_required"] = True
        if tls_verify:
            info["tls_verify"] = True
    return info


def info_line(fields: dict) -> bytes:
    """nats-server joins the parts with spaces, hence the space before CRLF."""
    return b"INFO " + orjson.dumps(fields) + b" \r\n"
