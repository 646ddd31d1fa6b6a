"""Issue 39 end to end: `ctl doctor --list`, `--only` / `--skip` through the real command, a node
on another driver among three flagged (and only it), and a RoCE hw_counter rising graded as a
rate — real server, real agents on simulated nodes, the real `ctl` process and its exit code."""

from __future__ import annotations

import json
from pathlib import Path

from llmgw.doctor import CHECKS
from tests.e2e.harness import (
    FAST_AGENT,
    FAST_FLEET,
    Proc,
    Server,
    ctl,
    make_sim_node,
    one_error_line,
    run_llmgw,
    start_agent,
    wait_until,
)
from tests.e2e.test_doctor import problems, wait_for_exit


def test_list_names_every_check_with_what_it_reads_and_means() -> None:
    listed = run_llmgw("ctl", "doctor", "--list", "-o", "json")  # no server needed
    assert listed.returncode == 0, listed.stderr
    checks = json.loads(listed.stdout)["checks"]
    assert [c["id"] for c in checks] == list(CHECKS)
    assert all(c["reads"] and c["scope"] in ("node", "cluster") for c in checks)
    table = run_llmgw("ctl", "doctor", "--list")
    assert table.returncode == 0 and table.stdout.split()[:2] == ["CHECK", "SCOPE"]
    rows = {line.split()[0] for line in table.stdout.splitlines()[1:] if line and not line[0].isspace()}
    assert rows == set(CHECKS)
    assert "CRIT: " in table.stdout and "WARN: " in table.stdout
    for args in (("--only", "clock,nope"), ("--skip", "bogus"), ("--local", "--only", "driver-versions,clock")):
        bad = run_llmgw("ctl", "--server", "http://127.0.0.1:9", "doctor", *args)
        assert bad.returncode == 3, bad.stderr  # UNKNOWN, as the Nagios guidelines have bad usage
        assert "no check" in one_error_line(bad) or "need a server" in one_error_line(bad)


def test_the_one_node_on_another_driver_is_flagged_and_only_it(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    nodes = ["node-1", "node-2", "node-3"]
    configs = {node: make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--ib-ports", "1", "--roce-ports", "1")
               for node in nodes}
    # node-3 upgraded on its own: the agent reads versions when it registers, as after a reboot.
    changed = run_llmgw("sim", "node", "set-versions", str(configs["node-3"].parent), "--driver", "550.90.07")
    assert changed.returncode == 0 and "driver 550.90.07" in changed.stdout, changed.stderr
    for node in nodes:
        procs.append(start_agent(tmp_path, node, configs[node]))
    wait_until(lambda: len(server.nodes()) == 3, "three nodes registered", procs=procs)

    found = wait_for_exit(server, 1, "the odd driver found", procs, "--only", "driver-versions,firmware-versions")
    assert problems(found) == [("(cluster)", "driver-versions", "warn", "node-3")]
    [odd] = [f for f in found["findings"] if f["status"] == "warn"]
    assert "node-3 runs NVIDIA driver 550.90.07; the other 2 nodes" in odd["finding"], odd
    assert "550.54.15 ×2, 550.90.07 ×1" in odd["finding"] and "drain node-3" in odd["action"]
    assert {f["check"] for f in found["findings"]} == {"driver-versions", "firmware-versions"}
    firmware = next(f for f in found["findings"] if f["check"] == "firmware-versions")
    assert firmware["status"] == "ok" and "GPU VBIOS 96.00.A5.00.1A" in firmware["finding"], firmware

    # The API takes the same selection (only=, skip=); an id that is no check is a 400 naming it.
    import httpx

    api = f"{server.url}/api/v1/doctor"
    clocks = httpx.get(api, params={"only": "clock,cert"}, timeout=10).json()
    assert {f["check"] for f in clocks["findings"]} == {"clock", "cert"}
    refused = httpx.get(api, params={"skip": "clock,bogus"}, timeout=10)
    assert refused.status_code == 400 and "'bogus'" in refused.text

    # --skip leaves it out (the rest of this fleet is healthy once each port has two readings).
    rest = wait_for_exit(server, 0, "doctor ok without the version check", procs, "--skip", "driver-versions")
    assert "driver-versions" not in {f["check"] for f in rest["findings"]}
    assert {"firmware-versions", "counters", "ports"} <= {f["check"] for f in rest["findings"]}
    quiet = ctl(server.url, "doctor", "--quiet", "--only", "driver-versions")
    assert (quiet.returncode == 1
            and quiet.stdout.splitlines()[1].startswith("WARN (cluster) driver-versions: node-3 runs"))

    # A RoCE port whose peers' packets go missing: packet_seq_err rising, graded as a rate.
    roce = "mlx5_1"
    assert run_llmgw("sim", "node", "set-counter", str(configs["node-2"].parent), roce, "1", "packet_seq_err",
                     "900").returncode == 0
    rising = wait_for_exit(server, 1, "the rising packet_seq_err found", procs, "--node", "node-2",
                           "--only", "counters")
    assert problems(rising) == [("node-2", "counters", "warn", f"{roce}/1")]
    said = rising["findings"][0]
    assert "packet_seq_err +900 (" in said["finding"] and "/s)" in said["finding"], said
    assert "mlnx_qos -i eth0" in said["action"], said


def test_local_takes_only_and_skip(tmp_path: Path) -> None:
    made = run_llmgw("sim", "node", "--dir", str(tmp_path / "n"), "--node-id", "n-1", "--ib-ports", "1",
                     "--init-port", "mlx5_0")
    assert made.returncode == 0, made.stderr
    config = str(tmp_path / "n" / "agent.yaml")
    skipped = run_llmgw("ctl", "doctor", "--local", "--config", config, "--interval", "0", "--skip", "ports",
                        "-o", "json")
    assert skipped.returncode == 0, skipped.stderr  # the INIT port is not looked at
    checks = {f["check"] for f in json.loads(skipped.stdout)["findings"]}
    assert "ports" not in checks and {"memlock", "nvml", "counters"} <= checks
    only = run_llmgw("ctl", "doctor", "--local", "--config", config, "--interval", "0", "--only", "ports", "-o", "json")
    assert only.returncode == 2 and {f["check"] for f in json.loads(only.stdout)["findings"]} == {"ports"}
