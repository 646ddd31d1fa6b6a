"""Read models: what the JSON API and the gateway may see of the control plane, typed.

`FleetReads` is what `api.py` reads (nodes, replicas, models, the gateway's endpoints), each as
the view struct the API encodes; `GatewayFeed` is what the gateway learns (the ready endpoints
of every model with their engine keys, and why a model has none, for its 503). Neither changes
anything: changes are operator actions (`operator.py`). New reads (the admin pages, fabrics,
doctor's findings) get a method here and a view struct beside these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from llmgw.catalog.sources import shown
from llmgw.server.control import Settle
from llmgw.server.fabric_service import FabricService
from llmgw.server.gateway.enginemetrics import EngineLoad
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.gwfeed import GatewayFeedService, GatewayView
from llmgw.server.last_endpoints import Entry, LastEndpoints
from llmgw.server.moves import Move
from llmgw.server.reconcile import Reconciler, Replica, ReplicaState
from llmgw.server.registry import Node, NodeRegistry
from llmgw.server.restart import MoveOutcome, move_outcome
from llmgw.server.rollout import Rollout
from llmgw.server.weights import ProgressView, WeightsBoard
from llmgw.wire import messages as m

log = logging.getLogger("llmgw.server")


class NodeView(msgspec.Struct, kw_only=True):
    """A node as `GET /api/v1/nodes` shows it."""

    id: str
    state: str
    reason: str
    state_since: float
    connected: bool
    address: str
    version: str
    last_heartbeat_age: float | None
    gpus: int
    gpu_name: str
    gpu_source: str
    gpu_note: str
    fabrics: list[str]
    ports: int
    ports_active: int
    identity: str | None
    cert_days_left: float | None
    features: list[str]
    # Every declared fabric's verdict (usable or not, and why), and each port's current state.
    fabric_status: list[m.FabricStatus] = []
    port_states: list[PortState] = []
    mgmt_interface: str = ""
    heartbeats: int = 0  # received from this node since the server started
    mark: str = ""  # cordoned | draining (`ctl cordon`, `ctl drain`): no new placements
    # GPU index (as a string: JSON keys) → why it takes no new work (issue 43, server/remedy.py).
    unplaceable: dict[str, str] = {}


class PortState(msgspec.Struct, kw_only=True):
    port: str  # "mlx5_0/1"
    state: str
    phys_state: str
    rate_gbps: float


class NodeDetail(NodeView, kw_only=True):
    inventory: m.Inventory | None = None
    # The latest heartbeat's reading of each port, counters included (None: "N/A (no PMA)").
    port_readings: list[m.PortCounters] = []
    # The latest heartbeat's reading of each GPU: temperature, utilisation, memory used, ECC, Xid.
    gpu_health: list[m.GpuHealth] = []


class ShardView(msgspec.Struct, kw_only=True):
    shard_id: str
    node: str
    rank: int
    gpus: list[int]
    port: int
    state: str
    endpoint: str
    pid: int
    exit_code: int | None
    reason: str
    launch_env: list[m.EnvSetting] = []


class MoveView(msgspec.Struct, kw_only=True):
    """A replica's unfinished move (moves.py), as `ctl replicas` shows it."""

    id: int
    kind: str  # drain | rollout | spread | lost | move
    state: str  # queued | surging | below | retiring
    role: str  # "old": this replica is being replaced; "successor": this one replaces `other`
    other: str  # the successor's id (role old; "" while queued) or the replaced replica's
    reason: str
    note: str


def move_view(move: Move | None, replica_id: str) -> MoveView | None:
    if move is None:
        return None
    old = move.replica == replica_id
    return MoveView(id=move.id, kind=move.kind, state=str(move.state), role="old" if old else "successor",
                    other=move.successor if old else move.replica, reason=move.reason, note=move.note)


class ReplicaView(msgspec.Struct, kw_only=True):
    """A replica as `GET /api/v1/replicas` shows it."""

    id: str
    model: str
    profile: str
    state: str
    reason: str
    age: float
    state_since: float
    attempt: int
    failures: int
    retry_in: float | None
    adopted: bool
    endpoint: str
    shards: list[ShardView]
    tail: list[str]
    # The weights download a starting replica waits on (issue 12); None when there is none.
    progress: ProgressView | None = None
    move: MoveView | None = None  # being replaced, or replacing another (drain, rollout, spread)


class RolloutView(msgspec.Struct, kw_only=True):
    """A model's latest rolling replacement (rollout.py)."""

    state: str  # rolling | halted | done
    what: str  # what changed: "args", "env, gpus", ...
    replaced: int
    total: int
    note: str  # what it does now, or why it halted
    state_since: float


def rollout_view(ro: Rollout | None, now: float) -> RolloutView | None:
    if ro is None:
        return None
    return RolloutView(state=str(ro.state), what=ro.what, replaced=ro.replaced, total=ro.total, note=ro.note,
                       state_since=_wall(now, ro.state_since))


class ModelView(msgspec.Struct, kw_only=True):
    name: str
    source: str
    replicas: int
    ready: int
    profiles: list[str]
    balancer: str
    rollout: RolloutView | None = None


class EndpointView(msgspec.Struct, kw_only=True):
    """A gateway endpoint as `GET /api/v1/endpoints` shows it."""

    model: str
    endpoint: str
    outstanding: int
    breaker: str
    breaker_reason: str
    violations: list[str]
    engine_up: bool
    healthy: bool
    health_reason: str
    load: EngineLoad | None


def _wall(now_mono: float, t: float) -> float:
    return round(time.time() - (now_mono - t), 3)


def node_view(node: Node, now: float, detail: bool = False, mark: str = "",
              unplaceable: dict[int, str] | None = None) -> NodeView:
    inv = node.inventory
    names = sorted({g.name for g in inv.gpus if g.name})
    view = NodeView(
        id=node.id,
        state=node.state,
        reason=node.reason,
        state_since=_wall(now, node.state_since),
        connected=node.connected,
        address=node.address,
        version=node.version,
        last_heartbeat_age=None if node.last_heartbeat is None else round(now - node.last_heartbeat, 3),
        gpus=len(inv.gpus),
        gpu_name=", ".join(names),
        gpu_source=inv.gpu_source,
        gpu_note=inv.gpu_note,
        fabrics=[f.name for f in node.fabrics],
        ports=len(node.ports),
        ports_active=sum(1 for p in node.ports.values() if p.state.upper() == "ACTIVE"),
        identity=node.identity,
        cert_days_left=None if not node.cert_not_after else round((node.cert_not_after - time.time()) / 86400, 1),
        features=node.features,
        fabric_status=node.fabric_status,
        port_states=[PortState(port=key, state=p.state, phys_state=p.phys_state, rate_gbps=p.rate_gbps)
                     for key, p in node.ports.items()],
        mgmt_interface=inv.mgmt_interface,
        heartbeats=node.heartbeats,
        mark=mark,
        unplaceable={str(i): why for i, why in sorted((unplaceable or {}).items())},
    )
    if detail:
        health = list(node.heartbeat.gpus) if node.heartbeat is not None else []
        return NodeDetail(**msgspec.structs.asdict(view), inventory=inv, port_readings=list(node.ports.values()),
                          gpu_health=health)
    return view


def replica_view(r: Replica, now: float, weights: WeightsBoard | None = None, move: Move | None = None) -> ReplicaView:
    shards = [
        ShardView(
            shard_id=sh.shard_id,
            node=sh.node,
            rank=sh.rank,
            gpus=list(sh.gpus),
            port=sh.port,
            state=str(sh.state),
            endpoint=sh.endpoint,
            pid=sh.pid,
            exit_code=sh.exit_code,
            reason=sh.reason,
            launch_env=list(sh.launch_env),
        )
        for sh in r.shards
    ]
    rank0 = next((sh for sh in r.shards if sh.rank == 0), None)
    return ReplicaView(
        id=r.id,
        model=r.model,
        profile=r.profile,
        state=str(r.state),
        reason=r.reason,
        age=round(now - r.created_at, 3),
        state_since=_wall(now, r.state_since),
        attempt=r.attempt,
        failures=r.failures,
        retry_in=(round(r.next_attempt_at - now, 3) if r.state == ReplicaState.FAILED and r.next_attempt_at > now
                  else None),
        adopted=r.adopted,
        endpoint=rank0.endpoint if rank0 is not None and r.state == ReplicaState.READY else "",
        shards=shards,
        tail=list(r.tail),
        progress=(weights.of([sh.shard_id for sh in r.shards], now)
                  if weights is not None and r.state == ReplicaState.STARTING else None),
        move=move_view(move, r.id),
    )


class Marks(Protocol):
    """A node's cordon or drain mark (drain.Drainer)."""

    def mark_of(self, node_id: str) -> str: ...


class ReadModel(Protocol):
    """What the JSON API reads (api.py depends on this, not on the objects behind it)."""

    def nodes(self, now: float) -> list[NodeView]: ...
    def node(self, node_id: str, now: float) -> NodeView | None: ...
    def replicas(self, now: float) -> list[ReplicaView]: ...
    def replica(self, replica_id: str, now: float) -> ReplicaView | None: ...
    def models(self, now: float = 0.0) -> list[ModelView]: ...
    def endpoints(self) -> list[EndpointView]: ...
    def fabrics(self) -> list[dict[str, Any]]: ...
    def fabric(self, fabric_id: str) -> dict[str, Any] | None: ...
    def fabric_topology(self, fabric_id: str) -> dict[str, Any] | None: ...
    def gateways(self) -> list[GatewayView]: ...
    def move(self, move_id: int) -> MoveOutcome | None: ...


class FleetReads:
    """The `ReadModel` over the registry, the reconciler and the gateway's balancers."""

    def __init__(self, registry: NodeRegistry, reconciler: Reconciler, gateway: Gateway,
                 weights: WeightsBoard | None = None, fabrics: FabricService | None = None,
                 marks: Marks | None = None, followers: GatewayFeedService | None = None,
                 unplaceable: Callable[[], dict[str, dict[int, str]]] = dict) -> None:
        self.unplaceable = unplaceable  # GPUs a finding keeps out of placement (server/remedy_service.py)
        self.followers = followers  # gateway workers and gateways on other machines (gwfeed.py)
        self.marks = marks
        self.weights = weights
        self.registry = registry
        self.reconciler = reconciler
        self.gateway = gateway
        self.fabric_map = fabrics

    def fabrics(self) -> list[dict[str, Any]]:
        service = self.fabric_map
        if service is None:
            return []
        return [s for s in (service.summary(f) for f in service.fabric_ids()) if s is not None]

    def gateways(self) -> list[GatewayView]:
        return self.followers.views() if self.followers is not None else []

    def fabric(self, fabric_id: str) -> dict[str, Any] | None:
        return self.fabric_map.detail(fabric_id) if self.fabric_map else None

    def fabric_topology(self, fabric_id: str) -> dict[str, Any] | None:
        return self.fabric_map.topology(fabric_id) if self.fabric_map else None

    def nodes(self, now: float) -> list[NodeView]:
        out = self.unplaceable()
        return [node_view(n, now, mark=self._mark(n.id), unplaceable=out.get(n.id))
                for n in sorted(self.registry.nodes.values(), key=lambda n: n.id)]

    def _mark(self, node_id: str) -> str:
        return self.marks.mark_of(node_id) if self.marks is not None else ""

    def node(self, node_id: str, now: float) -> NodeView | None:
        node = self.registry.get(node_id)
        return None if node is None else node_view(node, now, detail=True, mark=self._mark(node_id),
                                                    unplaceable=self.unplaceable().get(node_id))

    def replicas(self, now: float) -> list[ReplicaView]:
        replicas = sorted(self.reconciler.replicas.values(), key=lambda r: (r.model, r.created_at, r.id))
        moves = self.reconciler.unfinished_by_replica()
        return [replica_view(r, now, self.weights, moves.get(r.id)) for r in replicas]

    def move(self, move_id: int) -> MoveOutcome | None:
        move = self.reconciler.moves.get(move_id)
        return None if move is None else move_outcome(move, self.reconciler)

    def replica(self, replica_id: str, now: float) -> ReplicaView | None:
        replica = self.reconciler.replicas.get(replica_id)
        return (None if replica is None
                else replica_view(replica, now, self.weights, self.reconciler.move_of(replica_id)))

    def models(self, now: float = 0.0) -> list[ModelView]:
        reconciler = self.reconciler
        return [
            ModelView(
                name=model.name,
                source=shown(model.source) if model.source else model.name,  # no user:pass@ nor signature
                replicas=model.replicas,
                ready=sum(1 for r in reconciler.of_model(model.name) if r.state == ReplicaState.READY),
                profiles=[p.name for p in model.profiles],
                balancer=model.balancer,
                rollout=rollout_view(reconciler.rollout_of(model), now),
            )
            for model in reconciler.models.values()
        ]

    def endpoints(self) -> list[EndpointView]:
        return [
            EndpointView(
                model=name,
                endpoint=status.endpoint,
                outstanding=status.outstanding,
                breaker=status.breaker,
                breaker_reason=status.breaker_reason,
                violations=list(status.violations),
                engine_up=up,
                healthy=status.healthy,
                health_reason=status.health_reason,
                load=status.load,
            )
            for name, route in sorted(self.gateway.routes.items())
            for status in route.balancer.status()
            for up in (self.gateway.engine_up.get(status.endpoint, False),)
        ]


class GatewayFeed:
    """What the gateway learns from the control plane: built before the gateway, which asks it
    why a model has no endpoint (its 503) and is handed the ready endpoints after every pass."""

    def __init__(self, reconciler: Reconciler, settle: Settle, clock: Callable[[], float],
                 last: LastEndpoints | None = None) -> None:
        self.reconciler = reconciler
        self.settle = settle
        self.clock = clock
        self.last = last  # the set published before a restart (None: nothing kept, as in unit tests)
        self._said_kept = False

    def _ready(self) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        for replica in self.reconciler.replicas.values():
            if replica.state != ReplicaState.READY:
                continue
            for shard in replica.shards:
                if shard.rank == 0 and shard.endpoint:
                    out[shard.endpoint] = Entry(model=replica.model, node=shard.node,
                                                key=shard.spec.api_key if shard.spec is not None else "")
        return out

    def endpoint_set(self) -> tuple[dict[str, set[str]], dict[str, str], bool]:
        """What the gateway (and every follower) is handed after a pass: the ready endpoints, their
        keys, and whether the control plane is still settling. Settling, the set is not rebuilt
        yet: it is the ready endpoints so far beside the last published set's endpoints on nodes
        not back yet (followers keep what they have on top); settled, it is the real set, and kept."""
        entries = self._ready()
        settling = not self.settle.settled
        if self.last is not None:
            if settling:
                kept = self.last.unconfirmed(set(self.settle.registry.nodes))
                if not self._said_kept and kept:
                    self._said_kept = True
                    log.info("settling: serving the last settled endpoint set (%d endpoint(s) on %d node(s) not back "
                             "yet) beside the replicas rebuilt so far", len(kept), len({e.node for e in kept.values()}))
                entries = {**kept, **entries}
            else:
                self.last.save(entries)
        ready: dict[str, set[str]] = {}
        keys: dict[str, str] = {}
        for endpoint, entry in entries.items():
            ready.setdefault(entry.model, set()).add(endpoint)
            keys[endpoint] = entry.key
        return ready, keys, settling

    def not_ready_reason(self, model: str) -> str:
        """Why the gateway has no endpoint for `model`, for its 503. It once said "no ready
        replica: small-k94f5 ready; small-cd96h ready" (issue 9): replicas adopted during the
        settle period were ready but never handed to the gateway. A ready replica named here
        is one whose endpoint is out of rotation, and the text says so."""
        replicas = self.reconciler.of_model(model)
        settle = self.settle.note(self.clock())
        if not replicas:
            return settle or "no replicas (replicas: 0 in the catalog?)"
        parts = []
        for r in replicas[:3]:
            if r.state == ReplicaState.READY:
                endpoint = next((s.endpoint for s in r.shards if s.rank == 0 and s.endpoint), "")
                parts.append(f"{r.id} is ready but its endpoint {endpoint} is not in rotation" if endpoint
                             else f"{r.id} is ready but reported no endpoint")
            else:
                parts.append(f"{r.id} {r.state}" + (f" ({r.reason})" if r.reason else ""))
        if len(replicas) > 3:
            parts.append(f"{len(replicas) - 3} more")
        return "; ".join(parts + ([settle] if settle else []))
