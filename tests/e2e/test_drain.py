"""Cordon and drain end to end: a real server, two agents running simulated engines, steady
openai-client traffic through the gateway, and `llmgw ctl` processes as an SRE runs them.

A drain moves each replica with the move primitive: the replacement is ready before the old one
leaves rotation and gets Drain, so no request fails; with nowhere to go a drain stops nothing
and exits 1 with the reason, `--force` stops and says so; marks survive a server restart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.harness import (
    FAST_AGENT,
    Load,
    Proc,
    Server,
    engines_config,
    make_sim_node,
    one_error_line,
    pid_alive,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)
from tests.e2e.test_doors import digest

OPERATOR, VIEWER, KEY = "ops-drain-41c7", "viewer-drain-9e02", "sk-drain-5b3d"


CREDENTIALS = f"""\
gateway:
  api_keys: ["{digest(KEY)}"]
api:
  operator_tokens: ["{digest(OPERATOR)}"]
  viewer_tokens: ["{digest(VIEWER)}"]
"""
CATALOG = """\
models:
  - name: chat
    replicas: 2
    profiles:
      - engine: sim
        gpus: 1
        stop_grace: 10s
        args: ["--ttft-ms", "5", "--itl-ms", "5"]
"""


def ctl(server: Server, *args: str, token: str = OPERATOR, timeout: float = 60) -> Any:
    base = {"LLMGW_TOKEN": token, "LLMGW_CA": "", "LLMGW_CERT": "", "LLMGW_KEY": ""}
    return run_llmgw("ctl", "--server", server.url, *args, env=base, timeout=timeout)


def ready_on(server: Server, n: int) -> dict[str, str] | None:
    """replica id → node, when exactly `n` replicas exist and all are ready."""
    rs = replicas(server)
    if len(rs) != n or any(r["state"] != "ready" for r in rs):
        return None
    return {r["id"]: r["shards"][0]["node"] for r in rs}


def pids(server: Server) -> dict[str, int]:
    return {r["id"]: r["shards"][0]["pid"] for r in replicas(server) if r["shards"]}


def fleet(tmp_path: Path, procs: list[Proc]) -> tuple[Server, dict[str, Proc]]:
    # A settle long enough for both nodes to register before the first placement (spread over both).
    server = Server(tmp_path, engines_config(CATALOG, CREDENTIALS).replace("settle: 0.5s", "settle: 3s"), token=VIEWER)
    configs = {node: make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "2")
               for node in ("gpu-01", "gpu-02")}
    procs.append(server.start())
    agents = {}
    for node, cfg in configs.items():
        agents[node] = start_agent(tmp_path, node, cfg, "--stop-engines-on-exit")
        procs.append(agents[node])
    placed = wait_until(lambda: ready_on(server, 2), "two replicas ready", procs=procs)
    assert sorted(placed.values()) == ["gpu-01", "gpu-02"], placed  # one on each node (spread)
    return server, agents


def test_drain_moves_every_replica_under_load_without_a_failed_request(tmp_path: Path, procs: list[Proc]) -> None:
    server, agents = fleet(tmp_path, procs)
    before = pids(server)
    on_01 = next(rid for rid, node in (ready_on(server, 2) or {}).items() if node == "gpu-01")

    # Only an operator may cordon or drain: a viewer is refused (403), an API key is no fleet credential (401).
    for token, status in ((VIEWER, "HTTP 403"), (KEY, "HTTP 401")):
        for args in (("cordon", "gpu-01"), ("drain", "gpu-01"), ("uncordon", "gpu-01")):
            result = ctl(server, *args, token=token)
            assert result.returncode == 1 and status in one_error_line(result), (args, result.stderr)
    assert server.nodes()["gpu-01"]["mark"] == ""
    # A typed id is one path segment: it cannot reach another route (this cordoned gpu-01) nor
    # break the URL (a traceback); the server says there is no such node.
    for args in (("drain", "gpu-01/cordon?x="), ("cordon", "gpu-01/x/.."), ("cordon", "gpu\x1b]0;t\x07")):
        result = ctl(server, *args)
        assert result.returncode == 1 and "no node" in one_error_line(result), (args, result.stderr)
    assert ctl(server, "uncordon", "..").returncode == 2
    assert server.nodes()["gpu-01"]["mark"] == ""

    with Load(server.url, "chat", threads=3, api_key=KEY) as load:
        result = ctl(server, "drain", "gpu-01", "--timeout", "90", timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        ok_during = load.ok
    assert load.failures == [], load.failures[:5]
    assert ok_during > 10, ok_during  # traffic flowed throughout

    # The node runs nothing; two ready replicas on gpu-02; the old engine exited.
    placed = ready_on(server, 2)
    assert placed is not None and set(placed.values()) == {"gpu-02"}, replicas(server)
    assert on_01 not in placed
    wait_until(lambda: not pid_alive(before[on_01]), "the drained engine to exit", procs=procs)
    out = result.stdout
    assert "draining gpu-01" in out and on_01 in out and "drained: it runs nothing" in out, out
    # The agent got Drain (not a plain Stop), and the engine stopped gracefully.
    assert "draining shard" in agents["gpu-01"].log()
    # The mark is shown (`ctl nodes`, /api/v1/nodes) and the event log tells the story.
    assert server.nodes()["gpu-01"]["mark"] == "draining"
    nodes_out = ctl(server, "nodes", token=VIEWER).stdout
    assert "ready,draining" in nodes_out, nodes_out
    events = json.loads(ctl(server, "events", "--node", "gpu-01", "-o", "json", token=VIEWER).stdout)
    messages = [e["message"] for e in events if e["kind"] == "drain"]
    assert any("drain of gpu-01 requested by operator token" in m for m in messages), messages
    assert any(f"move of {on_01} retiring" in m for m in messages) and any(f"move of {on_01} done" in m
                                                                           for m in messages)

    # Uncordon: placements allowed again (a new replica may land there), and said (-o json: the answer only).
    undone = ctl(server, "uncordon", "gpu-01", "-o", "json")
    assert undone.returncode == 0 and json.loads(undone.stdout) == {"node": "gpu-01", "uncordoned": True}, undone.stdout
    assert server.nodes()["gpu-01"]["mark"] == ""


def test_drain_with_nowhere_to_go_stops_nothing_then_force_stops_and_marks_survive_a_restart(
        tmp_path: Path, procs: list[Proc]) -> None:
    server, agents = fleet(tmp_path, procs)
    assert ctl(server, "cordon", "gpu-02").returncode == 0
    assert "ready,cordoned" in ctl(server, "nodes", token=VIEWER).stdout
    before = pids(server)
    on_01 = next(rid for rid, node in (ready_on(server, 2) or {}).items() if node == "gpu-01")

    # --timeout: the command gives up waiting (exit 1, said), the drain goes on server-side.
    result = ctl(server, "drain", "gpu-01", "--timeout", "0")
    assert result.returncode == 1 and "timed out after 0s" in one_error_line(result), result.stderr
    # gpu-02 takes no new placements: the replica on gpu-01 has nowhere to go.
    result = ctl(server, "drain", "gpu-01", "--timeout", "60", timeout=90)
    assert result.returncode == 1, result.stdout + result.stderr
    line = one_error_line(result)
    assert ("drain of gpu-01 incomplete" in line and on_01 in line and "no room" in line
            and "gpu-02: cordoned" in line), line
    assert "--force" in line
    # Nothing stopped: the same engines serve.
    assert ready_on(server, 2) is not None and pids(server) == before
    assert all(pid_alive(p) for p in before.values())

    # --force: stopped anyway, and the output names the replica that is down.
    result = ctl(server, "drain", "gpu-01", "--force", "--timeout", "60", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DOWN (--force)" in result.stdout and on_01 in result.stdout, result.stdout
    assert "serves instead" not in result.stdout, result.stdout  # its successor is pending: said so, not that it serves
    wait_until(lambda: not pid_alive(before[on_01]), "the forced engine to exit", procs=procs)
    assert not any(s["node"] == "gpu-01" and s["state"] != "stopped" for r in replicas(server) for s in r["shards"])
    pending = [r for r in replicas(server) if r["state"] == "pending"]
    assert len(pending) == 1 and "gpu-01: cordoned; gpu-02: cordoned" in pending[0]["reason"], pending

    # Marks survive a restart of the server (nodes.sqlite in its state dir).
    server.proc.stop()
    procs.append(server.start())
    wait_until(lambda: {n: v["mark"] for n, v in server.nodes().items()} == {"gpu-01": "draining",
                                                                             "gpu-02": "cordoned"},
               "both marks back after the restart", procs=[server.proc, *agents.values()])
    # Uncordon gpu-02: the replica that was down finds room there.
    assert ctl(server, "uncordon", "gpu-02").returncode == 0
    placed = wait_until(lambda: ready_on(server, 2), "two replicas ready on gpu-02",
                        procs=[server.proc, *agents.values()])
    assert set(placed.values()) == {"gpu-02"}
