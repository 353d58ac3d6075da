"""Password hashing: PBKDF2-HMAC-SHA256 with a 16-byte random salt, in one self-describing string.

The string uses the PHC format, ``$pbkdf2-sha256$i=600000$<salt>$<hash>`` (base64 without padding), so it says
which algorithm and how many iterations made it and can be stored anywhere a password hash can (the config file's
``password_hash``, the output of ``brokerctl hash-password``).  600,000 iterations is OWASP's 2023 figure.

Hashing costs a sizeable fraction of a second by design; hashlib releases the GIL while it works, so callers on an
event loop run these functions in a thread pool.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re

ALGORITHM = "pbkdf2-sha256"
DEFAULT_ITERATIONS = 600_000
MIN_ITERATIONS, MAX_ITERATIONS = 1_000, 10_000_000
SALT_BYTES = 16

_PHC = re.compile(r"^\$pbkdf2-sha256\$i=(\d+)\$([A-Za-z0-9+/]+)\$([A-Za-z0-9+/]+)$")


class HashFormatError(ValueError):
    pass


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4))


def hash_password(password: str, iterations: int = DEFAULT_ITERATIONS) -> str:
    salt = os.urandom(SALT_BYTES)
    dk = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"${ALGORITHM}$i={iterations}${_b64(salt)}${_b64(dk)}"


def parse(stored: str) -> tuple[int, bytes, bytes]:
    """(iterations, salt, derived key); HashFormatError if ``stored`` is not a hash this module makes."""
    m = _PHC.match(stored)
    if not m:
        raise HashFormatError("not a $pbkdf2-sha256$i=<iterations>$<salt>$<hash> string")
    iterations = int(m.group(1))
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise HashFormatError(f"iterations must be between {MIN_ITERATIONS} and {MAX_ITERATIONS}")
    try:
        salt, dk = _unb64(m.group(2)), _unb64(m.group(3))
    except ValueError:
        raise HashFormatError("bad base64 in the hash") from None
    if len(salt) < 8 or len(dk) < 16:
        raise HashFormatError("salt or hash too short")
    return iterations, salt, dk


def verify(stored: str, password: str, cost: int = 0) -> bool:
    """Constant-time check of ``password`` against ``stored``, made to take at least ``cost`` iterations whatever
    ``stored`` takes (the rest spent on nothing), so that hashes of different costs take the same time."""
    iterations, salt, dk = parse(stored)
    candidate = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations, dklen=len(dk))
    if cost > iterations:
        hashlib.pbkdf2_hmac("sha256", password.encode(), salt, cost - iterations, dklen=len(dk))
    return hmac.compare_digest(candidate, dk)


def cost_of(stored: str) -> int:
    """The iterations ``stored`` takes to check (0 if it is not a hash of ours)."""
    try:
        return parse(stored)[0]
    except HashFormatError:
        return 0


def dummy_hash(iterations: int) -> str:
    """A hash no password matches: unknown users are checked against it, so they cost what known ones do.

    Checking costs what it costs for a real hash (the same iterations, salt and key sizes), but making it costs
    nothing: a random derived key is as unmatchable as the hash of a random password (2**-256), and the
    supervisor makes one at every start, security on or off (PBKDF2 would take ~0.2 s of the start-up)."""
    return f"${ALGORITHM}$i={iterations}${_b64(os.urandom(SALT_BYTES))}${_b64(os.urandom(32))}"
