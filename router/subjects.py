"""Subject syntax, shared by every protocol.

Subjects are dot-separated tokens with the NATS rules: no empty token, no whitespace, ``*`` matches exactly one
token, ``>`` matches one or more trailing tokens and may only be the last token.  Wildcards are whole tokens:
``f*o`` is a literal.
"""

from __future__ import annotations

import re

PWC = "*"
FWC = ">"

# Non-empty tokens without the whitespace nats-server rejects inside a token (sublist.go); other characters are
# allowed.  One pass of the regex engine: subjects are checked on hot paths (a NATS queue request's reply inbox).
_SHAPE = re.compile(r"[^ \t\r\n\f.]+(?:\.[^ \t\r\n\f.]+)*")


def tokens(subject: str) -> list[str]:
    return subject.split(".")


def is_valid_pattern(subject: str, max_length: int) -> bool:
    """A subscription pattern: wildcards allowed; at most ``max_length`` bytes in UTF-8 (as on the wire)."""
    if not subject or (len(subject) if subject.isascii() else len(subject.encode())) > max_length \
            or _SHAPE.fullmatch(subject) is None:
        return False
    # '>' is only meaningful as the final token.
    return FWC not in subject or FWC not in subject.split(".")[:-1]


def is_valid_literal(subject: str, max_length: int) -> bool:
    """A subject a message can be published to: a valid pattern without wildcard tokens."""
    return is_valid_pattern(subject, max_length) and ((PWC not in subject and FWC not in subject)
                                                      or is_literal(subject))


def is_literal(subject: str) -> bool:
    toks = subject.split(".")
    return PWC not in toks and FWC not in toks


def covers(pattern: str, subject: str) -> bool:
    """True if ``pattern`` matches the literal ``subject``: for one-off checks, the trie serves bulk matching."""
    p = pattern.split(".")
    s = subject.split(".")
    for i, tok in enumerate(p):
        if tok == FWC:
            return len(s) > i
        if i >= len(s) or (tok != PWC and tok != s[i]):
            return False
    return len(p) == len(s)
