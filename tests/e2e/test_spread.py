"""A model's replicas end up on different nodes (issue 18), through real servers and agents."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl,
    ctl_json,
    engines_config,
    make_sim_node,
    replicas,
    start_agent,
    wait_until,
)
from tests.e2e.test_replicas import CATALOG as REPLICAS_CATALOG
from tests.faults.fleet import CATALOG, FAULT_AGENT, FAULT_FLEET, FAULT_GATEWAY, MODEL, Load

TWO_REPLICAS = REPLICAS_CATALOG.split("  - name: large")[0]  # small: 2 replicas of 1 GPU


def test_first_start_waits_for_expected_nodes_then_spreads(tmp_path: Path, procs: list[Proc]) -> None:
    """`reconcile.expect_nodes` (what `llmgw demo` sets): nothing is placed while one of them
    is missing, however long the first node has been there, and once the last registers the
    replicas go one per node. Without it, both would land on the node that came first."""
    config = engines_config(TWO_REPLICAS).replace("  settle: 0.5s\n",
                                                  "  settle: 5m\n  expect_nodes: [gpu-01, gpu-02]\n")
    server = Server(tmp_path, config)
    procs.append(server.start())
    configs = {node: make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "4")
               for node in ("gpu-01", "gpu-02")}
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


def test_a_late_node_gets_one_replica_moved_to_it_under_load_with_no_failed_request(tmp_path: Path,
                                                                                    procs: list[Proc]) -> None:
    """One node with both replicas of a model; a second node joins; within the (short) cooldown
    one replica moves there, successor ready first, the old one out of rotation and drained,
    while the official openai client sends requests without a single failure."""
    server = Server(tmp_path, FAULT_FLEET + FAULT_GATEWAY + "placement:\n  spread: nodes\n  spread_cooldown: 2s\n"
                    + CATALOG.replace('args: ["--ttft-ms"', 'args: ["--startup-delay", "3", "--ttft-ms"'))
    procs.append(server.start())
    configs = {node: make_sim_node(tmp_path, node, server.fleet_url, FAULT_AGENT, "--gpus", "2")
               for node in ("gpu-01", "gpu-02")}
    procs.append(start_agent(tmp_path, "gpu-01", configs["gpu-01"], "--stop-engines-on-exit"))

    def on(*want: str) -> list[dict[str, Any]] | None:
        """Exactly the replicas wanted, ready on these nodes, every one in rotation and healthy."""
        rs = replicas(server)
        eps = {e["endpoint"]: e for e in server.get("/api/v1/endpoints") if e["model"] == MODEL}
        ok = (sorted(r["shards"][0]["node"] for r in rs) == sorted(want) and all(r["state"] == "ready" for r in rs)
              and all(eps.get(r["shards"][0]["endpoint"], {}).get("healthy") for r in rs))
        return rs if ok else None

    before = wait_until(lambda: on("gpu-01", "gpu-01"), "both replicas ready on gpu-01", deadline=60, procs=procs)
    seen_moving: list[dict[str, Any]] = []
    with Load(server.url) as load:
        load.wait_successes(20, "requests served before the second node joins")
        procs.append(start_agent(tmp_path, "gpu-02", configs["gpu-02"], "--stop-engines-on-exit"))

        def moving() -> dict[str, Any] | None:
            """The move in the API, then in the operator's table while it happens (the successor
            takes 3 s to start): the replica being moved says so."""
            row = next((r for r in replicas(server) if (r.get("move") or {}).get("kind") == "spread"), None)
            if row is not None:
                seen_moving.append(row)
                table = ctl(server.url, "replicas").stdout
                if "spread" in table:
                    return row
                assert not on("gpu-01", "gpu-02"), f"the move ended before ctl replicas showed it:\n{table}"
            return None

        row = wait_until(moving, "ctl replicas to show a spread move", deadline=60, procs=procs)
        assert row["move"]["reason"].startswith(f"spread: 2 of 2 replicas of {MODEL} on gpu-01"), row
        after = wait_until(lambda: on("gpu-01", "gpu-02"), "one replica moved to gpu-02", deadline=60, procs=procs)
        load.wait_successes(20, "requests served after the move")
    line = load.report("spread move", "one replica moved from gpu-01 to gpu-02")
    assert load.failures(avoidable_only=False) == [], line
    assert len(load.outcomes) >= 40
    # One replica stayed, one was replaced by a successor on gpu-02; no other move happened.
    assert len({r["id"] for r in before} & {r["id"] for r in after}) == 1
    events = ctl_json(server.url, "events", "--model", MODEL)
    spread = [e for e in events if e["kind"] == "spread"]
    assert any("asked: spread: 2 of 2 replicas of chat on gpu-01" in e["message"] for e in spread), spread
    assert any(" done: " in e["message"] for e in spread), spread
    assert sum("asked:" in e["message"] for e in spread) == 1, spread


def test_spread_off_holds_and_a_reload_turns_it_on(tmp_path: Path, procs: list[Proc]) -> None:
    """`placement.spread: off` leaves a crowded model alone; a reload (SIGHUP) to `nodes` takes
    effect at once, without a restart."""
    config = engines_config(TWO_REPLICAS) + "placement:\n  spread: off\n  spread_cooldown: 1s\n"
    server = Server(tmp_path, config)
    procs.append(server.start())
    configs = {node: make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "2")
               for node in ("gpu-01", "gpu-02")}
    procs.append(start_agent(tmp_path, "gpu-01", configs["gpu-01"], "--stop-engines-on-exit"))

    def ready_on() -> list[str] | None:
        rs = replicas(server)
        return sorted(r["shards"][0]["node"] for r in rs) if len(rs) == 2 and all(r["state"] == "ready"
                                                                                  for r in rs) else None

    assert wait_until(ready_on, "two replicas ready on gpu-01", procs=procs) == ["gpu-01", "gpu-01"]
    procs.append(start_agent(tmp_path, "gpu-02", configs["gpu-02"], "--stop-engines-on-exit"))
    wait_until(lambda: server.nodes().get("gpu-02", {}).get("state") == "ready", "gpu-02 ready", procs=procs)
    assert ready_on() == ["gpu-01", "gpu-01"] and not [r for r in replicas(server) if r.get("move")]
    server.config.write_text(config.replace("spread: off", "spread: nodes"))
    server.proc.signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: ready_on() == ["gpu-01", "gpu-02"], "one replica moved to gpu-02 after the reload", procs=procs,
               deadline=60)
    assert "placement: spread nodes, cooldown 1s" in server.proc.log()  # type: ignore[union-attr]
