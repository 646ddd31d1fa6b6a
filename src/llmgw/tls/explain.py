"""Turn a TLS failure into one line an operator can act on.

Pure: inspects the exception (and, when the caller has it, the certificate the peer presented)
and returns text. OpenSSL's own words ("certificate verify failed: IP address mismatch") say
what broke but not which certificate to reissue, with which flags; this says both.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Iterator
from typing import Literal

from cryptography import x509

from llmgw.tls.info import sans_of

Side = Literal["client", "server"]

# OpenSSL X509_V_ERR_* codes (x509_vfy.h), as ssl.SSLCertVerificationError.verify_code.
_V_SIGNATURE_FAILURE = 7
_V_NOT_YET_VALID = 9
_V_EXPIRED = 10
_V_DEPTH_ZERO_SELF_SIGNED = 18
_V_SELF_SIGNED_IN_CHAIN = 19
_V_NO_ISSUER_LOCALLY = 20
_V_UNABLE_TO_VERIFY_LEAF = 21
_V_INVALID_CA = 24
_V_INVALID_PURPOSE = 26
_V_HOSTNAME_MISMATCH = 62
_V_IP_MISMATCH = 64
_UNKNOWN_CA_CODES = {
    2,  # unable to get issuer certificate
    _V_SIGNATURE_FAILURE,
    _V_DEPTH_ZERO_SELF_SIGNED,
    _V_SELF_SIGNED_IN_CHAIN,
    _V_NO_ISSUER_LOCALLY,
    _V_UNABLE_TO_VERIFY_LEAF,
    _V_INVALID_CA,
}

_ALERT_WORDS = {
    "SSLV3_ALERT_BAD_CERTIFICATE": "bad certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "certificate unknown",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "unsupported certificate",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "certificate revoked",
    "TLSV1_ALERT_ACCESS_DENIED": "access denied",
    "TLSV1_ALERT_DECRYPT_ERROR": "decrypt error",
}
_VERSION_REASONS = {
    "TLSV1_ALERT_PROTOCOL_VERSION",
    "UNSUPPORTED_PROTOCOL",
    "NO_PROTOCOLS_AVAILABLE",
    "VERSION_TOO_LOW",
    "WRONG_SSL_VERSION",
}
_PLAINTEXT_REASONS = {"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "RECORD_LAYER_FAILURE",
                      "PACKET_LENGTH_TOO_LONG"}
_ALPN_REASONS = {"TLSV1_ALERT_NO_APPLICATION_PROTOCOL", "NO_APPLICATION_PROTOCOL"}
_NO_SHARED_REASONS = {"SSLV3_ALERT_HANDSHAKE_FAILURE", "NO_SHARED_CIPHER", "NO_SUITABLE_SIGNATURE_ALGORITHM",
                      "NO_SHARED_SIGNATURE_ALGORITHMS"}

CA_DIR_HINT = "<ca-dir>"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and everything it wraps (trio.BrokenResourceError wraps the SSLError as
    its __cause__; exception groups hold theirs in .exceptions)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        if isinstance(cur, BaseExceptionGroup):
            todo.extend(cur.exceptions)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None:
                todo.append(nxt)


def _find_ssl_error(exc: BaseException) -> ssl.SSLError | ssl.CertificateError | None:
    for cur in _chain(exc):
        if isinstance(cur, ssl.SSLError | ssl.CertificateError):
            return cur
    return None


def _as_cert(peer_cert: bytes | x509.Certificate | None) -> x509.Certificate | None:
    if peer_cert is None or isinstance(peer_cert, x509.Certificate):
        return peer_cert
    try:
        return x509.load_der_x509_certificate(peer_cert)
    except ValueError:
        try:
            return x509.load_pem_x509_certificate(peer_cert)
        except ValueError:
            return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _reissue_server(host: str, cert: x509.Certificate | None, ca_dir: str) -> str:
    hosts: list[str] = []
    ips: list[str] = []
    for san in sans_of(cert) if cert is not None else []:
        kind, _, value = san.partition(":")
        if kind == "DNS":
            hosts.append(value)
        elif kind == "IP":
            ips.append(value)
    bare = host.strip("[]")
    if _is_ip(bare):
        if bare not in ips:
            ips.append(bare)
    elif bare not in hosts:
        hosts.append(bare)
    flags = " ".join([*(f"--host {h}" for h in hosts), *(f"--ip {i}" for i in ips)])
    more = "" if cert is not None else " …"
    return f"`llmgw ctl cert server --dir {ca_dir} {flags}{more} --force`"


def _date(moment: object) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC") if hasattr(moment, "strftime") else str(moment)


def _client_side(err: ssl.SSLError | ssl.CertificateError, host: str, cert: x509.Certificate | None,
                 ca_dir: str) -> str | None:
    """We dialed `host`; say what is wrong with its certificate or why it refused ours."""
    code = getattr(err, "verify_code", None)
    detail = getattr(err, "verify_message", None) or str(err)
    if code in (_V_IP_MISMATCH, _V_HOSTNAME_MISMATCH):
        sans = ", ".join(sans_of(cert)) if cert is not None else None
        listed = (f"its SANs: {sans}" if sans
                  else ("it has no SANs" if cert is not None else f"{host} is not among its SANs"))
        return (
            f"server certificate is not valid for {host} ({listed}); "
            f"reissue it with {_reissue_server(host, cert, ca_dir)}"
        )
    if code == _V_EXPIRED:
        when = f" on {_date(cert.not_valid_after_utc)}" if cert is not None else ""
        return (
            f"the server certificate of {host} expired{when}; reissue it with {_reissue_server(host, cert, ca_dir)} "
            "and restart the server"
        )
    if code == _V_NOT_YET_VALID:
        when = f" until {_date(cert.not_valid_before_utc)}" if cert is not None else " yet"
        return (
            f"the server certificate of {host} is not valid{when}; check the clocks of this machine and of the one "
            "that issued it"
        )
    if code in _UNKNOWN_CA_CODES:
        issuer = f" (issued by {cert.issuer.rfc4514_string()})" if cert is not None else ""
        return (
            f"the server certificate of {host} is not signed by the CA we trust{issuer}: {detail}; "
            "point tls.ca at the cluster's ca.crt, or reissue the server certificate from that CA"
        )
    if code == _V_INVALID_PURPOSE:
        return (
            f"the certificate {host} presented is not a server certificate (no serverAuth usage); "
            f"issue one with {_reissue_server(host, cert, ca_dir)}"
        )
    if code is not None:
        return f"the server certificate of {host} failed verification: {detail}"
    reason = getattr(err, "reason", None) or ""
    node_hint = f"`llmgw ctl cert node <node-id> --dir {ca_dir}` (or `cert operator` for ctl)"
    if reason == "TLSV1_ALERT_UNKNOWN_CA":
        return (
            f"{host} refused our client certificate: it is not issued by the CA the server trusts; "
            f"issue one from the cluster CA with {node_hint}"
        )
    if reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED":
        return (
            f"{host} refused our client certificate: it has expired; reissue it with "
            f"`llmgw ctl cert node <node-id> --dir {ca_dir} --force` (or `cert operator … --force` for ctl)"
        )
    if reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return (
            f"{host} requires a client certificate and we sent none; set tls.cert and tls.key "
            f"(issue them with {node_hint})"
        )
    if reason == "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE":
        return (
            f"{host} refused our client certificate: it lacks clientAuth usage (a server certificate?); "
            f"issue one with {node_hint}"
        )
    if reason in _ALERT_WORDS:
        return (
            f"{host} refused our client certificate ({_ALERT_WORDS[reason]}); "
            "check it with `llmgw ctl cert show <cert>`"
        )
    return None


def _server_side(err: ssl.SSLError | ssl.CertificateError, host: str, ca_dir: str) -> str | None:
    """A client at `host` connected to us; say what was wrong with its certificate or ours."""
    code = getattr(err, "verify_code", None)
    detail = getattr(err, "verify_message", None) or str(err)
    who = f"client {host}"
    if code == _V_EXPIRED:
        return (
            f"{who} presented an expired certificate; "
            f"reissue it with `llmgw ctl cert node <node-id> --dir {ca_dir} --force`"
        )
    if code == _V_NOT_YET_VALID:
        return f"{who} presented a certificate that is not valid yet; check the clocks"
    if code in _UNKNOWN_CA_CODES:
        return (
            f"{who} presented a certificate not issued by our CA ({detail}); "
            f"issue it from the cluster CA with `llmgw ctl cert node <node-id> --dir {ca_dir}`"
        )
    if code == _V_INVALID_PURPOSE:
        return (
            f"{who} presented a certificate without clientAuth usage (a server certificate?); "
            f"issue a node certificate with `llmgw ctl cert node <node-id> --dir {ca_dir}`"
        )
    if code is not None:
        return f"{who} presented a certificate that failed verification: {detail}"
    reason = getattr(err, "reason", None) or ""
    if reason in ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "TLSV13_ALERT_CERTIFICATE_REQUIRED"):
        return (
            f"{who} sent no client certificate; agents need tls.cert and tls.key from "
            f"`llmgw ctl cert node <node-id> --dir {ca_dir}`"
        )
    if reason == "TLSV1_ALERT_UNKNOWN_CA":
        return (
            f"{who} does not trust our server certificate (not from the CA it has as tls.ca); "
            "give it the cluster's ca.crt"
        )
    if reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED":
        return (
            f"{who} refused our server certificate as expired; "
            f"reissue it with `llmgw ctl cert server --dir {ca_dir} --host … --ip … --force`"
        )
    if reason in ("SSLV3_ALERT_CERTIFICATE_UNKNOWN", "SSLV3_ALERT_BAD_CERTIFICATE"):
        return (
            f"{who} refused our server certificate ({_ALERT_WORDS[reason]}), most likely because the name or "
            "IP it dials is not among its SANs; compare with `llmgw ctl cert show <server.crt>`"
        )
    if reason == "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE":
        return (
            f"{who} refused our server certificate: it lacks serverAuth usage; "
            f"issue one with `llmgw ctl cert server --dir {ca_dir} --host … --ip …`"
        )
    return None


def _common(err: ssl.SSLError | ssl.CertificateError | None, exc: BaseException, host: str, side: Side) -> str:
    peer = f"{host}" if side == "client" else f"client {host}"
    reason = getattr(err, "reason", None) or ""
    if reason in _VERSION_REASONS:
        return f"no TLS version in common with {peer} (llmgw needs TLS 1.2 or newer)"
    if reason in _PLAINTEXT_REASONS:
        if side == "client":
            return (
                f"{host} did not answer in TLS "
                "(a plain-text port? a server run with --insecure needs an http:// URL)"
            )
        return f"{peer} did not speak TLS (is it configured with an http:// URL or --insecure?)"
    if reason in _ALPN_REASONS:
        return f"{peer} and we share no application protocol (ALPN); is this the llmgw fleet port?"
    if reason in _NO_SHARED_REASONS:
        return f"TLS handshake with {peer} failed: no cipher or key type in common ({reason.lower()})"
    if isinstance(err, ssl.SSLEOFError) or reason == "UNEXPECTED_EOF_WHILE_READING":
        if side == "client":
            return (
                f"{host} closed the connection during the TLS handshake; it most likely refused our client "
                "certificate (from another CA, expired, or none sent): see the server's log"
            )
        return (
            f"{peer} closed the connection during the TLS handshake; it most likely refused our server certificate: "
            "see its log"
        )
    for cur in _chain(exc):
        if isinstance(cur, ConnectionRefusedError):
            return f"cannot connect to {host}: connection refused (is the server running and listening there?)"
        if isinstance(cur, ConnectionResetError):
            return f"{peer} reset the connection during the TLS handshake"
        if isinstance(cur, TimeoutError):
            return f"TLS handshake with {peer} timed out"
    text = str(err) if err is not None else (str(exc) or type(exc).__name__)
    return f"TLS with {peer} failed: {text}"


def is_plain_http(exc: BaseException) -> bool:
    """Whether a failed server handshake met a plain-HTTP request: OpenSSL recognises one from its
    first bytes ("GET ", "POST", "HEAD", "PUT ", "CONNECT": HTTP_REQUEST, HTTPS_PROXY_REQUEST)."""
    return getattr(_find_ssl_error(exc), "reason", None) in ("HTTP_REQUEST", "HTTPS_PROXY_REQUEST")


def explain_tls_error(
    exc: BaseException,
    host: str,
    *,
    peer_cert: bytes | x509.Certificate | None = None,
    side: Side = "client",
    ca_dir: str = CA_DIR_HINT,
) -> str:
    """One line saying what failed and which `llmgw ctl cert` call fixes it.

    `host` is what we dialed (client side) or the peer's address (server side). `peer_cert`
    (DER, PEM or parsed) is the certificate the server presented, when the caller fetched it
    (see `llmgw.tls.net.fetch_server_certificate`): it lets a name mismatch list the SANs.
    """
    err = _find_ssl_error(exc)
    if err is not None:
        cert = _as_cert(peer_cert)
        line = _client_side(err, host, cert, ca_dir) if side == "client" else _server_side(err, host, ca_dir)
        if line is not None:
            return line
    return _common(err, exc, host, side)
