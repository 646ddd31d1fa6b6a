"""The move primitive: replace one replica with a successor, then retire the old one. Pure.

Drain (a node going in for maintenance), rolling replacement (a profile's new flags) and spread
all come down to this. A move places a successor first (with a constraint: nodes to avoid; it
always runs the catalog's current spec), waits until it is ready, and only then retires the old
replica: the old one becomes DRAINING, which takes its endpoint out of the gateway's rotation
on the pass's sync (`rotation_synced`), and only after that do its shards get `Drain` (the agent
stops the engine with its grace; vLLM finishes running requests on SIGTERM). Kubernetes'
RollingUpdate with maxSurge 1 and maxUnavailable 0 is the model, and as there, at most one
surge per model is in flight at a time: further moves of the model wait, QUEUED.

Where no node has room for the successor, the caller decides (`NoRoom`): FAIL (drain: the old
one serves on, the move says why), BELOW (a rollout, a forced drain: the old one retires first
and the successor takes its place, one below desired for that time) or WAIT (a replica on a lost
node, lost.py: the successor waits for room as a pending replica while the old one serves on).
A successor that fails ends the move FAILED with its reason and the engine's last lines; the old
replica serves on. Every state change goes through the table in `states.py` and leaves a `Note` for the event
log (kind, message, node, model, replica), drained by the server after each pass.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable

import msgspec

from llmgw.server.observe import Observer
from llmgw.server.replicas import Replica, Settings
from llmgw.server.states import LEAVING, MOVE_ACTIVE, MOVE_ENDED, MoveState, ReplicaState, move_may

KEEP_ENDED = 200  # finished moves kept for callers polling their outcome (`ctl drain`), newest


class NoRoom(enum.StrEnum):
    FAIL = "fail"  # the move fails, the old replica serves on (drain without --force)
    BELOW = "below"  # the old replica retires first; the successor takes its place (rollout, --force)
    WAIT = "wait"  # the successor waits for room, the old replica serves on meanwhile (a lost node, lost.py)


class Note(msgspec.Struct, frozen=True):
    """One line for the event log."""

    kind: str
    message: str
    node: str = ""
    model: str = ""
    replica: str = ""
    detail: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()  # every node the replica ran on (a 2-node replica's move is found by both)


class Move(msgspec.Struct, kw_only=True):
    id: int
    replica: str  # the replica being replaced
    model: str
    node: str  # the node it is about, for the event log: the one drained, else the old replica's rank 0's
    nodes: list[str] = []  # every node the old replica ran on
    kind: str  # the event kind and who asked: "drain", "rollout", "spread", "lost", "restart", "move"
    reason: str  # the caller's words: "drain of gpu-01 requested by operator …"
    avoid: list[str] = []  # nodes the successor must not be placed on
    no_room: NoRoom = NoRoom.FAIL
    # One surge per model at a time (maxSurge 1). A lost node's replacements surge together: each
    # replaces a replica that may already be dead, and a rack's worth one after another would take
    # a startup time each.
    alone: bool = True
    state: MoveState = MoveState.QUEUED
    successor: str = ""
    note: str = ""  # what it waits for, or why it failed
    tail: list[str] = []  # a failed successor's last engine lines
    created_at: float = 0.0
    state_since: float = 0.0


class Mover(Observer):
    """Moves over the replica book; the reconciler is one and calls `_advance_moves` each pass."""

    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        super().__init__(settings, rng)
        self.moves: dict[int, Move] = {}
        self._move_ids = 0
        self.notes: list[Note] = []  # for the event log, since the last drain_notes()

    # -- what callers use ----------------------------------------------------------------------------

    def request_move(self, replica_id: str, now: float, *, reason: str, kind: str = "move",
                     avoid: Iterable[str] = (), no_room: NoRoom = NoRoom.FAIL, alone: bool = True,
                     node: str = "") -> Move | str:
        """Ask for `replica_id` to be replaced; the Move (its state follows, pass by pass), or
        why not in words (no such replica, already leaving, already being moved). `node`: the
        node the move is about (a drain's: its events are that node's, not rank 0's)."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return f"no replica {replica_id!r}"
        if replica.state in LEAVING:
            return f"replica {replica_id} is already {replica.state}"
        if replica.replaces:
            return f"replica {replica_id} is itself the successor of {replica.replaces}, still surging"
        current = self.move_of(replica_id)
        if current is not None:
            return f"replica {replica_id} is already being moved ({current.kind}: {current.reason})"
        self._move_ids += 1
        nodes = list(dict.fromkeys(s.node for s in sorted(replica.shards, key=lambda s: s.rank)))
        node = node or (nodes[0] if nodes else "")
        move = Move(id=self._move_ids, replica=replica_id, model=replica.model, node=node, nodes=nodes, kind=kind,
                    reason=reason, avoid=sorted(set(avoid)), no_room=no_room, alone=alone, created_at=now,
                    state_since=now)
        self.moves[move.id] = move
        self.generation += 1
        self._note(move, f"move of {replica_id} ({replica.model}) asked: {reason}")
        return move

    def move_of(self, replica_id: str) -> Move | None:
        """The unfinished move of a replica (as the old one or as the successor), if any."""
        for move in self.moves.values():
            if move.state not in MOVE_ENDED and replica_id in (move.replica, move.successor):
                return move
        return None

    def unfinished_by_replica(self) -> dict[str, Move]:
        """Every unfinished move under both its replicas' ids: one walk of the move table for a
        whole listing, where `move_of` per replica walked it once for each."""
        out: dict[str, Move] = {}
        for move in self.moves.values():
            if move.state not in MOVE_ENDED:
                out.setdefault(move.replica, move)
                if move.successor:
                    out.setdefault(move.successor, move)
        return out

    def active_moves(self, model: str) -> list[Move]:
        return [mv for mv in self.moves.values() if mv.model == model and mv.state not in MOVE_ENDED]

    def rotation_synced(self) -> bool:
        """The gateway has synced its endpoints: every draining replica is out of its rotation
        now and may be drained. True when that newly holds for one (the driver runs a pass)."""
        changed = False
        for replica in self.replicas.values():
            if replica.state == ReplicaState.DRAINING and not replica.out_of_rotation:
                replica.out_of_rotation = True
                changed = True
        return changed

    def drain_notes(self) -> list[Note]:
        out, self.notes = self.notes, []
        return out

    # -- the pass's step ---------------------------------------------------------------------------

    def _advance_moves(self, now: float) -> None:
        """Move every unfinished move as far as the picture allows (called twice a pass: before
        the counts, and after placement so a successor that found no room is seen at once)."""
        in_order = sorted(self.moves.values(), key=lambda mv: mv.id)
        for move in in_order:
            if move.state not in MOVE_ACTIVE:
                continue
            old = self.replicas.get(move.replica)
            successor = self.replicas.get(move.successor)
            if move.state == MoveState.SURGING:
                self._surging(move, old, successor, now)
            elif old is None:  # RETIRING, BELOW: the old one is gone
                self._move_to(move, MoveState.DONE, now, _retired(move, successor))
        busy = {mv.model: mv.replica for mv in self.moves.values() if mv.state in MOVE_ACTIVE and mv.alone}
        for move in in_order:
            if move.state != MoveState.QUEUED:
                continue
            old = self.replicas.get(move.replica)
            if old is None or old.state in LEAVING:
                self._move_to(move, MoveState.DONE, now, f"{move.replica} was gone before its move began")
            elif not move.alone or move.model not in busy:
                if move.alone:
                    busy[move.model] = move.replica
                self._surge(move, old, now)
            else:  # one surge per model: say whose turn it is (ctl drain printed "[queued]: -")
                note = f"waiting for the move of {busy[move.model]} to finish (one per model at a time)"
                if move.note != note:
                    move.note = note
                    self.generation += 1
        self._forget_ended()
        # Only a move retires a replica (DRAINING): with none retiring, no replica is looked at.
        retiring = [self.replicas.get(mv.replica) for mv in self.moves.values()
                    if mv.state in (MoveState.RETIRING, MoveState.BELOW)]
        for replica in retiring:
            if replica is not None and replica.state == ReplicaState.DRAINING and replica.out_of_rotation:
                self.stop_replica(replica, now, replica.reason, drain=True)

    def _surge(self, move: Move, old: Replica, now: float) -> None:
        rid = self._new_id(move.model)
        self._put(Replica(id=rid, model=move.model, created_at=now, state_since=now, replaces=old.id,
                          avoid=list(move.avoid)))
        move.successor = rid
        self.log.append(f"move {move.id}: successor {rid} for {old.id} ({move.reason})")
        avoid = f", not on {', '.join(move.avoid)}" if move.avoid else ""
        self._move_to(move, MoveState.SURGING, now, f"placing successor {rid}{avoid}")

    def _surging(self, move: Move, old: Replica | None, successor: Replica | None, now: float) -> None:
        if successor is None or successor.state in LEAVING:
            self._move_to(move, MoveState.FAILED, now, f"successor {move.successor} went away before it was ready")
            return
        if old is None or old.state in LEAVING:
            successor.replaces = ""  # it simply takes the place
            self._move_to(move, MoveState.DONE, now, f"{move.replica} left on its own; {successor.id} takes its place")
            return
        if successor.state == ReplicaState.READY:
            successor.replaces = ""
            self._retire(old, now, f"replaced by {successor.id} ({move.reason})")
            self._move_to(move, MoveState.RETIRING, now, f"{successor.id} ready; {old.id} leaves rotation and drains")
        elif successor.state == ReplicaState.FAILED or successor.failures:
            move.tail = list(successor.tail)
            why = successor.reason
            self.stop_replica(successor, now, f"failed successor of {old.id}: {why}")
            self._move_to(move, MoveState.FAILED, now, f"successor {successor.id} failed: {why}; {old.id} serves on")
        elif successor.state == ReplicaState.PENDING and successor.reason.startswith("no placement"):
            if move.no_room == NoRoom.WAIT:
                note = (f"no room for a successor of {old.id} ({successor.reason.removeprefix('no placement: ')}); "
                        f"it serves on while {successor.id} waits for room")
                if move.note != note:  # said once per change, not every pass
                    move.note = note
                    self.generation += 1
                    self._note(move, f"move of {move.replica} waits: {note}")
                    self.log.append(f"move {move.id}: {note}")
            elif move.no_room == NoRoom.FAIL:
                self._pop(successor.id)
                self._move_to(move, MoveState.FAILED, now, f"no room for a successor of {old.id} "
                              f"({successor.reason.removeprefix('no placement: ')}); it serves on")
            else:
                successor.replaces = ""
                self._retire(old, now,
                             f"retired before its successor {successor.id} ({move.reason}): no room for a surge")
                self._move_to(move, MoveState.BELOW, now,
                              f"no room for a surge ({successor.reason.removeprefix('no placement: ')}); "
                              f"{old.id} retires first, one below desired until {successor.id} is ready")

    def _retire(self, replica: Replica, now: float, reason: str) -> None:
        """Out of rotation first (DRAINING), drained once the gateway has synced; a replica that
        serves nothing (starting, failed, pending) is stopped at once."""
        if replica.state in (ReplicaState.READY, ReplicaState.STARTING):
            self.generation += 1
            replica.out_of_rotation = replica.state != ReplicaState.READY  # never in rotation: drain at once
            self._replica_to(replica, ReplicaState.DRAINING, now, reason, "retired by a move")
            self.log.append(f"replica {replica.id} draining: {reason}")
        elif replica.state == ReplicaState.PENDING or replica.gone():
            self._pop(replica.id)
            self.log.append(f"dropped replica {replica.id}: {reason}")
        else:
            self.stop_replica(replica, now, reason)

    def _move_to(self, move: Move, new: MoveState, now: float, note: str) -> None:
        if not move_may(move.state, new):
            # a bug here, not a peer's
            raise AssertionError(f"move {move.id}: {move.state} → {new} is not in MOVE_TRANSITIONS")
        if new != move.state:
            move.state = new
            move.state_since = now
            self.generation += 1
        successor = self.replicas.get(move.successor) if new in MOVE_ENDED else None
        if successor is not None:
            successor.avoid = []  # the constraint was the move's: a cordon, not this, keeps it off a node after
        move.note = note
        self._note(move, f"move of {move.replica} {new}: {note}",
                   detail=tuple(move.tail) if new == MoveState.FAILED else ())

    def _note(self, move: Move, message: str, detail: tuple[str, ...] = ()) -> None:
        self.notes.append(Note(move.kind, message, node=move.node, model=move.model, replica=move.replica,
                               detail=detail, nodes=tuple(move.nodes)))

    def _forget_ended(self) -> None:
        ended = [mid for mid, mv in self.moves.items() if mv.state in MOVE_ENDED]
        for mid in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self.moves[mid]


def _retired(move: Move, successor: Replica | None) -> str:
    """What is true when the old replica is gone: a --force move's successor may still wait for room."""
    if successor is None:
        return f"{move.replica} retired"
    if successor.state == ReplicaState.READY:
        return f"{move.replica} retired; {move.successor} serves instead"
    return f"{move.replica} retired; {move.successor} is {successor.state} and serves once ready"
