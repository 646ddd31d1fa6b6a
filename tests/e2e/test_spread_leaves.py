"""`placement.spread: leaves`, end to end: a real server, agents on simulated nodes whose stand-in
ibnetdiscover prints a two-leaf fabric (gpu-1 and gpu-2 under one leaf, gpu-3 under the other).
The two replicas of a model land on gpu-1 and gpu-2 (one GPU each, the only nodes at first):
different nodes, one leaf. Once gpu-3 joins, spreading over leaves moves one replica there under
load, with no failed request; spreading over nodes (the default) moves nothing, since no node
holds two."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from tests.e2e.harness import (
    SIM_FABRIC_FAST,
    Proc,
    Server,
    ctl,
    ctl_json,
    make_sim_fabric,
    make_sim_node,
    replicas,
    start_agent,
    wait_until,
)
from tests.faults.fleet import CATALOG, FAULT_AGENT, FAULT_FLEET, FAULT_GATEWAY, MODEL, Load

LEAF_1 = ["gpu-1", "gpu-2"]
LEAF_2 = ["gpu-3"]
DEADLINE = 90.0  # three agents, a fabric map and a surge on a shared two-core machine


class Crowded:
    """The server, the fabric and gpu-1/gpu-2 with the model's two replicas ready on them."""

    def __init__(self, tmp: Path, procs: list[Proc], spread: str) -> None:
        self.tmp, self.procs = tmp, procs
        self.fabric_dir = tmp / "fabric"
        made = make_sim_fabric(self.fabric_dir, LEAF_1 + LEAF_2, rails=1, group_size=2)
        self.leaf_of = {node: made["leaf_of"][f"{node} mlx5_0"] for node in LEAF_1 + LEAF_2}
        assert self.leaf_of["gpu-1"] == self.leaf_of["gpu-2"] != self.leaf_of["gpu-3"], self.leaf_of
        # The successor takes 3 s to start, so `ctl replicas` can be seen showing the move.
        self.config = (FAULT_FLEET + FAULT_GATEWAY + SIM_FABRIC_FAST
                       + f"placement:\n  spread: {spread}\n  spread_cooldown: 2s\n"
                       + CATALOG.replace('args: ["--ttft-ms"', 'args: ["--startup-delay", "3", "--ttft-ms"'))
        self.server = Server(tmp, self.config)
        procs.append(self.server.start())
        for node in LEAF_1:
            self.add(node)
        self.before = wait_until(lambda: self.on("gpu-1", "gpu-2"), "a replica ready on gpu-1 and one on gpu-2",
                                 DEADLINE, procs)

    def add(self, node: str) -> None:
        config = make_sim_node(self.tmp, node, self.server.fleet_url, FAULT_AGENT, "--gpus", "1", "--ib-ports", "1",
                               "--fabric", str(self.fabric_dir))
        self.procs.append(start_agent(self.tmp, node, config, "--stop-engines-on-exit"))

    def on(self, *want: str) -> list[dict[str, Any]] | None:
        """Exactly the replicas wanted, ready on these nodes, every one in rotation and healthy."""
        rs = replicas(self.server)
        eps = {e["endpoint"]: e for e in self.server.get("/api/v1/endpoints") if e["model"] == MODEL}
        ok = (sorted(r["shards"][0]["node"] for r in rs) == sorted(want) and all(r["state"] == "ready" for r in rs)
              and all(eps.get(r["shards"][0]["endpoint"], {}).get("healthy") for r in rs))
        return rs if ok else None

    def mapped(self) -> bool:
        """The fabric map names every node's adapter (what the leaves are read from)."""
        fabrics = self.server.get("/api/v1/fabrics")
        if len(fabrics) != 1 or not fabrics[0]["topology"]:
            return False
        adapters = self.server.get(f"/api/v1/fabrics/{fabrics[0]['id']}/topology")["adapters"]
        return {a["node"] for a in adapters} == set(LEAF_1 + LEAF_2)

    def spread_events(self) -> list[dict[str, Any]]:
        return [e for e in ctl_json(self.server.url, "events", "--model", MODEL) if e["kind"] == "spread"]


def test_spread_over_leaves_moves_one_replica_to_the_other_leaf_under_load(tmp_path: Path, procs: list[Proc]) -> None:
    fleet = Crowded(tmp_path, procs, "leaves")
    leaf = fleet.leaf_of["gpu-1"]
    wait_until(fleet.mapped, "the two-leaf fabric mapped", DEADLINE, procs)
    assert fleet.on("gpu-1", "gpu-2"), "a move before any node had room"
    seen: list[dict[str, Any]] = []
    with Load(fleet.server.url) as load:
        load.wait_successes(20, "requests served before gpu-3 joins")
        fleet.add("gpu-3")

        def moving() -> dict[str, Any] | None:
            """The move in the API, then in the operator's table while it happens."""
            row = next((r for r in replicas(fleet.server) if (r.get("move") or {}).get("kind") == "spread"), None)
            if row is not None:
                seen.append(row)
                table = ctl(fleet.server.url, "replicas").stdout
                if "spread" in table:
                    return row
                assert not fleet.on("gpu-1", "gpu-3") and not fleet.on("gpu-2", "gpu-3"), \
                    f"the move ended before ctl replicas showed it:\n{table}"
            return None

        row = wait_until(moving, "ctl replicas to show a spread move", DEADLINE, procs)
        assert row["move"]["reason"].startswith(f"spread: 2 of 2 replicas of {MODEL} on leaf {leaf}; "
                                                "gpu-3 can take one"), row

        def moved() -> list[dict[str, Any]] | None:
            return fleet.on("gpu-1", "gpu-3") or fleet.on("gpu-2", "gpu-3")

        after = wait_until(moved, "one replica moved to gpu-3", DEADLINE, procs)
        load.wait_successes(20, "requests served after the move")
    line = load.report("spread over leaves", f"one replica moved from {leaf} to {fleet.leaf_of['gpu-3']}")
    assert load.failures(avoidable_only=False) == [], line
    # One replica stayed, one was replaced by a successor on gpu-3; no other move happened.
    assert len({r["id"] for r in fleet.before} & {r["id"] for r in after}) == 1
    spread = fleet.spread_events()
    assert sum("asked:" in e["message"] for e in spread) == 1, spread
    assert any(f"asked: spread: 2 of 2 replicas of {MODEL} on leaf {leaf}" in e["message"] for e in spread), spread
    assert any(" done: " in e["message"] for e in spread), spread


def test_spread_over_nodes_leaves_replicas_under_one_leaf_until_a_reload_says_leaves(tmp_path: Path,
                                                                                      procs: list[Proc]) -> None:
    """The same fleet with the default `nodes`: gpu-3 ready, the map whole, nothing moves (no node
    holds two). A reload to `leaves` then moves one: the difference is the mode alone."""
    fleet = Crowded(tmp_path, procs, "nodes")
    fleet.add("gpu-3")
    wait_until(lambda: fleet.server.nodes().get("gpu-3", {}).get("state") == "ready", "gpu-3 ready", DEADLINE, procs)
    wait_until(fleet.mapped, "the two-leaf fabric mapped", DEADLINE, procs)
    assert fleet.on("gpu-1", "gpu-2") and not [r for r in replicas(fleet.server) if r.get("move")]
    assert fleet.spread_events() == []
    fleet.server.config.write_text(fleet.config.replace("spread: nodes", "spread: leaves"))
    fleet.server.proc.signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: fleet.on("gpu-1", "gpu-3") or fleet.on("gpu-2", "gpu-3"),
               "one replica moved to gpu-3 after the reload", DEADLINE, procs)
    assert any(f"on leaf {fleet.leaf_of['gpu-1']}" in e["message"] for e in fleet.spread_events())
