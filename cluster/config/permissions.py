"""Permission strings and what they allow.

A user's permissions are strings:

- ``admin``: everything, including the admin protocol;
- ``publish:<topic>`` / ``subscribe:<topic>``, where ``<topic>`` is
  - a subject, ``chat.room1``: exactly that subject;
  - ``<subject>.*``, ``chat.*`` (Jolt's wildcard suffix): ``chat`` itself and every subject beginning ``chat.``,
    at any depth;
  - ``<subject>.>``, ``chat.>`` (NATS' spelling): every subject beginning ``chat.``, but not ``chat``;
  - ``*`` (or ``>``): every subject.
  So ``subscribe:chat.*`` covers ``chat``, ``chat.room1`` and ``chat.room1.x``, but not ``chatty``.
  Anything else is refused (``PermissionFormatError``), ``ch*`` too: a ``*`` or ``>`` inside a token.

A subscription pattern with wildcards is allowed only if one permission covers every subject it can match:
``subscribe:chat.*`` allows ``chat.>`` and ``chat.*.x``, not ``*.room1``.
"""

from __future__ import annotations

from shardbroker.router.subjects import FWC, PWC, is_valid_literal

ADMIN = "admin"
_ACTIONS = ("publish", "subscribe")
_CACHE_MAX = 4096


class PermissionFormatError(ValueError):
    pass


class _Rules:
    """The topics one action is allowed on."""

    __slots__ = ("all", "exact", "subtree", "below", "_cache")

    def __init__(self) -> None:
        self.all = False
        self.exact: set[str] = set()
        self.subtree: list[list[str]] = []   # prefix itself and everything under it
        self.below: list[list[str]] = []     # everything strictly under the prefix
        self._cache: dict[str, bool] = {}

    def add(self, topic: str) -> None:
        # In a subject, ``ch*`` is the literal token "ch*"; in a permission it is almost certainly a wildcard
        # meant as ``ch.*`` (or a prefix match, which does not exist), so it is refused rather than granted as
        # the literal nobody publishes to.
        if any((PWC in tok or FWC in tok) and tok not in (PWC, FWC) for tok in topic.split(".")):
            raise PermissionFormatError(
                f"{topic!r} has a * or > inside a token: wildcards are whole tokens only (chat.*, chat.>), "
                f"and a permission cannot name a subject with one inside a token")
        if topic in (PWC, FWC):
            self.all = True
        elif topic.endswith(".*") and is_valid_literal(topic[:-2], 1 << 20):
            self.subtree.append(topic[:-2].split("."))
        elif topic.endswith(".>") and is_valid_literal(topic[:-2], 1 << 20):
            self.below.append(topic[:-2].split("."))
        elif is_valid_literal(topic, 1 << 20):
            self.exact.add(topic)
        else:
            raise PermissionFormatError(
                f"{topic!r} is not a subject, <subject>.*, <subject>.> or *")

    def covers_subject(self, subject: str) -> bool:
        hit = self._cache.get(subject)
        if hit is None:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            hit = self._cache[subject] = self._covers(subject.split("."), literal=True)
        return hit

    def covers_pattern(self, pattern: str) -> bool:
        toks = pattern.split(".")
        if PWC not in toks and FWC not in toks:
            return self.covers_subject(pattern)
        return self._covers(toks, literal=False)

    def _covers(self, toks: list[str], literal: bool) -> bool:
        if self.all:
            return True
        if literal and ".".join(toks) in self.exact:
            return True
        # A prefix rule covers a pattern when the pattern's first tokens are that literal prefix: whatever its
        # wildcards match afterwards stays under the prefix.
        for prefix in self.subtree:
            if toks[:len(prefix)] == prefix and (len(toks) > len(prefix) or literal):
                return True
        for prefix in self.below:
            if len(toks) > len(prefix) and toks[:len(prefix)] == prefix:
                return True
        return False


class Permissions:
    def __init__(self, strings: list[str]) -> None:
        self.strings = sorted(set(strings))
        self.admin = False
        self._rules = {action: _Rules() for action in _ACTIONS}
        for perm in self.strings:
            if perm == ADMIN:
                self.admin = True
                continue
            action, sep, topic = perm.partition(":")
            if not sep or action not in self._rules:
                raise PermissionFormatError(f"{perm!r}: expected publish:<topic>, subscribe:<topic> or admin")
            try:
                self._rules[action].add(topic)
            except PermissionFormatError as exc:
                raise PermissionFormatError(f"{perm!r}: {exc}") from None

    def may_publish(self, subject: str) -> bool:
        return self.admin or self._rules["publish"].covers_subject(subject)

    def may_receive(self, subject: str) -> bool:
        """Subscribe permission on one literal subject: checked for every delivery."""
        return self.admin or self._rules["subscribe"].covers_subject(subject)

    def may_subscribe(self, pattern: str) -> bool:
        """Subscribe permission on every subject ``pattern`` can match."""
        return self.admin or self._rules["subscribe"].covers_pattern(pattern)


def validate(strings: list[str]) -> None:
    Permissions(strings)
