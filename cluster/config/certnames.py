"""The names a verified client certificate proves, for mapping it to a user (``tls.verify_and_map``).

In nats-server's order (``checkClientTLSCertSubject``), most likely to match first: the email addresses of its
subject alternative names, then its DNS names, then its URIs, then its subject's distinguished name.  A user holds
the names that log it in (``security.users[].cert_names``); the first name of the certificate that a user holds
picks that user.

Distinguished names are compared as DNs, not as text: attribute types by short name and without regard to case
(``CN``, ``cn`` and ``commonName`` are one), values exactly, the RDNs in RFC 4514's order (most specific first:
``CN=alice,OU=eng,O=Acme``, what ``openssl x509 -noout -subject -nameopt RFC2253`` prints) or in the
certificate's (``O=Acme,OU=eng,CN=alice``), spaces after the separators allowed.  Everything else is an exact
string.

Input is the dict ``ssl.SSLSocket.getpeercert()`` returns: nothing here reads a socket.
"""

from __future__ import annotations

import re

# getpeercert()'s long names, and the short ones RFC 4514 and OpenSSL print.
_SHORT = {
    "commonName": "CN", "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST",
    "streetAddress": "STREET", "organizationName": "O", "organizationalUnitName": "OU", "domainComponent": "DC",
    "userId": "UID", "emailAddress": "EMAILADDRESS", "serialNumber": "SERIALNUMBER", "postalCode": "POSTALCODE",
    "surname": "SN", "givenName": "GIVENNAME", "title": "TITLE", "pseudonym": "PSEUDONYM",
}
_ALIASES = {name.upper(): short for name, short in _SHORT.items()} | {"E": "EMAILADDRESS", "EMAIL": "EMAILADDRESS",
                                                                       "S": "ST", "USERID": "UID"}
_TYPE = re.compile(r"^(?:[A-Za-z][A-Za-z0-9-]*|\d+(?:\.\d+)+)$")
_SPECIAL = ',+"\\<>;='


class DnError(ValueError):
    """A configured distinguished name that cannot be read."""


def identities(peercert: dict | None) -> list[tuple[str, str]]:
    """(kind, name) for each name the certificate proves, in the order they are tried: ``email``, ``dns``,
    ``uri`` (exact strings), then ``dn`` (canonical DNs: see ``canonical_dn``), RFC 4514's order first."""
    if not peercert:
        return []
    sans = peercert.get("subjectAltName") or ()
    out = [("email", v) for k, v in sans if k == "email"]
    out += [("dns", v) for k, v in sans if k == "DNS"]
    out += [("uri", v) for k, v in sans if k == "URI"]
    rdns = [frozenset((_short(t), v) for t, v in rdn) for rdn in peercert.get("subject") or ()]
    if rdns:
        out.append(("dn", _join(reversed(rdns))))
        if len(rdns) > 1:
            out.append(("dn", _join(rdns)))
    return out


def canonical_dn(text: str) -> str | None:
    """``text`` as a canonical DN (RDNs in the order written), or None if it is not one (an email address, a
    host name).  Raises ``DnError`` for text that looks like a DN (``TYPE=...``) but cannot be read."""
    if "=" not in text or "://" in text:
        return None
    head = text.split("=", 1)[0].strip()
    if not _TYPE.match(head):
        return None
    return _join(_parse(text))


def describe(peercert: dict | None) -> str:
    """The certificate's subject in RFC 4514 form, for logs."""
    rdns = [frozenset((_short(t), v) for t, v in rdn) for rdn in (peercert or {}).get("subject") or ()]
    return _join(reversed(rdns)) if rdns else "(no subject)"


def _short(attribute: str) -> str:
    return _SHORT.get(attribute) or _ALIASES.get(attribute.upper(), attribute.upper())


def _join(rdns) -> str:
    return ",".join("+".join(f"{t}={_escape(v)}" for t, v in sorted(rdn)) for rdn in rdns)


def _escape(value: str) -> str:
    out = "".join("\\" + ch if ch in _SPECIAL else ch for ch in value)
    if out.startswith((" ", "#")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


def _parse(text: str) -> list[frozenset]:
    """RFC 4514's string form, leniently (spaces around separators): the RDNs in the order written."""
    rdns: list[frozenset] = []
    pairs: list[tuple[str, str]] = []
    kind, buf, i = None, [], 0
    while i <= len(text):
        ch = text[i] if i < len(text) else ","
        at_end = i >= len(text)
        if ch == "\\" and not at_end:
            if re.match(r"[0-9A-Fa-f]{2}", text[i + 1:i + 3]):
                # \HH: UTF-8 bytes; a run of them is one character
                raw = bytearray()
                while i < len(text) and text[i] == "\\" and re.match(r"[0-9A-Fa-f]{2}", text[i + 1:i + 3]):
                    raw.append(int(text[i + 1:i + 3], 16))
                    i += 3
                try:
                    buf.append(raw.decode())
                except UnicodeDecodeError:
                    raise DnError(f"{text!r}: bad escape in a value") from None
                continue
            if i + 1 >= len(text):
                raise DnError(f"{text!r}: ends with a backslash")
            buf.append("\x00" + text[i + 1])   # escaped: kept, even a space at either end
            i += 2
            continue
        if ch == "=" and kind is None:
            kind = "".join(buf).strip()
            if not _TYPE.match(kind):
                raise DnError(f"{text!r}: {kind!r} is not an attribute type")
            buf = []
        elif ch in ",+;" or at_end:
            if kind is None:
                raise DnError(f"{text!r}: expected TYPE=value")
            pairs.append((_short(kind), _value(buf)))
            kind, buf = None, []
            if ch != "+":
                rdns.append(frozenset(pairs))
                pairs = []
        else:
            buf.append(ch)
        i += 1
    return rdns


def _value(buf: list[str]) -> str:
    """Unescaped spaces at either end are the separators' (lenient), escaped ones are the value's."""
    text = "".join(buf)
    start, end = 0, len(text)
    while start < end and text[start] == " ":
        start += 1
    while end > start and text[end - 1] == " " and (end < 2 or text[end - 2] != "\x00"):
        end -= 1
    return text[start:end].replace("\x00", "")
