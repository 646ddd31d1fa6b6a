"""`ctl restart REPLICA`: the successor first, as drain and rollout do (the move primitive, moves.py).

Before issue 46 a restart stopped the replica and let the reconciler place a new one: a model
with one replica answered 503 for the 3–4 s its engine took to start. Now a ready replica is
restarted by a move of kind "restart": a successor is placed and ready before the old one leaves
rotation and drains (Kubernetes' `rollout restart`, maxSurge 1, maxUnavailable 0). Where no node
has room for the successor the move fails and the old one serves on, with the reason; `--force`
(NoRoom.BELOW) lets it stop first then, one below desired until its successor is ready. A
replica that serves nothing (pending, starting, failed) is stopped at once: nothing is lost. Pure.
"""

from __future__ import annotations

import msgspec

from llmgw.server.moves import Move, Mover, NoRoom
from llmgw.server.states import LEAVING, ReplicaState


class MoveOutcome(msgspec.Struct, kw_only=True):
    """One move as `GET /api/v1/moves/{id}` shows it (`ctl restart` follows its own to the end)."""

    id: int
    kind: str  # restart | drain | rollout | spread | move
    state: str  # queued | surging | below | retiring | done | failed
    replica: str  # the one replaced
    model: str
    successor: str  # "" while queued
    successor_state: str  # "" when there is none (yet, or any more)
    reason: str
    note: str  # what it waits for, or why it failed
    tail: list[str] = []  # a failed successor's last engine lines


def move_outcome(move: Move, mover: Mover) -> MoveOutcome:
    successor = mover.replicas.get(move.successor) if move.successor else None
    return MoveOutcome(id=move.id, kind=move.kind, state=str(move.state), replica=move.replica, model=move.model,
                       successor=move.successor, successor_state=str(successor.state) if successor is not None else "",
                       reason=move.reason, note=move.note, tail=list(move.tail))


class RestartResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What `POST /api/v1/replicas/{id}/restart` answers."""

    restarting: str
    message: str
    move: MoveOutcome | None = None  # None: stopped at once (it served nothing)


def restart(mover: Mover, replica_id: str, who: str, now: float, *, force: bool) -> RestartResult | tuple[int, str]:
    """Restart `replica_id`; what was done, or (HTTP status, why not)."""
    replica = mover.replicas.get(replica_id)
    if replica is None:
        return 404, f"no replica {replica_id!r}"
    reason = f"restart requested by {who}"
    if replica.state not in LEAVING and replica.state != ReplicaState.READY and mover.move_of(replica_id) is None:
        mover.stop_replica(replica, now, reason)
        return RestartResult(restarting=replica_id,
                             message=f"{replica_id} was {replica.state} (serving nothing): stopped; "
                                     "a new replica is placed")
    asked = mover.request_move(replica_id, now, reason=reason + (" (--force)" if force else ""), kind="restart",
                               no_room=NoRoom.BELOW if force else NoRoom.FAIL)
    if isinstance(asked, str):
        return 409, f"cannot restart {replica_id}: {asked}"
    return RestartResult(restarting=replica_id, move=move_outcome(asked, mover),
                         message=f"restarting {replica_id}: a successor is placed first; {replica_id} serves "
                                 "until it is ready")
