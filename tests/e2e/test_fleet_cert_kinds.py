"""Certificates that mean the wrong thing, through real agents, a real server and real TLS
(issue 21 items 3 and 4): only node certificates register, and revoked serials are refused.

An operator certificate named gpu-01 is not node gpu-01. A node certificate replaced with
`ctl cert node --force` (the old key is denied) or revoked with `ctl cert revoke` stops working
once the server re-reads its deny list (SIGHUP or `ctl reload`): the live stream ends, every
reconnect is refused with the reason, and the refusals are counted.
"""

from __future__ import annotations

import hashlib
import shutil
import signal
from pathlib import Path

from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    bearer,
    ctl,
    make_sim_node,
    one_error_line,
    run_llmgw,
    tls_agent_config,
    wait_until,
)

TOKEN = "op-token-for-reload"


def cert(cadir: Path, *args: str) -> str:
    result = run_llmgw("ctl", "cert", *args, "--dir", str(cadir))
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def serial_of(cadir: Path, name: str) -> str:
    import json

    listing = json.loads(run_llmgw("ctl", "cert", "list", "--dir", str(cadir), "-o", "json").stdout)
    return next(i["serial"] for i in reversed(listing) if i["common_name"] == name and i["status"] == "ok")


def refused(server: Server, reason: str) -> float:
    import httpx

    metrics = httpx.get(f"{server.url}/metrics", timeout=5, headers=bearer(server.token)).text
    for line in metrics.splitlines():
        if line.startswith(f'llmgw_fleet_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def start_server(tmp_path: Path, cadir: Path, procs: list[Proc]) -> Server:
    config = FAST_FLEET + (
        f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n"
        f"  deny_list: {cadir / 'revoked.json'}\n"
        f'api:\n  operator_tokens: ["sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
    )
    server = Server(tmp_path, config, insecure=False, token=TOKEN)
    procs.append(server.start())
    return server


def agent(tmp_path: Path, base: Path, cadir: Path, name: str, crt: Path, key: Path, node_id: str) -> Proc:
    config = tls_agent_config(base, cadir / "ca.crt", crt, key, node_id=node_id)
    return Proc(name, ["agent", "--config", str(config)], tmp_path)


def test_only_node_certificates_register(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    cert(cadir, "init")
    cert(cadir, "server", "--ip", "127.0.0.1")
    cert(cadir, "operator", "gpu-01")
    cert(cadir, "viewer", "gpu-02")
    # One name, one kind: node gpu-01 cannot be issued beside operator gpu-01, even with --force.
    for force in ((), ("--force",)):
        second = run_llmgw("ctl", "cert", "node", "gpu-01", "--dir", str(cadir), *force)
        assert second.returncode == 1 and "'gpu-01' already has an operator certificate" in second.stderr
        assert not (cadir / "node-gpu-01.crt").exists()
    server = start_server(tmp_path, cadir, procs)
    base = make_sim_node(tmp_path, "gpu-01", server.fleet_url)

    impostor = agent(tmp_path, base, cadir, "agent-operator", cadir / "operator-gpu-01.crt",
                     cadir / "operator-gpu-01.key", "gpu-01")
    procs.append(impostor)
    wait_until(lambda: "'gpu-01' is an operator certificate, not a node certificate" in impostor.log(),
               "the operator certificate refused, and the agent told why", procs=[server.proc, impostor])
    viewer = agent(tmp_path, base, cadir, "agent-viewer", cadir / "viewer-gpu-02.crt", cadir / "viewer-gpu-02.key",
                   "gpu-02")
    procs.append(viewer)
    wait_until(lambda: "'gpu-02' is a viewer certificate, not a node certificate" in viewer.log(),
               "the viewer certificate refused", procs=[server.proc, viewer])
    wait_until(lambda: refused(server, "not_node") >= 2, "both refusals counted", procs=[server.proc])
    assert server.nodes() == {}


def test_revoked_and_replaced_node_certificates_are_refused(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    cert(cadir, "init")
    cert(cadir, "server", "--ip", "127.0.0.1")
    cert(cadir, "node", "gpu-01")
    cert(cadir, "node", "gpu-02")
    stolen = tmp_path / "stolen"
    stolen.mkdir(mode=0o700)
    for name in ("node-gpu-01.crt", "node-gpu-01.key"):
        shutil.copy2(cadir / name, stolen / name)
    server = start_server(tmp_path, cadir, procs)
    base = make_sim_node(tmp_path, "gpu-01", server.fleet_url)

    old = agent(tmp_path, base, cadir, "agent-old", stolen / "node-gpu-01.crt", stolen / "node-gpu-01.key", "gpu-01")
    procs.append(old)
    wait_until(lambda: server.nodes().get("gpu-01", {}).get("state") == "ready",
               "gpu-01 ready with its first certificate",
               procs=[server.proc, old])

    # Reissued with --force: the replaced serial goes on the deny list, and `cert list` says so.
    out = cert(cadir, "node", "gpu-01", "--force")
    assert "now on the deny list" in out
    listing = run_llmgw("ctl", "cert", "list", "--dir", str(cadir)).stdout
    assert any("gpu-01" in line and "revoked" in line for line in listing.splitlines()), listing

    # The server gets the updated list (SIGHUP): the old certificate's stream ends and every
    # reconnect with it is refused as revoked.
    server.proc.signal(signal.SIGHUP)
    wait_until(lambda: "is revoked" in old.log(), "the old certificate refused after SIGHUP", procs=[server.proc, old])
    wait_until(lambda: refused(server, "revoked") >= 1, "the refusal counted as revoked", procs=[server.proc])
    wait_until(lambda: server.nodes()["gpu-01"]["state"] != "ready", "gpu-01's old stream ended", procs=[server.proc])
    old.stop()

    # The new pair works.
    new = agent(tmp_path, base, cadir, "agent-new", cadir / "node-gpu-01.crt", cadir / "node-gpu-01.key", "gpu-01")
    procs.append(new)
    wait_until(lambda: server.nodes().get("gpu-01", {}).get("state") == "ready",
               "gpu-01 ready with its new certificate",
               procs=[server.proc, new])

    # Revoked by serial, picked up by `ctl reload`: gpu-02 registered never again.
    serial = serial_of(cadir, "gpu-02")
    assert f"revoked node gpu-02 (serial {serial})" in cert(cadir, "revoke", serial[:12])
    reload = ctl(server.url, "--token", TOKEN, "reload")
    assert reload.returncode == 0, reload.stderr
    gpu02 = agent(tmp_path, base, cadir, "agent-gpu-02", cadir / "node-gpu-02.crt", cadir / "node-gpu-02.key", "gpu-02")
    procs.append(gpu02)
    wait_until(lambda: f"serial {serial}) is revoked" in gpu02.log(), "gpu-02 refused after ctl reload",
               procs=[server.proc, gpu02])
    wait_until(lambda: refused(server, "revoked") >= 2, "counted", procs=[server.proc])
    assert "gpu-02" not in server.nodes()
    assert server.nodes()["gpu-01"]["state"] == "ready" and new.alive()


def test_revoked_operator_and_viewer_certificates_on_the_public_port(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    cert(cadir, "init")
    cert(cadir, "server", "--ip", "127.0.0.1")
    cert(cadir, "operator", "alice")
    cert(cadir, "viewer", "grafana")
    config = FAST_FLEET + (
        f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n"
        f"  deny_list: {cadir / 'revoked.json'}\n"
        f"public_tls:\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n  ca: {cadir / 'ca.crt'}\n"
    )
    server = Server(tmp_path, config, insecure=False, public_ca=cadir / "ca.crt")
    procs.append(server.start())

    def as_(name: str, *args: str):  # type: ignore[no-untyped-def]
        kind = "operator" if name == "alice" else "viewer"
        return ctl(server.url, "--ca", str(cadir / "ca.crt"), "--cert", str(cadir / f"{kind}-{name}.crt"),
                   "--key", str(cadir / f"{kind}-{name}.key"), *args)

    assert as_("grafana", "nodes").returncode == 0
    assert as_("alice", "reload").returncode == 0
    cert(cadir, "revoke", "grafana")
    assert as_("alice", "reload").returncode == 0  # the server re-reads the deny list
    denied = as_("grafana", "nodes")
    assert denied.returncode == 1 and "'grafana' is revoked" in one_error_line(denied)
    cert(cadir, "revoke", "alice")
    server.proc.signal(signal.SIGHUP)
    wait_until(lambda: "'alice' is revoked" in as_("alice", "reload").stderr, "alice refused after SIGHUP",
               procs=[server.proc])
