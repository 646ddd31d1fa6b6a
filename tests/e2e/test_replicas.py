"""Engines and replicas end to end: real server, agents and simulated engines on loopback."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl_json,
    engine_auth,
    engines_config,
    make_sim_node,
    pid_alive,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)

CATALOG = """\
models:
  - name: small
    replicas: 2
    profiles:
      - name: tp1
        engine: sim
        gpus: 1
        args: ["--startup-delay", "0.3"]
  - name: large
    replicas: 1
    profiles:
      - name: tp2
        engine: sim
        gpus: 2
"""


def fleet(tmp_path: Path, procs: list[Proc], catalog: str = CATALOG, nodes: int = 2, gpus: int = 4,
          backoff: str = "0.5s", backoff_max: str = "5s", lost_after: str = "2s",
          ) -> tuple[Server, dict[str, Proc], dict[str, Path]]:
    # The first start waits for every node (issue 18: otherwise gpu-01, started first, gets every
    # replica and spreading then moves one, racing what the test looks at).
    names = ", ".join(f"gpu-0{i}" for i in range(1, nodes + 1))
    config = engines_config(catalog, backoff=backoff, backoff_max=backoff_max).replace(
        "  settle: 0.5s\n", f"  settle: 30s\n  expect_nodes: [{names}]\n")
    server = Server(tmp_path, config.replace("lost_after: 2s", f"lost_after: {lost_after}"))
    procs.append(server.start())
    agents, configs = {}, {}
    for i in range(1, nodes + 1):
        node = f"gpu-0{i}"
        configs[node] = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", str(gpus))
        agents[node] = start_agent(tmp_path, node, configs[node], "--stop-engines-on-exit")
        procs.append(agents[node])
    return server, agents, configs


def all_ready(server: Server, count: int) -> list[dict[str, Any]] | None:
    rs = replicas(server)
    return rs if len(rs) == count and all(r["state"] == "ready" for r in rs) else None


def pids(rs: list[dict[str, Any]]) -> dict[str, int]:
    return {r["id"]: r["shards"][0]["pid"] for r in rs}


def chat(endpoint: str, model: str, headers: dict[str, str]) -> str:
    """Straight to the engine, with its key (the shard's, from the agent's state file)."""
    response = httpx.post(f"{endpoint}/v1/chat/completions",
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                          headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def test_replicas_ready_and_a_killed_engine_is_replaced(tmp_path: Path, procs: list[Proc]) -> None:
    server, _, _ = fleet(tmp_path, procs)
    ready = wait_until(lambda: all_ready(server, 3), "three replicas ready", procs=procs)
    # The operator's view through the real CLI.
    listed = ctl_json(server.url, "replicas")
    assert sorted(r["model"] for r in listed) == ["large", "small", "small"]
    for r in listed:
        shard = r["shards"][0]
        assert {"id", "model", "state", "shards"} <= r.keys() and r["state"] == "ready"
        assert {"node", "gpus", "rank", "state", "endpoint"} <= shard.keys()
        assert len(shard["gpus"]) == (2 if r["model"] == "large" else 1)
        assert chat(shard["endpoint"], r["model"], engine_auth(tmp_path, shard["shard_id"]))
    # No two engines share a GPU on a node.
    held = [(r["shards"][0]["node"], g) for r in listed for g in r["shards"][0]["gpus"]]
    assert len(held) == len(set(held))
    table = run_llmgw("ctl", "--server", server.url, "replicas")
    assert table.returncode == 0 and "small" in table.stdout and "ready" in table.stdout

    victim = next(r for r in ready if r["model"] == "small")
    old_pid = victim["shards"][0]["pid"]
    import os

    os.kill(old_pid, signal.SIGKILL)
    replaced = wait_until(
        lambda: next((r for r in replicas(server) if r["id"] == victim["id"] and r["state"] == "ready"
                      and r["shards"][0]["pid"] != old_pid), None),
        "the killed engine's replica to be replaced", procs=procs)
    assert replaced["attempt"] == victim["attempt"] + 1
    assert chat(replaced["shards"][0]["endpoint"], "small", engine_auth(tmp_path, replaced["shards"][0]["shard_id"]))
    assert "exited" in server.proc.log() or "killed" in server.proc.log()


def test_agent_and_server_restarts_adopt_running_engines(tmp_path: Path, procs: list[Proc]) -> None:
    # Adoption, not liveness: a restarted agent on a loaded machine can take over 2 s to come
    # back, and a node declared lost has its replicas placed anew (new ids, not adopted).
    server, agents, configs = fleet(tmp_path, procs, lost_after="30s")
    before = pids(wait_until(lambda: all_ready(server, 3), "three replicas ready", procs=procs))

    # kill -9 an agent: its engines keep running; a new agent adopts them (same pids).
    agents["gpu-01"].kill9()
    assert all(pid_alive(p) for p in before.values())
    agents["gpu-01"] = start_agent(tmp_path, "gpu-01", configs["gpu-01"], "--stop-engines-on-exit")
    procs.append(agents["gpu-01"])
    live = [server.proc, *agents.values()]
    wait_until(lambda: "adopted shard" in agents["gpu-01"].log(), "adoption logged", procs=live)
    wait_until(lambda: (rs := all_ready(server, 3)) and pids(rs) == before, "same replicas, same pids", procs=live)

    # Restart the server: the replicas come back from the agents' reports, same ids and pids.
    assert server.proc.stop() == 0
    procs.append(server.start())
    live = [server.proc, *agents.values()]
    rs = wait_until(lambda: (rs := all_ready(server, 3)) and pids(rs) == before and rs, "replicas rebuilt from reports",
                    procs=live)
    assert all(r["adopted"] for r in rs)
    held = {(r["shards"][0]["node"], g) for r in rs for g in r["shards"][0]["gpus"]}

    # The next placement does not hand out GPUs the adopted engines hold.
    server.config.write_text(server.config.read_text() + """\
  - name: extra
    replicas: 2
    profiles:
      - engine: sim
        gpus: 1
""")
    server.proc.signal(signal.SIGHUP)
    rs = wait_until(lambda: all_ready(server, 5), "the extra replicas ready", procs=live)
    extra = {(r["shards"][0]["node"], g) for r in rs if r["model"] == "extra" for g in r["shards"][0]["gpus"]}
    assert len(extra) == 2 and not extra & held  # 1 + 3 GPUs free (gpu-01: small + large; gpu-02: small)
    assert pids([r for r in rs if r["model"] != "extra"]) == before


def test_model_removed_from_catalog_stops_its_engines(tmp_path: Path, procs: list[Proc]) -> None:
    server, _, _ = fleet(tmp_path, procs)
    rs = wait_until(lambda: all_ready(server, 3), "three replicas ready", procs=procs)
    large_pid = next(r["shards"][0]["pid"] for r in rs if r["model"] == "large")
    server.config.write_text(server.config.read_text().split("  - name: large")[0])
    server.proc.signal(signal.SIGHUP)
    wait_until(lambda: [r["model"] for r in replicas(server)] == ["small", "small"], "large gone from replicas",
               procs=procs)
    wait_until(lambda: not pid_alive(large_pid), "the large engine process to exit", procs=procs)
    assert all(pid_alive(r["shards"][0]["pid"]) for r in rs if r["model"] == "small")


def test_engine_that_exits_during_startup_is_failed_with_its_output(tmp_path: Path, procs: list[Proc]) -> None:
    catalog = """\
models:
  - name: broken
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
        args: ["--fail-startup"]
"""
    # A long backoff keeps the replica failed while ctl looks at it (no retry in between).
    server, _, _ = fleet(tmp_path, procs, catalog, nodes=1, backoff="5m", backoff_max="5m")
    failed = wait_until(lambda: next((r for r in replicas(server) if r["state"] == "failed"), None),
                        "the replica to fail", procs=procs)
    assert "during startup" in failed["reason"] and failed["tail"]
    assert failed["retry_in"] is not None  # backoff, not a spin
    table = run_llmgw("ctl", "--server", server.url, "replicas")
    assert table.returncode == 0
    assert "failed" in table.stdout and failed["tail"][-1].strip() in table.stdout
