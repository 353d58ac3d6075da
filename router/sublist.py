"""A subscription trie: patterns in, matching values out.

One level per token, with a dict of literal children plus a ``*`` slot and a ``>`` slot, as nats-server's sublist.
Values are opaque and hashable (a subscription object, a worker index); a value may be stored under several patterns
and a pattern may hold several values.  Empty branches are pruned on removal, so memory follows live patterns only.

Caching of match results is the caller's business (see ``router.routes``): the trie exposes a ``generation`` that
changes on every insert and remove, which is what a cache needs to know.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from shardbroker.router.subjects import FWC, PWC


class _Node:
    __slots__ = ("children", "pwc", "fwc", "values")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.pwc: _Node | None = None
        # '>' may only be the last token, so its slot holds values directly.
        self.fwc: dict[Hashable, None] = {}
        self.values: dict[Hashable, None] = {}

    def empty(self) -> bool:
        return not (self.children or self.pwc or self.fwc or self.values)


class Sublist:
    def __init__(self) -> None:
        self._root = _Node()
        self._count = 0
        self.generation = 0

    def __len__(self) -> int:
        return self._count

    def insert(self, pattern: str, value: Hashable) -> bool:
        """Store ``value`` under ``pattern``; False if it was already there."""
        toks = pattern.split(".")
        node = self._root
        last = len(toks) - 1
        for i, tok in enumerate(toks):
            if tok == FWC and i == last:
                slot = node.fwc
                break
            if tok == PWC:
                if node.pwc is None:
                    node.pwc = _Node()
                node = node.pwc
            else:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                node = child
        else:
            slot = node.values
        if value in slot:
            return False
        slot[value] = None
        self._count += 1
        self.generation += 1
        return True

    def remove(self, pattern: str, value: Hashable) -> bool:
        """Remove ``value`` from ``pattern``; False if it was not there."""
        toks = pattern.split(".")
        path: list[tuple[_Node, str]] = []
        node = self._root
        last = len(toks) - 1
        for i, tok in enumerate(toks):
            if tok == FWC and i == last:
                slot = node.fwc
                break
            nxt = node.pwc if tok == PWC else node.children.get(tok)
            if nxt is None:
                return False
            path.append((node, tok))
            node = nxt
        else:
            slot = node.values
        if value not in slot:
            return False
        del slot[value]
        self._count -= 1
        self.generation += 1
        # Prune the branch bottom-up while it is empty.
        while path and node.empty():
            parent, tok = path.pop()
            if tok == PWC:
                parent.pwc = None
            else:
                del parent.children[tok]
            node = parent
        return True

    def match(self, subject: str) -> list[Hashable]:
        """Values of every pattern matching the literal ``subject``, one entry per (pattern, value)."""
        out: list[Hashable] = []
        if not self._count:   # no split for an empty trie (a one-worker broker's remote one, most queue-group ones)
            return out
        _match(self._root, subject.split("."), out)
        return out

    def patterns(self) -> Iterator[tuple[str, Hashable]]:
        """Every (pattern, value) stored; for snapshots and introspection, not the hot path."""
        stack: list[tuple[_Node, tuple[str, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for value in node.values:
                yield ".".join(prefix), value
            for value in node.fwc:
                yield ".".join(prefix + (FWC,)), value
            for tok, child in node.children.items():
                stack.append((child, prefix + (tok,)))
            if node.pwc is not None:
                stack.append((node.pwc, prefix + (PWC,)))


def _match(root: _Node, toks: list[str], out: list[Hashable]) -> None:
    """Depth first, ``*`` branches before literal ones, with a stack of its own rather than recursion: a pattern of
    a thousand ``*`` tokens is valid (``limits.max_topic_length`` allows it) and must not reach Python's recursion
    limit."""
    n = len(toks)
    stack = [(root, 0)]
    while stack:
        node, i = stack.pop()
        while True:
            if node.fwc and i < n:
                out.extend(node.fwc)
            if i == n:
                out.extend(node.values)
                break
            child = node.children.get(toks[i])
            i += 1
            if node.pwc is not None:
                if child is not None:
                    stack.append((child, i))   # after everything below the '*' branch
                node = node.pwc
            elif child is not None:
                node = child
            else:
                break
