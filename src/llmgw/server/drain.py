"""Cordon, uncordon and drain: a node taken out for maintenance with traffic flowing throughout.

A **cordoned** node gets no new placements (the reconciler sees `NodeInfo.cordoned`); what runs
there stays. A **draining** node is cordoned, and its replicas are moved elsewhere one at a time
with the move primitive (moves.py): each replacement is placed and ready before the old replica
leaves rotation and gets `Drain`. Without `force` a replica for which no node has room stays and
serves (its move fails, saying why); with `force` it is retired anyway and is down until room
frees (`NoRoom.BELOW`), which the move's note and the event log say.

The marks survive a restart: `nodes.sqlite` (WAL) in the server's state directory, as
fabric.sqlite keeps subnet-manager history (DESIGN.md, "Sources of truth"). A restarted server
resumes a drain: `after_pass` asks for the next move of every draining node after each pass, so
what it moves depends on what the fleet reports, not on a list kept from before.
Writes are one short transaction per operator action, on the event loop's thread.
"""

from __future__ import annotations

import enum
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from llmgw.server.moves import Move, NoRoom
from llmgw.server.reconcile import Reconciler
from llmgw.server.registry import NodeRegistry
from llmgw.server.sqlitefile import connect_checked, move_aside
from llmgw.server.states import HOLDING, LEAVING, MOVE_ENDED, MoveState, ReplicaState

log = logging.getLogger("llmgw.server.drain")

FILE_NAME = "nodes.sqlite"
AUTO_WHO = "auto: "  # the `who` of a cordon the system set for a finding (server/remedy.py AUTO_PREFIX)
_SCHEMA = ("CREATE TABLE IF NOT EXISTS marks (node TEXT PRIMARY KEY, mark TEXT NOT NULL, since REAL NOT NULL, "
           "who TEXT NOT NULL, force INTEGER NOT NULL DEFAULT 0)")


class Mark(enum.StrEnum):
    CORDONED = "cordoned"
    DRAINING = "draining"


class MarkRecord(msgspec.Struct, frozen=True):
    mark: Mark
    since: float  # wall clock
    who: str
    force: bool = False


class MarkStore:
    """The node marks on disk. A file that is not a database is moved aside with a warning and a
    new one started (the marks are lost, the server runs: an operator cordons again)."""

    def __init__(self, state_dir: str | Path) -> None:
        directory = Path(state_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / FILE_NAME
        try:
            self.db = connect_checked(self.path, _SCHEMA, synchronous="FULL")  # a mark must survive a power cut
        except sqlite3.DatabaseError as exc:
            aside = move_aside(self.path)
            log.warning("node marks: %s is not a readable database (%s); moved it aside to %s and started a new one: "
                        "cordon or drain marks it held are lost", self.path, exc, aside)
            self.db = connect_checked(self.path, _SCHEMA, synchronous="FULL")

    def load(self) -> dict[str, MarkRecord]:
        rows = self.db.execute("SELECT node, mark, since, who, force FROM marks").fetchall()
        out = {}
        for node, mark, since, who, force in rows:
            try:
                out[node] = MarkRecord(Mark(mark), since, who, bool(force))
            except ValueError:
                log.warning("node marks: %s has an unknown mark %r; ignored", node, mark)
        return out

    def put(self, node: str, record: MarkRecord) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO marks (node, mark, since, who, force) VALUES (?, ?, ?, ?, ?)",
                            (node, str(record.mark), record.since, record.who, int(record.force)))

    def delete(self, node: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM marks WHERE node = ?", (node,))

    def close(self) -> None:
        self.db.close()


class DrainItem(msgspec.Struct, kw_only=True):
    replica: str
    model: str
    state: str  # the replica's state, or "moved"/"gone" once it left the node
    move: str = ""  # the move's state
    successor: str = ""
    note: str = ""


class DrainView(msgspec.Struct, kw_only=True):
    """`GET/POST /api/v1/nodes/{node}/drain`: where a drain stands."""

    node: str
    mark: str
    force: bool
    done: bool  # the node runs nothing
    in_progress: bool  # a move in flight, a replica still to move, or one still stopping
    items: list[DrainItem]
    failed: list[str] = []  # one line per replica that stays on the node, and why
    down: list[str] = []  # --force: replicas retired with no place to go (down until room frees)



def moves_tried(reconciler: Reconciler, asked: list[int]) -> set[str] | None:
    """A node's moves, one at a time (a drain's, self-healing's): None while one of `asked` is
    still under way, else the replicas they already tried to move."""
    moves = [reconciler.moves.get(i) for i in asked]
    if any(mv is not None and mv.state not in MOVE_ENDED for mv in moves):
        return None
    return {mv.replica for mv in moves if mv is not None}

class Drainer:
    """The marks, and the drains they drive. `record(kind, message, node)` goes to the event log."""

    def __init__(self, store: MarkStore, reconciler: Reconciler, registry: NodeRegistry, *,
                 now: Callable[[], float], wake: Callable[[], None],
                 record: Callable[[str, str, str], None] = lambda kind, message, node: None) -> None:
        self.store = store
        self.reconciler = reconciler
        self.registry = registry
        self.now = now
        self.wake = wake
        self.record = record
        self.marks = store.load()
        self._moves: dict[str, list[int]] = {}  # node → the moves this drain asked for, in order
        if self.marks:
            log.info("node marks from %s: %s", store.path,
                     ", ".join(f"{n} {r.mark}" for n, r in sorted(self.marks.items())))

    def cordoned(self) -> set[str]:
        """The nodes that take no new placements (cordoned or draining)."""
        return set(self.marks)

    def mark_of(self, node_id: str) -> str:
        record = self.marks.get(node_id)
        if record is not None and record.who.startswith(AUTO_WHO):
            return f"{record.mark} ({record.who})"  # cordoned (auto: gpu 3 Xid 79)
        return str(record.mark) if record is not None else ""

    # -- operator actions (each says what stands in the way, or "") -----------------------------------

    def cordon(self, node_id: str, who: str) -> str:
        if self.registry.get(node_id) is None:
            return "not found"
        current = self.marks.get(node_id)
        if node_id not in self.marks or (current is not None and current.who.startswith(AUTO_WHO)):
            # An operator's cordon of an auto-cordoned node makes it theirs: never lifted automatically.
            self._set(node_id, MarkRecord(Mark.CORDONED, time.time(), who))
            self.record("node", f"node {node_id} cordoned by {who}: no new placements; what runs there stays", node_id)
        return ""

    # -- the system's own cordons (server/remedy_service.py): `who` is AUTO_WHO + the finding ---------

    def auto_cordon(self, node_id: str, reason: str) -> bool:
        """Cordon for a finding; False where the node is gone or already marked (by anyone)."""
        if self.registry.get(node_id) is None or node_id in self.marks:
            return False
        self._set(node_id, MarkRecord(Mark.CORDONED, time.time(), AUTO_WHO + reason))
        return True

    def auto_uncordon(self, node_id: str) -> bool:
        """Lift a cordon the system set; an operator's (or a drain) is never touched."""
        record = self.marks.get(node_id)
        if record is None or record.mark != Mark.CORDONED or not record.who.startswith(AUTO_WHO):
            return False
        del self.marks[node_id]
        self.store.delete(node_id)
        self.reconciler.generation += 1
        self.wake()
        return True

    def uncordon(self, node_id: str, who: str) -> str:
        if self.registry.get(node_id) is None and node_id not in self.marks:
            return "not found"
        record = self.marks.pop(node_id, None)
        if record is not None:
            self.store.delete(node_id)
            self._moves.pop(node_id, None)
            self.record("node", f"node {node_id} uncordoned by {who} (was {record.mark}): placements allowed again",
                        node_id)
            self.reconciler.generation += 1
            self.wake()
        return ""

    def drain(self, node_id: str, who: str, *, force: bool) -> DrainView | str:
        if self.registry.get(node_id) is None:
            return "not found"
        current = self.marks.get(node_id)
        if current is None or current.mark != Mark.DRAINING or current.force != force:
            self._set(node_id, MarkRecord(Mark.DRAINING, time.time(), who, force))
            self._moves[node_id] = []  # a drain asked again tries again what failed before
            on = sorted({r.id for r in self._on(node_id)})
            self.record("drain", f"drain of {node_id} requested by {who}{' (--force)' if force else ''}: cordoned; "
                        f"moving {len(on)} replica(s): {', '.join(on) or 'none'}", node_id)
        self.after_pass()
        view = self.view(node_id)
        assert view is not None  # the node is registered
        return view

    def _set(self, node_id: str, record: MarkRecord) -> None:
        self.store.put(node_id, record)
        self.marks[node_id] = record
        self.reconciler.generation += 1  # a pass in progress re-reads usage
        self.wake()

    # -- progress ------------------------------------------------------------------------------------

    def _on(self, node_id: str) -> list:
        """Replicas holding anything on the node (a shard starting, serving or stopping)."""
        return [r for r in self.reconciler.on_node(node_id)
                if any(s.node == node_id and s.state in HOLDING for s in r.shards)]

    def after_pass(self) -> None:
        """Every draining node with no move of its drain in flight gets its next one (one at a
        time), for the next replica there that has not failed to move in this drain."""
        for node_id, record in self.marks.items():
            if record.mark != Mark.DRAINING:
                continue
            asked = self._moves.setdefault(node_id, [])
            tried = moves_tried(self.reconciler, asked)
            if tried is None:
                continue
            for replica in sorted(self._on(node_id), key=lambda r: (r.created_at, r.id)):
                if replica.id in tried or replica.state in LEAVING or replica.state not in (ReplicaState.READY,
                                                                                             ReplicaState.STARTING):
                    continue
                result = self.reconciler.request_move(
                    replica.id, self.now(), reason=f"drain of {node_id} requested by {record.who}", kind="drain",
                    avoid=[node_id], no_room=NoRoom.BELOW if record.force else NoRoom.FAIL, node=node_id)
                if isinstance(result, Move):
                    asked.append(result.id)
                    self.wake()
                    break
                log.info("drain of %s: %s", node_id, result)

    def view(self, node_id: str) -> DrainView | None:
        record = self.marks.get(node_id)
        if record is None and self.registry.get(node_id) is None:
            return None
        items: list[DrainItem] = []
        failed: list[str] = []
        down: list[str] = []
        seen: set[str] = set()
        for move_id in self._moves.get(node_id, []):
            mv = self.reconciler.moves.get(move_id)
            if mv is None:
                continue
            seen.add(mv.replica)
            replica = self.reconciler.replicas.get(mv.replica)
            items.append(DrainItem(replica=mv.replica, model=mv.model, state=str(replica.state) if replica else "gone",
                                   move=str(mv.state), successor=mv.successor, note=mv.note))
            if mv.state == MoveState.FAILED and replica is not None and replica.state not in LEAVING:
                failed.append(f"{mv.replica} ({mv.model}): {mv.note}")
            if mv.state in (MoveState.BELOW, MoveState.DONE) and mv.note.startswith("no room"):
                down.append(f"{mv.replica} ({mv.model}): {mv.note}")
            elif mv.state == MoveState.DONE and (succ := self.reconciler.replicas.get(mv.successor)) is not None \
                    and succ.state == ReplicaState.PENDING and record is not None and record.force:
                down.append(f"{mv.replica} ({mv.model}): retired; successor {succ.id} waits: {succ.reason}")
        draining = record is not None and record.mark == Mark.DRAINING
        busy = any(i.move and MoveState(i.move) not in MOVE_ENDED for i in items)
        for replica in self._on(node_id):
            if replica.id not in seen:
                items.append(DrainItem(replica=replica.id, model=replica.model, state=str(replica.state),
                                       note="waiting for its turn" if draining else ""))
                busy = busy or draining
            elif replica.state in LEAVING:
                busy = True  # drained, its engine still stopping
        return DrainView(node=node_id, mark=str(record.mark) if record else "", force=bool(record and record.force),
                         done=not self._on(node_id), in_progress=busy, items=items, failed=failed, down=down)
