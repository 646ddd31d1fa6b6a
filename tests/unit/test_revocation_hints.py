"""The line a revoked gateway or node reads names the command that issues its new certificate,
and that command works as printed on the CA directory, where the revoked pair's files still are
(without --force it refused: "already exists; pass --force to replace it")."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from cryptography import x509

from llmgw.server.gateway.forwarded import ForwardedPeer
from llmgw.tls import ca as store
from llmgw.tls.revocation import Revocations, fleet_refusal, gateway_refusal


def peer(cert: Path, unit: str, name: str) -> ForwardedPeer:
    serial = x509.load_pem_x509_certificate(cert.read_bytes()).serial_number
    return ForwardedPeer({"subject": [[["organizationName", "llmgw"]], [["organizationalUnitName", unit]],
                                      [["commonName", name]]], "serialNumber": f"{serial:X}"})


def follow(hint: str, cadir: Path) -> subprocess.CompletedProcess[str]:
    command = re.search(r"`llmgw ([^`]+)`", hint)
    assert command, hint
    return subprocess.run([sys.executable, "-m", "llmgw", *shlex.split(command.group(1)), "--dir", str(cadir)],
                          capture_output=True, text=True, timeout=60)


def test_the_revoked_certificates_hint_issues_a_new_one_as_printed(tmp_path: Path) -> None:
    cadir = tmp_path / "ca"
    now = time.time()
    store.init_ca(cadir, now=now)
    store.issue_client(cadir, "gateway", "gw-1", now=now)
    store.issue_client(cadir, "node", "gpu-01", now=now)
    gateway = peer(cadir / "gateway-gw-1.crt", "gateways", "gw-1")
    node = peer(cadir / "node-gpu-01.crt", "nodes", "gpu-01")
    store.revoke(cadir, "gw-1", now=now)
    store.revoke(cadir, "gpu-01", now=now)
    denied = Revocations(str(cadir / "revoked.json"))
    for refusal in (gateway_refusal(gateway, denied), fleet_refusal(node, denied, require_node=True)):
        assert refusal is not None and refusal[0] == "revoked"
        result = follow(refusal[1], cadir)
        assert result.returncode == 0, (refusal[1], result.stderr)


def test_a_certificate_of_another_kind_is_told_to_take_a_gateway_certificate_of_its_own_name(tmp_path: Path) -> None:
    """A viewer's certificate used as a gateway's: `ctl cert` refuses a second kind under one name,
    so the hint names a placeholder, not the viewer's name."""
    cadir = tmp_path / "ca"
    now = time.time()
    store.init_ca(cadir, now=now)
    store.issue_client(cadir, "viewer", "dash", now=now)
    refusal = gateway_refusal(peer(cadir / "viewer-dash.crt", "viewers", "dash"), Revocations())
    assert refusal is not None and refusal[0] == "not_gateway"
    assert follow(refusal[1].replace("NAME", "dash"), cadir).returncode != 0  # what the hint said before
    assert follow(refusal[1].replace("NAME", "gw-dash"), cadir).returncode == 0
