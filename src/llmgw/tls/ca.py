"""The cluster CA on disk: create it, issue certificates from it, and record what it issued.

Layout of a CA directory (mode 0700):
    ca.crt, ca.key (0600)       the CA
    issued/<serial>.json        one record per issued certificate (its PEM, kind, where written)
    revoked.json                the deny list: revoked serials (`cert revoke`, `--force` reissues)
    <prefix>.crt, <prefix>.key  issued certificates, unless --out puts them elsewhere
One record file per certificate keeps issuing atomic without a shared index to rewrite; the deny
list is rewritten whole (atomically) on each revocation.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from llmgw.errors import LlmgwError, UsageError
from llmgw.fsutil import ensure_dir, write_atomic
from llmgw.tls.build import (
    CA_DAYS,
    DEFAULT_KEY_TYPE,
    LEAF_DAYS,
    Kind,
    PrivateKey,
    build_ca,
    build_leaf,
    generate_key,
    split_hosts,
    validate_common_name,
    validate_node_id,
    validate_operator_name,
)
from llmgw.tls.context import check_key_mode
from llmgw.tls.info import CertInfo, describe
from llmgw.tls.revocation import DENY_LIST, DenyList, Revoked, read_deny_list

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
ISSUED_DIR = "issued"
from llmgw.tls.defaults import DEFAULT_CA_NAME  # noqa: E402 - re-exported

# The server's own gateway workers' names (server/gateway/workers.py): no remote gateway may take one.
LOCAL_WORKER_NAME = re.compile(r"worker-[0-9]+")

_KIND_ORDER = {"ca": 0, "server": 1, "node": 2, "operator": 3, "viewer": 4, "gateway": 5}
# Kinds that identify a client: one name holds one of them, so a name always means one thing.
ClientKind = Literal["node", "operator", "viewer", "gateway"]
CLIENT_KINDS: tuple[ClientKind, ...] = get_args(ClientKind)


class IssuedRecord(msgspec.Struct, kw_only=True):
    """What `issued/<serial>.json` holds."""

    kind: str
    serial: str
    common_name: str
    cert: str
    key: str
    issued_at: float
    pem: str


class Issued(msgspec.Struct, kw_only=True):
    info: CertInfo
    # The requested validity ran past the CA's own expiry and was cut to it.
    clamped: bool = False
    # The serial of the certificate a --force reissue replaced, now on the deny list.
    revoked: str | None = None


@dataclasses.dataclass(frozen=True)
class Ca:
    directory: Path
    cert: x509.Certificate
    key: PrivateKey
    cert_path: Path
    key_path: Path


def _key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _same_key(cert: x509.Certificate, key: PrivateKey) -> bool:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    return cert.public_key().public_bytes(der, spki) == key.public_key().public_bytes(der, spki)


def init_ca(
    directory: str | Path,
    *,
    now: float,
    name: str = DEFAULT_CA_NAME,
    days: int = CA_DAYS,
    key_type: str = DEFAULT_KEY_TYPE,
    force: bool = False,
) -> CertInfo:
    """Create the CA key and self-signed certificate; refuse to replace one unless `force`."""
    validate_common_name(name, "CA name")
    root = private_dir(directory)
    cert_path, key_path = root / CA_CERT, root / CA_KEY
    existing = [p for p in (cert_path, key_path) if p.exists()]
    if existing and not force:
        raise LlmgwError(
            f"a CA already exists in {root} ({', '.join(p.name for p in existing)}); "
            "pass --force to replace it (certificates it issued will stop being trusted)"
        )
    key = generate_key(key_type)
    cert = build_ca(key, name, now, days)
    write_atomic(key_path, _key_pem(key), mode=0o600, replace=force)
    write_atomic(cert_path, _cert_pem(cert), mode=0o644, replace=force)
    # An empty deny list from the start, so a server's tls.deny_list can point at it before the
    # first revocation (the server refuses to start with a deny list that does not exist).
    _write_deny_list(root, DenyList())
    return describe(cert, str(cert_path), now, key=str(key_path))


def private_dir(directory: str | Path) -> Path:
    """The CA directory, created with mode 0700 or tightened to it: ca.key and every issued key
    live there. LlmgwError when a looser directory cannot be tightened (not its owner)."""
    root = ensure_dir(directory, mode=0o700)
    mode = stat.S_IMODE(root.stat().st_mode)
    if mode & 0o077:
        try:
            os.chmod(root, 0o700)
        except OSError as exc:
            raise LlmgwError(
                f"CA directory {root} is mode {mode:04o} (others could read or replace its keys) and cannot be "
                f"made 0700: {exc.strerror or exc}; as its owner run `chmod 700 {root}`, or use another --dir"
            ) from None
    return root


def load_ca(directory: str | Path) -> Ca:
    root = Path(directory)
    cert_path, key_path = root / CA_CERT, root / CA_KEY
    if not cert_path.exists() and not key_path.exists():
        raise LlmgwError(f"no CA in {root} ({CA_CERT} missing); create one with `llmgw ctl cert init --dir {root}`")
    try:
        cert_data = cert_path.read_bytes()
        key_data = key_path.read_bytes()
    except FileNotFoundError as exc:
        raise LlmgwError(f"the CA in {root} is incomplete: {exc.filename} is missing")
    except PermissionError as exc:
        raise LlmgwError(f"cannot read {exc.filename}: permission denied (run as the CA's owner)")
    check_key_mode(key_path)
    try:
        cert = x509.load_pem_x509_certificate(cert_data)
    except ValueError:
        raise LlmgwError(f"{cert_path} is not a PEM certificate")
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except TypeError:
        raise LlmgwError(f"{key_path} is encrypted; llmgw needs the CA key unencrypted (mode 0600)")
    except ValueError:
        raise LlmgwError(f"{key_path} is not a PEM private key")
    if not _same_key(cert, key):  # type: ignore[arg-type]
        raise LlmgwError(f"{key_path} does not match {cert_path}; the CA directory is inconsistent")
    return Ca(directory=root, cert=cert, key=key, cert_path=cert_path, key_path=key_path)  # type: ignore[arg-type]


def _prefix(root: Path, out: str | None, default_base: str) -> Path:
    if out is None:
        return root / default_base
    path = Path(out)
    if out.endswith(("/", "\\")) or path.is_dir():
        return path / default_base
    if path.suffix in (".crt", ".key", ".pem"):
        path = path.with_suffix("")
    return path


def _issue(
    directory: str | Path,
    *,
    kind: Kind,
    common_name: str,
    default_base: str,
    now: float,
    days: int,
    out: str | None,
    key_type: str,
    force: bool,
    dns: Sequence[str] = (),
    ips: Sequence = (),
    not_after: float | None = None,
) -> Issued:
    ca = load_ca(directory)
    prefix = _prefix(ca.directory, out, default_base)
    cert_path = prefix.with_name(prefix.name + ".crt")
    key_path = prefix.with_name(prefix.name + ".key")
    if not force:
        for path in (cert_path, key_path):
            if path.exists():
                raise LlmgwError(f"{path} already exists; pass --force to replace it, or --out another prefix")
    replaced = None
    if kind in CLIENT_KINDS:
        _refuse_second_kind(ca, kind, common_name, now)
        replaced = _replaced_serial(ca, cert_path, kind)
    key = generate_key(key_type)
    cert, clamped = build_leaf(
        ca_cert=ca.cert,
        ca_key=ca.key,
        public_key=key.public_key(),
        kind=kind,
        common_name=common_name,
        now=now,
        days=days,
        dns=dns,
        ips=ips,
        not_after=not_after,
    )
    ensure_dir(prefix.parent)
    write_atomic(key_path, _key_pem(key), mode=0o600, replace=force)
    write_atomic(cert_path, _cert_pem(cert), mode=0o644, replace=force)
    serial = format(cert.serial_number, "x")
    record = IssuedRecord(
        kind=kind,
        serial=serial,
        common_name=common_name,
        cert=str(cert_path.resolve()),
        key=str(key_path.resolve()),
        issued_at=now,
        pem=_cert_pem(cert).decode(),
    )
    issued_dir = ensure_dir(ca.directory / ISSUED_DIR, mode=0o755)
    write_atomic(issued_dir / f"{serial}.json", msgspec.json.encode(record), mode=0o644)
    if replaced is not None:
        _deny(ca.directory, [Revoked(serial=replaced, common_name=common_name, kind=kind, revoked_at=now,
                                     reason=f"superseded by {serial}")])
    return Issued(info=describe(cert, str(cert_path), now, key=str(key_path)), clamped=clamped, revoked=replaced)


def _record_cert(ca: Ca, rec: IssuedRecord) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(rec.pem.encode())
    except ValueError:
        raise LlmgwError(f"issue record {ca.directory / ISSUED_DIR / rec.serial}.json holds no certificate") from None


def _refuse_second_kind(ca: Ca, kind: str, common_name: str, now: float) -> None:
    """One name, one kind: an operator certificate named gpu-01 beside node gpu-01's would make
    the name mean two things. Revoked and expired certificates do not count."""
    denied = deny_list(ca.directory).serials()
    for rec in read_records(ca.directory):
        if rec.common_name != common_name or rec.kind == kind or rec.kind not in CLIENT_KINDS:
            continue
        if int(rec.serial, 16) in denied or _record_cert(ca, rec).not_valid_after_utc.timestamp() <= now:
            continue
        raise LlmgwError(
            f"{common_name!r} already has {'an' if rec.kind == 'operator' else 'a'} {rec.kind} certificate "
            f"(serial {rec.serial}, {rec.cert}); one name "
            f"holds one kind: choose another name for the {kind}, or revoke that one first "
            f"(`llmgw ctl cert revoke {rec.serial}`)"
        )


def _replaced_serial(ca: Ca, cert_path: Path, kind: str) -> str | None:
    """The serial of the certificate this --force reissue overwrites, when this CA issued it as the
    same kind: it is denied once the new one is written (a replaced key must stop working)."""
    if not cert_path.exists():
        return None
    try:
        old = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError):
        return None
    serial = format(old.serial_number, "x")
    if not any(rec.serial == serial and rec.kind == kind for rec in read_records(ca.directory)):
        return None
    return None if int(serial, 16) in deny_list(ca.directory).serials() else serial


def deny_list(directory: str | Path) -> DenyList:
    """The CA directory's deny list (empty when nothing was ever revoked)."""
    return read_deny_list(Path(directory) / DENY_LIST, missing_ok=True)


def _deny(directory: Path, entries: list[Revoked]) -> Path:
    current = deny_list(directory)
    known = {r.serial for r in current.revoked}
    current.revoked.extend(e for e in entries if e.serial not in known)
    return _write_deny_list(directory, current)


def _write_deny_list(directory: Path, deny: DenyList) -> Path:
    path = directory / DENY_LIST
    write_atomic(path, msgspec.json.format(msgspec.json.encode(deny), indent=2) + b"\n", mode=0o644, replace=True)
    return path


class Revocation(msgspec.Struct, kw_only=True):
    """What `ctl cert revoke` did."""

    deny_list: str
    revoked: list[Revoked]
    already: list[str] = []  # serials that were on the list before


def revoke(directory: str | Path, target: str, *, now: float, reason: str = "") -> Revocation:
    """Put a certificate on the deny list by serial (hex, as `cert list` shows it; a unique
    prefix of 8 or more digits will do) or every certificate with that common name."""
    ca = load_ca(directory)
    records = read_records(ca.directory)
    wanted = target.strip().lower().removeprefix("0x").replace(":", "")
    chosen = [r for r in records if r.serial == wanted]
    if not chosen and len(wanted) >= 8:
        chosen = [r for r in records if r.serial.startswith(wanted)]
        if len(chosen) > 1:
            raise UsageError(f"serial prefix {target!r} matches {len(chosen)} certificates; give more digits")
    if not chosen:
        chosen = [r for r in records if r.common_name == target]
    if not chosen:
        raise UsageError(f"no certificate with serial or name {target!r} in {ca.directory} (see `llmgw ctl cert list`)")
    denied = {r.serial for r in deny_list(ca.directory).revoked}
    fresh = [Revoked(serial=r.serial, common_name=r.common_name, kind=r.kind, revoked_at=now, reason=reason)
             for r in chosen if r.serial not in denied]
    path = _deny(ca.directory, fresh) if fresh else ca.directory / DENY_LIST
    return Revocation(deny_list=str(path.resolve()), revoked=fresh,
                      already=[r.serial for r in chosen if r.serial in denied])


def issue_server(
    directory: str | Path,
    *,
    hosts: Sequence[str],
    ips: Sequence[str],
    now: float,
    days: int = LEAF_DAYS,
    name: str | None = None,
    out: str | None = None,
    key_type: str = DEFAULT_KEY_TYPE,
    force: bool = False,
    not_after: float | None = None,
) -> Issued:
    """A serverAuth certificate whose SANs hold every host and IP agents dial."""
    dns, addrs = split_hosts(hosts, ips)
    common_name = name if name is not None else (dns[0] if dns else str(addrs[0]))
    return _issue(
        directory,
        kind="server",
        common_name=common_name,
        default_base="server",
        now=now,
        days=days,
        out=out,
        key_type=key_type,
        force=force,
        dns=dns,
        ips=addrs,
        not_after=not_after,
    )


def issue_client(
    directory: str | Path,
    kind: ClientKind,
    name: str,
    *,
    now: float,
    days: int = LEAF_DAYS,
    out: str | None = None,
    key_type: str = DEFAULT_KEY_TYPE,
    force: bool = False,
    not_after: float | None = None,
) -> Issued:
    """A clientAuth certificate with CN = `name`, by default DIR/<kind>-<name>.crt and .key. The
    kind is its OU, which is what the server reads (server/auth.py, fleet/identity):
        node      OU=nodes: the CN is the node id the agent registers as; the fleet port only
        operator  OU=operators: `llmgw ctl` against the public API, changes included
        viewer    OU=viewers: reads /api/v1, /admin and /metrics, never mutates
        gateway   OU=gateways: follows the gateway feed on the fleet port (the endpoint set and the
                  engines' keys), never registers as a node, never reaches the API
    """
    if kind == "node":
        validate_node_id(name)
    else:
        validate_operator_name(name)
    if kind == "gateway" and LOCAL_WORKER_NAME.fullmatch(name):
        raise UsageError(f"gateway name {name!r} is what the server calls its own gateway workers (their series in "
                         "/metrics carry the same `worker` label): choose another, as in gw-1")
    return _issue(
        directory,
        kind=kind,
        common_name=name,
        default_base=f"{kind}-{name}",
        now=now,
        days=days,
        out=out,
        key_type=key_type,
        force=force,
        not_after=not_after,
    )


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def read_records(directory: str | Path) -> list[IssuedRecord]:
    issued = Path(directory) / ISSUED_DIR
    if not issued.is_dir():
        return []
    records = []
    for path in sorted(issued.glob("*.json")):
        try:
            records.append(msgspec.json.decode(path.read_bytes(), type=IssuedRecord))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LlmgwError(f"cannot read issue record {path}: {exc}; move it aside to list the rest")
    return records


def list_certificates(directory: str | Path, now: float) -> list[CertInfo]:
    """The CA and every certificate it issued, oldest first, with a status each.

    A record whose file was later replaced by a reissue is "superseded"; one on the deny list is
    "revoked"; one that the current CA did not sign (the CA was re-created with --force) is
    "other CA".
    """
    ca = load_ca(directory)
    records = read_records(ca.directory)
    standing = _Standing(ca, records)
    rows: list[tuple[int, float, CertInfo]] = [
        (0, 0.0, describe(ca.cert, str(ca.cert_path.resolve()), now, key=str(ca.key_path.resolve())))]
    for rec in records:
        cert = _record_cert(ca, rec)
        info = describe(cert, rec.cert, now, key=rec.key)
        info.status = standing.status(cert, info.status)
        rows.append((_KIND_ORDER.get(info.kind, 9), rec.issued_at, info))
    rows.sort(key=lambda row: (row[0], row[1]))
    return [info for _, _, info in rows]


def status_in_ca(directory: str | Path, cert: x509.Certificate, dated: str) -> str:
    """What `cert list` says of this certificate (`cert show --dir`): one source of status.
    `dated`: its status from its dates alone (llmgw.tls.info.status_of)."""
    ca = load_ca(directory)
    return _Standing(ca, read_records(ca.directory)).status(cert, dated)


class _Standing:
    """A certificate's standing with its CA: signed by it, on its deny list, reissued since."""

    def __init__(self, ca: Ca, records: list[IssuedRecord]) -> None:
        self.ca = ca
        self.denied = deny_list(ca.directory).serials()
        latest: dict[str, float] = {}
        for rec in records:
            latest[rec.cert] = max(latest.get(rec.cert, rec.issued_at), rec.issued_at)
        self.superseded = {rec.serial for rec in records if rec.issued_at < latest[rec.cert]}

    def status(self, cert: x509.Certificate, dated: str) -> str:
        if cert == self.ca.cert:
            return dated
        if not _issued_by(cert, self.ca.cert):
            return "other CA"
        if cert.serial_number in self.denied:
            return "revoked"
        if format(cert.serial_number, "x") in self.superseded:
            return "superseded"
        return dated

