"""The reconciler's driver: feeds it what the fleet says, runs it, and sends its decisions.

Runs on every change and on a tick (level-triggered). New placements wait for a short settle
period after the server starts, so that agents reconnecting after a restart report their
engines (adoption) before anything new is placed beside them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence

import trio
import trio.lowlevel

from llmgw.catalog.schema import Model, PlacementSettings, ReconcileSettings
from llmgw.fabric.declared import fabric_devices, placement_view
from llmgw.fabric.locality import Places
from llmgw.server.known_nodes import KnownNodes
from llmgw.server.links import Links
from llmgw.server.reconcile import NodeInfo, Reconciler, Refusal, Settings, StartShard, StopShard
from llmgw.server.registry import NodeRegistry, Transition
from llmgw.server.settling import Ended, SettlePlan, SettleState
from llmgw.server.wakeup import Wakeup
from llmgw.server.weights import WeightsBoard
from llmgw.wire import messages as m
from llmgw.wire.ids import printable

log = logging.getLogger("llmgw.server.reconcile")

STEP_BUDGET = 0.005  # seconds of reconcile work between two chances for everything else to run


def make_reconciler(models: Sequence[Model], settings: ReconcileSettings, rng: random.Random | None = None,
                    placement: PlacementSettings | None = None) -> Reconciler:
    """The reconciler for a catalog and the config's reconcile and placement sections."""
    placement = placement or PlacementSettings()
    return Reconciler(
        models,
        Settings(
            backoff_initial=float(settings.backoff_initial),
            backoff_max=float(settings.backoff_max),
            port_range=settings.port_range,
            spread=placement.spread_mode,
            spread_cooldown=float(placement.spread_cooldown),
        ),
        rng,
    )


class Settle:
    """The settle period after a start (llmgw.server.settling.SettlePlan, the pure state): nothing
    new is placed, and the gateways are told the endpoint set is not rebuilt yet, until every
    node known before has re-registered, or `reconcile.settle_max` has passed (a first start:
    its `expect_nodes`, or `reconcile.settle`)."""

    def __init__(self, settings: ReconcileSettings, registry: NodeRegistry, known: KnownNodes | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.known = known
        self.plan = SettlePlan(now=0.0, known=(), expect=(), settle=0.0, settle_max=0.0)  # settled until start()

    @property
    def settled(self) -> bool:
        return not self.plan.settling

    def start(self, now: float) -> None:
        known = set(self.known.ids) if self.known is not None else set()  # as of this start
        # expect_nodes is for a first start; after one, every node seen is known (and a lost
        # one, dropped from the known nodes, is not waited for because the config names it).
        plan = self.plan = SettlePlan(now=now, known=known, expect=self.settings.expect_nodes,
                                      settle=float(self.settings.settle), settle_max=float(self.settings.settle_max))
        if not plan.settling:
            return
        if known:
            log.info("settling: waiting up to %gs for %d known nodes to report their engines before placing replicas; "
                     "gateways keep their last endpoint set until then", plan.bound, len(plan.awaited))
        elif plan.awaited:
            log.info("first start: waiting up to %gs for %d expected nodes to register before placing replicas",
                     plan.bound, len(plan.awaited))
        else:
            log.info("first start: waiting %gs for nodes to register before placing replicas", plan.bound)

    def _connected(self) -> set[str]:
        return {n.id for n in self.registry.nodes.values() if n.connected}

    def note(self, now: float) -> str:
        """Why nothing new is placed yet, while the settle period holds placements; else ""."""
        return self.plan.note(now, self._connected()) if self.plan.settling else ""

    def left(self, now: float) -> float:
        """Seconds to wait before placing anything (0: settled; the transition is logged once)."""
        plan = self.plan
        if not plan.settling:
            return 0.0
        if plan.step(now, self._connected()) is SettleState.SETTLED:
            if plan.ended is Ended.ALL_BACK:
                log.info("settled %.1fs after the start: all %d known nodes have registered; placing replicas",
                         now - plan.started_at, len(plan.awaited))
            elif plan.missing_at_end:
                log.info("settled at the %gs bound; not waiting for %s", plan.bound,
                         ", ".join(sorted(plan.missing_at_end)))
            else:
                log.info("settle period over; placing replicas")
            return 0.0
        return max(plan.left(now), 0.01)

    def forget(self, node_id: str) -> None:
        """The node is gone for good: this settle period does not wait for it."""
        self.plan.forget(node_id)


class Controller:
    """Built from its parts (composition root: server/app.py): the reconciler, the settle period,
    the node registry, the live streams by node (read only: the fleet service adds and removes
    them, server/links.py), and what to call after every pass."""

    def __init__(
        self,
        reconciler: Reconciler,
        registry: NodeRegistry,
        *,
        settle: Settle,
        links: Links,
        known: KnownNodes | None = None,
        on_pass: Callable[[], None] = lambda: None,  # after every pass (the gateway syncs endpoints)
        on_refused: Callable[[str], None] = lambda reason: None,  # counts a refused message by reason (metrics)
        weights: WeightsBoard | None = None,
        places: Callable[[], Places | None] = lambda: None,  # the fabric map's latest view (fabric_service)
        cordoned: Callable[[], set[str]] = set,  # nodes that take no new placements (drain.py)
        unplaceable: Callable[[], dict[str, dict[int, str]]] = dict,  # node → GPU → why not (remedy_service.py)
        wakeup: Wakeup | None = None,  # who asks for a pass now (the drainer, the remedy service), server/wakeup.py
    ) -> None:
        self.cordoned = cordoned
        self.unplaceable = unplaceable
        self.registry = registry
        self.known = known
        self.settings = settle.settings
        self.reconciler = reconciler
        self.settle = settle
        self.links = links
        self.on_pass = on_pass
        self.on_refused = on_refused
        self.weights = weights if weights is not None else WeightsBoard()  # downloads of starting shards (Progress)
        self.places = places
        self._refusals_logged: set[tuple[str, str]] = set()
        self.wakeup = wakeup if wakeup is not None else Wakeup()
        self.passes = 0

    # -- FleetObserver --------------------------------------------------------------------------

    def node_registered(self, node_id: str, msg: m.Register) -> None:
        if self.known is not None:
            self.known.add(node_id)
        node = self.registry.get(node_id)
        host = node.endpoint_host if node is not None else ""
        self._refused(self.reconciler.on_register(node_id, msg.shards, trio.current_time(), time.time(),
                                                  endpoint_host=host))
        self.wake()

    def fabrics_changed(self, node_id: str) -> None:
        """A node's usable fabrics changed: multi-node placement and the replicas on it are
        re-decided now, not at the next tick."""
        self.wake()

    def node_disconnected(self, node_id: str) -> None:
        self.wake()

    def node_forgotten(self, node_id: str) -> None:
        """The operator said the node is gone for good: its shards are lost, and neither this
        settle period nor the next start waits for it."""
        if self.known is not None:
            self.known.remove(node_id)
        self.settle.forget(node_id)
        self.reconciler.on_node_gone(node_id, trio.current_time())
        self.wake()

    def shard_status(self, node_id: str, msg: m.ShardStatus) -> None:
        refused = self.reconciler.on_shard_status(node_id, msg, trio.current_time())
        self._refused(refused)
        if not refused:
            self.weights.clear(msg.shard_id)  # a real state change ends what the download showed
        self.wake()

    def progress(self, node_id: str, msg: m.Progress) -> None:
        """A download's bytes (issue 12): shown and counted, never a state change (no wake)."""
        refused = self.reconciler.on_progress(node_id, msg, trio.current_time())
        self._refused(refused)
        if not refused and self.reconciler.owner(msg.shard_id) is not None:
            self.weights.update(node_id, msg, trio.current_time())

    def shard_resync(self, node_id: str, shards: list[m.ShardReport]) -> None:
        """A heartbeat's full shard list (level-triggered resync): a pass only when it changed something."""
        refused, changed = self.reconciler.on_resync(node_id, shards, trio.current_time(), time.time())
        self._refused(refused)
        if changed:
            log.info("node %s: resync found the server's view of its shards out of date; healed", node_id)
            self.wake()

    def _refused(self, refusals: list[Refusal]) -> None:
        """Count every refusal; log the first of each kind per node (a hostile node must not
        flood the log, and the count says how many followed). Illegal state transitions the
        reports asked for are logged here too."""
        self._log_illegal()
        for refusal in refusals:
            self.on_refused(refusal.reason)
            key = (refusal.node, refusal.reason)
            if key not in self._refusals_logged:
                self._refusals_logged.add(key)
                log.warning("%s (further %s refusals from %s are only counted: llmgw_fleet_refused_total)",
                            refusal.detail, refusal.reason, refusal.node)

    def transitions(self, items: list[Transition]) -> None:
        now = trio.current_time()
        for t in items:
            self.reconciler.on_node_state(t.node_id, t.new, now)
            if t.new == "lost" and self.known is not None:
                # A restarted server must not wait out its settle period for a node already
                # lost (8 s of 503s with the default settle, issue 9); it is known again once
                # it registers.
                self.known.remove(t.node_id)
            if t.new == "lost":
                self.settle.forget(t.node_id)  # nor does this settle period wait for it
        self.wake()

    # -- driving -------------------------------------------------------------------------------------

    def wake(self) -> None:
        self.wakeup.wake()

    def set_catalog(self, models: Sequence[Model]) -> None:
        before = set(self.reconciler.models)
        self.reconciler.set_catalog(models)
        after = set(self.reconciler.models)
        log.info("catalog: %d models (added: %s; removed: %s)", len(after),
                 ", ".join(sorted(after - before)) or "none", ", ".join(sorted(before - after)) or "none")
        self.wake()

    def set_placement(self, placement: PlacementSettings) -> None:
        """A reload's placement section takes effect at once (spreading off during an incident)."""
        settings = self.reconciler.settings
        new = (placement.spread_mode, float(placement.spread_cooldown))
        if (settings.spread, settings.spread_cooldown) != new:
            log.info("placement: spread %s, cooldown %gs", *new)
            settings.spread, settings.spread_cooldown = new
            self.wake()

    def nodes(self) -> list[NodeInfo]:
        out = []
        cordoned = self.cordoned()
        unplaceable = self.unplaceable()
        # placement.spread: leaves reads the leaf switches each node's adapters are cabled to.
        places = self.places() if self.reconciler.settings.spread == "leaves" else None
        by_node = places.by_node if places is not None else {}
        for n in self.registry.nodes.values():
            fabrics, notes = placement_view(n.fabrics, n.fabric_status, list(n.ports.values()))
            out.append(NodeInfo(
                node_id=n.id,
                state=n.state,
                connected=n.connected,
                gpus=n.inventory.gpus,
                features=n.features,
                version=n.version,
                endpoint_host=n.endpoint_host,
                fabrics=fabrics,
                fabric_notes=notes,
                # The master address of a multi-node replica whose rank 0 runs here: the host its
                # engines are reached on (advertise_host), the address its agent derives its ranks'
                # NCCL/Gloo interface from (issue 38: one address, not the route to the server).
                address=n.endpoint_host,
                fabric_devices=fabric_devices(n.fabric_status),
                cordoned=n.id in cordoned,
                unplaceable=unplaceable.get(n.id, {}),
                leaves=sorted({place.leaf_name for place in by_node.get(n.id, {}).values()}),
            ))
        return out

    async def run(self) -> None:
        self.settle.start(trio.current_time())
        while True:
            now = trio.current_time()
            settle_left = self.settle.left(now)
            if settle_left <= 0:
                await self.run_once()
            else:
                # Nothing is placed yet, but engines adopted from re-registered nodes serve at
                # once: the gateway learns of every ready replica now, not after the settle.
                self.on_pass()
            timeout = float(self.settings.tick)
            deadline = self.reconciler.next_deadline()
            if deadline is not None:
                timeout = min(timeout, max(deadline - now, 0.01))
            if settle_left > 0:
                timeout = min(timeout, settle_left)
            with trio.move_on_after(timeout):
                await self.wakeup.wait()
            # Let a burst of changes (a whole node registering) land before the next pass.
            await trio.lowlevel.checkpoint()

    async def run_once(self) -> None:
        """One pass, in steps: after any stretch of work longer than STEP_BUDGET the gateway,
        the API and the fleet streams get their turn (a pass placing 1,000 replicas on 1,000
        nodes takes seconds of CPU; it must never arrive as one block)."""
        last = time.perf_counter()
        self.reconciler.places = self.places()  # a reference: the fabric service builds it off the loop
        for action in self.reconciler.steps(self.nodes(), trio.current_time()):
            if action is not None:
                self._send(action)
            if time.perf_counter() - last > STEP_BUDGET:
                self._log_decisions()  # a thousand placements are a thousand lines: in pieces too
                await trio.lowlevel.checkpoint()
                last = time.perf_counter()
        self.passes += 1
        self._log_decisions()
        self.on_pass()
        # The gateway has synced: replicas a move retires are out of its rotation now, and may
        # be drained on the next pass (at once: a wake).
        if self.reconciler.rotation_synced():
            self.wake()

    def _log_decisions(self) -> None:
        self._log_illegal()
        for line in self.reconciler.drain_log():
            log.info("%s", printable(line))  # lines carry engine exit reasons a node sent

    def _log_illegal(self) -> None:
        for illegal in self.reconciler.drain_illegal():
            log.warning("%s", printable(illegal.line()))  # states may be text a node sent

    def _send(self, action: StartShard | StopShard) -> None:
        session = self.links.get(action.node)
        if session is None:
            log.warning("cannot send to %s: no stream (it will be retried when the node registers)", action.node)
            return
        shard_id = action.spec.shard_id if isinstance(action, StartShard) else action.shard_id
        owner = self.reconciler.owner(shard_id)
        if owner != action.node:
            # A node is sent requests only for its own shards (issue 19); the decisions never
            # mix them up, and this keeps a future one that does from reaching the wrong node.
            log.error("not sending %s for shard %s to %s: the shard is %s", type(action).__name__, shard_id,
                      action.node, f"on {owner}" if owner else "unknown")
            return
        if isinstance(action, StartShard):
            if not session.supports(m.FEATURE_START):
                log.warning("node %s: agent cannot start engines (too old?); not sending Start", action.node)
                return
            session.send(m.Start(spec=action.spec))
        elif action.drain and session.supports(m.FEATURE_DRAIN):
            session.send(m.Drain(shard_id=action.shard_id, reason=action.reason, grace=action.grace))
        else:
            if not session.supports(m.FEATURE_STOP):
                log.warning("node %s: agent cannot stop engines (too old?); not sending Stop", action.node)
                return
            session.send(m.Stop(shard_id=action.shard_id, grace=action.grace, reason=action.reason))
