"""Queue groups across the cluster: for each message, exactly one member of each matching group receives it.

Every worker knows every queue subscription of the cluster (members are announced over the fabric like interest),
so whichever worker owns a message's subject (``router.shardmap``) can pick the members: the publishing worker
hands the message to the owner, the owner picks one member per group name, round-robin, and forwards the message
to each picked member's worker.  As in nats-server, members of one group name form one group across patterns
(``SUB jobs.* w`` and ``SUB jobs.> w`` share the group ``w``), and plain subscribers are served before queue ones.

A member is ``(group, worker, cid, sid, user)``: enough for the owner to address it and for its worker to find it,
and the name of the user it receives as (None with security off), so that the owner picks only among members that
may receive the subject now: one member's permission narrowed must not make the group drop its share.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardbroker.router.subjects import covers
from shardbroker.router.sublist import Sublist

if TYPE_CHECKING:
    from shardbroker.workers.subscription import Subscription

Member = tuple  # (group: str, worker: int, cid: int, sid: bytes, user: str | None)
MayReceive = Callable[[str, str], bool]   # (user name, subject): whether that user may receive it now


class Group:
    """The members of one group name matching one subject, and whose turn it is."""

    __slots__ = ("name", "members", "next", "next_here")

    def __init__(self, name: str, members: tuple) -> None:
        self.name = name
        self.members = members
        self.next = random.randrange(len(members))  # spread even when routes are rebuilt often
        self.next_here = self.next                  # the turn among one worker's own members (pick_named)


def _order(member: Member) -> tuple:
    return member[:4]   # a user of None sorts with names


class GroupTable:
    def __init__(self, index: int) -> None:
        self.index = index
        self.trie = Sublist()
        self.local: dict[tuple[int, bytes], Subscription] = {}
        self._members: dict[tuple[int, bytes], Member] = {}   # as announced
        self._local_by_group: dict[str, list[Subscription]] = {}
        self._by_peer: dict[int, set[tuple[str, Member]]] = {}

    # -- membership -----------------------------------------------------------------------------------------
    def add_local(self, sub: Subscription) -> Member:
        user = sub.conn.user
        member = (sub.queue, self.index, sub.conn.cid, sub.sid, user.name if user is not None else None)
        self.trie.insert(sub.subject, member)
        self.local[(sub.conn.cid, sub.sid)] = sub
        self._members[(sub.conn.cid, sub.sid)] = member
        self._local_by_group.setdefault(sub.queue, []).append(sub)
        return member

    def remove_local(self, sub: Subscription) -> Member | None:
        key = (sub.conn.cid, sub.sid)
        member = self._members.get(key)
        if self.local.get(key) is not sub or not self.trie.remove(sub.subject, member):
            return None
        del self.local[key], self._members[key]
        peers = self._local_by_group.get(sub.queue, [])
        if sub in peers:
            peers.remove(sub)
        if not peers:
            self._local_by_group.pop(sub.queue, None)
        return member

    def user_of(self, sub: Subscription) -> str | None:
        """The user a local member was announced as."""
        member = self._members.get((sub.conn.cid, sub.sid))
        return member[4] if member is not None else None

    def snapshot(self) -> list[tuple[str, Member]]:
        """This worker's members, for a peer that says hello."""
        return [(sub.subject, self._members[key]) for key, sub in self.local.items()]

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

    def names(self, subject: str) -> set[str]:
        """The names of the groups with a member matching ``subject``, anywhere in the broker."""
        return {member[0] for member in self.trie.match(subject)}

    def groups(self, subject: str, may_receive: MayReceive | None = None) -> list[Group]:
        """The groups matching ``subject``, each of the members that may receive it (``may_receive``; None:
        security off); a group none of whose members may is no group for this subject."""
        by_name: dict[str, set] = {}
        for member in self.trie.match(subject):
            user = member[4]
            if may_receive is not None and (user is None or not may_receive(user, subject)):
                continue
            by_name.setdefault(member[0], set()).add(member)
        return [Group(name, tuple(sorted(members, key=_order))) for name, members in sorted(by_name.items())]

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

    @staticmethod
    def pick_named(groups: list[Group], names: tuple[bytes, ...], prefer: int) -> dict[int, list]:
        """One member of each group ``names`` lists (a message from a NATS hub, which picked this broker for
        them), of worker ``prefer`` (this one) when it has one -> {worker: [(group, cid, sid), ...]}."""
        wanted = {name.decode("utf-8", "replace") for name in names}
        targets: dict[int, list] = {}
        for group in groups:
            if group.name not in wanted:
                continue
            pool = [m for m in group.members if m[1] == prefer] or group.members
            member = pool[group.next_here % len(pool)]
            group.next_here = (group.next_here + 1) % len(pool)
            targets.setdefault(member[1], []).append((member[0], member[2], member[3]))
        return targets

    def member(self, group: str, cid: int, sid: bytes, subject: str) -> Subscription | None:
        """The local subscription a picked member names; if it left meanwhile, another local member of the same
        group that matches, so the message still reaches exactly one member when this worker has one."""
        sub = self.local.get((cid, sid))
        if sub is not None and sub.queue == group:
            return sub
        for other in self._local_by_group.get(group, ()):
            if covers(other.subject, subject):
                return other
        return None
