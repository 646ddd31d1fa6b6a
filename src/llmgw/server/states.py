"""The states of shards and replicas as the server sees them: two enums, two transition tables. Pure.

h11 keeps each side's state as an enum and one table, and an illegal event raises; here an illegal
transition is *refused*: the state stays as it was and the reconciler reports an `Illegal` record,
which its driver logs as a warning. A peer's message must never crash the control plane, and a
refused transition is a sign of a lost or reordered message or a bug, which a person should read.

A shard is one attempt to run one engine process: an attempt that ended (stopped, failed, exited)
stays ended, and a new attempt gets a new shard id. "lost" is this server's verdict (the node went
away, or stopped reporting the shard), and it means unknown, not dead: a ready replica with a lost
shard stays ready and serves on until it is replaced (lost.py). The node's own later report of the
same shard is the truth again (the fleet is the source of truth, DESIGN.md), so a lost shard may
become anything an agent reports, and one the node no longer reports when it is back has exited.
States arriving from agents are text (`ShardStatus.state`, `ShardReport.state`): an unknown one is
refused like an illegal transition.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import msgspec

# The shard enum lives in wire/: the agent sets it too; the server keeps its table here.
from llmgw.wire.shardstate import ShardState as ShardState


class ReplicaState(enum.StrEnum):
    PENDING = "pending"  # wants a placement
    STARTING = "starting"  # placed (or adopted), not every shard serves yet
    READY = "ready"  # every shard serves
    FAILED = "failed"  # a shard failed; waits out its backoff and its shards' stop, then pending
    # Being retired by a move (moves.py): out of the gateway's rotation first, then its shards
    # get Drain (in-flight requests finish up to the grace) once the gateway has let it go.
    DRAINING = "draining"
    STOPPING = "stopping"  # on its way out (surplus, catalog change, restart); forgotten once its shards are gone


S = ShardState
R = ReplicaState

# Shard states that hold GPUs and a port.
HOLDING: frozenset[ShardState] = frozenset({S.STARTING, S.READY, S.UNHEALTHY, S.STOPPING})
SERVING: frozenset[ShardState] = frozenset({S.READY, S.UNHEALTHY})
GONE: frozenset[ShardState] = frozenset({S.STOPPED, S.FAILED, S.EXITED, S.LOST})
ENDED: frozenset[ShardState] = frozenset({S.STOPPED, S.FAILED, S.EXITED})  # an attempt's end: final

_AFTER_START = frozenset({S.STOPPING, S.STOPPED, S.FAILED, S.EXITED, S.LOST})

# Every legal change of a shard's state (staying in a state is always legal and no change).
SHARD_TRANSITIONS: Mapping[ShardState, frozenset[ShardState]] = {
    S.STARTING: frozenset({S.READY, S.UNHEALTHY}) | _AFTER_START,
    S.READY: frozenset({S.UNHEALTHY}) | _AFTER_START,  # an engine that served never starts again
    S.UNHEALTHY: frozenset({S.READY}) | _AFTER_START,
    S.STOPPING: frozenset({S.STOPPED, S.FAILED, S.EXITED, S.LOST}),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
    S.EXITED: frozenset(),
    # The node came back and reports the shard: its report is the truth again.
    S.LOST: frozenset({S.STARTING, S.READY, S.UNHEALTHY, S.STOPPING, S.STOPPED, S.FAILED, S.EXITED}),
}

# Every legal change of a replica's state.
REPLICA_TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = {
    R.PENDING: frozenset({R.STARTING, R.STOPPING}),
    R.STARTING: frozenset({R.READY, R.FAILED, R.DRAINING, R.STOPPING}),
    R.READY: frozenset({R.FAILED, R.DRAINING, R.STOPPING}),
    R.FAILED: frozenset({R.PENDING, R.STOPPING}),
    R.DRAINING: frozenset({R.STOPPING}),
    R.STOPPING: frozenset(),
}

# On their way out: not counted against the catalog's replicas, never placed, never derived again.
LEAVING: frozenset[ReplicaState] = frozenset({R.DRAINING, R.STOPPING})


class MoveState(enum.StrEnum):
    """One move (moves.py): replace a replica with a successor, then retire the old one."""

    QUEUED = "queued"  # waits for the model's other move (one surge per model at a time)
    SURGING = "surging"  # the successor is placed (or waits for a placement) and starting
    BELOW = "below"  # no room for a surge: the old one retires first, the successor takes its place
    RETIRING = "retiring"  # the successor serves; the old one leaves rotation, drains, stops
    DONE = "done"
    FAILED = "failed"  # the successor failed or found no room: the old one serves on


MV = MoveState
MOVE_TRANSITIONS: Mapping[MoveState, frozenset[MoveState]] = {
    MV.QUEUED: frozenset({MV.SURGING, MV.DONE, MV.FAILED}),
    MV.SURGING: frozenset({MV.BELOW, MV.RETIRING, MV.DONE, MV.FAILED}),
    MV.BELOW: frozenset({MV.DONE, MV.FAILED}),
    MV.RETIRING: frozenset({MV.DONE}),
    MV.DONE: frozenset(),
    MV.FAILED: frozenset(),
}
MOVE_ACTIVE: frozenset[MoveState] = frozenset({MV.SURGING, MV.BELOW, MV.RETIRING})
MOVE_ENDED: frozenset[MoveState] = frozenset({MV.DONE, MV.FAILED})

assert set(SHARD_TRANSITIONS) == set(ShardState) and set(REPLICA_TRANSITIONS) == set(ReplicaState)
assert set(MOVE_TRANSITIONS) == set(MoveState)


class Illegal(msgspec.Struct, frozen=True):
    """A transition refused: what, from where to where, and what asked for it."""

    kind: str  # "shard" or "replica"
    id: str
    old: str
    new: str
    cause: str  # "ShardStatus from gpu-01", "Register from gpu-01", "node lost", ...

    def line(self) -> str:
        return (f"{self.kind} {self.id}: {self.cause} asks {self.old} → {self.new}, which is not a legal transition; "
                f"it stays {self.old}")


def shard_state(text: str) -> ShardState | None:
    """The state an agent reported, or None for one this server does not know."""
    try:
        return ShardState(text)
    except ValueError:
        return None


def shard_may(old: ShardState, new: ShardState) -> bool:
    return new == old or new in SHARD_TRANSITIONS[old]


def replica_may(old: ReplicaState, new: ReplicaState) -> bool:
    return new == old or new in REPLICA_TRANSITIONS[old]


def move_may(old: MoveState, new: MoveState) -> bool:
    return new == old or new in MOVE_TRANSITIONS[old]
