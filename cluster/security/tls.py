"""TLS contexts for the listeners, from the files the configuration names (docs/security.md#tls).

The supervisor reads every file once (``read``), at start and at each reload, and builds each listener's context
from what it read (``contexts``): a file that is missing, unreadable or wrong stops the start, or refuses the
reload (the running contexts stay), with the key named.  The workers are handed the same bytes over their control
channel and build their contexts from those: they never read the files, so every worker, and a worker started
later, runs what the supervisor checked, whatever the files hold by then.

Ciphers are OpenSSL's defaults; the minimum version is TLS 1.2 (``min_version``: or 1.3).  The ssl module loads a
certificate chain from files only, so what was read into memory is handed to it through a memfd: on Linux the
private key never lands on a disk (elsewhere, a private temporary file, removed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Iterator

from shardbroker.cluster.config import TLS_LISTENERS, Config, TlsSettings, protocols, tls_settings
from shardbroker.cluster.config.certnames import describe

Material = dict[str, str]   # path -> the PEM text it held when read
_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
_EXPIRY_WARNING = 14 * 86400   # seconds before its end at which a certificate is said to expire soon


class TlsError(Exception):
    """One line: which key, which file, what is wrong with it."""


def enabled(config: Config) -> list[TlsSettings]:
    """The settings of every listener that is on and has TLS."""
    return [s for s in (tls_settings(config, name) for name in TLS_LISTENERS if protocols.listener_on(config, name))
            if s is not None]


def read(config: Config) -> Material:
    """Every file the TLS settings of the enabled listeners name, read now."""
    material: Material = {}
    for s in enabled(config):
        for name in ("cert", "key", "ca"):
            path = getattr(s, name)
            if path is None or path in material:
                continue
            try:
                with open(path, "rb") as fh:
                    raw = fh.read()
            except OSError as exc:
                raise TlsError(f"{s.key_of(name)}: {path!r}: cannot read: {exc.strerror}") from None
            if b"-----BEGIN " not in raw:
                raise TlsError(f"{s.key_of(name)}: {path!r}: not a PEM file (no -----BEGIN line)")
            try:
                material[path] = raw.decode("ascii")
            except UnicodeDecodeError:
                raise TlsError(f"{s.key_of(name)}: {path!r}: not a PEM file (not ASCII)") from None
    return material


def contexts(config: Config, material: Material) -> dict[str, ssl.SSLContext]:
    """A server context for each enabled listener with TLS, by listener name ("ndjson", "nats", ...)."""
    return {s.listener: context(s, material) for s in enabled(config)}


def context(s: TlsSettings, material: Material) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[s.min_version]
    ctx.options |= ssl.OP_NO_RENEGOTIATION   # TLS 1.2's: asyncio cannot do it, and a client could make us work
    try:
        with _as_file(material[s.cert]) as cert, _as_file(material[s.key]) as key:
            ctx.load_cert_chain(cert, key, password=_no_password)
    except _Encrypted:
        raise TlsError(f"{s.key_of('key')}: {s.key!r}: the key is encrypted; give it unencrypted (mode 0600) "
                       f"(openssl pkey -in KEY -out KEY.plain)") from None
    except ssl.SSLError as exc:
        raise TlsError(f"{s.key_of('cert')}, {s.key_of('key')}: {s.cert!r}, {s.key!r}: {_reason(exc)}") from None
    if s.ca is not None:
        try:
            ctx.load_verify_locations(cadata=material[s.ca])
        except ssl.SSLError as exc:
            raise TlsError(f"{s.key_of('ca')}: {s.ca!r}: {_reason(exc)}") from None
        # Without verify a client may come without a certificate (and log in with a password); one that presents a
        # certificate must present one the CA signed.
        ctx.verify_mode = ssl.CERT_REQUIRED if s.verify or s.verify_and_map else ssl.CERT_OPTIONAL
    return ctx


def load(config: Config) -> tuple[Material, dict[str, ssl.SSLContext]]:
    """``read`` and ``contexts`` together: what a start and a reload check before anything is applied."""
    material = read(config)
    return material, contexts(config, material)


def summary(config: Config, material: Material) -> list[str]:
    """One line per listener with TLS, for the log at start and after a reload."""
    out = []
    for s in enabled(config):
        cert = certificate(material.get(s.cert, ""))
        ends = expiry(material.get(s.cert, ""))
        line = (f"{s.listener}: TLS {s.min_version}+, certificate {describe(cert) if cert else s.cert}"
                + (f" (until {time.strftime('%Y-%m-%d', time.gmtime(ends))})" if ends else ""))
        if s.ca:
            line += (f"; client certificates {'required' if s.verify or s.verify_and_map else 'optional'}, "
                     f"verified against {s.ca}" + ("; they name the user" if s.verify_and_map else ""))
        if s.handshake_first:
            line += f"; handshake first{' (or after INFO)' if s.handshake_first == 'auto' else ''}"
        out.append(line)
    return out


def certificate(pem: str) -> dict | None:
    """The first certificate of ``pem`` as ``getpeercert()`` shows one (subject, notAfter, ...), for logs and
    /varz; None where this Python cannot say."""
    # The ssl module has no public way to read a certificate that is not a peer's; CPython's own tests use this.
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        with _as_file(pem) as path:
            return decode(path)
    except (ssl.SSLError, OSError, ValueError):
        return None


def expiry(pem: str) -> float | None:
    """When the first certificate of ``pem`` expires (epoch seconds), or None."""
    cert = certificate(pem)
    if not cert or "notAfter" not in cert:
        return None
    return float(ssl.cert_time_to_seconds(cert["notAfter"]))


def warnings(config: Config, material: Material, now: float | None = None) -> list[str]:
    """What an operator should hear about the certificates (expired, or expiring within two weeks), and about a
    monitoring port that anyone beyond this machine may read."""
    now = time.time() if now is None else now
    out = []
    mon = config.monitoring
    settings = tls_settings(config, "monitoring")
    if mon.enabled and not _is_loopback(mon.bind) and (settings is None or not settings.verify):
        out.append(f"monitoring listens on {mon.bind} without TLS client certificates: anyone who reaches it "
                   f"reads /connz (every client's address, user name and subjects); bind it to 127.0.0.1 (the "
                   f"default), or set monitoring.tls with verify and a ca")
    for path in sorted({s.cert for s in enabled(config)}):
        ends = expiry(material.get(path, ""))
        if ends is None:
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ends))
        if ends <= now:
            out.append(f"TLS certificate {path} expired on {when}: clients that verify it refuse it")
        elif ends - now < _EXPIRY_WARNING:
            out.append(f"TLS certificate {path} expires on {when}")
    return out


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# -- the accepting side: a socket handed over, its first byte, its handshake ------------------------------------

_CLIENT_HELLO = 0x16   # a TLS record of type handshake: what a TLS client's first byte always is
_REFUSAL_LINGER = 2.0  # seconds a refused client gets to read the refusal and close before we do
# Seconds a closing TLS connection waits for the client's close_notify (asyncio's default, 30, would hold a
# graceful stop): the same as a plaintext close waits for the client's FIN (workers.connection.LINGER).
_SHUTDOWN_TIMEOUT = 2.0


async def accept(sock: socket.socket, ctx: ssl.SSLContext, timeout: float, factory: Callable[[], asyncio.Protocol],
                 refusal: bytes = b"", greeting: Callable[[], bytes] | None = None,
                 greet_after: float | None = None) -> tuple[str, str]:
    """TLS on an accepted socket, on the running loop and never blocking it; -> how it went, and why: ``"ok"`` (the
    protocol ``factory`` makes is connected), ``"plaintext"`` (the client spoke first, without TLS: it got
    ``refusal``), ``"timeout"`` (no handshake within ``timeout`` seconds of the call), ``"failed"`` (the handshake
    began and failed: a bad certificate, a protocol error, a client that left in the middle) or ``"closed"`` (the
    client left before it sent anything).  The socket is closed unless the outcome is ``"ok"``.

    ``greeting`` (NATS' INFO) is sent in plaintext before the handshake, at once or, with ``greet_after``, if the
    client has not started one within that many seconds (nats-server's handshake_first "auto").  What the client
    sends first is peeked at, not read: 0x16 starts a TLS handshake, anything else is a plaintext client."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    sock.setblocking(False)
    try:
        if greeting is not None:
            if greet_after:
                first = await _first_byte(loop, sock, min(deadline, loop.time() + greet_after))
                if first is None:
                    _send_all(sock, greeting())
            else:
                _send_all(sock, greeting())
        first = await _first_byte(loop, sock, deadline)
    except OSError as exc:
        sock.close()
        return "closed", str(exc)
    if first is None:
        asyncio.ensure_future(_refuse(loop, sock, refusal))
        return "timeout", f"no TLS handshake within {timeout:g}s"
    if not first:
        sock.close()
        return "closed", "closed before any handshake"
    if first[0] != _CLIENT_HELLO:
        asyncio.ensure_future(_refuse(loop, sock, refusal))
        return "plaintext", f"plaintext on a TLS port (first byte {first!r})"
    try:
        await loop.connect_accepted_socket(factory, sock, ssl=ctx,
                                           ssl_handshake_timeout=max(0.05, deadline - loop.time()),
                                           ssl_shutdown_timeout=_SHUTDOWN_TIMEOUT)
    except ConnectionAbortedError as exc:   # asyncio's and uvloop's word for a handshake past its timeout
        sock.close()
        return ("timeout" if "longer than" in str(exc) else "failed"), str(exc)
    except (ssl.SSLError, OSError, EOFError) as exc:
        sock.close()
        if isinstance(exc, ssl.SSLError):
            return "failed", _reason(exc)
        # A client that began a handshake and left it: asyncio reports the alert it may have sent (an unknown
        # CA, a bad certificate) as a reset.  Failed all the same.
        return "failed", (f"the client closed the connection during the handshake ({exc!r}): it may not trust "
                          f"this certificate")
    return "ok", ""


async def _first_byte(loop: asyncio.AbstractEventLoop, sock: socket.socket, deadline: float) -> bytes | None:
    """The first byte the client sent (b"" at EOF), peeked at once it arrives; None if nothing came by
    ``deadline``."""
    fd = sock.fileno()
    while True:
        try:
            return sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            pass
        ready = loop.create_future()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, max(0.0, deadline - loop.time()))
        except TimeoutError:
            return None
        finally:
            loop.remove_reader(fd)


def _send_all(sock: socket.socket, data: bytes) -> None:
    """A greeting on a fresh socket, whose send buffer is empty: it fits, or the connection is useless."""
    if data and sock.send(data) != len(data):
        raise BlockingIOError("greeting did not fit the socket's send buffer")


async def _refuse(loop: asyncio.AbstractEventLoop, sock: socket.socket, refusal: bytes) -> None:
    """Say ``refusal`` in plaintext and close without losing it: closing with the client's bytes unread would send
    a reset, which makes the client's kernel drop what it had not read yet, the refusal included.  So: send,
    half-close, read and discard until the client closes (or ``_REFUSAL_LINGER`` passes), then close."""
    try:
        if refusal:
            sock.send(refusal)
        sock.shutdown(socket.SHUT_WR)
        end = loop.time() + _REFUSAL_LINGER
        while loop.time() < end:
            if await _first_byte(loop, sock, end) in (None, b""):
                break
            if not sock.recv(65536):
                break
    except OSError:
        pass
    finally:
        sock.close()


class _Encrypted(Exception):
    pass


def _no_password() -> str:
    # Without this, OpenSSL would ask for a passphrase on the terminal, and the broker would hang waiting for it.
    raise _Encrypted()


def _reason(exc: ssl.SSLError) -> str:
    reason = exc.reason.lower().replace("_", " ") if exc.reason else str(exc)
    detail = getattr(exc, "verify_message", None)   # SSLCertVerificationError: "certificate has expired", ...
    return f"{reason}: {detail}" if detail else reason


@contextlib.contextmanager
def _as_file(text: str) -> Iterator[str]:
    """A path that reads as ``text`` while the block runs; nothing is left behind."""
    data = text.encode("ascii")
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="shardbroker-tls-") as directory:   # mode 0700
        path = os.path.join(directory, "pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        yield path
