"""The user registry: names, password hashes, permissions.

The supervisor holds the authoritative registry; every worker holds a replica.  A change is a small dict, checked
and applied by the supervisor, then applied by every worker, in the same order (control channels are FIFO):

    {"op": "create", "user": u, "hash": h, "permissions": [...]}
    {"op": "delete", "user": u}
    {"op": "password", "user": u, "hash": h}
    {"op": "permissions", "user": u, "permissions": [...]}
    {"op": "replace", "users": [snapshot entries]}           # a config reload

Plaintext passwords never enter the registry: configuration passwords are hashed at load (in parallel threads;
hashlib releases the GIL) and admin-protocol passwords are hashed by the worker that received them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# The configuration owns what a file may say about users (and checks it at load); this module builds on it.
from shardbroker.cluster.config import SecurityConfig, certnames, configured_users, passwords
from shardbroker.cluster.config.permissions import Permissions


@dataclass
class User:
    name: str
    password_hash: str
    permissions: Permissions
    builtin: bool = False   # the configuration's admin_user: cannot be deleted nor lose admin at run time
    token: bool = False     # NATS clients may present its password as CONNECT auth_token
    # The configuration's, in plaintext: qlite's handshake needs it (docs/qlite.md).  Never in a repr or a log.
    qlite_secret: str | None = field(default=None, repr=False)
    # The names a client certificate may prove to log in as this user (tls.verify_and_map; cluster.config.certnames).
    # A user with these and no password has an empty ``password_hash``: no password logs it in.
    cert_names: tuple[str, ...] = ()

    def entry(self) -> dict:
        entry = {"user": self.name, "hash": self.password_hash, "permissions": self.permissions.strings,
                 "builtin": self.builtin, "token": self.token}
        if self.qlite_secret is not None:
            entry["qlite_secret"] = self.qlite_secret
        if self.cert_names:
            entry["cert_names"] = list(self.cert_names)
        return entry


class Registry:
    def __init__(self, users: list[User] | None = None) -> None:
        self.users: dict[str, User] = {u.name: u for u in users or []}
        self._by_cert: dict[tuple[str, str], str] | None = None   # built when first needed, dropped on a change
        self._cost: int | None = None   # hash_cost, likewise

    def get(self, name: str) -> User | None:
        return self.users.get(name)

    def hash_cost(self) -> int:
        """The most PBKDF2 iterations any stored password hash takes (0: none has one).  Every password check
        is made to cost this much, known user or not (``passwords.verify``'s ``cost``): a hash made at another
        cost (a ``password_hash`` from ``brokerctl hash-password``, a reload that changed ``iterations``) would
        otherwise tell by its time which names exist."""
        if self._cost is None:
            self._cost = max((passwords.cost_of(u.password_hash) for u in self.users.values() if u.password_hash),
                             default=0)
        return self._cost

    def by_certificate(self, peercert: dict | None) -> tuple[User, str] | None:
        """The user the first name a verified client certificate proves belongs to (in nats-server's order:
        cluster.config.certnames), and that name; None if no user holds any of them."""
        if self._by_cert is None:
            index: dict[tuple[str, str], str] = {}
            for user in self.users.values():
                for name in user.cert_names:
                    index[("name", name)] = user.name
                    dn = certnames.canonical_dn(name)
                    if dn is not None:
                        index[("dn", dn)] = user.name
            self._by_cert = index
        for kind, name in certnames.identities(peercert):
            owner = self._by_cert.get(("dn" if kind == "dn" else "name", name))
            if owner is not None and owner in self.users:
                return self.users[owner], name
        return None

    def snapshot(self) -> list[dict]:
        return [u.entry() for u in self.users.values()]

    @classmethod
    def from_snapshot(cls, entries: list[dict]) -> Registry:
        return cls([_user(e) for e in entries])

    def listing(self) -> list[dict]:
        """Names and permissions, never hashes: what admin.list_users shows."""
        return [{"user": u.name, "permissions": u.permissions.strings}
                for u in sorted(self.users.values(), key=lambda u: u.name)]

    def check(self, change: dict) -> str | None:
        """The error reason that refuses ``change``, or None."""
        op, name = change.get("op"), change.get("user")
        user = self.users.get(name) if isinstance(name, str) else None
        if op == "create":
            return "user_exists" if user is not None else None
        if op == "replace":
            return None
        if user is None:
            return "unknown_user"
        if user.builtin and (op in ("delete", "password")
                             or (op == "permissions" and "admin" not in change["permissions"])):
            return "protected_user"   # the configuration's: changed there (and a reload), or nobody may lock it
        return None

    def apply(self, change: dict) -> set[str]:
        """Apply a checked change; -> the names that no longer exist."""
        op = change["op"]
        self._by_cert = None
        self._cost = None
        if op == "replace":
            new = {e["user"]: _user(e) for e in change["users"]}
            gone = set(self.users) - set(new)
            self.users = new
            return gone
        name = change["user"]
        if op == "create":
            self.users[name] = User(name, change["hash"], Permissions(change["permissions"]))
        elif op == "delete":
            del self.users[name]
            return {name}
        elif op == "password":
            self.users[name].password_hash = change["hash"]
        elif op == "permissions":
            self.users[name].permissions = Permissions(change["permissions"])
        else:
            raise ValueError(f"unknown registry change {op!r}")
        return set()


def _user(entry: dict) -> User:
    return User(entry["user"], entry["hash"], Permissions(entry["permissions"]), entry.get("builtin", False),
                entry.get("token", False), entry.get("qlite_secret"), tuple(entry.get("cert_names", ())))


def from_config(security: SecurityConfig) -> Registry:
    """Build the registry, hashing plaintext passwords in parallel.  The config was validated at load."""
    entries = configured_users(security)
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="hash") as pool:
        hashes = list(pool.map(lambda e: _hash_of(e[1], security.iterations), entries))
    return Registry([User(u.username, h, Permissions(u.permissions), builtin, u.token, u.qlite_secret,
                          tuple(u.cert_names))
                     for (_, u, builtin), h in zip(entries, hashes)])


def _hash_of(user, iterations: int) -> str:
    """The user's password hash; empty for a user that logs in by certificate only (no password matches it)."""
    if user.password_hash:
        return user.password_hash
    if not user.password and user.cert_names:
        return ""
    return passwords.hash_password(user.password or "", iterations)
