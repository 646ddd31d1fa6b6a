"""Pure construction of keys, names and certificates: values in, x509 objects out, time passed in.

Nothing here touches files or clocks, so every extension and validity rule is testable alone;
`llmgw.tls.ca` does the writing.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Sequence
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import UsageError
from llmgw.tls.defaults import CA_DAYS, DEFAULT_KEY_TYPE, KEY_TYPES, LEAF_DAYS, KeyType  # noqa: F401 - re-exported

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
Kind = Literal["ca", "server", "node", "operator", "viewer", "gateway"]

ORGANIZATION = "llmgw"
# The organizational unit is how a server tells the kinds of client certificate apart: only
# `llmgw ctl cert operator` writes OU=operators, `cert viewer` OU=viewers, `cert node` OU=nodes
# (the only kind the fleet port accepts).
OPERATOR_OU = "operators"
VIEWER_OU = "viewers"
NODE_OU = "nodes"
# `cert gateway`: a gateway on another machine (`llmgw gateway --control-plane`) may follow the
# control plane's gateway feed on the fleet port, nothing more (no node registration, no API).
GATEWAY_OU = "gateways"
CLIENT_OUS = {NODE_OU: "node", OPERATOR_OU: "operator", VIEWER_OU: "viewer", GATEWAY_OU: "gateway"}

# Certificates start a little in the past so a peer whose clock is slightly behind accepts them.
BACKDATE_SECONDS = 300

# Node ids become the certificate's CN and are compared with the id an agent registers as:
# host-name-like, no spaces or slashes, 64 characters at most (the X.509 limit for a CN).
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_OPERATOR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}$")
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def generate_key(key_type: str = DEFAULT_KEY_TYPE) -> PrivateKey:
    if key_type == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "rsa-3072":
        return rsa.generate_private_key(public_exponent=65537, key_size=3072)
    if key_type == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise UsageError(f"unknown key type {key_type!r}; use one of {', '.join(KEY_TYPES)}")


def describe_key(public_key: object) -> str:
    """A short name for a key ("ecdsa-p256", "rsa-3072", "ed25519") for listings."""
    if isinstance(public_key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey):
        curve = public_key.curve.name
        return {"secp256r1": "ecdsa-p256", "secp384r1": "ecdsa-p384"}.get(curve, f"ecdsa-{curve}")
    if isinstance(public_key, rsa.RSAPublicKey | rsa.RSAPrivateKey):
        return f"rsa-{public_key.key_size}"
    if isinstance(public_key, ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey):
        return "ed25519"
    return type(public_key).__name__


def _signing_hash(key: PrivateKey) -> hashes.SHA256 | None:
    # Ed25519 signs the message itself; passing a hash is an error in cryptography.
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def validate_node_id(node_id: str) -> str:
    if not _NODE_ID.match(node_id):
        raise UsageError(
            f"invalid node id {node_id!r}: use letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit, at most 64 characters), as in gpu-01"
        )
    return node_id


def validate_operator_name(name: str) -> str:
    if not _OPERATOR.match(name):
        raise UsageError(
            f"invalid operator name {name!r}: use letters, digits and '.', '_', '-', '@', '+' "
            "(starting with a letter or digit, at most 64 characters), as in alice"
        )
    return name


def validate_common_name(name: str, what: str = "name") -> str:
    if not name or len(name) > 64 or any(ord(c) < 32 for c in name):
        raise UsageError(f"invalid {what} {name!r}: 1 to 64 printable characters")
    return name


def split_hosts(
    hosts: Sequence[str], ips: Sequence[str]
) -> tuple[list[str], list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Validate DNS names and IPs for a server certificate.

    An IP given as a host becomes an IP entry: TLS clients match an IP they dial only against
    IPAddress SANs, so a DNS entry spelled "10.0.0.1" would never match.
    """
    dns: list[str] = []
    addrs: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for raw in ips:
        try:
            addr = ipaddress.ip_address(raw.strip().strip("[]"))
        except ValueError:
            raise UsageError(f"--ip {raw!r} is not an IP address; pass names with --host")
        if addr not in addrs:
            addrs.append(addr)
    for raw in hosts:
        name = raw.strip().rstrip(".").lower()
        try:
            addr = ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            pass
        else:
            if addr not in addrs:
                addrs.append(addr)
            continue
        labels = name.split(".")
        if labels and labels[0] == "*":
            labels = labels[1:]
        if not name or len(name) > 253 or not labels or not all(_DNS_LABEL.match(x) for x in labels):
            raise UsageError(
                f"--host {raw!r} is not a DNS name (letters, digits, '-' per label, "
                "optionally starting with '*.')"
            )
        if name not in dns:
            dns.append(name)
    if not dns and not addrs:
        raise UsageError("a server certificate needs at least one --host or --ip (every name and address agents dial)")
    return dns, addrs


def validity(
    now: float, days: int, not_after: float | None = None, cap: dt.datetime | None = None
) -> tuple[dt.datetime, dt.datetime, bool]:
    """(not_before, not_after, clamped). `not_after` overrides `days` (tests issue expired
    certificates with it); `cap` is the CA's own expiry, which no leaf may outlive."""
    if days < 1:
        raise UsageError(f"--days must be at least 1, got {days}")
    start = dt.datetime.fromtimestamp(now - BACKDATE_SECONDS, tz=dt.UTC).replace(microsecond=0)
    if not_after is None:
        end = dt.datetime.fromtimestamp(now, tz=dt.UTC).replace(microsecond=0) + dt.timedelta(days=days)
    else:
        end = dt.datetime.fromtimestamp(not_after, tz=dt.UTC).replace(microsecond=0)
        start = min(start, end - dt.timedelta(days=1))
    clamped = False
    if cap is not None and end > cap:
        end, clamped = cap, True
    return start, end, clamped


def _name(common_name: str, unit: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION)]
    if unit:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def build_ca(key: PrivateKey, name: str, now: float, days: int = CA_DAYS) -> x509.Certificate:
    """A self-signed CA that may sign leaves only (pathLen 0)."""
    validate_common_name(name, "CA name")
    start, end, _ = validity(now, days)
    subject = _name(name)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
    )
    return builder.sign(key, _signing_hash(key))


def build_leaf(
    *,
    ca_cert: x509.Certificate,
    ca_key: PrivateKey,
    public_key: object,
    kind: Kind,
    common_name: str,
    now: float,
    days: int = LEAF_DAYS,
    dns: Sequence[str] = (),
    ips: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address] = (),
    not_after: float | None = None,
) -> tuple[x509.Certificate, bool]:
    """A server, node, operator or viewer certificate signed by the CA; returns (cert, clamped)."""
    if kind == "server":
        unit, usage = None, ExtendedKeyUsageOID.SERVER_AUTH
    elif kind == "node":
        unit, usage = NODE_OU, ExtendedKeyUsageOID.CLIENT_AUTH
    elif kind == "operator":
        unit, usage = OPERATOR_OU, ExtendedKeyUsageOID.CLIENT_AUTH
    elif kind == "viewer":
        unit, usage = VIEWER_OU, ExtendedKeyUsageOID.CLIENT_AUTH
    elif kind == "gateway":
        unit, usage = GATEWAY_OU, ExtendedKeyUsageOID.CLIENT_AUTH
    else:
        raise ValueError(f"not a leaf kind: {kind!r}")
    validate_common_name(common_name)
    start, end, clamped = validity(now, days, not_after, cap=ca_cert.not_valid_after_utc)
    is_rsa = isinstance(public_key, rsa.RSAPublicKey)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, unit))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=is_rsa,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)  # type: ignore[arg-type]
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
    sans += [x509.IPAddress(addr) for addr in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, _signing_hash(ca_key)), clamped
