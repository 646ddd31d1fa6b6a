"""Rolling replacement: a reload that changes what a model's replicas run replaces them one at a time. Pure.

What counts as a change is what the engine would run differently: engine, source, args, command,
env, GPUs per node, and the order of the model's profiles (a replica placed under another order
may not be the one the catalog now prefers). Replica counts, timeouts and the gateway's settings
are not: a reload that changes only those replaces nothing.

Kubernetes' RollingUpdate with maxSurge 1 and maxUnavailable 0 is the model: each replacement is
a move (moves.py), whose successor is ready before the old replica leaves rotation. Where no node
has room for the extra replica, the move retires the old one first (`NoRoom.BELOW`) and the event
log says so. The next move starts only when every replica of the model is ready again, so there is
never more than one in flight. A successor that fails halts the rollout: the old replicas serve
on, `ctl models` and `ctl rollout status` say halted and why, and it stays halted until a reload
changes the model again (then a new rollout starts).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable, Mapping

import msgspec

from llmgw.catalog.schema import Model, Profile
from llmgw.server.lost import Keeper
from llmgw.server.moves import NoRoom, Note
from llmgw.server.replicas import Refusal, Replica, Settings
from llmgw.server.states import LEAVING, MoveState, ReplicaState
from llmgw.wire import messages as m


class RolloutState(enum.StrEnum):
    ROLLING = "rolling"
    HALTED = "halted"  # a new replica failed; the old ones serve; a reload that changes the model starts anew
    DONE = "done"


ROLLOUT_TRANSITIONS: Mapping[RolloutState, frozenset[RolloutState]] = {
    RolloutState.ROLLING: frozenset({RolloutState.HALTED, RolloutState.DONE}),
    RolloutState.HALTED: frozenset(),
    RolloutState.DONE: frozenset(),
}
assert set(ROLLOUT_TRANSITIONS) == set(RolloutState)


class Rollout(msgspec.Struct, kw_only=True):
    model: str
    target: str  # the model's run fingerprint this rollout brings every replica to
    state: RolloutState = RolloutState.ROLLING
    what: str  # what changed, in words ("args, env")
    total: int  # replicas to replace when it began
    replaced: int = 0
    moves: list[int] = []
    note: str = ""  # what it does now, or why it halted
    started_at: float = 0.0
    state_since: float = 0.0


def fingerprint(model: Model) -> str:
    """What the model's replicas run, as one comparable string (counts and timeouts left out)."""
    parts = [(p.name, p.engine, p.source or model.source or model.name, list(p.args), list(p.command),
              sorted(p.env.items()), p.gpus, p.nodes) for p in model.profiles]
    return msgspec.json.encode(parts).decode()


def changed(replica: Replica, model: Model) -> str:
    """What differs between what `replica` runs and what the catalog says it should ("" for nothing)."""
    profile: Profile | None = next((p for p in model.profiles if p.name == replica.profile), None)
    spec = next((s.spec for s in replica.shards if s.rank == 0 and s.spec is not None), None)
    if profile is None or spec is None:
        return ""  # a profile that left the catalog is stopped elsewhere; nothing placed yet
    what = []
    if spec.engine != profile.engine:
        what.append("engine")
    if spec.source != (profile.source or model.source or model.name):
        what.append("source")
    if list(spec.args) != list(profile.args):
        what.append("args")
    if list(spec.command) != list(profile.command):
        what.append("command")
    if dict(spec.env) != dict(profile.env):
        what.append("env")
    if len(spec.gpus) != profile.gpus:
        what.append("gpus")
    if replica.profile_order and replica.profile_order != [p.name for p in model.profiles]:
        what.append("profile order")
    return ", ".join(what)


class Roller(Keeper):
    """Rollouts over the move primitive; the reconciler is one and calls `_roll` each pass."""

    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        super().__init__(settings, rng)
        self.rollouts: dict[str, Rollout] = {}  # by model: the latest one
        # Cost: a steady pass must not compare every replica's spec (bench-reconcile). A model
        # whose replicas were all found current for its fingerprint is skipped until the
        # fingerprint changes or a node registers (adopted engines may run anything).
        self._fingerprints: dict[str, tuple[Model, str]] = {}
        self._current: dict[str, str] = {}  # model → the fingerprint all its replicas ran when last looked at

    def on_register(self, node_id: str, reports: Iterable[m.ShardReport], now: float, wall_now: float | None = None,
                    endpoint_host: str | None = None) -> list[Refusal]:
        self._current.clear()
        return super().on_register(node_id, reports, now, wall_now, endpoint_host)

    def _fingerprint(self, model: Model) -> str:
        known = self._fingerprints.get(model.name)
        if known is None or known[0] is not model:
            known = (model, fingerprint(model))
            self._fingerprints[model.name] = known
        return known[1]

    def rollout_of(self, model: Model) -> Rollout | None:
        """The model's rollout as a reader should see it: one that a reload made due but that no
        pass has begun yet shows as rolling (`ctl reload && ctl rollout status` must not read
        "no rollout" in between, nor during the settle period after a restart)."""
        ro = self.rollouts.get(model.name)
        target = self._fingerprint(model)
        if ro is not None and ro.target == target:
            return ro
        stale = sorted({w for r in self.of_model(model.name)
                        if r.state in (ReplicaState.READY, ReplicaState.STARTING) and not r.replaces
                        and (w := changed(r, model))})
        if not stale:
            return None
        count = sum(1 for r in self.of_model(model.name) if r.state not in LEAVING and changed(r, model))
        return Rollout(model=model.name, target=target, what="; ".join(stale), total=count,
                       note="begins at the next reconcile pass")

    def _roll(self, models: Mapping[str, Model], now: float) -> None:
        for name in [n for n in self.rollouts if n not in models]:
            del self.rollouts[name]
        for model in models.values():
            ro = self.rollouts.get(model.name)
            if ((ro is None or ro.state != RolloutState.ROLLING)
                    and self._current.get(model.name) == self._fingerprint(model)):
                continue
            self._roll_model(model, now)

    def _roll_model(self, model: Model, now: float) -> None:
        ro = self.rollouts.get(model.name)
        if ro is not None and ro.state == RolloutState.ROLLING:
            self._follow(ro, now)
        replicas = [r for r in self.of_model(model.name) if r.state not in LEAVING]
        moving = self.unfinished_by_replica()  # one walk of the move table, not one per replica
        stale = [(r, what) for r in replicas
                 if r.state in (ReplicaState.READY, ReplicaState.STARTING) and not r.replaces
                 and r.id not in moving and (what := changed(r, model))]
        target = self._fingerprint(model)
        if not stale and not self.active_moves(model.name) and (ro is None or ro.state != RolloutState.ROLLING):
            self._current[model.name] = target  # nothing to look at again until the catalog or the fleet changes
        else:
            self._current.pop(model.name, None)
        if ro is None or ro.target != target:
            if not stale:
                if ro is not None and ro.state != RolloutState.DONE:
                    del self.rollouts[model.name]  # what runs is what the catalog says again
                    self.notes.append(Note("rollout", f"rollout of {model.name} ended ({ro.state}): the catalog "
                                           "matches what its replicas run again", model=model.name))
                return
            whats = sorted({w for _, w in stale})
            ro = Rollout(model=model.name, target=target, what="; ".join(whats), total=len(stale), started_at=now,
                         state_since=now)
            self.rollouts[model.name] = ro
            self.generation += 1
            self.notes.append(Note("rollout", f"rollout of {model.name} begins: {ro.what} changed; {len(stale)} of "
                                   f"{len(replicas)} replica(s) to replace, one at a time", model=model.name))
        if ro.state != RolloutState.ROLLING:
            return
        if self.active_moves(model.name):
            return
        if not stale:
            if all(r.state == ReplicaState.READY for r in replicas):
                self._rollout_to(ro, RolloutState.DONE, now, f"all {len(replicas)} replica(s) run the new spec")
            return
        if any(r.state != ReplicaState.READY for r in replicas):
            ro.note = "waiting for every replica to be ready before the next replacement"
            return  # one at a time: the last replacement serves before the next begins
        replica, what = stale[0]
        move = self.request_move(replica.id, now, reason=f"rollout of {model.name}: {what} changed", kind="rollout",
                                 no_room=NoRoom.BELOW)
        if not isinstance(move, str):
            ro.moves.append(move.id)
            ro.note = f"replacing {replica.id} ({ro.replaced + 1} of {ro.total})"

    def _follow(self, ro: Rollout, now: float) -> None:
        """The rollout's moves: count the done, halt on a failed one or a failing new replica."""
        replaced = 0
        for move_id in ro.moves:
            move = self.moves.get(move_id)
            if move is None:
                continue
            if move.state == MoveState.FAILED:
                self._rollout_to(ro, RolloutState.HALTED, now, f"{move.note} ({ro.replaced} of {ro.total} replaced)")
                return
            successor = self.replicas.get(move.successor)
            if successor is not None and (successor.failures or successor.state == ReplicaState.FAILED):
                # Placed below desired (no room for a surge) and failing: the others stay as they are.
                self._rollout_to(ro, RolloutState.HALTED, now, f"new replica {successor.id} failed: {successor.reason} "
                                 f"({ro.replaced} of {ro.total} replaced)")
                return
            if move.state == MoveState.DONE:
                replaced += 1
        ro.replaced = replaced

    def _rollout_to(self, ro: Rollout, new: RolloutState, now: float, note: str) -> None:
        if new != ro.state and new not in ROLLOUT_TRANSITIONS[ro.state]:
            raise AssertionError(f"rollout of {ro.model}: {ro.state} → {new} is not in ROLLOUT_TRANSITIONS")
        ro.state = new
        ro.state_since = now
        ro.note = note
        self.generation += 1
        self.notes.append(Note("rollout", f"rollout of {ro.model} {new}: {note}", model=ro.model))
