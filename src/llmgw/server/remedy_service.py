"""The control plane's side of a fleet that heals itself (issue 43): it grades the nodes whose
heartbeat changed with doctor's GPU checks, feeds the pure decision (server/remedy.py) and carries
out what it says: a cordon through the drain marks (drain.py, kept on disk with `who` "auto: …"),
the replicas on the affected GPUs moved with the move primitive (successor ready before the old
one leaves rotation), every action an event and `llmgw_auto_cordons_total{reason}`.

Off the event loop: on the loop, one pass takes references to the readings of the nodes whose
heartbeat changed (the registry replaces a node's readings on each heartbeat, never edits them:
doctor.py); a worker thread grades them (two checks per node, a few µs each: 1,000 nodes take a
few ms, but a fleet of any size must not hold up heartbeats or the gateway); back on the loop,
the decision and its actions. One pass per heartbeat interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio
from prometheus_client import CollectorRegistry, Counter

from llmgw.catalog.schema import RemedySettings
from llmgw.doctor.facts import Finding, NodeFacts
from llmgw.doctor.node import NODE_CHECKS, NodeContext
from llmgw.server.doctor import node_facts
from llmgw.server.drain import Drainer, moves_tried
from llmgw.server.moves import Move, NoRoom
from llmgw.server.reconcile import Reconciler
from llmgw.server.registry import NodeRegistry
from llmgw.server.remedy import (
    GPU_CHECKS,
    Cordon,
    Fault,
    GpuBack,
    GpuOut,
    MarkKind,
    Remedy,
    Report,
    Uncordon,
    faults,
    mark_kind,
)
from llmgw.server.states import HOLDING, LEAVING, ReplicaState

log = logging.getLogger("llmgw.server.remedy")


def grade(facts: list[NodeFacts], node_checks: tuple[str, ...]) -> dict[str, list[Fault]]:
    """Node → its faults: doctor's GPU checks and `node_checks` on each (pure; in a thread)."""
    ctx = NodeContext()
    names = [name for name in (*sorted(GPU_CHECKS), *node_checks) if name in NODE_CHECKS]
    out: dict[str, list[Fault]] = {}
    for n in facts:
        found: list[Finding] = []
        for name in names:
            try:
                found.extend(NODE_CHECKS[name](n, ctx))
            except Exception:  # a check's bug must not stop the others (doctor says `unknown` for it)
                log.exception("remedy: check %s on %s failed", name, n.id)
        out[n.id] = faults(found, node_checks)
    return out


class RemedyService:
    """Built from its parts (server/app.py); `run` is its task, `unplaceable` what placement and
    `ctl nodes` read."""

    def __init__(self, settings: RemedySettings, registry: NodeRegistry, reconciler: Reconciler, drainer: Drainer, *,
                 record: Callable[[str, str, str], None], metrics: CollectorRegistry | None = None,
                 wake: Callable[[], None] = lambda: None, clock: Callable[[], float] = trio.current_time) -> None:
        self.settings = settings
        self.remedy = Remedy(settings)
        self.registry = registry
        self.reconciler = reconciler
        self.drainer = drainer
        self.record = record  # (kind, message, node) → the event log
        self.wake = wake
        self.clock = clock
        self.cordons = Counter("llmgw_auto_cordons", "Nodes cordoned by auto-remediation, by finding.", ["reason"],
                               registry=metrics)
        self._seen: dict[str, int] = {}  # node → the heartbeat count last graded
        self._moves: dict[str, list[int]] = {}  # auto-cordoned node → the moves asked for it

    def unplaceable(self) -> dict[str, dict[int, str]]:
        return self.remedy.unplaceable()

    def configure(self, settings: RemedySettings) -> None:
        """A reload's remedy section, at once (`report` during an incident stops the cordons);
        the histories stay, so a finding held before is still held."""
        if settings != self.settings:
            self._say(settings)
            self.settings = self.remedy.settings = settings
            self.reconciler.generation += 1  # `off` frees the unplaceable GPUs for the next pass
            self.wake()

    def _say(self, settings: RemedySettings) -> None:
        log.info("auto_remediate: %s (hold %d readings, clear after %gs, at most %d nodes / %g %%)",
                 settings.mode, settings.hold, settings.clear_after, settings.max_nodes, settings.max_percent)

    async def run(self) -> None:
        self._say(self.settings)
        while True:
            if self.settings.mode != "off":
                await self.step()
            await trio.sleep(self.registry.heartbeat_interval)

    async def step(self) -> None:
        facts = self._changed()
        if facts:
            graded = await trio.to_thread.run_sync(grade, facts, tuple(self.settings.node_checks))
            now = self.clock()
            for node_id, found in graded.items():
                if node_id in self.registry.nodes:
                    self.remedy.observe(node_id, found, now)
        self.act(self.clock())

    def _changed(self) -> list[NodeFacts]:
        now, wall, interval = self.clock(), time.time(), self.registry.heartbeat_interval
        out = []
        for node_id in list(self._seen):
            if node_id not in self.registry.nodes:
                del self._seen[node_id]
                self.remedy.forget(node_id)
        for node in self.registry.nodes.values():
            if node.heartbeat is None or not node.connected or node.state != "ready":
                continue  # stale readings count neither for nor against
            if self._seen.get(node.id) == node.heartbeats:
                continue
            self._seen[node.id] = node.heartbeats
            out.append(node_facts(node, now, wall, interval))
        return out

    def act(self, now: float) -> None:
        """The decision on what the fleet reports now, carried out; then the moves it implies."""
        marks = {node: mark_kind(record.who) for node, record in self.drainer.marks.items()}
        fleet = {n.id: len(n.inventory.gpus) for n in self.registry.nodes.values()}
        changed = False
        for action in self.remedy.decide(now, marks, fleet):
            if isinstance(action, Cordon):
                if self.drainer.auto_cordon(action.node, action.reason):
                    what = "every replica there moves" if action.node_wide else (
                        f"replicas on GPU {', '.join(map(str, action.gpus))} move; the others stay")
                    self.record("remedy", f"node {action.node} cordoned automatically: {action.reason}: {what}",
                                action.node)
                    self.cordons.labels(_label(action.reason)).inc()
                    self._moves[action.node] = []
            elif isinstance(action, Uncordon):
                if self.drainer.auto_uncordon(action.node):
                    self.record("remedy", f"node {action.node} uncordoned automatically: {action.reason}", action.node)
                    self._moves.pop(action.node, None)
            elif isinstance(action, Report):
                self.record("remedy", f"node {action.node}: {action.reason}: not cordoned: {action.why}", action.node)
            elif isinstance(action, GpuOut):
                self.record("remedy", f"node {action.node} GPU {action.gpu} not placeable: {action.reason}",
                            action.node)
                changed = True
            elif isinstance(action, GpuBack):
                self.record("remedy", f"node {action.node} GPU {action.gpu} placeable again: {action.reason}",
                            action.node)
                changed = True
        if changed:
            self.reconciler.generation += 1  # a pass in progress re-reads usage
            self.wake()
        self._move_off(now)

    def _move_off(self, now: float) -> None:
        """Each auto-cordoned node with no move of ours in flight gets its next one (one at a time,
        as a drain does), for a replica on an affected GPU (any, for a node-wide finding)."""
        for node_id, record in self.drainer.marks.items():
            if mark_kind(record.who) != MarkKind.AUTO or node_id not in self.registry.nodes:
                continue
            asked = self._moves.setdefault(node_id, [])
            tried = moves_tried(self.reconciler, asked)
            if tried is None:
                continue
            gpus, node_wide = self.remedy.affected(node_id, len(self.registry.nodes[node_id].inventory.gpus))
            bad = set(gpus)
            for replica in sorted(self.reconciler.on_node(node_id), key=lambda r: (r.created_at, r.id)):
                if replica.id in tried or replica.state in LEAVING or replica.state not in (ReplicaState.READY,
                                                                                             ReplicaState.STARTING):
                    continue
                if not any(s.node == node_id and s.state in HOLDING and (node_wide or bad & set(s.gpus))
                           for s in replica.shards):
                    continue
                reason = f"auto-cordon of {node_id}: {record.who.removeprefix('auto: ')}"
                result = self.reconciler.request_move(replica.id, now, reason=reason, kind="remedy", avoid=[node_id],
                                                      no_room=NoRoom.FAIL)
                if isinstance(result, Move):
                    asked.append(result.id)
                    self.wake()
                    break
                log.info("remedy: %s", result)


def _label(reason: str) -> str:
    """A bounded label for the metric: "xid-79", "ecc", "nvlink", "health" or the check."""
    words = reason.split()
    if "Xid" in words and words.index("Xid") + 1 < len(words):
        return f"xid-{words[words.index('Xid') + 1]}"
    lowered = reason.lower()
    for key in ("ecc", "nvlink", "inventory"):
        if key in lowered:
            return key
    if reason.startswith("gpu "):
        return "health"
    return reason.split(":")[0][:32]
