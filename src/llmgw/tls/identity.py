"""Who is on the other end of a verified TLS connection.

Reads `getpeercert()`, which is non-empty only when the peer's certificate was verified against
the context's CA, so an unverified certificate never yields an identity. Works on ssl.SSLObject,
ssl.SSLSocket and trio.SSLStream (which forwards getpeercert).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from llmgw.tls.build import CLIENT_OUS, OPERATOR_OU


class HasPeerCert(Protocol):
    def getpeercert(self) -> Mapping[str, Any] | None: ...


def _subject_values(ssl_object: HasPeerCert, attribute: str) -> list[str] | None:
    cert = ssl_object.getpeercert()
    if not cert:
        return None
    return [value for rdn in cert.get("subject", ()) for key, value in rdn if key == attribute]


def peer_common_name(ssl_object: HasPeerCert) -> str | None:
    """The CN of the verified client (or server) certificate; None without one, or when the
    subject holds several CNs (ambiguous, so no identity)."""
    values = _subject_values(ssl_object, "commonName")
    if not values or len(values) != 1:
        return None
    return values[0]


def peer_units(ssl_object: HasPeerCert) -> list[str]:
    """The OUs of the verified peer certificate (empty without one): what kind of certificate
    `llmgw ctl cert` issued (nodes, operators, viewers)."""
    return _subject_values(ssl_object, "organizationalUnitName") or []


def peer_is_operator(ssl_object: HasPeerCert) -> bool:
    """True for a verified certificate issued by `llmgw ctl cert operator` (OU=operators); node
    certificates (OU=nodes) and connections without a certificate are not operators."""
    values = _subject_values(ssl_object, "organizationalUnitName")
    return values is not None and OPERATOR_OU in values


def peer_kind(ssl_object: HasPeerCert) -> str | None:
    """"node", "operator" or "viewer" for a verified certificate from `llmgw ctl cert` (by its
    OU); None without a certificate, for one of no llmgw kind, or for one claiming two kinds."""
    values = _subject_values(ssl_object, "organizationalUnitName")
    kinds = {CLIENT_OUS[v] for v in values or () if v in CLIENT_OUS}
    return kinds.pop() if len(kinds) == 1 else None


def peer_serial(ssl_object: HasPeerCert) -> int | None:
    """The verified peer certificate's serial number (what a deny list names), None without one."""
    cert = ssl_object.getpeercert()
    serial = cert.get("serialNumber") if cert else None
    return int(serial, 16) if serial else None
