"""Pure certificate construction: extensions, names, validity (time passed in, no files)."""

from __future__ import annotations

import datetime as dt
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import UsageError
from llmgw.tls.build import (
    BACKDATE_SECONDS,
    build_ca,
    build_leaf,
    generate_key,
    split_hosts,
    validate_node_id,
    validate_operator_name,
    validity,
)
from llmgw.tls.info import describe, kind_of, sans_of, usages_of

NOW = 1_750_000_000.0  # a fixed instant: nothing here reads the clock


def _ca(key_type: str = "ecdsa-p256", days: int = 3650):
    key = generate_key(key_type)
    return key, build_ca(key, "test CA", NOW, days)


def test_ca_extensions() -> None:
    key, cert = _ca()
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca is True and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign
    ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "test CA"
    cert.verify_directly_issued_by(cert)  # self-signed with its own key
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(days=3650, seconds=BACKDATE_SECONDS)


@pytest.mark.parametrize("key_type", ["ecdsa-p256", "rsa-3072", "ed25519"])
def test_key_types_sign_and_verify(key_type: str) -> None:
    ca_key, ca = _ca(key_type)
    leaf_key = generate_key(key_type)
    cert, clamped = build_leaf(
        ca_cert=ca, ca_key=ca_key, public_key=leaf_key.public_key(), kind="node", common_name="gpu-01", now=NOW
    )
    assert not clamped
    cert.verify_directly_issued_by(ca)
    expected = {"ecdsa-p256": ec.EllipticCurvePublicKey, "rsa-3072": rsa.RSAPublicKey,
                "ed25519": ed25519.Ed25519PublicKey}
    assert isinstance(cert.public_key(), expected[key_type])
    if key_type == "rsa-3072":
        assert cert.public_key().key_size == 3072
    assert describe(cert, "x", NOW).key_type == key_type


def test_server_leaf_has_every_san_and_server_auth() -> None:
    ca_key, ca = _ca()
    dns, ips = split_hosts(["ctrl", "ctrl.example.com"], ["127.0.0.1", "fd00::5"])
    cert, _ = build_leaf(
        ca_cert=ca, ca_key=ca_key, public_key=generate_key().public_key(), kind="server",
        common_name="ctrl", now=NOW, dns=dns, ips=ips,
    )
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["ctrl", "ctrl.example.com"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                       ipaddress.ip_address("fd00::5")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca is False
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ca_ski.digest
    assert kind_of(cert) == "server"
    assert sans_of(cert) == ["DNS:ctrl", "DNS:ctrl.example.com", "IP:127.0.0.1", "IP:fd00::5"]


def test_node_and_operator_are_told_apart() -> None:
    ca_key, ca = _ca()
    node, _ = build_leaf(ca_cert=ca, ca_key=ca_key, public_key=generate_key().public_key(), kind="node",
                         common_name="gpu-01", now=NOW)
    op, _ = build_leaf(ca_cert=ca, ca_key=ca_key, public_key=generate_key().public_key(), kind="operator",
                       common_name="alice", now=NOW)
    assert kind_of(node) == "node" and kind_of(op) == "operator"
    assert usages_of(node) == ["digitalSignature", "clientAuth"] == usages_of(op)
    assert [a.value for a in op.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)] == ["operators"]
    assert [a.value for a in node.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)] == ["nodes"]
    assert node.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-01"


def test_rsa_leaf_allows_key_encipherment_only_for_rsa() -> None:
    ca_key, ca = _ca()
    ec_leaf, _ = build_leaf(ca_cert=ca, ca_key=ca_key, public_key=generate_key().public_key(), kind="node",
                            common_name="a", now=NOW)
    rsa_leaf, _ = build_leaf(ca_cert=ca, ca_key=ca_key, public_key=generate_key("rsa-3072").public_key(), kind="node",
                             common_name="a", now=NOW)
    assert "keyEncipherment" not in usages_of(ec_leaf)
    assert "keyEncipherment" in usages_of(rsa_leaf)


def test_serials_are_random_and_large() -> None:
    ca_key, ca = _ca()
    serials = {
        build_leaf(ca_cert=ca, ca_key=ca_key, public_key=generate_key().public_key(), kind="node", common_name="n",
                   now=NOW)[0].serial_number
        for _ in range(5)
    }
    assert len(serials) == 5
    assert all(s.bit_length() > 64 for s in serials)


def test_validity_backdates_and_clamps_to_the_ca() -> None:
    start, end, clamped = validity(NOW, 365)
    assert start.timestamp() == NOW - BACKDATE_SECONDS
    assert end.timestamp() == NOW + 365 * 86400
    assert not clamped
    cap = dt.datetime.fromtimestamp(NOW + 10 * 86400, tz=dt.UTC)
    _, end, clamped = validity(NOW, 365, cap=cap)
    assert clamped and end == cap


def test_leaf_cannot_outlive_its_ca() -> None:
    ca_key, ca = _ca(days=30)
    cert, clamped = build_leaf(ca_cert=ca, ca_key=ca_key, public_key=generate_key().public_key(), kind="node",
                               common_name="n", now=NOW, days=365)
    assert clamped
    assert cert.not_valid_after_utc == ca.not_valid_after_utc


def test_explicit_not_after_in_the_past_gives_an_expired_certificate() -> None:
    ca_key, ca = _ca()
    cert, _ = build_leaf(
        ca_cert=ca, ca_key=ca_key, public_key=generate_key().public_key(), kind="node",
        common_name="old", now=NOW, not_after=NOW - 86400,
    )
    assert cert.not_valid_after_utc.timestamp() == NOW - 86400
    assert cert.not_valid_before_utc < cert.not_valid_after_utc
    info = describe(cert, "old.crt", NOW)
    assert info.status == "expired" and info.days_left == -1.0


@pytest.mark.parametrize("node_id", ["gpu-01", "gpu01.rack3.example.com", "n_1", "A" * 64])
def test_valid_node_ids(node_id: str) -> None:
    assert validate_node_id(node_id) == node_id


@pytest.mark.parametrize("node_id", ["", "-gpu", "gpu 01", "gpu/01", "gpu,01", "CN=x", "é", "a" * 65, "gpu\n01"])
def test_invalid_node_ids_are_refused_in_one_line(node_id: str) -> None:
    with pytest.raises(UsageError) as err:
        validate_node_id(node_id)
    assert "invalid node id" in str(err.value) and "\n" not in str(err.value)


def test_operator_names() -> None:
    assert validate_operator_name("alice@example.com") == "alice@example.com"
    with pytest.raises(UsageError, match="invalid operator name"):
        validate_operator_name("alice smith")


def test_split_hosts_moves_ips_given_as_hosts_and_validates() -> None:
    dns, ips = split_hosts(["ctrl", "10.0.0.5", "CTRL.", "*.svc.example.com"], ["10.0.0.5", "[fd00::1]"])
    assert dns == ["ctrl", "*.svc.example.com"]
    assert ips == [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("fd00::1")]
    with pytest.raises(UsageError, match="at least one --host or --ip"):
        split_hosts([], [])
    with pytest.raises(UsageError, match="not an IP address"):
        split_hosts([], ["ctrl"])
    with pytest.raises(UsageError, match="not a DNS name"):
        split_hosts(["bad host"], [])
