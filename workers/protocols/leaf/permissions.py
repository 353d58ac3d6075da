"""What a leaf connection may carry: the hub's permissions for it (``import``/``export`` in its connect INFO) merged
with the remote's own ``deny_imports``/``deny_exports`` (../shared/reference/leafnodes.md §4).

The hub enforces its side by closing the connection (a literal LS+ outside ``import``, any LMSG outside ``export``:
``Permissions Violation``), and a spoke's violations cost it a 30 s penalty, so everything is filtered here before
it leaves.  A wildcard LS+ that only overlaps what the hub allows is sent: the hub filters it at delivery, as it does
for nats-server's own leafs.
"""

from __future__ import annotations

from shardbroker.router.subjects import covers

FWC, PWC = ">", "*"


def pattern_covers(a: str, b: str) -> bool:
    """Every subject ``b`` (a pattern) matches, ``a`` matches too."""
    at, bt = a.split("."), b.split(".")
    for i, tok in enumerate(at):
        if tok == FWC:
            return len(bt) > i
        if i >= len(bt) or bt[i] == FWC or (tok != PWC and (bt[i] == PWC or tok != bt[i])):
            return False
    return len(at) == len(bt)


def overlaps(a: str, b: str) -> bool:
    """Some subject matches both patterns."""
    at, bt = a.split("."), b.split(".")
    for i in range(max(len(at), len(bt))):
        x = at[i] if i < len(at) else None
        y = bt[i] if i < len(bt) else None
        if x == FWC or y == FWC:
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != y and x != PWC and y != PWC:
            return False
    return True


def _lists(rule: object) -> tuple[list[str], list[str]] | None:
    """nats-server's permission object: {"allow": [...], "deny": [...]}, either list optional; None if absent."""
    if not isinstance(rule, dict):
        return None
    allow = rule.get("allow")
    deny = rule.get("deny")
    return ([s for s in allow if isinstance(s, str)] if isinstance(allow, list) else None,   # type: ignore[return-value]
            [s for s in deny if isinstance(s, str)] if isinstance(deny, list) else [])


class LeafPermissions:
    def __init__(self, imports: object = None, exports: object = None, deny_imports: list[str] = (),
                 deny_exports: list[str] = ()) -> None:
        imp, exp = _lists(imports), _lists(exports)
        self.import_allow = imp[0] if imp else None      # None: everything
        self.import_deny = [*(imp[1] if imp else []), *deny_imports]
        self.export_allow = exp[0] if exp else None
        self.export_deny = [*(exp[1] if exp else []), *deny_exports]
        self.local_import_deny = list(deny_imports)

    def may_export(self, subject: str) -> bool:
        """Whether a message to ``subject`` may be sent to the hub (LMSG)."""
        if self.export_allow is not None and not any(covers(p, subject) for p in self.export_allow):
            return False
        return not any(covers(p, subject) for p in self.export_deny)

    def may_import(self, pattern: str) -> bool:
        """Whether interest in ``pattern`` may be advertised (LS+)."""
        if pattern.startswith("$LDS."):
            return True   # loop detection travels everywhere, as nats-server's does
        if any(pattern_covers(d, pattern) for d in self.import_deny):
            return False
        allow = self.import_allow
        if allow is None:
            return True
        if any(pattern_covers(a, pattern) for a in allow):
            return True
        literal = FWC not in pattern.split(".") and PWC not in pattern.split(".")
        return not literal and any(overlaps(a, pattern) for a in allow)

    def may_receive(self, subject: str) -> bool:
        """Whether a message from the hub may be delivered here (the remote's own deny_imports)."""
        return not self.local_import_deny or not any(covers(p, subject) for p in self.local_import_deny)
