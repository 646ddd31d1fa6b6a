"""Rolling replacement's decisions (rollout.py) on a fake clock: one replacement at a time with a
surge, never fewer ready than desired; one below desired where there is no room; a failing new
replica halts it with the old ones serving; only run-relevant changes start one."""

from __future__ import annotations

import msgspec

from llmgw.catalog.schema import Model, Profile
from llmgw.server.reconcile import Reconciler, StartShard
from llmgw.server.rollout import RolloutState, changed
from llmgw.server.states import ReplicaState
from llmgw.wire import messages as m
from tests.unit.test_moves import ready, serving
from tests.unit.test_reconcile import bring_up, make, nodes, starts, status, stops


def chat(n: int = 2, args: list[str] | None = None, gpus: int = 1, **kw: object) -> Model:
    return Model(name="chat", replicas=n, profiles=[Profile(name="p", engine="sim", gpus=gpus, args=args or [], **kw)])


def settle(rec: Reconciler, fleet: list, now: float) -> list[StartShard]:
    """One pass, then the gateway's sync and, for what it drained, the engines' exits."""
    actions = rec.reconcile(fleet, now)
    rec.rotation_synced()
    for stop in stops(actions) + stops(rec.reconcile(fleet, now)):
        rec.on_shard_status(stop.node, m.ShardStatus(shard_id=stop.shard_id, replica_id="", state="stopped"), now)
    return starts(actions)


def test_only_what_the_engine_runs_counts_as_a_change() -> None:
    rec = make([chat()])
    placed = bring_up(rec, nodes("gpu-01"))
    replica = rec.replicas[placed[0].spec.replica_id]
    assert changed(replica, chat()) == ""
    assert changed(replica, chat(n=5, stop_grace=30)) == ""  # counts and timeouts: no rollout
    assert changed(replica, chat(args=["--max-model-len", "4096"])) == "args"
    assert changed(replica, chat(env={"VLLM_X": "1"}, gpus=2)) == "env, gpus"
    two = Model(name="chat", replicas=2, profiles=[Profile(name="q", engine="sim"), Profile(name="p", engine="sim")])
    assert changed(replica, two) == "profile order"


def test_a_rollout_replaces_one_at_a_time_and_never_drops_below_desired() -> None:
    rec = make([chat()])
    fleet = nodes("gpu-01", "gpu-02")
    old = {s.spec.replica_id for s in bring_up(rec, fleet)}
    rec.set_catalog([chat(args=["--new-flag"])])
    # Before any pass has begun it, a reader already sees it due (`ctl reload && ctl rollout status`).
    due = rec.rollout_of(rec.models["chat"])
    assert due is not None and due.state == RolloutState.ROLLING and due.total == 2 and due.what == "args"
    replaced: list[str] = []
    for t in range(1, 40):
        new = settle(rec, fleet, t)
        assert len(new) <= 1  # one surge in flight at a time
        ready(rec, new)
        assert len(serving(rec)) >= 2, (t, rec.replicas)  # maxUnavailable 0
        replaced += [s.spec.replica_id for s in new]
        if rec.rollouts["chat"].state == RolloutState.DONE:
            break
    ro = rec.rollouts["chat"]
    assert ro.state == RolloutState.DONE and ro.replaced == 2 and len(replaced) == 2
    assert set(rec.replicas) == set(replaced) and not set(rec.replicas) & old
    assert all(s.spec and s.spec.args == ["--new-flag"] for r in rec.replicas.values() for s in r.shards)
    notes = [n.message for n in rec.drain_notes() if n.kind == "rollout"]
    assert notes[0].startswith("rollout of chat begins: args changed; 2 of 2") and "done" in notes[-1], notes


def test_no_room_for_a_surge_goes_one_below_desired_and_says_so() -> None:
    rec = make([chat(n=1, gpus=8)])
    fleet = nodes("gpu-01")
    [first] = bring_up(rec, fleet)
    rec.set_catalog([chat(n=1, gpus=8, args=["--x"])])
    new = settle(rec, fleet, 1) + settle(rec, fleet, 2)
    assert first.spec.replica_id not in rec.replicas and [s.spec.args for s in new] == [["--x"]]
    assert any("no room for a surge" in n.message and "one below desired" in n.message for n in rec.drain_notes())
    ready(rec, new)
    settle(rec, fleet, 3)
    assert rec.rollouts["chat"].state == RolloutState.DONE


def test_a_new_replica_that_fails_halts_the_rollout_with_the_old_ones_serving() -> None:
    rec = make([chat()])
    fleet = nodes("gpu-01", "gpu-02")
    old = {s.spec.replica_id for s in bring_up(rec, fleet)}
    rec.set_catalog([chat(args=["--bogus"])])
    [new] = settle(rec, fleet, 1)
    status(rec, new, "failed", reason="engine exited with code 2", tail=["error: unrecognized arguments: --bogus"])
    for t in range(2, 30):
        assert settle(rec, fleet, t) == []  # nothing more is tried
    ro = rec.rollouts["chat"]
    assert ro.state == RolloutState.HALTED and "engine exited with code 2" in ro.note and "0 of 2 replaced" in ro.note
    assert serving(rec) == old and {r.state for r in rec.replicas.values()} == {ReplicaState.READY}
    # A reload that fixes the profile starts a new rollout.
    rec.set_catalog([chat(args=["--good"])])
    assert len(settle(rec, fleet, 31)) == 1 and rec.rollouts["chat"].state == RolloutState.ROLLING
    # One that goes back to what runs ends it: nothing to replace.
    rec2 = make([chat()])
    bring_up(rec2, fleet)
    rec2.set_catalog([chat(args=["--bogus"])])
    [bad] = settle(rec2, fleet, 1)
    status(rec2, bad, "failed", reason="x")
    settle(rec2, fleet, 2)
    rec2.set_catalog([chat()])
    settle(rec2, fleet, 3)
    assert "chat" not in rec2.rollouts


def test_a_reload_without_a_run_change_starts_nothing() -> None:
    rec = make([chat()])
    fleet = nodes("gpu-01", "gpu-02")
    bring_up(rec, fleet)
    rec.set_catalog([msgspec.structs.replace(chat(), replicas=2)])
    assert settle(rec, fleet, 1) == [] and rec.rollouts == {} and rec.rollout_of(rec.models["chat"]) is None
