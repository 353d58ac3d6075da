"""How a leaf connection logs in to its hub: the CONNECT's auth fields and the client TLS context, from a remote's
configuration (cluster/config/leafnodes.py) and the URL being dialled.

The files (``nkey_file``, ``credentials``, the TLS ones) are read at each connection, as nats-server reads them: a
rotated file is used from the next (re)connect on, without a reload.  Every error is a ``LeafAuthError``, one line
naming the file and never quoting it (a seed is a secret): the link logs it and redials.
"""

from __future__ import annotations

import base64
import binascii
import re
import ssl

import nkeys

from shardbroker.cluster.config import LeafRemoteConfig, LeafTlsConfig, LeafUrl


class LeafAuthError(Exception):
    """One line: which file, what is wrong with it."""


# A .creds file as nsc writes it (and nats-server reads it): a block of dashes around each item, the JWT first.
def _block(title: str) -> re.Pattern[str]:
    return re.compile(rf"-{{3,}}[^\n]*BEGIN {title}[^\n]*-{{3,}}\r?\n\s*([\w.=-]+)\s*\r?\n\s*-{{3,}}[^\n]*END {title}")


_JWT, _CREDS_SEED = _block("NATS USER JWT"), _block("USER NKEY SEED")
_SEED_LINE = re.compile(r"^\s*(S[A-Z2-7]+)\s*$", re.M)   # an nkey file: the seed on a line of its own
_MAX_FILE = 1 << 20   # a creds file is a few KB: a path to something endless must not stall the worker


def connect_auth(remote: LeafRemoteConfig, url: LeafUrl, nonce: str | None) -> dict:
    """The CONNECT's auth fields for ``remote`` dialled at ``url``, nats-server's way (``sendLeafConnect``): ``jwt``
    and ``sig`` from a .creds file, or ``nkey`` and ``sig`` from a seed (``sig``: the hub's ``nonce`` signed,
    base64url without padding); then, beside them (auth callout reads them), the URL's ``user``/``pass`` (a user
    alone is a token, sent as ``user`` and ``auth_token`` both) or the remote's; and the remote's ``token``."""
    fields: dict[str, str] = {}
    if remote.credentials is not None:
        where = f"credentials {remote.credentials!r}"
        text = _read(remote.credentials, where)
        jwt, seed = _JWT.search(text), _CREDS_SEED.search(text)
        if jwt is None or seed is None:
            raise LeafAuthError(f"{where}: not a .creds file (a NATS USER JWT block, then a USER NKEY SEED block)")
        if jwt[1].count(".") != 2:
            raise LeafAuthError(f"{where}: the NATS USER JWT block holds no JWT (header.payload.signature)")
        fields["jwt"] = jwt[1]
        fields["sig"] = _sign(_user_key(seed[1], where), nonce, where)
    elif remote.nkey_file is not None:
        where = f"nkey_file {remote.nkey_file!r}"
        found = _SEED_LINE.search(_read(remote.nkey_file, where))
        if found is None:
            raise LeafAuthError(f"{where}: no nkey seed in it (a line SU...: `nk -gen user`)")
        key = _user_key(found[1], where)
        fields["nkey"] = key.public_key.decode()
        fields["sig"] = _sign(key, nonce, where)
    if url.user is not None:
        fields["user"] = url.user
        if url.password is not None:
            fields["pass"] = url.password
        else:
            fields["auth_token"] = url.user
    elif remote.user is not None:
        fields["user"], fields["pass"] = remote.user, remote.password or ""
    if remote.token is not None:
        fields["auth_token"] = remote.token
    return fields


def client_tls_context(remote: LeafRemoteConfig, url: LeafUrl) -> tuple[ssl.SSLContext, str] | None:
    """A client context and the name to check in the hub's certificate (``server_hostname``), or None where neither
    the remote's ``tls`` nor a ``tls://`` URL asks for TLS.  TLS 1.2 or later; the ``ca`` file, else the system's
    CAs; the client certificate where one is configured."""
    if remote.tls is False and not url.tls:
        return None
    tls = remote.tls if isinstance(remote.tls, LeafTlsConfig) else LeafTlsConfig()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # verifies the chain and the name by default
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION   # as the listeners' (cluster/security/tls.py)
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        if tls.ca is not None:
            ctx.load_verify_locations(cafile=tls.ca)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    except (OSError, ValueError) as exc:   # ssl.SSLError is an OSError: a file that is not PEM
        raise LeafAuthError(f"tls.ca {tls.ca!r}: {_reason(exc)}") from None
    if tls.cert is not None:
        try:
            ctx.load_cert_chain(tls.cert, tls.key, password=_no_password)
        except _Encrypted:
            raise LeafAuthError(f"tls.key {tls.key!r}: the key is encrypted; give it unencrypted (mode 0600)") from None
        except OSError as exc:
            raise LeafAuthError(f"tls.cert {tls.cert!r}, tls.key {tls.key!r}: {_reason(exc)}") from None
    return ctx, tls.server_name or url.host


def _read(path: str, where: str) -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_FILE)
    except OSError as exc:
        raise LeafAuthError(f"{where}: cannot read: {exc.strerror}") from None
    return raw.decode("ascii", "replace")


def _user_key(seed: str, where: str) -> nkeys.KeyPair:
    """The key pair of a user seed; nkeys checks neither the checksum nor the role, so a typo or an account's seed
    would only show as the hub's 'Authorization Violation': both are checked here."""
    data = seed.encode()
    try:
        raw = base64.b32decode(data + b"=" * (-len(data) % 8))
        if len(raw) != 36 or nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
            raise LeafAuthError(f"{where}: the nkey seed is malformed (wrong length or checksum)")
        role, _ = nkeys.decode_seed(data)
    except (binascii.Error, nkeys.NkeysError):
        raise LeafAuthError(f"{where}: the nkey seed is malformed") from None
    if role != nkeys.PREFIX_BYTE_USER:
        raise LeafAuthError(f"{where}: not a user's nkey seed (a user's starts with SU)")
    return nkeys.from_seed(data)


def _sign(key: nkeys.KeyPair, nonce: str | None, where: str) -> str:
    if not nonce:
        raise LeafAuthError(f"{where}: the hub's INFO has no nonce to sign (is it a leafnode port?)")
    return base64.urlsafe_b64encode(key.sign(nonce.encode())).rstrip(b"=").decode()


class _Encrypted(Exception):
    pass


def _no_password() -> str:
    # Without this, OpenSSL would ask for the key's passphrase on the terminal, and the worker would hang on it.
    raise _Encrypted()


def _reason(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return exc.reason.lower().replace("_", " ")
    return f"cannot read: {exc.strerror}" if getattr(exc, "strerror", None) else str(exc)
