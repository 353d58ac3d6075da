"""The ``leafnodes`` section: what the loader refuses (one ConfigError naming the key), how a remote logs in to its
hub (workers/protocols/leaf/credentials.py: CONNECT's auth fields, the client TLS context), and that the secrets stay
out of errors, reprs and the reload's record while the workers still get them."""

import base64
import json
import os
import socket
import ssl
import threading

import nacl.signing
import nkeys
import pytest
from cryptography.hazmat.primitives import serialization

from shardbroker.cluster import config as cfgmod
from shardbroker.cluster.config import ConfigError, LeafRemoteConfig, LeafTlsConfig, parse_url
from shardbroker.cluster.supervisor.reload import diff
from shardbroker.workers.protocols.leaf.credentials import LeafAuthError, client_tls_context, connect_auth

from support.certs import CertificateAuthority

HUB = "nats-leaf://hub.example:7422"


def load(tmp_path, leafnodes: dict, check_paths: bool = False) -> cfgmod.Config:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"leafnodes": leafnodes}))
    return cfgmod.load(str(path), check_paths=check_paths)


def refused(tmp_path, leafnodes: dict, check_paths: bool = False) -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, leafnodes, check_paths)
    return str(exc.value)


def remote(**keys) -> dict:
    return {"remotes": [{"urls": [HUB], **keys}]}


# -- the loader ---------------------------------------------------------------------------------------------------

def test_a_remote_loads_with_its_defaults(tmp_path):
    cfg = load(tmp_path, {"name": "edge", **remote(user="u", password="p", deny_imports=["a.>"])})
    (r,) = cfg.leafnodes.remotes
    assert (r.user, r.password, r.deny_imports, r.account, r.tls) == ("u", "p", ["a.>"], "$G", False)
    assert cfg.leafnodes.name == "edge" and cfg.leafnodes.reconnect_max == 30


@pytest.mark.parametrize("leafnodes,message", [
    (remote(colour="red"), "leafnodes.remotes[0].colour: unknown key"),
    ({"remotes": [{"urls": ["http://hub:7422"]}]}, "leafnodes.remotes[0].urls[0]: 'http://hub:7422': the scheme"),
    ({"remotes": [{"urls": ["nats-leaf://hub:7422/ws"]}]}, "leafnodes.remotes[0].urls[0]"),
    ({"remotes": [{"urls": ["nats-leaf://hub:99999"]}]}, "leafnodes.remotes[0].urls[0]"),
    ({"remotes": [{}]}, "leafnodes.remotes[0].urls: at least one URL"),
    (remote(token="t", nkey_file="/x"), "leafnodes.remotes[0]: one way to log in, got token and nkey_file"),
    (remote(user="u", password="p", credentials="/x"), "leafnodes.remotes[0]: one way to log in"),
    ({"remotes": [{"urls": ["nats-leaf://a:b@hub:7422"], "user": "u", "password": "p"}]},
     "leafnodes.remotes[0].urls[0]: credentials in the URL and leafnodes.remotes[0].user"),
    ({"remotes": [{"urls": ["nats-leaf://tok@hub:7422"], "token": "t"}]},
     "leafnodes.remotes[0].urls[0]: credentials in the URL and leafnodes.remotes[0].token"),
    (remote(user="u"), "leafnodes.remotes[0]: user and password go together"),
    (remote(deny_exports=["a.>.b"]), "leafnodes.remotes[0].deny_exports[0]: 'a.>.b' is not a subject"),
    (remote(tls={"cert": "/c.pem"}), "leafnodes.remotes[0].tls: cert and key go together"),
    (remote(tls={"timeout": 0}), "leafnodes.remotes[0].tls.timeout: must be between 0.1 and 600"),
    (remote(tls="yes"), "leafnodes.remotes[0].tls: expected"),
    ({"reconnect": 5, "reconnect_max": 2}, "leafnodes.reconnect_max: must be at least leafnodes.reconnect"),
    ({"name": "two words"}, "leafnodes.name"),
    ({"ping_max": 0}, "leafnodes.ping_max: must be between 1 and 1000"),
])
def test_a_bad_leafnodes_section_is_one_error_naming_the_key(tmp_path, leafnodes, message):
    assert message in refused(tmp_path, leafnodes)


@pytest.mark.parametrize("key", ["nkey_file", "credentials", "tls.ca", "tls.cert", "tls.key"])
def test_a_missing_file_is_a_config_error_at_start_only(tmp_path, key):
    present = tmp_path / "present.pem"
    present.write_text("x")
    missing = str(tmp_path / "missing")
    if key.startswith("tls."):
        tls = {"cert": str(present), "key": str(present), key[4:]: missing}
        doc = remote(tls=tls)
    else:
        doc = remote(**{key: missing})
    message = refused(tmp_path, doc, check_paths=True)
    assert message == f"leafnodes.remotes[0].{key}: {missing!r}: cannot read: No such file or directory"
    load(tmp_path, doc, check_paths=False)   # a reload, or a tool reading another machine's file: not checked


def test_a_directory_or_a_fifo_is_not_a_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert refused(tmp_path, remote(nkey_file=str(tmp_path)), True).endswith("is not a file")
    assert refused(tmp_path, remote(credentials=str(fifo)), True).endswith("is not a file")   # and did not hang


# -- secrets stay out of what is shown ----------------------------------------------------------------------------

def test_errors_never_show_a_password_token_or_url_credentials(tmp_path):
    for doc in ({"remotes": [{"urls": ["http://u:s3cret@hub"]}]},
                {"remotes": [{"urls": ["nats-leaf://u:s3cret@"]}]},
                {"remotes": [{"urls": ["nats-leaf://s3cret@hub/x"]}]},   # a user alone is a token
                {"remotes": [{"urls": ["nats-leaf://u:s3cret"]}]},      # "@host" forgotten: s3cret reads as a port
                {"remotes": [{"urls": "nats-leaf://u:s3cret@hub"}]},
                {"remotes": [{"urls": [HUB], "user": "u", "password": ["s3cret"]}]},
                {"remotes": [{"urls": [HUB], "token": 12345678}]}):
        message = refused(tmp_path, doc)
        assert "s3cret" not in message and "12345678" not in message, message
        assert message.startswith("leafnodes.remotes[0]"), message


def test_repr_and_the_parsed_url_hide_the_secrets():
    r = LeafRemoteConfig(urls=["nats-leaf://u:s3cret@hub:7422", "nats-leaf://t0ken@hub2"], user="u",
                         password="s3cret", token=None)
    shown = repr(r)
    assert "s3cret" not in shown and "t0ken" not in shown
    assert "nats-leaf://u:***@hub:7422" in shown and "password='***'" in shown and "token=None" in shown
    url = parse_url("tls://u:p%40ss@hub", "k")
    assert (url.url, url.host, url.port, url.tls, url.user, url.password) == ("tls://hub:7422", "hub", 7422, True,
                                                                            "u", "p@ss")
    assert "p@ss" not in repr(url)


def test_a_changed_leaf_password_is_a_change_the_workers_get(tmp_path):
    """The reload's diff drops the users' plaintext passwords (the running copy has none): a leaf remote's
    password must still count, and stay in the document the workers are sent, since they log in with it."""
    old = load(tmp_path, remote(user="u", password="one"))
    new = load(tmp_path, remote(user="u", password="two"))
    assert diff(old, new) == ["leafnodes.remotes"]
    kept = cfgmod.without_plaintext_passwords(new)
    assert cfgmod.document(kept)["leafnodes"]["remotes"][0]["password"] == "two"
    assert cfgmod.from_document(cfgmod.document(kept)).leafnodes == new.leafnodes


# -- CONNECT's auth fields ----------------------------------------------------------------------------------------

def user_seed() -> bytes:
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def verified(public_key: str, nonce: str, sig: str) -> bool:
    """The signature checked with the public key alone (not with the key pair that made it)."""
    raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    assert raw[0] == nkeys.PREFIX_BYTE_USER and len(raw) == 35
    nacl.signing.VerifyKey(raw[1:33]).verify(nonce.encode(), base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4)))
    return True


def auth(url: str = HUB, nonce: str | None = "n0nce", **keys) -> dict:
    return connect_auth(LeafRemoteConfig(urls=[url], **keys), parse_url(url, "k"), nonce)


def test_user_password_token_and_url_credentials():
    assert auth() == {}
    assert auth(user="u", password="p") == {"user": "u", "pass": "p"}
    assert auth(token="t") == {"auth_token": "t"}
    assert auth("nats-leaf://us%3Aer:p%40ss%2F@hub") == {"user": "us:er", "pass": "p@ss/"}
    assert auth("nats-leaf://u:@hub") == {"user": "u", "pass": ""}
    # nats-server's reading of a user alone: a token, sent as both (sendLeafConnect)
    assert auth("nats-leaf://t%20k@hub") == {"user": "t k", "auth_token": "t k"}


def test_nkey_file_signs_the_nonce(tmp_path):
    seed = user_seed()
    path = tmp_path / "user.nk"
    path.write_bytes(b"# comment\n" + seed + b"\n")
    fields = auth(nkey_file=str(path))
    assert set(fields) == {"nkey", "sig"} and "=" not in fields["sig"]
    assert fields["nkey"] == nkeys.from_seed(seed).public_key.decode() and fields["nkey"].startswith("U")
    assert verified(fields["nkey"], "n0nce", fields["sig"])
    # URL credentials ride along (auth callout)
    with_url = auth("nats-leaf://u:p@hub", nkey_file=str(path))
    assert (with_url["user"], with_url["pass"], with_url["nkey"]) == ("u", "p", fields["nkey"])


def creds(jwt: str, seed: bytes) -> str:
    return (f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


def test_a_creds_file_sends_its_jwt_and_signs_with_its_seed(tmp_path):
    seed = user_seed()
    jwt = "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.eyJzdWIiOiJVQUJDIn0.c2ln-_"
    path = tmp_path / "user.creds"
    path.write_text(creds(jwt, seed).replace("\n", "\r\n"))
    fields = auth(credentials=str(path))
    assert set(fields) == {"jwt", "sig"} and fields["jwt"] == jwt
    assert verified(nkeys.from_seed(seed).public_key.decode(), "n0nce", fields["sig"])


def test_login_errors_are_one_line_naming_the_file_never_the_seed(tmp_path):
    seed = user_seed()
    account_seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    typo = seed[:-3] + (b"A" if seed[-3:-2] != b"A" else b"B") + seed[-2:]
    files = {"typo.nk": typo, "account.nk": account_seed, "empty.nk": b"", "short.nk": b"SUAAAA\n",
             "good.nk": seed}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "broken.creds").write_text(creds("eyJ.eyJ.sig", seed).split("-----BEGIN USER")[0])
    (tmp_path / "nojwt.creds").write_text(creds("notajwt", seed))
    cases = [
        ({"nkey_file": str(tmp_path / "nope.nk")}, "n", "cannot read: No such file or directory"),
        ({"nkey_file": str(tmp_path)}, "n", "cannot read: Is a directory"),
        ({"nkey_file": str(tmp_path / "typo.nk")}, "n", "the nkey seed is malformed"),
        ({"nkey_file": str(tmp_path / "short.nk")}, "n", "the nkey seed is malformed"),
        ({"nkey_file": str(tmp_path / "account.nk")}, "n", "not a user's nkey seed"),
        ({"nkey_file": str(tmp_path / "empty.nk")}, "n", "no nkey seed in it"),
        ({"nkey_file": str(tmp_path / "good.nk")}, None, "no nonce to sign"),
        ({"nkey_file": str(tmp_path / "good.nk")}, "", "no nonce to sign"),
        ({"credentials": str(tmp_path / "broken.creds")}, "n", "not a .creds file"),
        ({"credentials": str(tmp_path / "nojwt.creds")}, "n", "holds no JWT"),
    ]
    for keys, nonce, message in cases:
        with pytest.raises(LeafAuthError) as exc:
            auth(nonce=nonce, **keys)
        text = str(exc.value)
        (which, path), = keys.items()
        assert text.startswith(f"{which} {path!r}: ") and message in text, text
        assert "\n" not in text and seed.decode()[2:20] not in text and account_seed.decode()[2:20] not in text


# -- the client TLS context ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority("leaf test CA")
    out = {"dir": d, "ca": ca.write(d)}
    out["server"], out["server_key"] = ca.issue("hub.example", dns=["hub.example"], ips=[]).write(d, "server")
    out["client"], out["client_key"] = ca.issue("edge", client=True, dns=[], ips=[]).write(d, "client")
    other = CertificateAuthority("another CA")
    out["other_ca"] = other.write(d, "other")
    out["stray"], _ = other.issue("hub.example", dns=["hub.example"], ips=[]).write(d, "stray")
    return out


def tls_for(tls, url: str = HUB):
    return client_tls_context(LeafRemoteConfig(urls=[url], tls=tls), parse_url(url, "k"))


def handshake(pki, ctx: ssl.SSLContext, hostname: str, server_cert: str = "server", require_client: bool = False):
    """One TLS handshake over a socketpair against a server with ``server_cert``; -> the client certificate the
    server saw (None without one).  Raises the client side's ssl error."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    key = pki["server_key"] if server_cert == "server" else pki[server_cert].replace(".pem", ".key")
    server_ctx.load_cert_chain(pki[server_cert], key)
    if require_client:
        server_ctx.load_verify_locations(pki["ca"])
        server_ctx.verify_mode = ssl.CERT_REQUIRED
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    seen = {}

    def serve():
        try:
            with server_ctx.wrap_socket(b, server_side=True) as s:
                seen["peer"] = s.getpeercert()
                s.recv(1)
        except (ssl.SSLError, OSError):
            pass

    t = threading.Thread(target=serve)
    t.start()
    try:
        with ctx.wrap_socket(a, server_hostname=hostname) as c:
            c.sendall(b"x")
    finally:
        a.close()
        t.join(10)
        b.close()
    return seen.get("peer")


def test_no_tls_unless_asked():
    assert tls_for(False) is None
    ctx, hostname = tls_for(False, "tls://hub.example")   # the URL asks
    assert hostname == "hub.example" and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_a_ca_a_client_certificate_and_the_name_checked(pki):
    ctx, hostname = tls_for(LeafTlsConfig(ca=pki["ca"], cert=pki["client"], key=pki["client_key"]))
    assert hostname == "hub.example" and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    peer = handshake(pki, ctx, hostname, require_client=True)
    assert dict(x[0] for x in peer["subject"])["commonName"] == "edge"
    # the hub's certificate names hub.example: another name is refused, unless server_name says it
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(pki, tls_for(LeafTlsConfig(ca=pki["ca"]), "nats-leaf://127.0.0.1:7422")[0], "127.0.0.1")
    ctx, hostname = tls_for(LeafTlsConfig(ca=pki["ca"], server_name="hub.example"), "nats-leaf://127.0.0.1:7422")
    assert hostname == "hub.example" and handshake(pki, ctx, hostname) is None


def test_verify_false_takes_any_certificate_and_verify_true_does_not(pki):
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(pki, tls_for(LeafTlsConfig(ca=pki["ca"]))[0], "hub.example", server_cert="stray")
    ctx, hostname = tls_for(LeafTlsConfig(verify=False))
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname
    handshake(pki, ctx, hostname, server_cert="stray")


def test_tls_errors_name_the_file(pki, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(open(pki["client_key"], "rb").read(), None)
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"pw")))
    cases = [
        (LeafTlsConfig(ca=str(tmp_path / "nope.pem")), "tls.ca", "cannot read: No such file or directory"),
        (LeafTlsConfig(ca=str(not_pem)), "tls.ca", ""),
        (LeafTlsConfig(cert=pki["client"], key=str(tmp_path / "nope.key")), "tls.cert", "No such file or directory"),
        (LeafTlsConfig(cert=pki["client"], key=pki["server_key"]), "tls.cert", "mismatch"),
        (LeafTlsConfig(cert=pki["client"], key=str(encrypted)), "tls.key", "encrypted"),   # and no prompt
    ]
    for tls, key_name, message in cases:
        with pytest.raises(LeafAuthError) as exc:
            tls_for(tls)
        text = str(exc.value)
        assert text.startswith(key_name + " '") and message in text and "\n" not in text, text
