"""A fleet that heals itself end to end (issue 43): a real server with `auto_remediate: act`,
agents on simulated nodes, openai-client traffic through the gateway, `llmgw sim node set-gpu`
as the fault and `llmgw ctl` as an SRE runs it.

Xid 79 on the GPU serving the replica → the node is cordoned automatically, the replica replaced
on a healthy GPU elsewhere with no failed request, the GPU not placeable, the events there;
cleared → the node and GPU return after the (short) clear window. Faults on more nodes than the
budget allows → only that many cordoned, the rest reported; an operator's cordon is never lifted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import (
    FAST_AGENT,
    Load,
    Proc,
    Server,
    bearer,
    engines_config,
    make_sim_node,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)
from tests.e2e.test_doors import digest

pytestmark = pytest.mark.e2e

OPERATOR, VIEWER, KEY = "ops-remedy-7d21", "viewer-remedy-3a90", "sk-remedy-c4e8"
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
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
        stop_grace: 10s
        args: ["--ttft-ms", "5", "--itl-ms", "5"]
  - name: other
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
        args: ["--ttft-ms", "5", "--itl-ms", "5"]
"""


def remedy(max_nodes: int) -> str:
    return f"""\
remedy:
  auto_remediate: act
  hold: 2
  clear_after: 3s
  max_nodes: {max_nodes}
  max_percent: 100
"""


def ctl(server: Server, *args: str, token: str = OPERATOR) -> Any:
    env = {"LLMGW_TOKEN": token, "LLMGW_CA": "", "LLMGW_CERT": "", "LLMGW_KEY": ""}
    return run_llmgw("ctl", "--server", server.url, *args, env=env, timeout=60)


def set_gpu(tmp: Path, node: str, gpu: int, *flags: str) -> None:
    result = run_llmgw("sim", "node", "set-gpu", str(tmp / node), str(gpu), *flags)
    assert result.returncode == 0, result.stderr


def events(server: Server) -> list[str]:
    out = ctl(server, "events", "-o", "json", token=VIEWER)
    assert out.returncode == 0, out.stderr
    return [e["message"] for e in json.loads(out.stdout) if e["kind"] == "remedy"]


def fleet(tmp: Path, procs: list[Proc], nodes: list[str], catalog: str, max_nodes: int) -> Server:
    server = Server(tmp, engines_config(catalog, CREDENTIALS + remedy(max_nodes)).replace("settle: 0.5s", "settle: 3s"),
                    token=VIEWER)
    configs = {node: make_sim_node(tmp, node, server.fleet_url, FAST_AGENT, "--gpus", "2") for node in nodes}
    procs.append(server.start())
    for node, cfg in configs.items():
        procs.append(start_agent(tmp, node, cfg, "--stop-engines-on-exit"))
    wait_until(lambda: (len(server.nodes()) == len(nodes)
                        and all(n["state"] == "ready" for n in server.nodes().values()))
               or None, "every node ready", procs=procs)
    return server


def serving(server: Server, model: str = "chat") -> tuple[str, str, int] | None:
    """(replica, node, GPU) of the model's one ready replica, when exactly one exists."""
    rs = [r for r in replicas(server) if r["model"] == model]
    if len(rs) != 1 or rs[0]["state"] != "ready":
        return None
    shard = rs[0]["shards"][0]
    return rs[0]["id"], shard["node"], shard["gpus"][0]


def pid_of(server: Server, replica: str) -> int:
    return next(r["shards"][0]["pid"] for r in replicas(server) if r["id"] == replica)


def test_xid_79_moves_the_replica_with_no_failed_request_and_the_gpu_returns(tmp_path: Path,
                                                                                procs: list[Proc]) -> None:
    server = fleet(tmp_path, procs, ["gpu-01", "gpu-02"], CATALOG, max_nodes=1)
    first = wait_until(lambda: serving(server), "the replica ready", procs=procs)
    rid, node, gpu = first
    other = "gpu-02" if node == "gpu-01" else "gpu-01"
    # Best fit packs the other model's replica beside it, on the node's healthy GPU: it must stay.
    neighbour = wait_until(lambda: serving(server, "other"), "the other model's replica ready", procs=procs)
    assert neighbour[1] == node and neighbour[2] != gpu, (first, neighbour)
    neighbour_pid = pid_of(server, neighbour[0])

    with Load(server.url, "chat", threads=3, api_key=KEY) as load:
        set_gpu(tmp_path, node, gpu, "--xid", "79")
        wait_until(lambda: server.nodes()[node]["mark"] == f"cordoned (auto: gpu {gpu} Xid 79)" or None,
                   "the node cordoned automatically", procs=procs)
        moved = wait_until(lambda: (s := serving(server)) is not None and s[0] != rid and s, "the replica replaced",
                           procs=procs, deadline=90)
        load.wait(10, "traffic after the move")
    assert load.failures == [], load.failures[:5]
    assert moved[1] == other, moved  # a healthy GPU, on the node that is not cordoned
    assert serving(server, "other") == neighbour and pid_of(server, neighbour[0]) == neighbour_pid  # untouched

    view = server.nodes()[node]
    assert view["unplaceable"] == {str(gpu): f"gpu {gpu} Xid 79"}, view
    listing = ctl(server, "nodes", token=VIEWER).stdout
    assert f"cordoned (auto: gpu {gpu} Xid 79)" in listing and "not placeable" in listing, listing
    described = ctl(server, "nodes", node, token=VIEWER).stdout  # the node alone: the GPU's row says why
    assert f"no: gpu {gpu} Xid 79" in described, described
    said = events(server)
    assert any(f"node {node} cordoned automatically: gpu {gpu} Xid 79" in m for m in said), said
    assert any(f"GPU {gpu} not placeable" in m for m in said), said
    metrics = httpx.get(f"{server.url}/metrics", headers=bearer(VIEWER), timeout=10).text
    assert 'llmgw_auto_cordons_total{reason="xid-79"} 1.0' in metrics, metrics[-2000:]

    # Cleared: after the clear window (3 s) the GPU is placeable and the node uncordoned.
    set_gpu(tmp_path, node, gpu, "--xid", "0")
    wait_until(lambda: (server.nodes()[node]["mark"] == "" and not server.nodes()[node]["unplaceable"]) or None,
               "the node and GPU back after the clear window", procs=procs)
    said = events(server)
    assert any(f"node {node} uncordoned automatically" in m for m in said), said
    assert any(f"GPU {gpu} placeable again" in m for m in said), said


def test_the_budget_holds_and_an_operators_cordon_is_never_lifted(tmp_path: Path, procs: list[Proc]) -> None:
    nodes = ["gpu-01", "gpu-02", "gpu-03"]
    server = fleet(tmp_path, procs, nodes, "models: []\n", max_nodes=1)
    assert ctl(server, "cordon", "gpu-03").returncode == 0
    for node in nodes:
        set_gpu(tmp_path, node, 0, "--xid", "79")

    def settled() -> list[str] | None:
        said = events(server)
        reported = [m for m in said if "not cordoned" in m]
        return said if len(reported) >= 2 else None

    said = wait_until(settled, "one node cordoned, two reported", procs=procs)
    marks = {n: v["mark"] for n, v in server.nodes().items()}
    auto = [n for n, mark in marks.items() if mark.startswith("cordoned (auto:")]
    assert len(auto) == 1 and marks["gpu-03"] == "cordoned", marks
    assert any("over the budget" in m for m in said) and any("already cordoned by an operator" in m for m in said), said
    assert all(server.nodes()[n]["unplaceable"] == {"0": "gpu 0 Xid 79"} for n in nodes)  # out, budget or not

    for node in nodes:
        set_gpu(tmp_path, node, 0, "--xid", "0")
    wait_until(lambda: server.nodes()[auto[0]]["mark"] == "" or None, "the auto-cordon lifted", procs=procs)
    wait_until(lambda: all(not v["unplaceable"] for v in server.nodes().values()) or None, "every GPU back",
               procs=procs)
    assert server.nodes()["gpu-03"]["mark"] == "cordoned"  # the operator's, still
    assert not any(m.startswith("node gpu-03 uncordoned") for m in events(server))
