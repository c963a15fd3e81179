"""TLS and mutual TLS with certificates made on the fly (self-signed CA)."""

from __future__ import annotations

import datetime
import ipaddress

import pytest

from kv_transfer.tiers.memory import DictByteStore
from kv_transfer.transport.grpc_transport import TlsClientConfig, TlsServerConfig

x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(name: str, issuer_key, issuer_name, *, ca: bool = False, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


class Pki:
    """A CA plus a server and a client certificate it signed, all PEM."""

    def __init__(self, ca_name: str = "test-ca") -> None:
        ca_key, ca_cert = _issue(ca_name, None, None, ca=True)
        server_key, server_cert = _issue("kv-server", ca_key, ca_cert.subject, server=True)
        client_key, client_cert = _issue("kv-client", ca_key, ca_cert.subject)
        pem = lambda c: c.public_bytes(serialization.Encoding.PEM)
        self.ca = pem(ca_cert)
        self.server_cert, self.server_key = pem(server_cert), _pem_key(server_key)
        self.client_cert, self.client_key = pem(client_cert), _pem_key(client_key)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


def test_tls_round_trip(make_server, make_client, pki: Pki) -> None:
    store = DictByteStore()
    server = make_server(store, tls=TlsServerConfig(pki.server_cert, pki.server_key))
    client = make_client(server.address, tls=TlsClientConfig(root_ca=pki.ca))
    data = bytes(range(256)) * 20_000  # 5 MB, several chunks
    assert client.put_bytes("mla:t", data)
    assert client.get_bytes("mla:t") == data
    assert store.get_bytes("mla:t") == data


def test_plaintext_client_cannot_talk_to_tls_server(make_server, make_client, pki: Pki) -> None:
    server = make_server(tls=TlsServerConfig(pki.server_cert, pki.server_key))
    client = make_client(server.address, timeout_s=1.0)
    assert client.put_bytes("mla:t", b"x") is False
    assert client.stats()["puts_failed"] == 1


def test_untrusted_server_certificate_is_a_miss(make_server, make_client, pki: Pki) -> None:
    server = make_server(tls=TlsServerConfig(pki.server_cert, pki.server_key))
    other = Pki("other-ca")
    client = make_client(server.address, timeout_s=1.0, tls=TlsClientConfig(root_ca=other.ca))
    assert client.get_bytes("mla:t") is None
    assert client.stats()["unavailable"] == 1


def test_mutual_tls_requires_a_client_certificate(make_server, make_client, pki: Pki) -> None:
    store = DictByteStore()
    tls = TlsServerConfig(pki.server_cert, pki.server_key, client_ca=pki.ca)
    server = make_server(store, tls=tls)
    anonymous = make_client(server.address, timeout_s=1.0, tls=TlsClientConfig(root_ca=pki.ca))
    assert anonymous.put_bytes("mla:t", b"x") is False
    assert len(store) == 0
    mtls = TlsClientConfig(pki.ca, cert_chain=pki.client_cert, private_key=pki.client_key)
    client = make_client(server.address, tls=mtls)
    assert client.put_bytes("mla:t", b"x") is True
    assert client.get_bytes("mla:t") == b"x"


def test_server_name_override(make_server, make_client, pki: Pki) -> None:
    server = make_server(tls=TlsServerConfig(pki.server_cert, pki.server_key))
    named = make_client(server.address, tls=TlsClientConfig(pki.ca, server_name="localhost"))
    assert named.put_bytes("k", b"v") and named.get_bytes("k") == b"v"
    wrong = TlsClientConfig(pki.ca, server_name="elsewhere.invalid")
    mismatched = make_client(server.address, timeout_s=1.0, tls=wrong)
    assert mismatched.get_bytes("k") is None
    assert mismatched.stats()["unavailable"] == 1
