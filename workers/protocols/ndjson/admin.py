"""The admin protocol's operations, independent of the wire: validate a request, hash a new password here (never
on the event loop, and plaintext never leaves this worker), and have the supervisor apply the change.  The
supervisor answers once every worker has it in force.

Each operation takes the request's fields and returns the reply's extra fields, or raises ``AdminError`` with the
reason to send back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardbroker.cluster.config import valid_name
from shardbroker.cluster.config.permissions import PermissionFormatError, validate

if TYPE_CHECKING:
    from shardbroker.workers.hub import Hub


class AdminError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _name(req: dict) -> str:
    name = req.get("user")
    if name is None or name == "":
        raise AdminError("missing_user")
    if not valid_name(name):
        raise AdminError("invalid_user")
    return name


def _password(req: dict) -> str:
    password = req.get("pass")
    if not isinstance(password, str) or not password:
        raise AdminError("missing_password")
    return password


def _permissions(req: dict) -> list[str]:
    perms = req.get("permissions", [])
    if not isinstance(perms, list) or not all(isinstance(p, str) for p in perms):
        raise AdminError("invalid_permission")
    try:
        validate(perms)
    except PermissionFormatError:
        raise AdminError("invalid_permission") from None
    return perms


async def _apply(hub: Hub, change: dict) -> dict:
    reply = await hub.supervisor_request({"k": "admin", "change": change})
    if reply.get("error"):
        raise AdminError(reply["error"])
    return {}


async def create_user(hub: Hub, req: dict) -> dict:
    name, password, perms = _name(req), _password(req), _permissions(req)
    if hub.auth.registry.get(name) is not None:
        raise AdminError("user_exists")  # answered here to spare the hashing; the supervisor checks again
    return await _apply(hub, {"op": "create", "user": name, "hash": await hub.auth.hash(password),
                              "permissions": perms})


async def delete_user(hub: Hub, req: dict) -> dict:
    return await _apply(hub, {"op": "delete", "user": _name(req)})


async def set_password(hub: Hub, req: dict) -> dict:
    name, password = _name(req), _password(req)
    if hub.auth.registry.get(name) is None:
        raise AdminError("unknown_user")
    return await _apply(hub, {"op": "password", "user": name, "hash": await hub.auth.hash(password)})


async def set_permissions(hub: Hub, req: dict) -> dict:
    return await _apply(hub, {"op": "permissions", "user": _name(req), "permissions": _permissions(req)})


async def list_users(hub: Hub, req: dict) -> dict:
    return {"users": hub.auth.registry.listing()}


OPERATIONS: dict[str, Any] = {
    "admin.create_user": create_user,
    "admin.delete_user": delete_user,
    "admin.set_password": set_password,
    "admin.set_permissions": set_permissions,
    "admin.list_users": list_users,
}
