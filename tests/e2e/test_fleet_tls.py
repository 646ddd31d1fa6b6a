"""Mutual TLS on the fleet port, with real handshakes between real processes.

A node proves who it is: its certificate's CN must equal the node id it registers as.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from llmgw.tls import ca
from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    get_json,
    make_sim_node,
    run_llmgw,
    tls_agent_config,
    wait_until,
)


def cert(*args: str) -> None:
    result = run_llmgw("ctl", "cert", *args)
    assert result.returncode == 0, result.stderr


def tls_server(tmp_path: Path, cadir: Path, server_cert: str = "server", name: str = "server") -> Server:
    config = FAST_FLEET + (
        f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / (server_cert + '.crt')}\n  key: "
        f"{cadir / (server_cert + '.key')}\n"
    )
    server = Server(tmp_path, config, name=name, insecure=False)
    return server


def refused(server: Server, reason: str) -> float:
    import httpx

    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'llmgw_fleet_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_mutual_tls_identity(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    cert("init", "--dir", str(cadir), "--name", "test CA")
    cert("server", "--dir", str(cadir), "--host", "localhost", "--ip", "127.0.0.1")
    cert("node", "gpu-01", "--dir", str(cadir))
    server = tls_server(tmp_path, cadir)
    procs.append(server.start())
    base = make_sim_node(tmp_path, "gpu-01", server.fleet_url)
    ca_crt, crt, key = cadir / "ca.crt", cadir / "node-gpu-01.crt", cadir / "node-gpu-01.key"

    # gpu-01's certificate, registering as gpu-01: accepted.
    good = Proc("agent-gpu-01", ["agent", "--config", str(tls_agent_config(base, ca_crt, crt, key))], tmp_path)
    procs.append(good)
    wait_until(lambda: server.nodes().get("gpu-01", {}).get("state") == "ready", "gpu-01 ready over mTLS",
               procs=[server.proc, good])
    assert server.nodes()["gpu-01"]["identity"] == "gpu-01"

    # The same (stolen) certificate, registering as gpu-02: refused, both names logged.
    thief = Proc("agent-thief", ["agent", "--config", str(tls_agent_config(base, ca_crt, crt, key, node_id="gpu-02"))],
                 tmp_path)
    procs.append(thief)
    wait_until(lambda: "client certificate is for 'gpu-01' but the agent registered as 'gpu-02'" in thief.log(),
               "the thief told why", procs=[server.proc, thief])
    wait_until(lambda: refused(server, "identity") >= 1, "identity refusal counted", procs=[server.proc])
    assert "does not match node id 'gpu-02'" in server.proc.log()
    assert "gpu-02" not in server.nodes()
    thief.stop()

    # A certificate from another CA: refused in the handshake, and the agent says so.
    other = tmp_path / "other-ca"
    cert("init", "--dir", str(other))
    cert("node", "gpu-03", "--dir", str(other))
    stranger = Proc("agent-stranger", ["agent", "--config", str(tls_agent_config(
        base, ca_crt, other / "node-gpu-03.crt", other / "node-gpu-03.key", node_id="gpu-03"))], tmp_path)
    procs.append(stranger)
    wait_until(lambda: "TLS with 127.0.0.1" in stranger.log() and "failed" in stranger.log(), "stranger refused",
               procs=[server.proc, stranger])
    wait_until(lambda: refused(server, "tls_handshake") >= 1, "handshake refusal counted", procs=[server.proc])
    assert "gpu-03" not in server.nodes()
    stranger.stop()

    # An expired certificate of the right CA: refused.
    now = time.time()
    ca.issue_client(cadir, "node", "gpu-04", now=now - 10 * 86400, days=1)
    expired = Proc("agent-expired", ["agent", "--config", str(tls_agent_config(
        base, ca_crt, cadir / "node-gpu-04.crt", cadir / "node-gpu-04.key", node_id="gpu-04"))], tmp_path)
    procs.append(expired)
    wait_until(lambda: "expired" in expired.log(), "expired certificate refused and explained",
               procs=[server.proc, expired])
    assert "gpu-04" not in server.nodes()
    expired.stop()
    assert server.nodes()["gpu-01"]["state"] == "ready" and good.alive()


def test_agent_rejects_server_certificate_without_the_dialed_ip(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    cert("init", "--dir", str(cadir))
    cert("server", "--dir", str(cadir), "--host", "ctrl", "--ip", "127.0.0.2", "--out", str(cadir / "wrong"))
    cert("node", "gpu-01", "--dir", str(cadir))
    server = tls_server(tmp_path, cadir, server_cert="wrong")
    procs.append(server.start())
    base = make_sim_node(tmp_path, "gpu-01", server.fleet_url)
    agent = Proc("agent-gpu-01", ["agent", "--config", str(tls_agent_config(
        base, cadir / "ca.crt", cadir / "node-gpu-01.crt", cadir / "node-gpu-01.key"))], tmp_path)
    procs.append(agent)
    wait_until(lambda: "server certificate is not valid for 127.0.0.1" in agent.log(), "the agent names the missing IP",
               procs=[server.proc, agent])
    assert "IP:127.0.0.2" in agent.log() and "llmgw ctl cert server" in agent.log()
    assert get_json(f"{server.url}/api/v1/nodes") == []


def test_plain_h2c_needs_insecure_on_the_agent(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("server: http://127.0.0.1:1\nnode_id: gpu-01\n")
    result = run_llmgw("agent", "--config", str(cfg))
    assert result.returncode == 2 and "--insecure" in result.stderr


def test_certificate_near_expiry_is_a_warning_in_the_agent_log_and_the_node_record(tmp_path: Path,
                                                                                   procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    cert("init", "--dir", str(cadir))
    cert("server", "--dir", str(cadir), "--host", "localhost", "--ip", "127.0.0.1")
    cert("node", "gpu-01", "--dir", str(cadir), "--days", "5")
    server = tls_server(tmp_path, cadir)
    procs.append(server.start())
    base = make_sim_node(tmp_path, "gpu-01", server.fleet_url)
    base.write_text(re.sub(r"  gpus: .*gpus.json", "  gpus: none", base.read_text()))  # a CPU-only node
    agent = Proc("agent-gpu-01", ["agent", "--config", str(tls_agent_config(
        base, cadir / "ca.crt", cadir / "node-gpu-01.crt", cadir / "node-gpu-01.key"))], tmp_path)
    procs.append(agent)
    wait_until(lambda: server.nodes().get("gpu-01", {}).get("state") == "ready", "gpu-01 ready",
               procs=[server.proc, agent])
    assert "expires in 5 days" in agent.log() and "llmgw ctl cert node" in agent.log()
    node = server.nodes()["gpu-01"]
    assert 4 < node["cert_days_left"] <= 5 and node["gpus"] == 0 and node["gpu_note"]
    table = run_llmgw("ctl", "--server", server.url, "nodes")
    assert table.returncode == 0
    assert "certificate expires in 5 days" in table.stdout and "CPU-only node" in table.stdout
