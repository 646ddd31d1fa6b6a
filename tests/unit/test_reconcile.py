"""Reconciler decisions with a fake clock: place, replace with backoff, surplus, orphans,
adoption after a restart and disowning what a node no longer runs."""

from __future__ import annotations

import random

import pytest

from llmgw.catalog.schema import Model, Profile
from llmgw.server.reconcile import NodeInfo, Reconciler, Settings, StartShard, StopShard
from llmgw.wire import messages as m


def gpus(n: int = 8) -> list[m.Gpu]:
    return [m.Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_mib=81559, nvlink={j: 18 for j in range(n) if j != i})
            for i in range(n)]


FEATURES = [m.FEATURE_START, m.FEATURE_STOP]


def nodes(*ids: str, state: str = "ready") -> list[NodeInfo]:
    return [NodeInfo(node_id=i, state=state, gpus=gpus(), features=FEATURES, endpoint_host=i) for i in ids]


def catalog(small: int = 2, big: int = 1) -> list[Model]:
    return [
        Model(name="small", replicas=small, profiles=[Profile(name="tp1", engine="sim", gpus=1)]),
        Model(name="big", replicas=big, profiles=[Profile(name="tp4", engine="sim", gpus=4)]),
    ]


def make(models: list[Model] | None = None) -> Reconciler:
    return Reconciler(models if models is not None else catalog(),
                      Settings(backoff_initial=2, backoff_max=60, port_range=(20000, 20999)), random.Random(7))


def starts(actions: list) -> list[StartShard]:
    return [a for a in actions if isinstance(a, StartShard)]


def stops(actions: list) -> list[StopShard]:
    return [a for a in actions if isinstance(a, StopShard)]


def status(rec: Reconciler, start: StartShard, state: str, **kw) -> None:
    rec.on_shard_status(start.node, m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                                  state=state, **kw), 0)


def bring_up(rec: Reconciler, fleet: list[NodeInfo], now: float = 0) -> list[StartShard]:
    placed = starts(rec.reconcile(fleet, now))
    for s in placed:
        rec.on_shard_status(s.node, m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id, state="ready",
                                                  endpoint=f"http://{s.node}:{s.spec.port}"), now)
    return placed


def test_places_every_missing_replica_without_gpu_overlap() -> None:
    rec = make()
    placed = bring_up(rec, nodes("gpu-01", "gpu-02"))
    assert len(placed) == 3
    held: dict[str, set[int]] = {}
    for s in placed:
        assert not held.setdefault(s.node, set()) & set(s.spec.gpus)
        held[s.node] |= set(s.spec.gpus)
    assert {r.state for r in rec.replicas.values()} == {"ready"}
    # The two small replicas are on different nodes (spread).
    assert len({s.node for s in placed if s.spec.model == "small"}) == 2
    assert rec.reconcile(nodes("gpu-01", "gpu-02"), 1) == []  # level-triggered: nothing more to do


def test_pending_reason_names_each_node() -> None:
    rec = make([Model(name="huge", replicas=1, profiles=[Profile(engine="sim", gpus=16)])])
    assert rec.reconcile(nodes("gpu-01") + nodes("gpu-09", state="lost"), 0) == []
    [replica] = rec.replicas.values()
    assert replica.state == "pending"
    assert replica.reason == "no placement: gpu-01: has 8 matching GPUs, 16 needed; gpu-09: lost"


def test_failed_engine_is_replaced_with_exponential_backoff() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes("gpu-01")
    [first] = starts(rec.reconcile(fleet, 0))
    times = []
    start = first
    now = 0.0
    for _ in range(4):
        rec.on_shard_status(start.node, m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                                      state="failed", exit_code=1,
                                                      reason="exited with code 1 during startup", tail=["boom"]), now)
        [replica] = rec.replicas.values()
        assert replica.state == "failed" and replica.tail == ["boom"]
        assert rec.reconcile(fleet, now) == []  # not before the backoff
        times.append(replica.next_attempt_at - now)
        now = replica.next_attempt_at
        [start] = starts(rec.reconcile(fleet, now))
        assert start.spec.replica_id == first.spec.replica_id and start.spec.shard_id != first.spec.shard_id
    assert times == [2, 4, 8, 16]
    # Once it is ready the failure count resets: the next crash is retried after the base delay.
    status(rec, start, "ready")
    status(rec, start, "exited", exit_code=-9, reason="killed by SIGKILL")
    [replica] = rec.replicas.values()
    assert replica.failures == 1 and replica.next_attempt_at - 0 == 2


def test_surplus_stops_the_newest_and_never_the_reconnecting_ready_one() -> None:
    rec = make(catalog(small=2, big=0))
    fleet = nodes("gpu-01", "gpu-02")
    bring_up(rec, fleet, now=0)
    rec.set_catalog(catalog(small=1, big=0))
    actions = rec.reconcile(fleet, 10)
    [stop] = stops(actions)
    newest = min(rec.replicas.values(), key=lambda r: (-r.started_at, r.id))
    assert stop.shard_id == newest.shards[0].shard_id
    rec.on_shard_status(stop.node, m.ShardStatus(shard_id=stop.shard_id, replica_id=newest.id, state="stopped"), 11)
    assert len(rec.replicas) == 1 and newest.id not in rec.replicas


def test_model_removed_from_catalog_is_stopped_and_forgotten() -> None:
    rec = make()
    fleet = nodes("gpu-01", "gpu-02")
    bring_up(rec, fleet)
    rec.set_catalog([m_ for m_ in catalog() if m_.name == "small"])
    stopped = stops(rec.reconcile(fleet, 5))
    assert [s.reason for s in stopped] == ["model big left the catalog"]
    assert rec.reconcile(fleet, 6) == []  # sent once
    big = next(r for r in rec.replicas.values() if r.model == "big")
    assert big.state == "stopping"
    rec.on_shard_status(stopped[0].node,
                        m.ShardStatus(shard_id=stopped[0].shard_id, replica_id=big.id, state="stopped"), 7)
    assert all(r.model == "small" for r in rec.replicas.values())


def test_adoption_after_server_restart_rebuilds_replicas_and_reserves_gpus() -> None:
    old = make()
    fleet = nodes("gpu-01", "gpu-02")
    placed = bring_up(old, fleet)
    reports: dict[str, list[m.ShardReport]] = {}
    for s in placed:
        reports.setdefault(s.node, []).append(m.ShardReport(spec=s.spec, state="ready", pid=100, endpoint=f"http://{s.node}:{s.spec.port}"))

    new = make()  # a fresh server: it knows nothing
    for node_id, rs in reports.items():
        assert new.on_register(node_id, rs, 0, endpoint_host=node_id) == []
    assert {r.id for r in new.replicas.values()} == {s.spec.replica_id for s in placed}
    assert all(r.adopted and r.state == "ready" for r in new.replicas.values())
    # Nothing to place or stop: the fleet already is what the catalog wants.
    assert new.reconcile(fleet, 1) == []
    # A new model now must not get GPUs the adopted engines hold.
    new.set_catalog([*catalog(), Model(name="extra", replicas=1, profiles=[Profile(engine="sim", gpus=2)])])
    [extra] = starts(new.reconcile(fleet, 2))
    held = {g for s in placed if s.node == extra.node for g in s.spec.gpus}
    assert not held & set(extra.spec.gpus)
    assert extra.spec.port not in {s.spec.port for s in placed if s.node == extra.node}


def test_disown_what_the_node_no_longer_runs() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes("gpu-01")
    [s] = bring_up(rec, fleet)
    # The agent restarts and its engine died meanwhile: it registers with no shards.
    rec.on_register("gpu-01", [], 5)
    [replica] = rec.replicas.values()
    assert replica.state == "failed" and "no longer runs" in replica.reason
    [again] = starts(rec.reconcile(fleet, 5))  # no penalty: replaced at once
    assert again.spec.replica_id == s.spec.replica_id


def test_start_lost_in_flight_is_retried_without_penalty() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes("gpu-01")
    starts(rec.reconcile(fleet, 0))
    rec.on_register("gpu-01", [], 1)  # reconnected before it heard of the Start
    [replica] = rec.replicas.values()
    assert replica.failures == 0 and "never received" in replica.reason
    assert starts(rec.reconcile(fleet, 1))


def test_unreachable_node_keeps_its_replicas_lost_node_gets_them_replaced() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes("gpu-01", "gpu-02")
    [s] = bring_up(rec, fleet)
    rec.on_node_state(s.node, "unreachable", 1)
    unreachable = [NodeInfo(node_id=n.node_id, state="unreachable" if n.node_id == s.node else "ready",
                            connected=n.node_id != s.node, gpus=n.gpus, features=FEATURES) for n in fleet]
    assert rec.reconcile(unreachable, 1) == []
    assert next(iter(rec.replicas.values())).state == "ready"
    rec.on_node_state(s.node, "lost", 100)
    lost = [NodeInfo(node_id=n.node_id, state="lost" if n.node_id == s.node else "ready", connected=n.node_id != s.node,
                     gpus=n.gpus, features=FEATURES) for n in fleet]
    [moved] = starts(rec.reconcile(lost, 100))
    assert moved.node != s.node


def test_lost_node_that_returns_after_the_successor_is_ready_has_its_engine_drained() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes("gpu-01", "gpu-02")
    [s] = bring_up(rec, fleet, now=0)
    rec.on_node_state(s.node, "lost", 100)
    lost = [NodeInfo(node_id=n.node_id, state="lost" if n.node_id == s.node else "ready", gpus=n.gpus,
                     features=FEATURES) for n in fleet]
    [replacement] = starts(rec.reconcile(lost, 100))
    status(rec, replacement, "ready")
    # The lost node comes back: its engine served all along; the successor is ready too, and
    # the move it belongs to retires the old one (out of rotation first, then drained).
    rec.on_register(s.node, [m.ShardReport(spec=s.spec, state="ready", pid=5, started_at=1_000_000.0)], 200,
                    wall_now=1_000_200.0)
    actions = rec.reconcile(fleet, 200)
    assert not starts(actions) and not stops(actions)
    assert rec.replicas[s.spec.replica_id].state == "draining"
    assert rec.rotation_synced()
    [drain] = stops(rec.reconcile(fleet, 201))
    assert drain.shard_id == s.spec.shard_id and drain.drain
    assert rec.drain_illegal() == []


def test_profile_fallback_and_missing_feature() -> None:
    model = Model(name="m", replicas=1,
                  profiles=[Profile(name="big", engine="sim", gpus=16), Profile(name="small", engine="sim", gpus=2)])
    rec = make([model])
    [s] = starts(rec.reconcile(nodes("gpu-01"), 0))
    assert s.spec.profile == "small" and len(s.spec.gpus) == 2
    old_agent = [NodeInfo(node_id="gpu-05", state="ready", gpus=gpus(), features=[], version="0.0.1")]
    rec2 = make([model])
    assert rec2.reconcile(old_agent, 0) == []
    assert "agent 0.0.1 cannot start engines" in next(iter(rec2.replicas.values())).reason


def test_stop_lost_with_a_broken_stream_is_sent_again() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes("gpu-01")
    [s] = bring_up(rec, fleet)
    rec.set_catalog([])
    [stop] = stops(rec.reconcile(fleet, 1))
    assert rec.reconcile(fleet, 2) == []  # sent once
    # The stream broke before the agent saw the Stop; it re-registers with the engine running.
    rec.on_register("gpu-01", [m.ShardReport(spec=s.spec, state="ready", pid=9)], 3)
    [again] = stops(rec.reconcile(fleet, 3))
    assert again.shard_id == stop.shard_id
    replica = next(iter(rec.replicas.values()))
    assert replica.state == "stopping" and replica.shards[0].state == "stopping"
    rec.on_shard_status("gpu-01",
                        m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id, state="stopped"), 4)
    assert rec.replicas == {}


def test_a_dead_engine_reported_after_a_server_restart_is_not_adopted() -> None:
    rec = make(catalog(small=1, big=0))
    spec = m.ShardSpec(shard_id="small-zzzzz.1", replica_id="small-zzzzz", model="small", profile="tp1", engine="sim",
                       gpus=[0], port=20001)
    rec.on_register("gpu-01", [m.ShardReport(spec=spec, state="exited",
                                             reason="the engine exited while the agent was not running")], 0)
    assert "small-zzzzz" not in rec.replicas
    [start] = starts(rec.reconcile(nodes("gpu-01"), 1))
    assert start.spec.replica_id != "small-zzzzz"


def test_engine_stopped_by_its_agent_is_placed_elsewhere() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes("gpu-01", "gpu-02")
    [s] = bring_up(rec, fleet)
    # The agent shuts down with --stop-engines-on-exit: "stopping", then "stopped".
    rec.on_shard_status(s.node, m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id, state="stopping",
                                              reason="agent stopping"), 1)
    [replica] = rec.replicas.values()
    assert replica.state == "failed" and "stopping by its agent" in replica.reason and replica.failures == 0
    assert starts(rec.reconcile(fleet, 1)) == []  # the engine still holds its GPU
    rec.on_shard_status(s.node, m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id, state="stopped"),
                        2)
    other = [n for n in fleet if n.node_id != s.node]
    [moved] = starts(rec.reconcile(other, 2))
    assert moved.node != s.node and moved.spec.replica_id == s.spec.replica_id


# -- cost: indexed by model, node and shard; a pass in steps (issue 9: models × replicas per message)


class CountingDict(dict):  # type: ignore[type-arg]
    """A replicas dict that counts whole scans."""

    scans = 0

    def values(self):  # type: ignore[no-untyped-def, override]
        CountingDict.scans += 1
        return super().values()

    def items(self):  # type: ignore[no-untyped-def, override]
        CountingDict.scans += 1
        return super().items()

    def __iter__(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().__iter__()


def test_fleet_messages_touch_only_what_they_name() -> None:
    models = [Model(name=f"m{i}", replicas=1, profiles=[Profile(name="tp1", engine="sim", gpus=1)]) for i in range(40)]
    rec = make(models)
    fleet = nodes("gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-05")
    placed = bring_up(rec, fleet)
    assert len(placed) == 40
    rec.replicas = CountingDict(rec.replicas)
    CountingDict.scans = 0
    one = placed[0]
    status(rec, one, "ready")
    rec.on_shard_status("gpu-01", m.ShardStatus(shard_id="nobody.1", replica_id="nobody", state="ready"), 0)
    rec.on_node_state("gpu-09", "lost", 1)
    rec.on_register("gpu-09", [], 1)
    assert CountingDict.scans == 0
    # And they still act on what they name: gpu-01 lost marks exactly its replicas' shards lost
    # (the replicas serve on until replaced, lost.py), and gpu-01 forgotten fails exactly them.
    on_01 = {s.spec.replica_id for s in placed if s.node == "gpu-01"}
    rec.on_node_state("gpu-01", "lost", 2)
    assert CountingDict.scans == 0
    assert {r.id for r in rec.replicas.values() if r.shards[0].state == "lost"} == on_01 == set(rec.kept)
    CountingDict.scans = 0  # the line above scanned
    rec.on_node_gone("gpu-01", 3)
    assert CountingDict.scans == 0
    assert {r.id for r in rec.replicas.values() if r.state == "failed"} == on_01
    assert rec.of_model("m0") and all(r.model == "m0" for r in rec.of_model("m0"))


def test_a_pass_yields_after_each_placement_and_rechecks_between_steps() -> None:
    models = [Model(name=f"m{i}", replicas=1, profiles=[Profile(name="tp1", engine="sim", gpus=1)]) for i in range(10)]
    rec = make(models)
    fleet = nodes("gpu-01", "gpu-02")
    steps = rec.steps(fleet, 0)
    first = next(steps)
    assert isinstance(first, StartShard)
    # Between two steps the operator restarts a pending replica and a node reports an engine
    # on GPUs the pass has not seen: the pass neither places the stopped one nor reuses the GPU.
    victim = next(r for r in rec.of_model("m9"))
    rec.stop_replica(victim, 0, "operator")
    adopted = m.ShardSpec(shard_id="other-aaaaa.1", replica_id="other-aaaaa", model="other", profile="p", engine="sim",
                          gpus=[0, 1, 2, 3, 4, 5, 6, 7], port=20500)
    rec.on_register("gpu-02", [m.ShardReport(spec=adopted, state="ready")], 0)
    rest = [a for a in steps]
    placed = [first, *starts([a for a in rest if a is not None])]
    assert len(rest) >= 8  # one step per placement at least
    assert victim.id not in {s.spec.replica_id for s in placed}
    # gpu-01 holds 8 (the first included); gpu-02 is full with the adopted engine; one waits.
    assert len(placed) == 8 and all(s.node == "gpu-01" for s in placed)
    [waiting] = [r for r in rec.replicas.values() if r.state == "pending"]
    assert "gpu-02: 0 of 8 GPUs free" in waiting.reason


def _surplus_fleet(wanted: int) -> Reconciler:
    """Seven replicas of `small`, one per state the surplus rule ranks, two starting and two
    ready ones that this server saw start at different times. Within a state the older one's id
    sorts first, so the id (the last tie-break) cannot pass for the start time."""
    from llmgw.server.reconcile import Replica, Shard

    rec = make(catalog(small=wanted, big=0))

    def replica(rid: str, state: str, started: float, shard_state: str | None, node: str = "gpu-01") -> None:
        shards = [] if shard_state is None else [
            Shard(shard_id=f"{rid}.1", node=node, gpus=[len(rec.replicas)], port=20000 + len(rec.replicas),
                  state=shard_state, started_at=started, seen_at=started, acked=True)
        ]
        rec._put(Replica(id=rid, model="small", profile="tp1", state=state, created_at=started,  # type: ignore[arg-type]
                         state_since=started, next_attempt_at=1000.0, shards=shards))  # indexed as the reconciler does

    replica("r-pending", "pending", 5.0, None)
    replica("r-failed", "failed", 6.0, "failed")
    replica("r-starting-old", "starting", 1.0, "starting")
    replica("r-starting-young", "starting", 3.0, "starting", node="gpu-02")
    replica("r-ready-old", "ready", 0.0, "ready")
    replica("r-ready-young", "ready", 2.0, "ready", node="gpu-02")
    replica("r-stopping", "stopping", 4.0, "stopping")  # already going: never counted, never picked
    return rec


# Which replicas the surplus rule takes away, written out (not computed with the code's sort key):
# pending first, then failed, then starting, then ready; within a state the newest goes first.
SURPLUS_CASES = [
    (5, ["r-pending"]),
    (4, ["r-pending", "r-failed"]),
    (3, ["r-pending", "r-failed", "r-starting-young"]),
    (2, ["r-pending", "r-failed", "r-starting-young", "r-starting-old"]),
    (1, ["r-pending", "r-failed", "r-starting-young", "r-starting-old", "r-ready-young"]),
]


@pytest.mark.parametrize(("wanted", "victims"), SURPLUS_CASES)
def test_surplus_priority_over_every_state_and_start_time(wanted: int, victims: list[str]) -> None:
    rec = _surplus_fleet(wanted)
    before = set(rec.replicas)
    actions = rec.reconcile(nodes("gpu-01", "gpu-02"), 10)
    assert not starts(actions)
    # Pending and failed ones hold nothing: they are dropped. The others are stopped, once each.
    gone = sorted(before - set(rec.replicas))
    stopping = sorted(r.id for r in rec.replicas.values() if r.state == "stopping" and r.id != "r-stopping")
    assert gone == sorted(v for v in victims if v in ("r-pending", "r-failed"))
    assert stopping == sorted(v for v in victims if v not in ("r-pending", "r-failed"))
    assert sorted(s.shard_id for s in stops(actions)) == sorted(
        [f"{v}.1" for v in victims if v not in ("r-pending", "r-failed")] + ["r-stopping.1"])
    kept = {r.id for r in rec.replicas.values() if r.state != "stopping"}
    assert len(kept) == wanted
    assert rec.reconcile(nodes("gpu-01", "gpu-02"), 11) == []  # level-triggered: decided once
