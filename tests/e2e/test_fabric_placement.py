"""Placement reads the fabric map, end to end: a real server, eight agents on simulated nodes whose
stand-in ibnetdiscover prints a two-leaf fabric. A four-node replica lands under one leaf (the
node ids are interleaved across the leaves, so an order by id alone would mix them); once a cable
of one of its nodes trains short, the next placement goes under the other leaf, and the server's
log and the placement event (`ctl events`) say why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl,
    engines_config,
    make_sim_fabric,
    make_sim_node,
    replicas,
    run_llmgw,
    start_agent,
    token_digest,
    wait_until,
)

TOKEN = "ops-7c41d9"
API = f'api:\n  operator_tokens: ["{token_digest(TOKEN)}"]\n'
FABRIC = """\
fabric:
  discover_interval: 1s
  sm_interval: 0.5s
  tool_timeout: 5s
"""
LEAF_1 = ["gpu-1", "gpu-3", "gpu-5", "gpu-7"]
LEAF_2 = ["gpu-2", "gpu-4", "gpu-6", "gpu-8"]
CATALOG = """\
models:
  - name: big
    replicas: 0
    profiles:
      - name: four-nodes
        engine: sim
        nodes: 4
        gpus: 1
"""
DEADLINE = 90.0  # eight agents and four engines on a shared two-core machine


def make_fabric(out: Path, *flags: str) -> dict[str, Any]:
    return make_sim_fabric(out, LEAF_1 + LEAF_2, *flags, rails=1, group_size=4)


def scale(server: Server, count: int) -> None:
    text = server.config.read_text()
    server.config.write_text(text.replace("replicas: 0", f"replicas: {count}") if count else
                             text.replace("replicas: 1", "replicas: 0"))
    result = ctl(server.url, "reload", env={"LLMGW_TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr


def ready_nodes(server: Server) -> list[str] | None:
    rs = replicas(server)
    if len(rs) == 1 and rs[0]["state"] == "ready":
        return sorted(s["node"] for s in rs[0]["shards"])
    return None


def test_a_replica_lands_under_one_leaf_and_a_short_cable_moves_the_next(tmp_path: Path, procs: list[Proc]) -> None:
    fabric_dir = tmp_path / "fabric"
    made = make_fabric(fabric_dir)
    assert {made["leaf_of"][f"{n} mlx5_0"] for n in LEAF_1} == {"leaf-g1-r0"}
    server = Server(tmp_path, engines_config(CATALOG, API + FABRIC), token=TOKEN)
    procs.append(server.start())
    for node in sorted(LEAF_1 + LEAF_2):
        config = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "1", "--ib-ports", "1",
                               "--fabric", str(fabric_dir))
        procs.append(start_agent(tmp_path, node, config, "--stop-engines-on-exit"))

    def mapped() -> str | None:
        fabrics = server.get("/api/v1/fabrics")
        if len(fabrics) != 1 or not fabrics[0]["topology"] or fabrics[0]["topology"]["adapters"] != 8:
            return None
        nodes = {a["node"] for a in server.get(f"/api/v1/fabrics/{fabrics[0]['id']}/topology")["adapters"]}
        return fabrics[0]["id"] if nodes == set(LEAF_1 + LEAF_2) else None

    fabric_id = wait_until(mapped, "the two-leaf fabric mapped, every adapter named by its node", DEADLINE, procs)
    scale(server, 1)
    assert wait_until(lambda: ready_nodes(server), "the 4-node replica ready", DEADLINE, procs) == sorted(LEAF_1)
    assert "under one leaf: leaf-g1-r0" in server.proc.log()  # type: ignore[union-attr]

    # A cable of gpu-3 trains at one lane (its sysfs and the dump say so alike); once the map shows
    # it, the next placement avoids gpu-3.
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-3"), "mlx5_0", "1", "up",
                     "--rate", "100 Gb/sec (1X NDR)").returncode == 0
    make_fabric(fabric_dir, "--degrade", "gpu-3")

    def degraded() -> bool:
        detail = server.get(f"/api/v1/fabrics/{fabric_id}")
        return any({link["a"]["name"], link["b"]["name"]} & {"gpu-3 mlx5_0"} for link in detail["degraded_links"])

    wait_until(degraded, "the short cable of gpu-3 in the map", DEADLINE, procs)
    scale(server, 0)
    wait_until(lambda: replicas(server) == [], "the first replica gone", DEADLINE, procs)
    scale(server, 1)
    assert wait_until(lambda: ready_nodes(server), "the next 4-node replica ready", DEADLINE, procs) == sorted(LEAF_2)
    why = "under one leaf: leaf-g2-r0; gpu-3: cable to leaf-g1-r0 trained 1xNDR (others 4xNDR)"
    log = server.proc.log()  # type: ignore[union-attr]
    assert why in log, log[-3000:]

    def placement_event() -> list[str] | None:  # what `ctl events` shows an operator
        events = server.get("/api/v1/events")
        found = [e["message"] for e in events if e["kind"] == "placement" and why in e["message"]]
        return found or None

    wait_until(placement_event, "the placement event saying where and why", DEADLINE, procs)
