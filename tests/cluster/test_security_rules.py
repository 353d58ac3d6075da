"""Rules docs/security.md and docs/nats.md promise: permissions that look like wildcards and are not are refused by
the admin protocol, and a NATS CONNECT with an nkey or a JWT is refused whatever else it carries."""

import pytest
from test_nats import NatsRaw
from test_security import ADMIN, auth, secure_config

from support.harness import Raw

LOOKALIKES = ["publish:ch*", "subscribe:chat.room*", "publish:a.*b", "subscribe:x.>y"]


def test_admin_protocol_refuses_a_wildcard_inside_a_token(start_broker):
    b = start_broker(workers=2, config=secure_config())
    with Raw(b.port) as c:
        assert auth(c, *ADMIN) == {"ok": True}
        for perm in LOOKALIKES:
            assert c.request({"op": "admin.create_user", "user": "eve", "pass": "pw", "permissions": [perm]}) == \
                {"ok": False, "error": "invalid_permission"}, perm
            assert c.request({"op": "admin.set_permissions", "user": "chatuser", "permissions": [perm]}) == \
                {"ok": False, "error": "invalid_permission"}, perm
        listed = c.request({"op": "admin.list_users"})["users"]
        assert "eve" not in [u["user"] for u in listed]
        assert [u["permissions"] for u in listed if u["user"] == "chatuser"] == [["publish:chat.*", "subscribe:chat.*"]]


VIOLATION = b"-ERR 'Authorization Violation'\r\n"
NKEY = "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4"


@pytest.mark.parametrize("secure", [False, True], ids=["security off", "security on"])
def test_nats_connect_with_nkey_or_jwt_is_an_authorization_violation(start_broker, secure):
    b = start_broker(workers=1, config=secure_config() if secure else None)
    credentials = b',"user":"chatuser","pass":"secret3"' if secure else b""
    for extra in (b'"nkey":"%s","sig":"c2ln"' % NKEY.encode(), b'"jwt":"eyJhbGciOi.x.y"'):
        with NatsRaw(b, connect=b'CONNECT {"verbose":false,' + extra + credentials + b'}\r\nPING\r\n') as c:
            assert c.line() == VIOLATION, extra
            assert c.closed()
    # what nats clients send without an nkey or a JWT (absent, or empty) is as before
    for extra in (b'"nkey":""', b'"jwt":""', b'"name":"x"'):
        with NatsRaw(b, connect=b'CONNECT {"verbose":false,' + extra + credentials + b'}\r\nPING\r\n') as c:
            assert c.line() == b"PONG\r\n", extra
