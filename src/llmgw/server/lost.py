"""A lost node's replicas: kept while they serve, replaced where there is room, whole again on return. Pure.

Lost means "unknown", not "dead": the node's agent has been silent past `fleet.lost_after`, but its
engines may well serve on (the gateway talks to them directly, DESIGN.md). Tearing down what may
still serve cost issue 41's probe 720 × 503 over 8.5 s: rank 1's agent lost took both 2-node
replicas down though their rank 0s served and nothing else could fit. So:

- A ready replica with a shard on a lost node stays ready and in the gateway's rotation; the
  gateway's own health checks decide whether it gets traffic (a dead rank 0 leaves rotation in
  about `health_interval × health_failures`, as a hung engine does). Its shards there are LOST.
- Each such replica gets a move (moves.py) with `NoRoom.WAIT`: a successor is placed where there is
  room, avoiding the lost nodes, and the old replica retires only once the successor is ready.
  Where there is no room the successor waits as a pending replica; the old one serves on. These
  moves surge together (`alone=False`): each replaces one that may already be dead.
- The node comes back (Register or resync): a shard it still runs is the replica's own again, the
  replica is whole, and a successor not yet ready is let go (adopted, not duplicated). A shard it
  no longer runs ends the replica as any rank ending does (observe.py).
- A successor that fails ends its move; the next is asked after the replica's backoff.
- While a move waits for room, the model's rollout and spreading wait too (they move one replica
  of a model at a time); `ctl forget` of the node ends the wait: its replicas fail and are placed
  again wherever they fit.
- A replica that never served (starting), or is already failed, is replaced as before; one the
  operator said is gone for good (`ctl forget`) is dead, not unknown (`on_node_gone`).
"""

from __future__ import annotations

import random

import msgspec

from llmgw.server.moves import Move, Mover, NoRoom
from llmgw.server.replicas import Replica, Settings, lost_note
from llmgw.server.states import GONE, LEAVING, MoveState, ReplicaState, ShardState

LOST_MOVE = "lost"  # the kind of a lost replica's move (event log, `ctl replicas`)


class Kept(msgspec.Struct, kw_only=True):
    """A ready replica serving on with a shard on a lost node: its move and the backoff between them."""

    move: int = 0  # the id of its current (or last) move; 0 before the first
    failures: int = 0  # successors that failed in a row
    not_before: float = 0.0  # no new move before this (the backoff after a failed successor)


class Keeper(Mover):
    """The lost-node rules over the replica book; the reconciler is one and calls `_keep_lost` each pass."""

    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        super().__init__(settings, rng)
        self.kept: dict[str, Kept] = {}  # replica id → its keeping

    def on_node_state(self, node_id: str, state: str, now: float) -> None:
        """The registry's verdict on a node. Unreachable changes nothing (engines may well serve);
        lost marks its shards LOST and keeps what served (see the module's docstring)."""
        if state != "lost":
            return
        self.generation += 1
        for replica in self._on(node_id):
            mine = [s for s in replica.shards if s.node == node_id and s.state not in GONE]
            if not mine:
                continue
            for shard in mine:
                self._shard_to(shard, ShardState.LOST, f"node {node_id} lost")
            if replica.state == ReplicaState.STOPPING:
                self._maybe_forget(replica)
            elif replica.state == ReplicaState.READY:
                self.kept.setdefault(replica.id, Kept())
                replica.reason = lost_note(node_id)
                self.log.append(f"replica {replica.id}: node {node_id} lost; it serves on while its endpoint answers, "
                                "and is replaced where there is room")
            else:  # never served, or already failed: nothing to keep
                self._fail(replica, now, f"node {node_id} is lost", [], penalty=False)

    def on_node_gone(self, node_id: str, now: float) -> None:
        """The operator said the node is gone for good (`ctl forget`): dead, not unknown. Every
        replica with a shard there fails and is placed again."""
        self.generation += 1
        for replica in self._on(node_id):
            mine = [s for s in replica.shards if s.node == node_id]
            for shard in mine:
                if shard.state not in GONE:
                    self._shard_to(shard, ShardState.LOST, f"node {node_id} forgotten")
            if replica.state == ReplicaState.STOPPING:
                self._maybe_forget(replica)
            elif any(s.state == ShardState.LOST for s in mine):
                self.kept.pop(replica.id, None)
                self._fail(replica, now, f"node {node_id} is gone (forgotten by an operator)", [], penalty=False)

    def kept_deadline(self) -> float | None:
        """When a backoff between a kept replica's moves ends next (the driver wakes then)."""
        times = [k.not_before for k in self.kept.values() if k.failures]
        return min(times) if times else None

    # -- the pass's step ---------------------------------------------------------------------------

    def _keep_lost(self, now: float) -> None:
        """Ask a move for every kept replica that has none (called before the moves advance, so
        its successor is placed in the same pass). Costs nothing while no node is lost."""
        if not self.kept:
            return
        moving = self.unfinished_by_replica()
        for rid in sorted(self.kept):
            keep = self.kept[rid]
            replica = self.replicas.get(rid)
            lost = sorted({s.node for s in replica.shards if s.state == ShardState.LOST}) if replica is not None else []
            if replica is None or replica.state != ReplicaState.READY or not lost:
                del self.kept[rid]  # whole again, failed, retired or gone: nothing to keep
                continue
            if rid in moving:
                continue  # its own move (or a drain's, a rollout's) is under way
            if keep.move:
                last = self.moves.get(keep.move)
                if last is None or last.state == MoveState.FAILED:
                    keep.failures += 1
                    delay = min(self.settings.backoff_max, self.settings.backoff_initial * 2 ** (keep.failures - 1))
                    keep.not_before = now + delay
                    self.log.append(f"replica {rid}: its successor failed; the next in {delay:g}s, "
                                    "it serves on meanwhile")
                keep.move = 0
            if now < keep.not_before:
                continue
            asked = self.request_move(rid, now, reason=f"node {', '.join(lost)} lost", kind=LOST_MOVE, avoid=lost,
                                      no_room=NoRoom.WAIT, alone=False)
            if isinstance(asked, str):
                self.log.append(f"replica {rid}: no move for its lost node: {asked}")
                continue
            keep.move = asked.id
            self.log.append(f"move {asked.id} asked: replace {rid} (node {', '.join(lost)} lost) where there is room")

    def _surging(self, move: Move, old: Replica | None, successor: Replica | None, now: float) -> None:
        """A lost replica's move ends early when its node is back before the successor is ready
        (the old one is whole: the successor is let go) or when the old one fails meanwhile (the
        successor simply takes its place); everything else is the move primitive's."""
        if (move.kind == LOST_MOVE and old is not None and successor is not None
                and successor.state not in LEAVING and successor.state != ReplicaState.READY):
            if old.state in (ReplicaState.FAILED, ReplicaState.PENDING):
                successor.replaces = ""
                self._move_to(move, MoveState.DONE, now,
                              f"{old.id} failed ({old.reason}); {successor.id} takes its place")
                return
            if old.state == ReplicaState.READY and not any(s.state == ShardState.LOST for s in old.shards):
                why = f"not needed: {old.id} is whole again"
                if successor.state == ReplicaState.PENDING or successor.gone():
                    self._pop(successor.id)
                    self.log.append(f"dropped replica {successor.id}: {why}")
                else:
                    self.stop_replica(successor, now, why)
                self._move_to(move, MoveState.DONE, now, f"{', '.join(move.avoid)} back; {old.id} serves on, whole")
                return
        super()._surging(move, old, successor, now)


__all__ = ["LOST_MOVE", "Keeper", "Kept"]
