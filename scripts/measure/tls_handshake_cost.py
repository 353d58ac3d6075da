#!/usr/bin/env python3
"""What one TLS handshake costs the server, in CPU: the figure behind docs/security.md#tls.

The server's side of full handshakes (no session resumption) is timed alone, client and server joined by memory
BIOs in this one process, so neither the network nor the client's work is counted: P-256 and RSA-2048
certificates, TLS 1.3 and 1.2.  The certificates are made with the openssl command.

    python scripts/measure/tls_handshake_cost.py [--count 500]
"""

from __future__ import annotations

import argparse
import os
import ssl
import statistics
import subprocess
import tempfile
import time


def certificate(directory: str, kind: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, f"{kind}.pem"), os.path.join(directory, f"{kind}.key")
    newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"] if kind == "p256" else \
        ["-newkey", "rsa:2048"]
    subprocess.run(["openssl", "req", "-x509", *newkey, "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key


def server_cpu_ms(cert: str, key: str, version: ssl.TLSVersion, count: int) -> float:
    """Median server CPU milliseconds per full handshake."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=cert)
    client.maximum_version = version
    samples = []
    for _ in range(count):
        c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        c = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
        s = server.wrap_bio(s_in, s_out, server_side=True)
        c_done = s_done = False
        spent = 0.0
        while not (c_done and s_done):
            if not c_done:
                try:
                    c.do_handshake()
                    c_done = True
                except ssl.SSLWantReadError:
                    pass
            s_in.write(c_out.read())
            if not s_done:
                started = time.process_time()
                try:
                    s.do_handshake()
                    s_done = True
                except ssl.SSLWantReadError:
                    pass
                spent += time.process_time() - started
            c_in.write(s_out.read())
        samples.append(spent)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=500, help="handshakes per case")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        for kind in ("p256", "rsa2048"):
            cert, key = certificate(directory, kind)
            for version in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
                ms = server_cpu_ms(cert, key, version, args.count)
                print(f"{kind:8} {version.name:8} {ms:6.3f} ms of server CPU per handshake")


if __name__ == "__main__":
    main()
