"""The reconciler with replicas spanning nodes: one Start per rank (rank 0 first, every spec with
the master address), ready only when every rank is, replaced whole when any rank ends or its
node's fabric goes bad, rebuilt as one replica from two nodes' reports after a restart, and placed
where the fabric map the driver hands it says (with the reasons in the log)."""

from __future__ import annotations

import random

from llmgw.catalog.schema import Model, Profile
from llmgw.fabric.analysis import analyse
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.fabric.locality import merge, places
from llmgw.server.reconcile import NodeInfo, Reconciler, Settings, StartShard, StopShard
from llmgw.sim.fabric import FabricSpec, generate
from llmgw.wire import messages as m
from tests.unit.test_reconcile import FEATURES, gpus


def fleet(*ids: str, fabrics: tuple[str, ...] = ("ib",), notes: dict[str, str] | None = None) -> list[NodeInfo]:
    return [NodeInfo(node_id=i, state="ready", gpus=gpus(), features=FEATURES, endpoint_host=f"10.0.0.{n}",
                     fabrics=list(fabrics), fabric_notes=notes or {}, address=f"10.0.0.{n}")
            for n, i in enumerate(ids, start=1)]


def make(mode: str = "native") -> Reconciler:
    big = Model(name="big", replicas=1, profiles=[Profile(name="2x8", engine="vllm", nodes=2, gpus=8,
                                                          engine_mode=mode)])  # type: ignore[arg-type]
    return Reconciler([big], Settings(backoff_initial=2, backoff_max=60, port_range=(20000, 20999)), random.Random(7))


def report(rec: Reconciler, start: StartShard, state: str, now: float = 0) -> None:
    endpoint = f"http://10.0.0.{start.node[-1]}:{start.spec.port}" if state == "ready" and start.spec.rank == 0 else ""
    rec.on_shard_status(start.node, m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                                  state=state,
                                                  endpoint=endpoint), now)


def test_one_start_per_rank_with_the_master_address():
    rec = make()
    nodes = fleet("gpu-1", "gpu-2")
    starts = [a for a in rec.reconcile(nodes, 0) if isinstance(a, StartShard)]
    assert [(s.node, s.spec.rank, s.spec.world) for s in starts] == [("gpu-1", 0, 2), ("gpu-2", 1, 2)]
    for s in starts:
        assert s.spec.master_addr == "10.0.0.1" and s.spec.fabric == "ib" and s.spec.gpus == list(range(8))
        assert s.spec.master_port == starts[0].spec.master_port and s.spec.master_port != starts[0].spec.port
    [replica] = rec.replicas.values()
    report(rec, starts[1], "ready")
    assert replica.state == "starting"  # rank 1 up is not enough
    report(rec, starts[0], "ready")
    assert replica.state == "ready"


def test_any_rank_ending_stops_and_replaces_the_whole_replica():
    rec = make()
    nodes = fleet("gpu-1", "gpu-2")
    starts = [a for a in rec.reconcile(nodes, 0) if isinstance(a, StartShard)]
    for s in starts:
        report(rec, s, "ready")
    report(rec, starts[1], "exited", now=1)
    [replica] = rec.replicas.values()
    assert replica.state == "failed"
    stops = [a for a in rec.reconcile(nodes, 1) if isinstance(a, StopShard)]
    # rank 0 too, though it still serves
    assert [(s.node, s.shard_id) for s in stops] == [("gpu-1", starts[0].spec.shard_id)]
    report(rec, starts[0], "stopped", now=2)
    again = [a for a in rec.reconcile(nodes, 10) if isinstance(a, StartShard)]
    assert len(again) == 2 and {s.spec.shard_id for s in again}.isdisjoint({s.spec.shard_id for s in starts})


def test_a_fabric_going_bad_fails_the_replica_past_nccls_retry_window_and_placement_says_why():
    rec = make()
    nodes = fleet("gpu-1", "gpu-2")
    starts = [a for a in rec.reconcile(nodes, 0) if isinstance(a, StartShard)]
    for s in starts:
        report(rec, s, "ready")
    broken = [*fleet("gpu-1"), NodeInfo(node_id="gpu-2", state="ready", gpus=gpus(), features=FEATURES,
                                        address="10.0.0.2",
                                        fabric_notes={"ib": "mlx5_1: no ACTIVE port (port 1 INIT (LinkUp))"})]
    [replica] = rec.replicas.values()
    # Within NCCL's queue-pair retry window (34 s with its defaults) the replica serves on.
    assert [a for a in rec.reconcile(broken, 1) if isinstance(a, StopShard)] == []
    assert [a for a in rec.reconcile(broken, 34) if isinstance(a, StopShard)] == [] and replica.state == "ready"
    actions = rec.reconcile(broken, 36)
    assert replica.state == "failed"
    assert replica.reason == ("gpu-2: fabric ib is no longer usable (mlx5_1: no ACTIVE port (port 1 INIT (LinkUp))) "
                              "for 35s, "
                              "past NCCL's 34s retry window")
    assert len([a for a in actions if isinstance(a, StopShard)]) == 2
    for s in starts:
        report(rec, s, "stopped", now=37)
    assert rec.reconcile(broken, 38) == []
    assert replica.state == "pending"
    assert "fabric ib: 1 of 2 nodes (gpu-1)" in replica.reason and "gpu-2: fabric ib not usable (mlx5_1" in (
        replica.reason)


def test_adopted_from_two_nodes_is_one_replica_and_a_missing_rank_fails_it():
    rec = make()
    starts = [a for a in rec.reconcile(fleet("gpu-1", "gpu-2"), 0) if isinstance(a, StartShard)]
    after = make()  # a restarted server
    for s in starts:
        rep = m.ShardReport(spec=s.spec, state="ready", pid=100 + s.spec.rank,
                            endpoint=f"http://10.0.0.{s.node[-1]}:{s.spec.port}" if s.spec.rank == 0 else "")
        after.on_register(s.node, [rep], 0, endpoint_host=f"10.0.0.{s.node[-1]}")
    [replica] = after.replicas.values()
    assert sorted(sh.rank for sh in replica.shards) == [0, 1] and replica.state == "ready"
    assert after.reconcile(fleet("gpu-1", "gpu-2"), 1) == []

    lonely = make()
    s0 = starts[0]
    lonely.on_register(s0.node, [m.ShardReport(spec=s0.spec, state="ready", pid=100, endpoint=f"http://10.0.0.1:{s0.spec.port}")],
                       0, endpoint_host="10.0.0.1")
    [half] = lonely.replicas.values()
    assert half.state == "starting"  # never ready with a rank missing
    actions = lonely.reconcile(fleet("gpu-1", "gpu-2"), 1)
    assert half.state == "failed" and half.reason == "rank(s) [1] of 2 not reported by any node"
    assert [a.shard_id for a in actions if isinstance(a, StopShard)] == [s0.spec.shard_id]


def test_ray_mode_reaches_the_spec():
    rec = make("ray")
    starts = [a for a in rec.reconcile(fleet("gpu-1", "gpu-2"), 0) if isinstance(a, StartShard)]
    assert {s.spec.engine_mode for s in starts} == {"ray"}


def test_the_fabric_map_the_driver_sets_decides_where_and_the_log_says_why():
    # gpu-1 and gpu-3 under leaf 1, gpu-2 and gpu-4 under leaf 2; gpu-1's cable trained short.
    spec = FabricSpec(nodes=["gpu-1", "gpu-3", "gpu-2", "gpu-4"], rails=1, group_size=2, spines=1, degraded=["gpu-1"])
    rec = make()
    rec.places = merge({"0xf": places("0xf", analyse(parse_topology(generate(spec).ibnetdiscover)))})
    starts = [a for a in rec.reconcile(fleet("gpu-1", "gpu-2", "gpu-3", "gpu-4"), 0) if isinstance(a, StartShard)]
    assert [s.node for s in starts] == ["gpu-2", "gpu-4"]
    [line] = [line for line in rec.drain_log() if line.startswith("placed ")]
    assert line.endswith("; under one leaf: leaf-g2-r0; gpu-1: cable to leaf-g1-r0 trained 1xNDR (others 4xNDR)"), line
    [replica] = rec.replicas.values()  # kept on the replica for its placement event
    assert replica.placement == ["under one leaf: leaf-g2-r0",
                                 "gpu-1: cable to leaf-g1-r0 trained 1xNDR (others 4xNDR)"]


def test_a_rail_back_within_the_window_costs_nothing_and_the_window_follows_the_profiles_nccl_settings():
    rec = make()
    nodes = fleet("gpu-1", "gpu-2")
    starts = [a for a in rec.reconcile(nodes, 0) if isinstance(a, StartShard)]
    for s in starts:
        report(rec, s, "ready")
    broken = [*fleet("gpu-1"), NodeInfo(node_id="gpu-2", state="ready", gpus=gpus(), features=FEATURES,
                                        address="10.0.0.2",
                                        fabric_notes={"ib": "mlx5_1: no ACTIVE port (port 1 INIT (LinkUp))"})]
    [replica] = rec.replicas.values()
    rec.reconcile(broken, 1)
    rec.reconcile(nodes, 20)  # the subnet manager is back: the rail is whole again
    rec.reconcile(broken, 30)  # down again later: the window starts over
    assert [a for a in rec.reconcile(broken, 60) if isinstance(a, StopShard)] == [] and replica.state == "ready"
    assert replica.state == "ready" and replica.id in rec.replicas


def test_the_qp_retry_window():
    from llmgw.fabric.qpretry import qp_retry_window

    assert round(qp_retry_window({}), 1) == 34.4  # 4.096 us * 2^20 * (7 + 1)
    assert round(qp_retry_window({"NCCL_IB_TIMEOUT": "18"}), 1) == 8.6  # NCCL 2.19's default
    assert round(qp_retry_window({"NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "3"}), 1) == 68.7
    assert qp_retry_window({"NCCL_IB_TIMEOUT": "nope"}) == qp_retry_window({})
