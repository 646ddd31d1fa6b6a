"""Hardware truth end to end: real agents on simulated nodes, a real server, the real CLI.

A declared adapter that is not there keeps its fabric from being advertised (with the reason
in `ctl nodes -o json` and the node's log); a port taken down under a running agent takes the
fabric away within two heartbeats and shows in /metrics; an engine is launched with the NCCL
and Gloo environment its node's discovery supports (what the process received, not what we
meant to send).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl_json,
    engines_config,
    make_sim_node,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)

# Slower heartbeats than FAST_FLEET, so "within two heartbeats" is measured, not raced.
HALF_SECOND_FLEET = engines_config("").replace("heartbeat_interval: 0.25s", "heartbeat_interval: 0.5s")


def node_json(server: Server, node_id: str) -> dict[str, Any] | None:
    found = [n for n in ctl_json(server.url, "nodes") if n["id"] == node_id]
    return found[0] if found else None


def metric(server: Server, name: str, **labels: str) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return None


def test_declared_adapter_missing_is_not_advertised(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, HALF_SECOND_FLEET)
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--ib-ports", "2",
                           "--absent-adapter", "mlx5_7")
    good = make_sim_node(tmp_path, "gpu-02", server.fleet_url, FAST_AGENT, "--ib-ports", "2")
    agent = start_agent(tmp_path, "gpu-01", config)
    procs += [agent, start_agent(tmp_path, "gpu-02", good)]
    node = wait_until(lambda: node_json(server, "gpu-01"), "gpu-01 in ctl nodes", procs=procs)
    assert node["fabrics"] == []
    [status] = node["fabric_status"]
    assert status["name"] == "ib" and status["usable"] is False
    assert status["problems"] == ["mlx5_7: no such adapter on this node"]
    assert status["ports"] == ["mlx5_0:1", "mlx5_1:1"]  # the adapters that are there, up, but not enough
    other = wait_until(lambda: node_json(server, "gpu-02"), "gpu-02 in ctl nodes", procs=procs)
    assert other["fabrics"] == ["ib"] and other["fabric_status"][0]["rate_gbps"] == 400.0
    assert other["mgmt_interface"] == "lo"
    # The node's own record and the table say it too; the node's log says why, once.
    detail = server.get("/api/v1/nodes/gpu-01")
    assert detail["fabric_status"][0]["problems"] == ["mlx5_7: no such adapter on this node"]
    table = run_llmgw("ctl", "--server", server.url, "nodes", env={"COLUMNS": "300"})
    assert "fabric ib not usable: mlx5_7: no such adapter on this node" in table.stdout, table.stdout
    assert "ib 400G" in table.stdout  # gpu-02's fabric, at its slowest link
    wait_until(lambda: "mlx5_7: no such adapter" in agent.log(), "the agent to log the reason", procs=procs)
    assert agent.log().count("mlx5_7: no such adapter") == 1


def test_port_down_at_runtime_takes_the_fabric_away_within_two_heartbeats(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, HALF_SECOND_FLEET)
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--ib-ports", "4")
    agent = start_agent(tmp_path, "gpu-01", config)
    procs.append(agent)
    wait_until(lambda: (n := node_json(server, "gpu-01")) and n["fabrics"] == ["ib"] and n["heartbeats"] >= 1,
               "gpu-01 with fabric ib and a heartbeat", procs=procs)
    labels = {"node": "gpu-01", "device": "mlx5_2", "port": "1"}
    assert metric(server, "llmgw_ib_port_active", state="ACTIVE", phys_state="LinkUp", **labels) == 1.0
    assert metric(server, "llmgw_ib_port_data_words_total", counter="port_xmit_data", **labels) == 0.0

    result = run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-01"), "mlx5_2", "1", "down")
    assert result.returncode == 0, result.stderr
    # Counted from when the port changed (set-port has returned), not from before the command
    # started: under load its interpreter alone took longer than a heartbeat (CI, 2026-12-04).
    before = server.get("/api/v1/nodes/gpu-01")["heartbeats"]
    after = wait_until(lambda: (n := server.get("/api/v1/nodes/gpu-01"))["fabrics"] == [] and n,
                       "the fabric to go away", procs=procs)
    assert after["heartbeats"] - before <= 2, (before, after["heartbeats"])
    [status] = after["fabric_status"]
    assert status["problems"] == ["mlx5_2: no ACTIVE port (port 1 DOWN (Disabled): the port is disabled)"]
    port = {p["port"]: p for p in after["port_states"]}["mlx5_2/1"]
    assert (port["state"], port["phys_state"]) == ("DOWN", "Disabled")
    assert metric(server, "llmgw_ib_port_active", state="DOWN", phys_state="Disabled", **labels) == 0.0
    wait_until(lambda: "usable fabrics now none (were ib)" in procs[0].log(), "the server to log the change",
               procs=procs)

    # Said once, however many heartbeats read it; and back when the port is.
    wait_until(lambda: server.get("/api/v1/nodes/gpu-01")["heartbeats"] >= after["heartbeats"] + 3,
               "three more heartbeats",
               procs=procs)
    assert len(re.findall(r"fabric ib: not usable: mlx5_2", agent.log())) == 1, agent.log()
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-01"), "mlx5_2", "1", "up").returncode == 0
    wait_until(lambda: server.get("/api/v1/nodes/gpu-01")["fabrics"] == ["ib"], "the fabric back", procs=procs)
    assert metric(server, "llmgw_ib_port_active", state="ACTIVE", phys_state="LinkUp", **labels) == 1.0


CATALOG_ENV = """\
models:
  - name: small
    replicas: 1
    profiles:
      - name: tp1
        engine: sim
        gpus: 1
        args: ["--fail-if-env-missing", "NCCL_IB_HCA", "--fail-if-env-missing", "NCCL_SOCKET_IFNAME",
               "--fail-if-env-missing", "GLOO_SOCKET_IFNAME", "--fail-if-env-missing", "NCCL_IB_GID_INDEX"]
        env:
          NCCL_SOCKET_IFNAME: "=lo"
"""


def launch_record(tmp_path: Path, shard_id: str) -> dict[str, Any]:
    [log] = list(tmp_path.glob(f"**/logs/{shard_id}.log"))
    for line in log.read_text().splitlines():
        if line.startswith("llmgw-sim-engine launch: "):
            return json.loads(line.split(": ", 1)[1])
    raise AssertionError(f"no launch record in {log}")


def test_engine_gets_the_nccl_environment_of_its_node_roce(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG_ENV))
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--profile", "roce-8nic")
    procs.append(start_agent(tmp_path, "gpu-01", config, "--stop-engines-on-exit"))
    [replica] = wait_until(lambda: (rs := replicas(server)) and rs[0]["state"] == "ready" and rs, "the replica ready",
                           procs=procs)
    [shard] = replica["shards"]
    record = launch_record(tmp_path, shard["shard_id"])
    assert record["env"]["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{i}:1" for i in range(8))
    assert record["env"]["NCCL_IB_GID_INDEX"] == "3"  # the RoCE v2 IPv4 GID of the simulated ConnectX table
    assert record["env"]["GLOO_SOCKET_IFNAME"] == "lo"
    assert record["env"]["NCCL_SOCKET_IFNAME"] == "=lo"
    env = {e["name"]: e for e in shard["launch_env"]}
    assert env["NCCL_SOCKET_IFNAME"] == {"name": "NCCL_SOCKET_IFNAME", "value": "=lo", "derived": "=lo",
                                         "overridden": True}
    assert env["NCCL_IB_GID_INDEX"]["value"] == "3" and not env["NCCL_IB_GID_INDEX"].get("overridden")
