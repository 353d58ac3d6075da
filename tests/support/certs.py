"""Certificates for the TLS tests, made here with ``cryptography``: a CA, and server and client certificates it
signs (valid, expired, with the subject alternative names a test needs).

P-256 keys: a handshake costs a fraction of a millisecond, so that tests measure the broker, not RSA.

    ca = CertificateAuthority("test CA")
    server = ca.issue("localhost", dns=["localhost"], ips=["127.0.0.1"])
    server.write(tmp_path, "server")        # -> (cert path, key path)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_ATTRIBUTES = {"CN": NameOID.COMMON_NAME, "O": NameOID.ORGANIZATION_NAME, "OU": NameOID.ORGANIZATIONAL_UNIT_NAME,
               "C": NameOID.COUNTRY_NAME, "L": NameOID.LOCALITY_NAME, "ST": NameOID.STATE_OR_PROVINCE_NAME,
               "DC": NameOID.DOMAIN_COMPONENT}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def name(*rdns: tuple[str, str]) -> x509.Name:
    """A subject from (attribute, value) pairs, most significant first as in the certificate (``("O", "Acme"),
    ("CN", "alice")`` is ``CN=alice,O=Acme`` in RFC 4514's order)."""
    return x509.Name([x509.NameAttribute(_ATTRIBUTES[k], v) for k, v in rdns])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class Issued:
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory, stem: str) -> tuple[str, str]:
        """``<stem>.pem`` and ``<stem>.key`` (mode 0600) in ``directory``; -> their paths."""
        cert, key = os.path.join(str(directory), f"{stem}.pem"), os.path.join(str(directory), f"{stem}.key")
        with open(cert, "wb") as fh:
            fh.write(self.cert_pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(self.key_pem)
        return cert, key


class CertificateAuthority:
    def __init__(self, common_name: str = "shardbroker test CA") -> None:
        self.key = _key()
        subject = name(("O", "shardbroker tests"), ("CN", common_name))
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(_now() - datetime.timedelta(days=1))
                     .not_valid_after(_now() + datetime.timedelta(days=365))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def write(self, directory, stem: str = "ca") -> str:
        path = os.path.join(str(directory), f"{stem}.pem")
        with open(path, "wb") as fh:
            fh.write(self.cert_pem)
        return path

    def issue(self, common_name: str = "localhost", *, subject: x509.Name | None = None,
              dns: list[str] | tuple[str, ...] = ("localhost",), ips: list[str] | tuple[str, ...] = ("127.0.0.1",),
              emails: list[str] | tuple[str, ...] = (), uris: list[str] | tuple[str, ...] = (),
              client: bool = False, expired: bool = False) -> Issued:
        """A certificate this CA signs: for a server (the default: localhost and 127.0.0.1) or, with
        ``client``, for a client; ``expired``: valid until yesterday."""
        key = _key()
        now = _now()
        before, after = (now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)) if expired else \
            (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=90))
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.RFC822Name(e) for e in emails]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (x509.CertificateBuilder().subject_name(subject or name(("CN", common_name)))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(before).not_valid_after(after)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))
