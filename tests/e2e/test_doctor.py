"""`llmgw ctl doctor` end to end (issue 14): a real server, real agents on simulated nodes and a
simulated fabric, and the real `ctl` process whose exit code cron and Nagios read.

A healthy fleet exits 0; then an INIT port (exit 2), a degraded cable (exit 1), a declared adapter
that is absent (exit 2) and a node certificate about to expire (exit 1, or 2 when closer) are each
found with the right check, status and subject; a server that is not there exits 3 with one line.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import (
    FAST_FLEET,
    SIM_FABRIC_FAST,
    Proc,
    Server,
    ctl,
    free_port,
    make_sim_fabric,
    make_sim_node,
    one_error_line,
    run_llmgw,
    start_agent,
    tls_agent_config,
    wait_until,
)

pytestmark = pytest.mark.e2e

FABRIC_FAST = FAST_FLEET + SIM_FABRIC_FAST
NODES = ["node-1", "node-2", "node-3", "node-4"]


def make_fabric(out: Path, *flags: str) -> None:
    make_sim_fabric(out, NODES, *flags)


def doctor(server: Server, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    result = ctl(server.url, "doctor", "-o", "json", *args, env=env)
    assert result.returncode in (0, 1, 2, 3), result.stderr
    return result.returncode, json.loads(result.stdout) if result.stdout.strip() else {}


def problems(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    return [(f["node"], f["check"], f["status"], f.get("subject", "")) for f in data.get("findings", [])
            if f["status"] != "ok"]


def wait_for_exit(server: Server, code: int, what: str, procs: list[Proc], *args: str,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        rc, data = doctor(server, *args, env=env)
        return data if rc == code else None

    return wait_until(check, what, procs=procs, deadline=60, interval=0.5)


def test_doctor_finds_an_init_port_a_degraded_cable_and_a_missing_adapter(tmp_path: Path, procs: list[Proc]) -> None:
    fabric_dir = tmp_path / "fabric"
    make_fabric(fabric_dir)
    server = Server(tmp_path, FABRIC_FAST)
    procs.append(server.start())
    dirs = {}
    for node in ("node-1", "node-2"):
        config = make_sim_node(tmp_path, node, server.fleet_url, "", "--ib-ports", "2", "--fabric", str(fabric_dir))
        dirs[node] = config.parent
        procs.append(start_agent(tmp_path, node, config))

    # Healthy: every check ok once both nodes are in, the fabric is mapped and each port has two readings.
    wait_until(lambda: len(server.nodes()) == 2, "both nodes registered", procs=procs)
    healthy = wait_for_exit(server, 0, "doctor to exit 0 on the healthy fleet", procs)
    assert problems(healthy) == []
    checks = {(f["node"], f["check"]) for f in healthy["findings"]}
    assert {("node-1", "ports"), ("node-2", "memlock"), ("node-2", "clock"), ("(cluster)", "fabrics")} <= checks
    fabric = next(f for f in healthy["findings"] if f["check"] == "fabrics")
    assert "topology known" in fabric["finding"], fabric
    # A Nagios plugin (issue 46, item 4): the verdict and the counts on the first line, perfdata
    # after the `|`, then the table; --quiet keeps the first line (Nagios shows "(No output
    # returned from plugin)" without one).
    table = ctl(server.url, "doctor")
    first = table.stdout.splitlines()[0]
    n = len(healthy["findings"])
    assert (table.returncode == 0
            and first.startswith(f"LLMGW DOCTOR OK - 2 nodes, {n} findings: 0 crit, 0 warn")), table.stdout
    assert re.search(rf" \| crit=0 warn=0 unknown=0 ok={n} nodes=2 took=\d+\.\d{{3}}s$", first), first
    assert table.stdout.splitlines()[1].split()[:2] == ["NODE", "CHECK"]
    quiet = ctl(server.url, "doctor", "--quiet")
    [line] = quiet.stdout.splitlines()
    assert quiet.returncode == 0 and line.split(" | ")[0] == first.split(" | ")[0], quiet.stdout

    # A port left in INIT (its subnet manager gone): critical, at the node, naming the port.
    assert run_llmgw("sim", "node", "set-port", str(dirs["node-1"]), "mlx5_1", "1", "init").returncode == 0
    found = wait_for_exit(server, 2, "the INIT port found", procs)
    assert ("node-1", "ports", "crit", "mlx5_1/1") in problems(found), problems(found)
    quiet = ctl(server.url, "doctor", "--quiet")
    assert quiet.returncode == 2
    status, *lines = quiet.stdout.strip().splitlines()
    assert status.startswith("LLMGW DOCTOR CRITICAL - 2 nodes,") and " | crit=" in status, status
    assert len(lines) == len(problems(found)) >= 1 and all(line.split()[0] in ("WARN", "CRIT", "UNKNOWN")
                                                           for line in lines)
    assert any(line.startswith("CRIT node-1 ports: mlx5_1/1 INIT") and "subnet manager" in line
               for line in lines), lines
    narrowed = ctl(server.url, "doctor", "--node", "node-2")
    assert narrowed.returncode == 0, narrowed.stdout  # the other node is fine
    assert run_llmgw("sim", "node", "set-port", str(dirs["node-1"]), "mlx5_1", "1", "up").returncode == 0
    wait_for_exit(server, 0, "doctor back to 0 once the port is ACTIVE", procs)

    # A dump that says node-2's cable trained at 1x while node-2 reads its port at 4X (a stale
    # dump, or a node lying about another's cables, issue 40 finding 10): the map says who
    # disagrees with whom, and the node's own reading stands: no degraded cable.
    make_fabric(fabric_dir, "--degrade", "node-2")
    found = wait_for_exit(server, 1, "the dump's disagreement with node-2 found", procs)
    [(where, check, status, _)] = problems(found)
    assert (where, check, status) == ("(cluster)", "fabrics", "warn")
    said = next(f for f in found["findings"] if f["status"] == "warn")
    assert "node-2 reads 400 Gb/s" in said["finding"] and "ibstat" in said["action"], said

    # The cable of node-2 really trains at 1x (its sysfs and the dump agree): a degraded cable,
    # a warning of the fabric, and the node's port at a quarter of the fabric's rate is critical.
    assert run_llmgw("sim", "node", "set-port", str(dirs["node-2"]), "mlx5_1", "1", "up",
                     "--rate", "100 Gb/sec (1X NDR)").returncode == 0

    def cable_found() -> dict[str, Any] | None:
        rc, data = doctor(server)
        return data if rc == 2 and len(problems(data)) == 2 and not any(
            "reads 400" in f["finding"] for f in data["findings"]) else None

    found = wait_until(cable_found, "the degraded cable found, the dump and node-2 agreeing", procs=procs, deadline=60,
                       interval=0.5)
    assert sorted((w, c, s) for w, c, s, _ in problems(found)) == [
        ("(cluster)", "fabrics", "warn"), ("node-2", "port-rate", "crit")], problems(found)
    cable = next(f for f in found["findings"] if f["check"] == "fabrics" and f["status"] == "warn")
    assert "node-2" in cable["finding"] and "reseat" in cable["action"], cable

    # A node whose agent declares an adapter it does not have: critical, naming the adapter.
    config = make_sim_node(tmp_path, "node-3", server.fleet_url, "", "--ib-ports", "2", "--fabric", str(fabric_dir),
                           "--absent-adapter", "mlx5_7")
    procs.append(start_agent(tmp_path, "node-3", config))
    found = wait_for_exit(server, 2, "the absent adapter found", procs, "--node", "node-3", "--check", "adapters")
    assert problems(found) == [("node-3", "adapters", "crit", "mlx5_7")]

    # Symbol errors rising on a port of node-1 (its agent reads them from sysfs each heartbeat):
    # a warning naming the port and the rise.
    counter = dirs["node-1"] / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters" / "symbol_error"
    counter.write_text("57\n")
    found = wait_for_exit(server, 1, "the rising symbol errors found", procs, "--node", "node-1", "--check", "counters")
    assert problems(found) == [("node-1", "counters", "warn", "mlx5_0/1")]
    assert "symbol_error +57" in found["findings"][0]["finding"]


def test_doctor_finds_gpu_faults_the_agent_reports(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url)
    procs.append(start_agent(tmp_path, "gpu-01", config))
    node_dir = str(config.parent)
    healthy = wait_for_exit(server, 0, "the GPUs healthy", procs, "--node", "gpu-01", "--check", "gpu-health")
    assert "8 GPUs healthy" in healthy["findings"][0]["finding"]

    assert run_llmgw("sim", "node", "set-gpu", node_dir, "3", "--xid", "79").returncode == 0
    found = wait_for_exit(server, 2, "the Xid found", procs, "--node", "gpu-01", "--check", "gpu-health")
    assert problems(found) == [("gpu-01", "gpu-health", "crit", "GPU 3")]
    assert "Xid 79 (GPU has fallen off the bus)" in found["findings"][0]["finding"]
    assert run_llmgw("sim", "node", "set-gpu", node_dir, "5", "--nvlink-down", "2").returncode == 0
    found = wait_for_exit(server, 2, "the NVLink links down found", procs, "--node", "gpu-01", "--check", "nvlink")
    assert problems(found) == [("gpu-01", "nvlink", "crit", "GPU 5")]
    assert run_llmgw("sim", "node", "set-gpu", node_dir, "3", "--xid", "0").returncode == 0
    assert run_llmgw("sim", "node", "set-gpu", node_dir, "5", "--nvlink-down", "0").returncode == 0
    wait_for_exit(server, 0, "the GPUs well again", procs, "--node", "gpu-01")
    bad = run_llmgw("sim", "node", "set-gpu", node_dir, "9", "--xid", "79")
    assert bad.returncode == 2 and "no GPU 9" in one_error_line(bad)


def test_doctor_finds_a_certificate_about_to_expire(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    for args in (("init",), ("server", "--ip", "127.0.0.1"), ("node", "gpu-01", "--days", "5"),
                 ("node", "gpu-02", "--days", "2")):
        result = run_llmgw("ctl", "cert", *args, "--dir", str(cadir))
        assert result.returncode == 0, result.stderr
    token = "doctor-viewer-token"
    config = FAST_FLEET + (
        f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n"
        "  require_identity: true\n"
        f'api:\n  viewer_tokens: ["sha256:{hashlib.sha256(token.encode()).hexdigest()}"]\n'
    )
    server = Server(tmp_path, config, insecure=False, token=token)
    procs.append(server.start())
    for node in ("gpu-01", "gpu-02"):
        base = make_sim_node(tmp_path, node, server.fleet_url)
        agent_config = tls_agent_config(base, cadir / "ca.crt", cadir / f"node-{node}.crt", cadir / f"node-{node}.key")
        procs.append(Proc(f"agent-{node}", ["agent", "--config", str(agent_config)], tmp_path))
    viewer = {"LLMGW_TOKEN": token}
    refused = ctl(server.url, "doctor")
    assert refused.returncode == 3 and len(refused.stderr.strip().splitlines()) == 1  # no credential: could not run

    five = wait_for_exit(server, 1, "gpu-01's certificate found expiring", procs, "--node", "gpu-01", env=viewer)
    assert problems(five) == [("gpu-01", "cert", "warn", "")]
    assert next(f["finding"] for f in five["findings"] if f["check"] == "cert") == "certificate expires in 5.0 days"
    two = wait_for_exit(server, 2, "gpu-02's certificate found expiring", procs, "--node", "gpu-02", "--check", "cert",
                        env=viewer)
    assert problems(two) == [("gpu-02", "cert", "crit", "")]
    whole = ctl(server.url, "doctor", "--quiet", env=viewer)
    # the status line, 2 findings
    assert whole.returncode == 2 and len(whole.stdout.strip().splitlines()) == 3, whole.stdout

    # What alerts are written on (issue 46, item 8): each certificate's expiry as a timestamp, and
    # the last full doctor run's verdict and counts (the --node runs above leave it alone).
    samples = scrape(server, token)
    expiry = {labels["identity"]: value for labels, value in samples["llmgw_certificate_expiry_timestamp_seconds"]
              if labels["kind"] == "node"}
    assert expiry.keys() == {"gpu-01", "gpu-02"}
    assert (abs(expiry["gpu-01"] - time.time() - 5 * 86400) < 3600
            and abs(expiry["gpu-02"] - time.time() - 2 * 86400) < 3600)
    assert any(labels == {"kind": "server", "identity": "fleet-port"}
               for labels, _ in samples["llmgw_certificate_expiry_timestamp_seconds"])
    assert samples["llmgw_doctor_status"] == [({}, 2.0)]
    counts = {labels["status"]: value for labels, value in samples["llmgw_doctor_findings"]}
    assert counts["crit"] == 1 and counts["warn"] == 1 and counts["ok"] > 0, counts
    [(_, ran)] = samples["llmgw_doctor_last_run_timestamp_seconds"]
    assert time.time() - 60 < ran <= time.time() + 1


def scrape(server: Server, token: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics as samples by name, read with prometheus_client's own parser."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=10).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_doctor_without_a_server_exits_3_with_one_line(tmp_path: Path) -> None:
    result = ctl(f"http://127.0.0.1:{free_port()}", "doctor")
    assert result.returncode == 3
    assert "cannot reach the llmgw server" in one_error_line(result)
    # stdout, where Nagios reads a plugin's answer, has the UNKNOWN status line.
    [line] = result.stdout.splitlines()
    assert line.startswith("LLMGW DOCTOR UNKNOWN - could not run: cannot reach the llmgw server"), line


def test_doctor_local_reads_a_simulated_node_as_its_agent_would(tmp_path: Path) -> None:
    result = run_llmgw("sim", "node", "--dir", str(tmp_path / "n"), "--node-id", "n-1", "--ib-ports", "2",
                       "--init-port", "mlx5_1")
    assert result.returncode == 0, result.stderr
    local = run_llmgw("ctl", "doctor", "--local", "--config", str(tmp_path / "n" / "agent.yaml"), "--interval", "0",
                      "-o", "json")
    assert local.returncode == 2, local.stderr
    data = json.loads(local.stdout)
    assert problems(data) == [("n-1", "ports", "crit", "mlx5_1/1")]
    assert {f["check"] for f in data["findings"]}.isdisjoint({"agent", "clock"})  # they need a server
    # No config: this machine's own discovery (without GPUs, NVML is unknown and says why).
    bare = run_llmgw("ctl", "doctor", "--local", "--check", "nvml", "--interval", "0", "-o", "json")
    assert bare.returncode in (0, 3), bare.stderr
    [nvml] = json.loads(bare.stdout)["findings"]
    assert nvml["status"] in ("ok", "unknown") and nvml["finding"]


def test_a_nagios_plugin_that_cannot_run_exits_unknown_never_critical(tmp_path: Path) -> None:
    """doctor and fabric-test are run by Nagios and cron: a typo, a missing config or a bad
    certificate path is 3 (UNKNOWN, the plugin guidelines' rule), not 2, which reads as CRITICAL."""
    cert = ("--cert", str(tmp_path / "none.crt"), "--key", str(tmp_path / "none.key"))
    for args in (("doctor", "--check", "nope"), ("doctor", "--local", "--config", str(tmp_path / "none.yaml")),
                 (*cert, "doctor"), ("fabric-test", "gpu-01"), ("fabric-test", "a", "b", "--rail-timeout", "0"),
                 (*cert, "fabric-test", "a", "b")):
        result = run_llmgw("ctl", "--server", "http://127.0.0.1:9", *args)
        assert result.returncode == 3, (args, result.returncode, result.stderr)
        one_error_line(result)
    # Elsewhere bad usage stays 2.
    assert run_llmgw("ctl", "nodes", "--nope").returncode == 2
