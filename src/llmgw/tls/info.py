"""What a certificate says (subject, SANs, usages, expiry), for `ctl cert list/show` and checks."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import UsageError
from llmgw.tls.build import CLIENT_OUS, describe_key

# A certificate this close to expiry is flagged in listings.
EXPIRES_SOON_DAYS = 30

_EKU_NAMES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
    ExtendedKeyUsageOID.CODE_SIGNING: "codeSigning",
    ExtendedKeyUsageOID.EMAIL_PROTECTION: "emailProtection",
    ExtendedKeyUsageOID.TIME_STAMPING: "timeStamping",
    ExtendedKeyUsageOID.OCSP_SIGNING: "OCSPSigning",
}
_KU_FLAGS = (
    ("digital_signature", "digitalSignature"),
    ("content_commitment", "nonRepudiation"),
    ("key_encipherment", "keyEncipherment"),
    ("data_encipherment", "dataEncipherment"),
    ("key_agreement", "keyAgreement"),
    ("key_cert_sign", "keyCertSign"),
    ("crl_sign", "cRLSign"),
)


class CertInfo(msgspec.Struct, kw_only=True):
    """One certificate as `ctl cert list/show -o json` prints it."""

    path: str
    kind: str
    subject: str
    common_name: str | None
    issuer: str
    sans: list[str]
    usages: list[str]
    is_ca: bool
    serial: str
    not_before: str
    not_after: str
    not_after_unix: float
    days_left: float
    status: str
    key_type: str
    sha256: str
    key: str | None = None


def iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_certificates(path: str) -> list[x509.Certificate]:
    """Every certificate in a PEM file; UsageError naming the file when there is none."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"certificate file {path} does not exist")
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory, not a certificate file")
    except PermissionError:
        raise UsageError(f"cannot read {path}: permission denied")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        if b"PRIVATE KEY-----" in data:
            raise UsageError(f"{path} holds a private key, not a certificate (the .crt file is next to it)")
        try:
            return [x509.load_der_x509_certificate(data)]
        except ValueError:
            raise UsageError(f"{path} holds no certificate (expected PEM: -----BEGIN CERTIFICATE-----)")
    return certs


def load_certificate(path: str) -> x509.Certificate:
    return load_certificates(path)[0]


def common_name(name: x509.Name) -> str | None:
    values = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(values[0].value) if len(values) == 1 else None


def sans_of(cert: x509.Certificate) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    out = [f"DNS:{v}" for v in ext.get_values_for_type(x509.DNSName)]
    out += [f"IP:{v}" for v in ext.get_values_for_type(x509.IPAddress)]
    out += [f"email:{v}" for v in ext.get_values_for_type(x509.RFC822Name)]
    out += [f"URI:{v}" for v in ext.get_values_for_type(x509.UniformResourceIdentifier)]
    return out


def usages_of(cert: x509.Certificate) -> list[str]:
    out: list[str] = []
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        pass
    else:
        out += [label for attr, label in _KU_FLAGS if getattr(ku, attr)]
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        pass
    else:
        out += [_EKU_NAMES.get(oid, oid.dotted_string) for oid in eku]
    return out


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def client_kind(name: x509.Name) -> str | None:
    """"node", "operator" or "viewer" from the subject's OU (None: none of ours, or several)."""
    kinds = {CLIENT_OUS[str(a.value)] for a in name.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
             if a.value in CLIENT_OUS}
    return kinds.pop() if len(kinds) == 1 else None


def kind_of(cert: x509.Certificate) -> str:
    if is_ca(cert):
        return "ca"
    usages = usages_of(cert)
    kind = client_kind(cert.subject)
    if kind is not None:
        return kind
    if "serverAuth" in usages:
        return "server"
    if "clientAuth" in usages:
        return "node"
    return "other"


def days_until(cert: x509.Certificate, now: float) -> float:
    return (cert.not_valid_after_utc.timestamp() - now) / 86400.0


def status_of(cert: x509.Certificate, now: float) -> str:
    if cert.not_valid_before_utc.timestamp() > now:
        return "not yet valid"
    left = days_until(cert, now)
    if left <= 0:
        return "expired"
    if left < EXPIRES_SOON_DAYS:
        return "expires soon"
    return "ok"


def describe(cert: x509.Certificate, path: str, now: float, key: str | None = None) -> CertInfo:
    left = days_until(cert, now)
    return CertInfo(
        path=path,
        key=key,
        kind=kind_of(cert),
        subject=cert.subject.rfc4514_string(),
        common_name=common_name(cert.subject),
        issuer=cert.issuer.rfc4514_string(),
        sans=sans_of(cert),
        usages=usages_of(cert),
        is_ca=is_ca(cert),
        serial=format(cert.serial_number, "x"),
        not_before=iso(cert.not_valid_before_utc),
        not_after=iso(cert.not_valid_after_utc),
        not_after_unix=cert.not_valid_after_utc.timestamp(),
        days_left=round(left, 2),
        status=status_of(cert, now),
        key_type=describe_key(cert.public_key()),
        sha256=cert.fingerprint(hashes.SHA256()).hex(),
    )


def cert_not_after(path: str) -> float:
    """The certificate's expiry as unix time (first certificate of the file)."""
    return load_certificate(path).not_valid_after_utc.timestamp()


def days_left(path: str, now: float) -> float:
    """Days until the certificate at `path` expires; negative once it has."""
    return (cert_not_after(path) - now) / 86400.0
