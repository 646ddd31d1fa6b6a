"""Revocation: the deny list of certificate serials, written by `llmgw ctl cert revoke` (and by a
`--force` reissue, for the certificate it replaces) and read by the server.

A plain list of serials rather than an X.509 CRL: the server only ever asks "is this verified
peer's serial denied?", the file is small (one entry per revoked certificate, kept until the CA
is replaced) and an operator can read it. The server loads it at start and again on SIGHUP or
`llmgw ctl reload` (tls.deny_list in its config), checks it at every fleet handshake and for
operator/viewer certificates on the public port, and ends live fleet streams whose certificate
became denied. Serials are 159 random bits, so one list serves every port and CA without
collisions.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from llmgw.errors import UsageError
from llmgw.tls.identity import HasPeerCert, peer_common_name, peer_kind, peer_serial

log = logging.getLogger("llmgw.tls")

DENY_LIST = "revoked.json"  # its name in the CA directory


class Revoked(msgspec.Struct, kw_only=True):
    serial: str  # lower-case hex, as `ctl cert list` shows it
    common_name: str
    kind: str
    revoked_at: float
    reason: str = ""


class DenyList(msgspec.Struct, kw_only=True):
    revoked: list[Revoked] = []

    def serials(self) -> frozenset[int]:
        return frozenset(int(r.serial, 16) for r in self.revoked)


def read_deny_list(path: str | Path, *, missing_ok: bool = False) -> DenyList:
    """The deny list at `path`; UsageError naming the file when it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return DenyList()
        raise UsageError(f"deny list {path} does not exist "
                         "(write it with `llmgw ctl cert revoke`, copied from the CA directory)")
    except OSError as exc:
        raise UsageError(f"cannot read deny list {path}: {exc.strerror or exc}")
    try:
        deny = msgspec.json.decode(data, type=DenyList)
        deny.serials()
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise UsageError(f"deny list {path} is not a deny list written by `llmgw ctl cert revoke`: {exc}")
    return deny


class Revocations:
    """The server's copy of the deny list (empty without tls.deny_list), reloaded on demand."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self.denied: frozenset[int] = read_deny_list(path).serials() if path else frozenset()

    def reload(self) -> str:
        """Re-read the file; on failure the previous list stays. Returns a line for the log."""
        if not self.path:
            return ""
        try:
            denied = read_deny_list(self.path).serials()
        except UsageError as exc:
            log.error("deny list not reloaded, keeping %d serials: %s", len(self.denied), exc)
            return f"deny list not reloaded: {exc}"
        added = len(denied - self.denied)
        self.denied = denied
        log.info("deny list %s: %d revoked serial(s) (%d new)", self.path, len(denied), added)
        return f"deny list: {len(denied)} revoked serial(s)"

    def refuses(self, peer: HasPeerCert) -> bool:
        serial = peer_serial(peer)
        return serial is not None and serial in self.denied


def gateway_refusal(peer: HasPeerCert, revocations: Revocations) -> tuple[str, str] | None:
    """Why the gateway feed refuses this verified peer: a revoked serial, or any certificate that
    is not a gateway certificate (OU=gateways). A node certificate reads only its own shards'
    business, a viewer only the API; neither may hold every engine's key."""
    name = peer_common_name(peer)
    serial = peer_serial(peer)
    if serial is not None and serial in revocations.denied:
        return "revoked", (f"the client certificate {name!r} (serial {serial:x}) is revoked; issue a new one with "
                           f"`llmgw ctl cert gateway {name} --force`")
    kind = peer_kind(peer)
    if kind != "gateway":
        what = f"an {kind}" if kind == "operator" else f"a {kind}" if kind else "not an llmgw"
        return "not_gateway", (f"the client certificate {name!r} is {what} certificate, not a gateway certificate "
                               f"(OU=gateways); issue one with `llmgw ctl cert gateway NAME` "
                               "(a name no other kind holds)")
    return None


def fleet_refusal(peer: HasPeerCert, revocations: Revocations, *, require_node: bool) -> tuple[str, str] | None:
    """Why the fleet port refuses this verified peer, as (metric reason, message for the agent),
    or None. A revoked serial is refused always; with `require_node` (tls.require_identity) only
    a node certificate (OU=nodes) may register, so an operator or viewer certificate named
    gpu-01 is not node gpu-01."""
    name = peer_common_name(peer)
    serial = peer_serial(peer)
    if serial is not None and serial in revocations.denied:
        return "revoked", (f"the client certificate {name!r} (serial {serial:x}) is revoked; issue a new one with "
                           f"`llmgw ctl cert node {name} --force` and give the agent that pair")
    kind = peer_kind(peer)
    # A gateway certificate is never a node, whatever the config.
    if (require_node or kind == "gateway") and kind != "node":
        what = f"an {kind}" if kind == "operator" else f"a {kind}" if kind else "not an llmgw"
        return "not_node", (f"the client certificate {name!r} is {what} certificate, not a node certificate "
                            f"(OU=nodes); issue one with `llmgw ctl cert node {name}`")
    return None
