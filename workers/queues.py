"""Queue groups across the cluster: for each message, exactly one member of each matching group receives it.

Every worker knows every queue subscription of the cluster (members are announced over the fabric like interest),
so whichever worker owns a message's subject (``router.shardmap``) can pick the members: the publishing worker
hands the message to the owner, the owner picks one member per group name, round-robin, and forwards the message
to each picked member's worker.  As in nats-server, members of one group name form one group across patterns
(``SUB jobs.* w`` and ``SUB jobs.> w`` share the group ``w``), and plain subscribers are served before queue ones.

A member is ``(group, worker, cid, sid)``: enough for the owner to address it and for its worker to find it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from router.subjects import covers
from router.sublist import Sublist

if TYPE_CHECKING:
    from .hub import Subscription

Member = tuple  # (group: str, worker: int, cid: int, sid: bytes)


class Group:
    """The members of one group name matching one subject, and whose turn it is."""

    __slots__ = ("name", "members", "next")

    def __init__(self, name: str, members: tuple) -> None:
        self.name = name
        self.members = members
        self.next = random.randrange(len(members))  # spread even when routes are rebuilt often


class QueueTable:
    def __init__(self, index: int) -> None:
        self.index = index
        self.trie = Sublist()
        self.local: dict[tuple[int, bytes], "Subscription"] = {}
        self._local_by_group: dict[str, list["Subscription"]] = {}
        self._by_peer: dict[int, set[tuple[str, Member]]] = {}

    # -- membership -----------------------------------------------------------------------------------------
    def add_local(self, sub: "Subscription") -> Member:
        member = (sub.queue, self.index, sub.conn.cid, sub.sid)
        self.trie.insert(sub.subject, member)
        self.local[(sub.conn.cid, sub.sid)] = sub
        self._local_by_group.setdefault(sub.queue, []).append(sub)
        return member

    def remove_local(self, sub: "Subscription") -> Member | None:
        member = (sub.queue, self.index, sub.conn.cid, sub.sid)
        if not self.trie.remove(sub.subject, member):
            return None
        self.local.pop((sub.conn.cid, sub.sid), None)
        peers = self._local_by_group.get(sub.queue, [])
        if sub in peers:
            peers.remove(sub)
        if not peers:
            self._local_by_group.pop(sub.queue, None)
        return member

    def snapshot(self) -> list[tuple[str, Member]]:
        """This worker's members, for a peer that says hello."""
        return [(sub.subject, (sub.queue, self.index, cid, sid)) for (cid, sid), sub in self.local.items()]

    def add_remote(self, peer: int, pattern: str, member: Member) -> bool:
        member = tuple(member)
        if self.trie.insert(pattern, member):
            self._by_peer.setdefault(peer, set()).add((pattern, member))
            return True
        return False

    def remove_remote(self, peer: int, pattern: str, member: Member) -> bool:
        member = tuple(member)
        if self.trie.remove(pattern, member):
            self._by_peer.get(peer, set()).discard((pattern, member))
            return True
        return False

    def drop_peer(self, peer: int) -> None:
        for pattern, member in self._by_peer.pop(peer, set()):
            self.trie.remove(pattern, member)

    # -- dispatch -------------------------------------------------------------------------------------------
    def matches(self, subject: str) -> bool:
        return bool(self.trie.match(subject))

    def groups(self, subject: str) -> list[Group]:
        by_name: dict[str, set] = {}
        for member in self.trie.match(subject):
            by_name.setdefault(member[0], set()).add(member)
        return [Group(name, tuple(sorted(members))) for name, members in sorted(by_name.items())]

    @staticmethod
    def pick(groups: list[Group], origin_worker: int, origin_cid: int, no_echo: bool) -> dict[int, list]:
        """One member per group -> {worker: [(group, cid, sid), ...]}.  With no_echo, the publishing connection
        is skipped and the next member tried (as nats-server does)."""
        targets: dict[int, list] = {}
        for group in groups:
            members = group.members
            n = len(members)
            for i in range(n):
                member = members[(group.next + i) % n]
                if no_echo and member[1] == origin_worker and member[2] == origin_cid:
                    continue
                group.next = (group.next + i + 1) % n
                targets.setdefault(member[1], []).append((member[0], member[2], member[3]))
                break
        return targets

    def member(self, group: str, cid: int, sid: bytes, subject: str) -> "Subscription | None":
        """The local subscription a picked member names; if it left meanwhile, another local member of the same
        group that matches, so the message still reaches exactly one member when this worker has one."""
        sub = self.local.get((cid, sid))
        if sub is not None and sub.queue == group:
            return sub
        for other in self._local_by_group.get(group, ()):
            if covers(other.subject, subject):
                return other
        return None
