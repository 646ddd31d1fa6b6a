"""The reconciler: desired (catalog) vs. actual (what agents report), and its *decide* step. Pure.

Level-triggered: `reconcile(nodes, now)` looks at the whole picture every time and returns
the Start/Stop messages to send; the server calls it on every change and on a tick. The
fleet is the source of truth (DESIGN.md): replicas are rebuilt from agents' reports after a
server restart (adoption) and forgotten when no agent reports them (disown).

Three parts, one job each: `states.py` (the shard and replica state machines), `observe.py`
(the *observe* step: Register, ShardStatus, a heartbeat's resync and node changes become the
observed state in a `ReplicaBook`, `replicas.py`) and this module (the *decide* step: counts,
placement, stops due).

Cost: a pass computes GPU and port usage once, not once per pending replica. A pass is a
generator (`steps`): it yields after each placement, and the driver lets the event loop run
between steps, so a pass placing a thousand replicas never holds the gateway or heartbeats.
Anything may change between two steps; every step re-checks what it acts on.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence

import msgspec

from llmgw.catalog.schema import Model, Profile
from llmgw.fabric.locality import Places
from llmgw.fabric.qpretry import qp_retry_window
from llmgw.placement import NodeCapacity, NoFit, Request, place
from llmgw.placement.multi import MultiPlacement, place_multi
from llmgw.placement.single import Placement
from llmgw.placement.spread import (
    SpreadModel,
    SpreadNode,
    SpreadReplica,
    crowded,
    decide,
    domain_of,
)
from llmgw.server.moves import NoRoom
from llmgw.server.replicas import (
    PAST_SHARDS,
    REFUSED_ENDPOINT,
    REFUSED_FOREIGN,
    Refusal,
    Replica,
    Settings,
    Shard,
)
from llmgw.server.rollout import Roller
from llmgw.server.states import (
    GONE,
    HOLDING,
    LEAVING,
    MOVE_ENDED,
    SERVING,
    Illegal,
    ReplicaState,
    ShardState,
)
from llmgw.wire import messages as m

__all__ = [
    "GONE", "HOLDING", "PAST_SHARDS", "REFUSED_ENDPOINT", "REFUSED_FOREIGN", "SERVING", "Action", "Illegal",
    "NodeInfo", "Reconciler", "Refusal", "Replica", "ReplicaState", "Settings", "Shard", "ShardState", "StartShard",
    "StopShard", "new_engine_key", "shard_spec",
]

_SURPLUS_ORDER = {ReplicaState.PENDING: 0, ReplicaState.FAILED: 1, ReplicaState.STARTING: 2, ReplicaState.READY: 3,
                  ReplicaState.DRAINING: 4, ReplicaState.STOPPING: 4}
AVOIDED = "not a place for this move"  # placement's reason for a node a move's successor avoids


class StartShard(msgspec.Struct, frozen=True):
    node: str
    spec: m.ShardSpec


class StopShard(msgspec.Struct, frozen=True):
    node: str
    shard_id: str
    grace: float
    reason: str
    drain: bool = False  # a move's retirement: Drain (in-flight requests finish), not Stop


Action = StartShard | StopShard


class NodeInfo(msgspec.Struct, kw_only=True):
    """The part of the node registry the reconciler needs."""

    node_id: str
    state: str
    connected: bool = True
    gpus: list[m.Gpu] = []
    features: list[str] = []
    version: str = ""
    # The host its engines are reached on (the server decides it: fleet.endpoint_host).
    endpoint_host: str = ""
    # Multi-node placement: fabrics usable now, why the other declared ones are not, and the
    # node's address (its endpoint host; rank 0's is a multi-node replica's master address).
    fabrics: list[str] = []
    fabric_notes: dict[str, str] = {}
    address: str = ""
    cordoned: bool = False  # no new placements (`ctl cordon`); what runs there stays
    fabric_devices: dict[str, list[str]] = {}  # usable fabric → its devices (where the fabric map is read)
    # The leaf switches its adapters are cabled to (the fabric map), for `placement.spread: leaves`.
    leaves: list[str] = []
    unplaceable: dict[int, str] = {}  # GPU → why it takes no new work (server/remedy.py)


class _Usage:
    """GPU and port usage of every node, computed once per pass and kept current as the pass
    places replicas; recomputed when something outside the pass changed the picture."""

    def __init__(self, nodes: Sequence[NodeInfo], replicas: Iterable[Replica], generation: int) -> None:
        self.generation = generation
        self.of_model: dict[str, dict[str, int]] = {}
        self.capacities: list[NodeCapacity] = [
            NodeCapacity(
                node_id=n.node_id,
                state=("cordoned" if n.cordoned and n.state == "ready" else n.state)
                if n.connected or n.state != "ready" else "unreachable",
                gpus=n.gpus,
                used_gpus=set(),
                used_ports=set(),
                can_start=m.FEATURE_START in n.features,
                version=n.version,
                fabrics=list(n.fabrics),
                fabric_notes=dict(n.fabric_notes),
                address=n.address,
                fabric_devices=n.fabric_devices,
                unplaceable=n.unplaceable,
            )
            for n in sorted(nodes, key=lambda n: n.node_id)
        ]
        self.by_node = {c.node_id: c for c in self.capacities}
        for replica in replicas:
            for shard in replica.shards:
                # A lost shard's engine may run on: its GPUs are not free on a node that is back
                # until the node has said (its Register, its next resync) whether it still runs.
                if shard.state in HOLDING or shard.state == ShardState.LOST:
                    self.hold(replica.model, shard.node, shard.gpus, shard.port)
                    if shard.rank == 0 and shard.spec is not None and shard.spec.master_port:
                        self.hold_port(shard.node, shard.spec.master_port)

    def hold_port(self, node_id: str, port: int) -> None:
        """A port taken besides a shard's own (rank 0's master port)."""
        capacity = self.by_node.get(node_id)
        if capacity is not None:
            capacity.used_ports.add(port)

    def hold(self, model: str, node_id: str, gpus: Iterable[int], port: int) -> None:
        capacity = self.by_node.get(node_id)
        if capacity is not None:
            capacity.used_gpus.update(gpus)
            capacity.used_ports.add(port)
        per_node = self.of_model.setdefault(model, {})
        per_node[node_id] = per_node.get(node_id, 0) + 1

    def for_model(self, model: str) -> list[NodeCapacity]:
        counts = self.of_model.get(model, {})
        for capacity in self.capacities:
            capacity.replicas_of_model = counts.get(capacity.node_id, 0)
        return self.capacities


def new_engine_key() -> str:
    """A shard's engine API key: 256 random bits, URL-safe (it travels in a header)."""
    return secrets.token_urlsafe(32)


class Reconciler(Roller):
    def __init__(self, models: Sequence[Model], settings: Settings, rng: random.Random | None = None,
                 new_key: Callable[[], str] = new_engine_key) -> None:
        super().__init__(settings, rng)
        self.new_key = new_key
        # The fabric map's view for multi-node placement (leaf locality, short cables); the
        # driver sets the latest before each pass. None: no map, nodes placed as if it said nothing.
        self.places: Places | None = None
        self.models: dict[str, Model] = {}
        self._profiles: dict[str, frozenset[str]] = {}  # model → its profile names (a pass asks once per replica)
        self.spread_moved_at: dict[str, float] = {}  # model → when its last spread move was asked (the cooldown)
        self._spread_no_room: dict[str, tuple[int, int]] = {}  # model → the picture in which no node had room
        # (replica, node) → when that node's fabric stopped being usable under the replica (a rail
        # down): it keeps serving for NCCL's queue-pair retry window (llmgw.fabric.qpretry).
        self._rail_down_since: dict[tuple[str, str], float] = {}
        self.set_catalog(models)

    def set_catalog(self, models: Sequence[Model]) -> None:
        self.generation += 1
        self.models = {model.name: model for model in models}
        self._profiles = {model.name: frozenset(p.name for p in model.profiles) for model in models}

    def drain_illegal(self) -> list[Illegal]:
        out, self.illegal = self.illegal, []
        return out

    # -- the loop body -------------------------------------------------------------------------

    def reconcile(self, nodes: Sequence[NodeInfo], now: float) -> list[Action]:
        """One whole pass at once (tests, tools): the actions `steps` yields."""
        return [action for action in self.steps(nodes, now) if action is not None]

    def steps(self, nodes: Sequence[NodeInfo], now: float) -> Iterator[Action | None]:
        """One pass as a generator of actions; `None` marks a unit of work done, where the
        driver may let others run (and change the picture) before it asks for the next."""
        by_id = {n.node_id: n for n in nodes}
        for n in nodes:
            if n.endpoint_host:
                self.endpoint_hosts[n.node_id] = n.endpoint_host
        self._spread(nodes, now)  # before the moves advance: a spread move asked now surges in this pass
        self._keep_lost(now)  # lost.py: a move for each replica serving on with a shard on a lost node
        self._advance_moves(now)  # first: a failed successor is seen failed, before its backoff ends
        self._roll(self.models, now)  # rolling replacement: a move for the next replica that runs an old spec
        self._advance_moves(now)  # and its surge, placed in this pass
        # Failed replicas whose backoff passed go back to pending (their shards are gone).
        for replica in self.replicas.values():
            if replica.state == ReplicaState.FAILED and now >= replica.next_attempt_at and replica.gone():
                self._replica_to(replica, ReplicaState.PENDING, now, replica.reason, "backoff over")
        # Anything whose model or profile left the catalog is stopped.
        for replica in list(self.replicas.values()):
            if replica.state in LEAVING:
                continue
            model = self.models.get(replica.model)
            if model is None:
                self.stop_replica(replica, now, f"model {replica.model} left the catalog")
            elif (replica.profile and replica.state != ReplicaState.PENDING
                  and replica.profile not in self._profiles[model.name]):
                self.stop_replica(replica, now, f"profile {replica.profile} left model {replica.model}")
        # Counts: add missing replicas, stop surplus ones (a step every 100 models).
        for i, model in enumerate(list(self.models.values())):
            if i % 100 == 99:
                yield None
            ids = self._of_model.get(model.name, ())
            # A move's successor counts once its old replica leaves (moves.py), not while it surges.
            active = [r for r in map(self.replicas.__getitem__, ids) if r.state not in LEAVING and not r.replaces]
            for _ in range(model.replicas - len(active)):
                rid = self._new_id(model.name)
                self._put(Replica(id=rid, model=model.name, created_at=now, state_since=now))
                self.log.append(f"new replica {rid} for {model.name}")
            if len(active) > model.replicas:
                # Stopped first: a replica that exists only because a node reused another's id,
                # then by state, then the one this server saw last (never a claimed start time).
                active.sort(key=lambda r: (not r.claimed, _SURPLUS_ORDER[r.state], -r.seen_at, r.id))
                for replica in active[: len(active) - model.replicas]:
                    if replica.state == ReplicaState.PENDING or replica.gone():
                        self._pop(replica.id)
                        self.log.append(f"dropped surplus replica {replica.id}")
                    else:
                        self.stop_replica(replica, now, f"surplus: {model.name} wants {model.replicas}")
        self._multinode_checks(by_id, now)
        # Place pending replicas, oldest first; one step each.
        pending = sorted((r for r in self.replicas.values() if r.state == ReplicaState.PENDING),
                         key=lambda r: (r.created_at, r.id))
        usage: _Usage | None = None
        for replica in pending:
            if (replica.state != ReplicaState.PENDING or self.replicas.get(replica.id) is not replica
                    or replica.model not in self.models):
                continue  # changed while the pass let others run
            if not replica.gone():
                continue  # a rank back from a lost node after it was given up: placed again once that one has stopped
            if usage is None or usage.generation != self.generation:
                usage = _Usage(nodes, self.replicas.values(), self.generation)
            starts = self._place(replica, usage, now)
            if not starts:
                yield None
            yield from starts  # rank 0 first: every rank's spec already names its address
        self._advance_moves(now)  # a successor that found no room is seen in this pass
        # Send stops that are due: a shard marked stopping on a connected node.
        for replica in list(self.replicas.values()):
            for shard in replica.shards:
                if shard.state == ShardState.STOPPING and not shard.stop_sent:
                    node = by_id.get(shard.node)
                    if node is not None and node.connected and node.state == "ready":
                        grace = shard.spec.stop_grace if shard.spec else 5.0
                        shard.stop_sent = True
                        yield StopShard(shard.node, shard.shard_id, grace, shard.reason, drain=shard.drain)
                    elif node is None or node.state == "lost":
                        self._shard_to(shard, ShardState.LOST, f"node {shard.node} gone while stopping")
                        self._maybe_forget(replica)
            if replica.state == ReplicaState.STOPPING:
                self._maybe_forget(replica)

    def _spread(self, nodes: Sequence[NodeInfo], now: float) -> None:
        """Spreading as a standing rule (placement/spread.py decides, issue 18): one replica of
        a model whose replicas share a node (or a leaf) while another node could take one is
        moved by the move primitive (moves.py: successor first, then the old one drained).

        Cost, in a pass with nothing to move: one look at each replica of a model wanting 2+
        (1,000 two-replica models over 1,000 nodes: 0.65 ms beside a 2.0 ms pass; building the
        decision's inputs for every model, as first written, took 2.5 ms). Placement is asked only for the models
        the decision would move, and asked again for one that had no room only once the
        replicas or the nodes changed."""
        mode = self.settings.spread
        if mode == "off":
            return
        cooldown = self.settings.spread_cooldown
        fleet: list[SpreadNode] | None = None
        domain: dict[str, str] = {}
        if mode == "leaves":
            fleet = self._spread_nodes(nodes)
            domain = {n.node_id: domain_of(n, n.node_id, mode) for n in fleet}
        busy: set[str] | None = None
        models: list[SpreadModel] = []
        replicas, holding_states = self.replicas, (ReplicaState.STARTING, ReplicaState.READY)
        for model in self.models.values():
            ids = self._of_model.get(model.name, ())
            if model.replicas < 2 or len(ids) < 2:
                continue
            held = [r.shards[0].node for r in map(replicas.__getitem__, ids)
                    if r.state in holding_states and len(r.shards) == 1]
            if domain:
                held = [domain.get(node, node) for node in held]
            if len(set(held)) == len(held):
                continue  # nothing shares a node (a leaf): the common case, without allocating the decision's inputs
            last = self.spread_moved_at.get(model.name)
            if busy is None:
                busy = {mv.model for mv in self.moves.values() if mv.state not in MOVE_ENDED}
            if model.name in busy or (last is not None and now - last < cooldown):
                continue
            holding = tuple(
                SpreadReplica(id=r.id, nodes=tuple(sorted({s.node for s in r.shards})),
                              ready=r.state == ReplicaState.READY)
                for r in map(self.replicas.__getitem__, ids)
                if r.state in (ReplicaState.STARTING, ReplicaState.READY) and not r.replaces and r.shards)
            models.append(SpreadModel(name=model.name, desired=model.replicas, replicas=holding, last_move_at=last))
        if not models:
            return
        if fleet is None:
            fleet = self._spread_nodes(nodes)
        # What a no-room answer depends on: the replicas (generation) and each node's readiness,
        # cordon and leaves (a node the fabric map moves to another leaf may become a target).
        picture = (self.generation, hash(tuple((n.node_id, n.ready, n.cordoned, n.leaves) for n in fleet)))
        names = [name for name in crowded(models, fleet, mode, now, cooldown)
                 if self._spread_no_room.get(name) != picture]
        if not names:
            return
        usage = _Usage(nodes, self.replicas.values(), self.generation)
        fits = {name: self._fits(name, usage) for name in names}
        moves = decide([x for x in models if x.name in fits], fleet, mode, now, fits, cooldown)
        for name in set(names) - {mv.model for mv in moves}:
            self._spread_no_room[name] = picture  # not again until something changes
        for move in moves:
            self._spread_no_room.pop(move.model, None)
            asked = self.request_move(move.replica, now, reason=move.reason, kind="spread", avoid=move.avoid,
                                      no_room=NoRoom.FAIL)
            if isinstance(asked, str):
                self.log.append(f"spread of {move.model} not asked: {asked}")
                continue
            self.spread_moved_at[move.model] = now
            self.log.append(f"move {asked.id} asked: {move.reason}")

    @staticmethod
    def _spread_nodes(nodes: Sequence[NodeInfo]) -> list[SpreadNode]:
        return [SpreadNode(node_id=n.node_id, ready=n.state == "ready" and n.connected, cordoned=n.cordoned,
                           leaves=tuple(n.leaves)) for n in nodes]

    def _fits(self, model_name: str, usage: _Usage) -> list[str]:
        """The nodes where one more single-node replica of the model fits now (any of its profiles)."""
        model = self.models[model_name]
        out = []
        for capacity in usage.for_model(model_name):
            for profile in model.profiles:
                if profile.nodes > 1:
                    continue
                req = Request(replica_id=f"{model_name}.spread", gpus=profile.gpus, gpu_kind=profile.gpu_kind,
                              gpu_memory_mib=profile.gpu_memory_mib)
                if isinstance(place(req, [capacity], self.settings.port_range), Placement):
                    out.append(capacity.node_id)
                    break
        return out

    def _multinode_checks(self, by_id: dict[str, NodeInfo], now: float) -> None:
        """A multi-node replica whose fabric is no longer usable on one of its nodes (a cable
        pulled, a subnet manager gone, one rail of four INIT) keeps serving for NCCL's queue-pair
        retry window (34 s with NCCL's defaults; its engine's health decides sooner if its
        collectives fail): a port back within it cost a stall. Past it the replica fails and is
        placed again where the fabric is whole. One adopted with ranks that no node reported
        (after the settle period, when every node that was there has re-registered) fails too:
        a replica missing a rank never serves."""
        down_before, self._rail_down_since = self._rail_down_since, {}
        for replica in self.multinode():  # indexed: a pass over single-node replicas pays nothing here
            if replica.state not in (ReplicaState.STARTING, ReplicaState.READY):
                continue
            world = max((s.spec.world for s in replica.shards if s.spec is not None), default=1)
            if world <= 1:
                continue
            missing = sorted(set(range(world)) - {s.rank for s in replica.shards})
            if missing:
                self._fail(replica, now, f"rank(s) {missing} of {world} not reported by any node", [], penalty=False)
                continue
            for shard in replica.shards:
                fabric = shard.spec.fabric if shard.spec is not None else ""
                node = by_id.get(shard.node)
                if (fabric and node is not None and node.connected and node.state == "ready"
                        and fabric not in node.fabrics):
                    key = (replica.id, shard.node)
                    since = self._rail_down_since[key] = down_before.get(key, now)
                    grace = qp_retry_window(shard.spec.env if shard.spec is not None else {})
                    if now - since < grace:
                        continue
                    why = node.fabric_notes.get(fabric, "no longer advertised")
                    self._fail(replica, now, f"{shard.node}: fabric {fabric} is no longer usable ({why}) for "
                                             f"{now - since:.0f}s, past NCCL's {grace:.0f}s retry window",
                               [], penalty=False)
                    break

    def _place(self, replica: Replica, usage: _Usage, now: float) -> list[StartShard]:
        model = self.models[replica.model]
        if not model.profiles:
            replica.reason = f"model {model.name} has no profiles"
            return []
        capacities = usage.for_model(model.name)
        if replica.avoid:
            capacities = [msgspec.structs.replace(c, state=AVOIDED)
                          if c.node_id in replica.avoid and c.state == "ready" else c
                          for c in capacities]  # a lost node avoided says "lost"
        replaced = self.replicas.get(replica.replaces) if replica.replaces else None
        if replaced is not None:
            # A successor does not count the replica it replaces (that one leaves once this one
            # is ready): a rollout keeps its replicas spread instead of stacking successors on
            # the fullest node, which spreading would then have to undo with a move of its own.
            leaving = {s.node for s in replaced.shards}
            capacities = [msgspec.structs.replace(c, replicas_of_model=c.replicas_of_model - 1)
                          if c.node_id in leaving else c
                          for c in capacities]
        reasons: list[str] = []
        attempt = replica.attempt + 1
        for profile in model.profiles:
            if profile.nodes > 1:
                multi = place_multi(Request(replica_id=f"{replica.id}.{attempt}", gpus=profile.gpus,
                                            gpu_kind=profile.gpu_kind, gpu_memory_mib=profile.gpu_memory_mib),
                                    profile.nodes, capacities, self.settings.port_range, self.places)
                if isinstance(multi, NoFit):
                    prefix = f"profile {profile.name}: " if len(model.profiles) > 1 else ""
                    reasons.append(prefix + multi.summary())
                    continue
                return self._placed_multi(replica, model, profile, multi, attempt, usage, now)
            shard_id = f"{replica.id}.{attempt}"
            result = place(
                Request(replica_id=shard_id, gpus=profile.gpus, gpu_kind=profile.gpu_kind,
                        gpu_memory_mib=profile.gpu_memory_mib),
                capacities,
                self.settings.port_range,
            )
            if isinstance(result, NoFit):
                prefix = f"profile {profile.name}: " if len(model.profiles) > 1 else ""
                reasons.append(prefix + result.summary())
                continue
            spec = shard_spec(model, profile, replica.id, shard_id, list(result.gpus), result.port, self.new_key())
            replica.attempt = attempt
            replica.profile = profile.name
            replica.profile_order = [p.name for p in model.profiles]
            replica.placement = []
            self._remember_past(replica)
            self._set_shards(replica, [
                Shard(
                    shard_id=shard_id,
                    node=result.node_id,
                    gpus=list(result.gpus),
                    port=result.port,
                    started_at=now,
                    seen_at=now,
                    spec=spec,
                )
            ])
            usage.hold(model.name, result.node_id, result.gpus, result.port)
            self._replica_to(replica, ReplicaState.STARTING, now, "", "placed")
            self.log.append(f"placed {shard_id} ({model.name}/{profile.name}) on {result.node_id} "
                            f"GPUs {list(result.gpus)} port {result.port}")
            return [StartShard(result.node_id, spec)]
        waiting = "; ".join(reasons)
        if replica.failures and replica.reason and not replica.reason.startswith("no placement"):
            waiting = f"{waiting} (last failure: {replica.reason})" if waiting else replica.reason
        self._replica_to(replica, ReplicaState.PENDING, now, f"no placement: {waiting}" if reasons else waiting,
                         "no placement")
        return []

    def _remember_past(self, replica: Replica) -> None:
        for old in replica.shards:
            replica.past[old.shard_id] = (old.node, old.seen_at)
        for stale in list(replica.past)[: max(0, len(replica.past) - PAST_SHARDS)]:
            del replica.past[stale]

    def _placed_multi(self, replica: Replica, model: Model, profile: Profile, multi: MultiPlacement, attempt: int,
                      usage: _Usage, now: float) -> list[StartShard]:
        """A shard per node, rank 0 first; each spec carries the master address and port."""
        world = len(multi.ranks)
        shards: list[Shard] = []
        for rank, placed in enumerate(multi.ranks):
            shard_id = f"{replica.id}.{attempt}.{rank}"
            spec = msgspec.structs.replace(
                shard_spec(model, profile, replica.id, shard_id, list(placed.gpus), placed.port, self.new_key()),
                rank=rank, world=world, master_addr=multi.master_addr, master_port=multi.master_port,
                fabric=multi.fabric, engine_mode="ray" if profile.engine_mode == "ray" else "",
            )
            shards.append(Shard(shard_id=shard_id, node=placed.node_id, rank=rank, gpus=list(placed.gpus),
                                port=placed.port, started_at=now, seen_at=now, spec=spec))
            usage.hold(model.name, placed.node_id, placed.gpus, placed.port)
        usage.hold_port(multi.ranks[0].node_id, multi.master_port)
        replica.attempt = attempt
        replica.profile = profile.name
        replica.profile_order = [p.name for p in model.profiles]
        replica.placement = list(multi.notes)
        self._remember_past(replica)
        self._set_shards(replica, shards)
        self._replica_to(replica, ReplicaState.STARTING, now, "", "placed")
        where = ", ".join(f"rank {s.rank} {s.node} GPUs {s.gpus} port {s.port}" for s in shards)
        self.log.append(f"placed {replica.id}.{attempt} ({model.name}/{profile.name}) on fabric {multi.fabric}: "
                        f"{where}; master {multi.master_addr}:{multi.master_port}"
                        + "".join(f"; {note}" for note in multi.notes))
        return [StartShard(s.node, s.spec) for s in shards if s.spec is not None]

    def next_deadline(self) -> float | None:
        """When a backoff expires next (the driver wakes then, besides its tick)."""
        # Only a replica that can go back to pending then: one whose shards are still being
        # stopped waits for that (a status wakes the loop), not for a deadline already past.
        times = [
            r.next_attempt_at
            for r in self.replicas.values()
            if r.state == ReplicaState.FAILED and r.gone()
        ]
        kept = self.kept_deadline()
        if kept is not None:
            times.append(kept)
        return min(times) if times else None

    def drain_log(self) -> list[str]:
        out, self.log = self.log, []
        return out


def shard_spec(model: Model, profile: Profile, replica_id: str, shard_id: str, gpus: list[int], port: int,
               api_key: str = "") -> m.ShardSpec:
    return m.ShardSpec(
        shard_id=shard_id,
        replica_id=replica_id,
        model=model.name,
        profile=profile.name,
        engine=profile.engine,
        source=profile.source or model.source or model.name,
        sha256=profile.sha256,
        allow_redirect_hosts=list(dict.fromkeys([*model.allow_redirect_hosts, *profile.allow_redirect_hosts])),
        rank=0,
        world=1,
        gpus=gpus,
        host="",
        port=port,
        args=list(profile.args),
        command=list(profile.command),
        env=dict(profile.env),
        health_path=profile.health_path,
        start_timeout=float(profile.start_timeout),
        stop_grace=float(profile.stop_grace),
        served_name=model.name,
        api_key=api_key,
    )
