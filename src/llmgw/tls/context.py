"""SSL contexts for the fleet port, the public port and their clients.

Files are checked with `cryptography` before OpenSSL sees them, so a wrong path, an encrypted
key or a key from another pair is reported as one line naming the file, not "[SSL] PEM lib".
"""

from __future__ import annotations

import hashlib
import os
import ssl
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives import serialization

from llmgw.errors import UsageError
from llmgw.tls.info import load_certificates

# RFC 9113 §9.2.2: HTTP/2 over TLS 1.2 needs ephemeral key exchange and an AEAD cipher.
# TLS 1.3 suites are not affected by this string.
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{what} file {path} does not exist")
    except IsADirectoryError:
        raise UsageError(f"{what} file {path} is a directory")
    except PermissionError:
        raise UsageError(f"cannot read {what} file {path}: permission denied")


def check_key_mode(key: str | os.PathLike[str]) -> None:
    """UsageError when group or others may access a private key file (mode & 0o077), as ssh
    refuses such keys: whoever else can read it can be this node, operator or server. Checked
    from the mode bits alone, so it holds for root too."""
    try:
        mode = stat.S_IMODE(os.stat(key).st_mode)
    except OSError:
        return  # reading it names the problem
    if mode & 0o077:
        raise UsageError(
            f"key file {key} is mode {mode:04o}: group or others can access it, so llmgw refuses it; "
            f"fix: chmod 600 {key}"
        )


def check_key_pair(cert: str, key: str) -> None:
    """UsageError naming the file when the pair cannot be used: missing, readable by others,
    encrypted, mismatched."""
    certs = load_certificates(cert)
    data = _read(key, "key")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise UsageError(
            f"key file {key} is encrypted; llmgw needs an unencrypted key (keep it mode 0600): "
            f"`openssl pkey -in {key} -out {key}.plain`"
        )
    except ValueError:
        if b"BEGIN CERTIFICATE" in data:
            raise UsageError(f"key file {key} holds a certificate, not a private key")
        raise UsageError(f"key file {key} holds no private key (expected PEM: -----BEGIN PRIVATE KEY-----)")
    except Exception as exc:  # cryptography raises UnsupportedAlgorithm for exotic keys
        raise UsageError(f"key file {key} cannot be used: {exc}")
    check_key_mode(key)
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if certs[0].public_key().public_bytes(der, spki) != private.public_key().public_bytes(der, spki):
        raise UsageError(
            f"key file {key} does not match certificate {cert}; use the .key written next to that .crt"
        )


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    check_key_pair(cert, key)
    try:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    except (ssl.SSLError, OSError) as exc:
        raise UsageError(f"cannot load certificate {cert} with key {key}: {exc}")


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    load_certificates(ca)
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise UsageError(f"cannot load CA file {ca}: {exc}")


def _harden(ctx: ssl.SSLContext, alpn: Sequence[str]) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_ciphers(_TLS12_CIPHERS)
    # Python 3.13's defaults: reject malformed certificates; trust an intermediate given as CA.
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN
    if alpn:
        ctx.set_alpn_protocols(list(alpn))


def server_context(
    cert: str,
    key: str,
    ca: str | None = None,
    require_client_cert: bool = False,
    alpn: Sequence[str] = ("h2", "http/1.1"),
) -> ssl.SSLContext:
    """A server context (TLS >= 1.2). With `ca`, client certificates are verified against it:
    required when `require_client_cert` (the fleet port), optional otherwise (the public port,
    where an operator certificate is one credential among others)."""
    if require_client_cert and not ca:
        raise UsageError("requiring client certificates needs a CA file to verify them (tls.ca)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx, alpn)
    _load_chain(ctx, cert, key)
    if ca:
        _load_ca(ctx, ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


class TakesContext(Protocol):
    """A listener that hands each new connection its `ssl_context` (web.server.HttpServer)."""

    ssl_context: ssl.SSLContext | None


class ServerTls:
    """The public port's TLS, built from its files (`public_tls` cert, key and optional client CA)
    with `server_context`, and built again from the same files on `reload()` (SIGHUP, `ctl
    reload`): a certificate renewed in place (certbot, cert-manager) reaches the next handshake of
    every listener `attach`ed here without a restart, while open connections keep theirs.
    `digest` changes when any of the files does (gateway workers rebuild theirs on it)."""

    def __init__(self, cert: str, key: str, ca: str = "", *, alpn: Sequence[str] = ("http/1.1",)) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self.alpn = tuple(alpn)
        self.context, self.digest = self._build()
        self._listeners: list[TakesContext] = []

    def _build(self) -> tuple[ssl.SSLContext, str]:
        ctx = server_context(self.cert, self.key, self.ca or None, require_client_cert=False, alpn=self.alpn)
        digest = hashlib.sha256()
        for path in (self.cert, self.key, self.ca):
            digest.update(_read(path, "certificate") if path else b"")
            digest.update(b"\0")
        return ctx, digest.hexdigest()

    def attach(self, listener: TakesContext) -> None:
        listener.ssl_context = self.context
        self._listeners.append(listener)

    def reload(self) -> bool:
        """Read the files again; True when they changed. A UsageError (one line naming the file)
        leaves the running context in place."""
        context, digest = self._build()
        if digest == self.digest:
            return False
        self.context, self.digest = context, digest
        for listener in self._listeners:
            listener.ssl_context = context
        return True


def client_context(
    ca: str,
    cert: str | None = None,
    key: str | None = None,
    alpn: Sequence[str] = ("h2",),
) -> ssl.SSLContext:
    """A client context that trusts only `ca` and checks the server's name or IP against its
    SANs; `cert`/`key` are the client certificate (node or operator) when the server asks."""
    if (cert is None) != (key is None):
        missing = "key" if key is None else "cert"
        raise UsageError(f"a client certificate needs both cert and key files; the {missing} is missing")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    _harden(ctx, alpn)
    _load_ca(ctx, ca)
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key)
    return ctx
