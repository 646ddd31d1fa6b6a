"""The engine's version, read by the agent before a launch, end to end: real server, real agents,
the simulated engine saying it is vLLM 0.10.2 (`llmgw sim engine --version`, as an agent asks it).

0.10.2 takes everything a one-node replica is launched with, so that one runs; a two-node replica
needs `--nnodes --node-rank --master-addr --master-port` (vLLM 0.11.1), so each of its ranks is
refused at once with the version found and the flags, before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    engines_config,
    make_sim_node,
    replicas,
    wait_until,
)

CATALOG = """\
models:
  - name: small
    replicas: 1
    profiles:
      - {name: one-node, engine: sim, gpus: 1}
  - name: big
    replicas: 1
    profiles:
      - {name: two-nodes, engine: sim, nodes: 2, gpus: 1}
"""
REFUSED = ("not started: vLLM 0.10.2 (llmgw sim engine --version) is older than 0.11.1, the first release with "
           "--nnodes, --node-rank, --master-addr, --master-port; upgrade vLLM on this node or run the "
           "replica on one node")


def test_a_launch_the_engine_is_too_old_for_is_refused_with_the_version_it_found(tmp_path: Path,
                                                                                 procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG))
    procs.append(server.start())
    agents = []
    for node in ("gpu-01", "gpu-02"):
        cfg = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "2", "--ib-ports", "2")
        agents.append(Proc(f"agent-{node}", ["agent", "--config", str(cfg), "--insecure", "--stop-engines-on-exit"],
                           tmp_path, env={"LLMGW_SIM_ENGINE_VERSION": "0.10.2"}))
    procs.extend(agents)

    def small_ready() -> dict[str, Any] | None:
        return next((r for r in replicas(server) if r["model"] == "small" and r["state"] == "ready"), None)

    wait_until(small_ready, "the one-node replica ready on vLLM 0.10.2", procs=procs)

    def refused() -> str | None:
        for event in server.get("/api/v1/events"):
            if REFUSED in str(event):
                return str(event)
        return None

    wait_until(refused, "a rank of the two-node replica refused for the engine's version", procs=procs)
    assert not any(r["model"] == "big" and r["state"] == "ready" for r in replicas(server))
    assert not list(tmp_path.glob("**/logs/big-*.log"))  # nothing of it was launched
    assert any("sim version 0.10.2 (llmgw sim engine --version" in agent.log() for agent in agents)
