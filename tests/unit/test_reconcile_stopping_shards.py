"""The reconciler and shards that are stopping or unhealthy: a failed replica whose engine is
still stopping sets no past deadline (no spinning loop), adopting a replica keeps its stopping
twin tracked (its GPUs are not free), and an unhealthy shard keeps its GPUs and its replica."""

from __future__ import annotations

import random

from llmgw.catalog.schema import Model, Profile
from llmgw.server.reconcile import NodeInfo, Reconciler, Settings, StartShard, StopShard
from llmgw.wire import messages as m


def _gpus() -> list[m.Gpu]:
    return [m.Gpu(index=i, name="H100", memory_mib=81559) for i in range(4)]


def _rec() -> Reconciler:
    return Reconciler([Model(name="small", replicas=1, profiles=[Profile(engine="sim", gpus=1)])],
                      Settings(backoff_initial=2, backoff_max=60, port_range=(20000, 20999)), random.Random(3))


FEATURES = [m.FEATURE_START, m.FEATURE_STOP]


def test_no_deadline_for_a_failed_replica_whose_engine_is_still_stopping() -> None:
    rec = _rec()
    fleet = [NodeInfo(node_id="n1", state="ready", gpus=_gpus(), features=FEATURES)]
    [start] = [a for a in rec.reconcile(fleet, 0) if isinstance(a, StartShard)]
    rec.on_shard_status("n1",
                        m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id, state="ready"), 0)
    rec.on_shard_status("n1", m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                            state="stopping"), 1)
    assert next(iter(rec.replicas.values())).state == "failed"
    assert rec.next_deadline() is None  # the "stopped" status wakes the loop, not a past deadline


def test_adopting_a_replica_while_its_failed_twin_is_still_stopping_keeps_both() -> None:
    rec = _rec()
    n1 = NodeInfo(node_id="n1", state="ready", gpus=_gpus(), features=FEATURES)
    n2 = NodeInfo(node_id="n2", state="ready", gpus=_gpus(), features=FEATURES)
    [first] = [a for a in rec.reconcile([n2], 0) if isinstance(a, StartShard)]
    rec.on_shard_status("n2",
                        m.ShardStatus(shard_id=first.spec.shard_id, replica_id=first.spec.replica_id, state="ready"), 0)
    rec.on_node_state("n2", "lost", 10)
    [second] = [a for a in rec.reconcile([n1], 10) if isinstance(a, StartShard)]
    rec.on_shard_status("n1", m.ShardStatus(shard_id=second.spec.shard_id, replica_id=second.spec.replica_id,
                                            state="ready"), 11)
    rec.on_shard_status("n1", m.ShardStatus(shard_id=second.spec.shard_id, replica_id=second.spec.replica_id,
                                            state="stopping"), 12)
    rec.on_register("n2", [m.ShardReport(spec=first.spec, state="ready", pid=5)], 13)
    shards = {s.shard_id: s.state for r in rec.replicas.values() for s in r.shards}
    assert shards[second.spec.shard_id] == "stopping"  # still tracked: its GPU is not free
    assert shards[first.spec.shard_id] == "ready"
    actions = rec.reconcile([n1, n2], 13)
    assert second.spec.shard_id in [a.shard_id for a in actions if isinstance(a, StopShard)]
    assert not [a for a in actions if isinstance(a, StartShard)]


def test_an_unhealthy_shard_keeps_its_gpus_and_its_replica_ready_with_the_reason() -> None:
    """Issue 9: agents report a hung engine `unhealthy`; the replica stays (the gateway's own
    health checks take the endpoint out of rotation) and its GPUs stay taken."""
    rec = _rec()
    fleet = [NodeInfo(node_id="n1", state="ready", gpus=_gpus(), features=FEATURES)]
    [start] = [a for a in rec.reconcile(fleet, 0) if isinstance(a, StartShard)]
    sid, rid = start.spec.shard_id, start.spec.replica_id
    rec.on_shard_status("n1", m.ShardStatus(shard_id=sid, replica_id=rid, state="ready"), 1)
    rec.on_shard_status("n1",
                        m.ShardStatus(shard_id=sid, replica_id=rid, state="unhealthy", reason="unhealthy since T"), 2)
    replica = rec.replicas[rid]
    assert replica.state == "ready" and replica.reason == "n1: unhealthy since T"
    assert not [a for a in rec.reconcile(fleet, 3) if isinstance(a, StartShard)]  # nothing placed twice
    rec.on_shard_status("n1", m.ShardStatus(shard_id=sid, replica_id=rid, state="ready"), 4)
    assert replica.state == "ready" and replica.reason == ""
