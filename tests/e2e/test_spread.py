"""A model's replicas end up on different nodes (issue 18), through real servers and agents."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    engines_config,
    make_sim_node,
    replicas,
    start_agent,
    wait_until,
)

TWO_REPLICAS = """\
models:
  - name: small
    replicas: 2
    profiles:
      - name: tp1
        engine: sim
        gpus: 1
        args: ["--startup-delay", "0.3"]
"""


def test_first_start_waits_for_expected_nodes_then_spreads(tmp_path: Path, procs: list[Proc]) -> None:
    """`reconcile.expect_nodes` (what `llmgw demo` sets): nothing is placed while one of them
    is missing, however long the first node has been there, and once the last registers the
    replicas go one per node. Without it, both would land on the node that came first."""
    config = engines_config(TWO_REPLICAS).replace("  settle: 0.5s\n", "  settle: 5m\n  expect_nodes: [gpu-01, gpu-02]\n")
    server = Server(tmp_path, config)
    procs.append(server.start())
    configs = {node: make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "4") for node in ("gpu-01", "gpu-02")}
    procs.append(start_agent(tmp_path, "gpu-01", configs["gpu-01"], "--stop-engines-on-exit"))
    wait_until(lambda: server.nodes().get("gpu-01", {}).get("state") == "ready", "gpu-01 registered", procs=procs)

    server_proc = procs[0]

    def held() -> bool:
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                            json={"model": "small", "messages": [{"role": "user", "content": "hi"}]})
        return answer.status_code == 503 and "until gpu-02 registers" in server_proc.log()

    # The gateway's 503 is logged with why nothing serves yet, naming the node it waits for.
    wait_until(held, "a 503 whose reason names gpu-02", procs=procs)
    assert replicas(server) == []
    procs.append(start_agent(tmp_path, "gpu-02", configs["gpu-02"], "--stop-engines-on-exit"))

    def ready() -> list[str] | None:
        rs = replicas(server)
        return [r["shards"][0]["node"] for r in rs] if len(rs) == 2 and all(r["state"] == "ready" for r in rs) else None

    nodes = wait_until(ready, "two replicas ready", procs=procs)
    assert sorted(nodes) == ["gpu-01", "gpu-02"], nodes
