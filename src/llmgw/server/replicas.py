"""The replicas the server knows and their shards, indexed, with the rules of their lifecycle. Pure.

`ReplicaBook` is the state the reconciler's two steps share: `observe.py` feeds it what the fleet
reports, `reconcile.py` decides on it. Every state change goes through `_shard_to` or
`_replica_to`, which consult the transition tables in `states.py`: an illegal one is refused (the
state stays) and recorded in `illegal` for the driver to log.

Cost: replicas are indexed by model, by node, by shard id and (multi-node ones) by span, so a message costs what it
touches, not models × replicas (10,000 models once meant 23 s stalls on every pass, issue 9).
"""

from __future__ import annotations

import random
import re
from typing import Literal

import msgspec

from llmgw.server.states import (
    GONE,
    HOLDING,
    LEAVING,
    SERVING,
    Illegal,
    ReplicaState,
    ShardState,
    replica_may,
    shard_may,
    shard_state,
)
from llmgw.wire import messages as m

PAST_SHARDS = 8
REFUSED_FOREIGN = "foreign shard"
REFUSED_ENDPOINT = "endpoint"


class Shard(msgspec.Struct, kw_only=True):
    shard_id: str
    node: str
    rank: int = 0
    gpus: list[int] = []
    port: int = 0
    endpoint: str = ""
    state: ShardState = ShardState.STARTING
    pid: int = 0
    exit_code: int | None = None
    reason: str = ""
    started_at: float = 0.0
    # When this server first knew the shard (placed or adopted), by its own clock: the surplus
    # rule goes by this, never by a start time a report claims (issue 19).
    seen_at: float = 0.0
    acked: bool = False  # the agent has said something about this shard
    stop_sent: bool = False
    drain: bool = False  # stopped by a move: the agent gets Drain (in-flight requests finish), not Stop
    spec: m.ShardSpec | None = None
    launch_env: list[m.EnvSetting] = []  # what the agent derived for NCCL/Gloo, and what the profile overrode


class Replica(msgspec.Struct, kw_only=True):
    id: str
    model: str
    profile: str = ""
    state: ReplicaState = ReplicaState.PENDING
    created_at: float
    state_since: float
    reason: str = ""
    tail: list[str] = []
    attempt: int = 0
    failures: int = 0
    next_attempt_at: float = 0.0
    adopted: bool = False
    # Adopted under a new id because the reported replica id was another replica's: this
    # replica exists only because a node said so, and goes first when there is a surplus.
    claimed: bool = False
    shards: list[Shard] = []
    # Shards of earlier attempts: shard id -> (node, seen_at), the last few. A node that
    # comes back reporting one of them is that replica's own engine returning, not a stranger.
    past: dict[str, tuple[str, float]] = {}
    # Where the last placement put a multi-node replica and why (the fabric map's notes: "under
    # one leaf: leaf-2", "gpu-07: cable to leaf-1 trained 4xDDR (others 4xHDR)"); the event says it.
    placement: list[str] = []
    # A move's successor (moves.py): the id of the replica it replaces while the move surges
    # (not counted against the catalog's replicas until then) and the nodes it must avoid.
    replaces: str = ""
    avoid: list[str] = []
    # The model's profile names, in order, when this replica was placed (rollout.py: a new order
    # is a change); empty for an adopted one, whose placement this server did not see.
    profile_order: list[str] = []
    # Draining: the gateway has synced since it left rotation, so its shards may get Drain.
    out_of_rotation: bool = False

    @property
    def started_at(self) -> float:
        return max((s.started_at for s in self.shards), default=self.created_at)

    @property
    def seen_at(self) -> float:
        return max((s.seen_at for s in self.shards), default=self.created_at)

    def complete(self) -> bool:
        """Every rank is there (a multi-node replica adopted from one node lacks the others')."""
        world = max((s.spec.world for s in self.shards if s.spec is not None), default=1)
        return {s.rank for s in self.shards} >= set(range(world))

    def gone(self) -> bool:
        """Every shard has ended (or there are none): nothing of this replica holds GPUs."""
        return all(s.state in GONE for s in self.shards)


class Refusal(msgspec.Struct, frozen=True):
    """A node's message about a shard that the reconciler did not act on, and why (issue 19).

    `reason` is the metric label (`llmgw_fleet_refused_total{reason}`), `detail` the log line.
    """

    node: str
    kind: str  # the message type: Register, ShardStatus, Progress, Heartbeat
    shard_id: str
    reason: str
    detail: str


def lost_note(node: str) -> str:
    """A kept replica's reason while a node it runs on is lost (lost.py)."""
    return f"{node} lost: serving on while its endpoint answers; replaced where there is room"


def _slug(name: str) -> str:
    """The model's name as the front of its replica ids: lower case, its dots kept
    (`llama-3.1-8b-instruct-wh57w`, where `llama-3-1-8b-…` could not be guessed from the
    name, issue 46). Dots are safe everywhere an id goes: shard ids split theirs off from the
    right (`<replica>.<attempt>[.<rank>]`), file names, URL segments and metric labels take
    them, and ids.py refuses `..`, so none is made here. `/ : @ +` (served names like
    `meta-llama/Llama-3.1-8B`) become `-`: an id is one path component."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", name.lower())
    slug = re.sub(r"[._-]*\.[._-]*", ".", slug)  # no "..", nor a dot beside a dash
    slug = slug[:48].strip("._-")
    return slug or "model"


class Settings(msgspec.Struct, kw_only=True):
    backoff_initial: float = 2.0
    backoff_max: float = 300.0
    port_range: tuple[int, int] = (20000, 29999)
    # Spreading a model's replicas as a standing rule (placement/spread.py): over nodes, leaf
    # switches or not at all, and at most one spread move per model this often.
    spread: Literal["nodes", "leaves", "off"] = "nodes"
    spread_cooldown: float = 300.0


class ReplicaBook:
    """Replicas by id with their indexes, and the lifecycle rules both steps apply."""

    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.rng = rng or random.Random()
        # Change replicas only through _put/_pop/_set_shards: they keep the indexes.
        self.replicas: dict[str, Replica] = {}
        self._of_model: dict[str, set[str]] = {}  # model → replica ids
        self._on_node: dict[str, set[str]] = {}  # node → ids of replicas with a shard there
        self._owner: dict[str, str] = {}  # shard id → replica id
        self._multi: set[str] = set()  # ids of replicas spanning nodes (a shard's spec has world > 1)
        self.generation = 0  # bumped by every input: a pass in progress re-reads usage
        self.log: list[str] = []  # human-readable decisions since the last drain_log()
        self.illegal: list[Illegal] = []  # transitions refused since the last drain_illegal()

    # -- indexes ---------------------------------------------------------------------------------

    def _put(self, replica: Replica) -> None:
        self.replicas[replica.id] = replica
        self._of_model.setdefault(replica.model, set()).add(replica.id)
        self._index_shards(replica)

    def _pop(self, replica_id: str) -> Replica | None:
        replica = self.replicas.pop(replica_id, None)
        if replica is not None:
            ids = self._of_model.get(replica.model)
            if ids is not None:
                ids.discard(replica_id)
                if not ids:
                    del self._of_model[replica.model]
            self._unindex_shards(replica)
        return replica

    def _index_shards(self, replica: Replica) -> None:
        for shard in replica.shards:
            self._owner[shard.shard_id] = replica.id
            self._on_node.setdefault(shard.node, set()).add(replica.id)
            if shard.spec is not None and shard.spec.world > 1:
                self._multi.add(replica.id)

    def _unindex_shards(self, replica: Replica) -> None:
        self._multi.discard(replica.id)
        for shard in replica.shards:
            if self._owner.get(shard.shard_id) == replica.id:
                del self._owner[shard.shard_id]
            ids = self._on_node.get(shard.node)
            if ids is not None:
                ids.discard(replica.id)
                if not ids:
                    del self._on_node[shard.node]

    def _set_shards(self, replica: Replica, shards: list[Shard]) -> None:
        self._unindex_shards(replica)
        replica.shards = shards
        self._index_shards(replica)

    def _new_id(self, model: str) -> str:
        alphabet = "bcdfghjklmnpqrstvwxz2456789"
        while True:
            rid = f"{_slug(model)}-{''.join(self.rng.choice(alphabet) for _ in range(5))}"
            if rid not in self.replicas:
                return rid

    def of_model(self, model: str) -> list[Replica]:
        """The replicas of one model (for the API and the gateway's 503 text), oldest first."""
        found = [self.replicas[rid] for rid in self._of_model.get(model, ()) if rid in self.replicas]
        return sorted(found, key=lambda r: (r.created_at, r.id))

    def multinode(self) -> list[Replica]:
        """The replicas spanning nodes, by id: the multi-node checks walk these, not every replica."""
        return [self.replicas[rid] for rid in sorted(self._multi) if rid in self.replicas]

    def on_node(self, node_id: str) -> list[Replica]:
        """Replicas with a shard on `node_id` (indexed: what a drain looks at costs what is there)."""
        return self._on(node_id)

    def _on(self, node_id: str) -> list[Replica]:
        return [self.replicas[rid] for rid in sorted(self._on_node.get(node_id, ())) if rid in self.replicas]

    def _find_shard(self, shard_id: str) -> tuple[Replica, Shard] | None:
        replica = self.replicas.get(self._owner.get(shard_id, ""))
        if replica is None:
            return None
        for shard in replica.shards:
            if shard.shard_id == shard_id:
                return replica, shard
        return None

    def owner(self, shard_id: str) -> str | None:
        """The node a shard runs on, or None for a shard nobody here knows."""
        found = self._find_shard(shard_id)
        return found[1].node if found is not None else None

    # -- transitions (the tables in states.py decide) ----------------------------------------------

    def _shard_to(self, shard: Shard, new: str, cause: str) -> bool:
        """Move a shard to `new` (a state an agent may have sent as text); False, recorded, when
        the table refuses it or the state is unknown."""
        state = shard_state(new)
        if state is None or not shard_may(ShardState(shard.state), state):
            self.illegal.append(Illegal("shard", shard.shard_id, str(shard.state), new if state is None else str(state),
                                        cause if state is not None else f"{cause} (an unknown state)"))
            return False
        shard.state = state
        return True

    def _replica_to(self, replica: Replica, new: ReplicaState, now: float, reason: str, cause: str) -> bool:
        old = ReplicaState(replica.state)
        if not replica_may(old, new):
            self.illegal.append(Illegal("replica", replica.id, str(old), str(new), cause))
            return False
        if new != old:
            replica.state = new
            replica.state_since = now
        replica.reason = reason
        return True

    # -- lifecycle rules ---------------------------------------------------------------------------

    def _derive(self, replica: Replica, now: float) -> None:
        """A replica's state from its shards' (after a shard changed)."""
        if replica.state in LEAVING or replica.state == ReplicaState.FAILED or not replica.shards:
            return
        states = {s.state for s in replica.shards}
        # A ready replica with a shard on a lost node serves on (lost.py): lost is not known dead.
        kept = (replica.state == ReplicaState.READY and ShardState.LOST in states
                and states - {ShardState.LOST} <= SERVING)
        if kept or (states <= SERVING and replica.complete()):
            if replica.state != ReplicaState.READY:
                self.log.append(f"replica {replica.id} ready")
            # An unhealthy shard's reason (since when) shows on the replica (`ctl replicas`), and a lost one's.
            reason = (next((f"{s.node}: {s.reason}" for s in replica.shards if s.state == ShardState.UNHEALTHY), "")
                      or next((lost_note(s.node) for s in replica.shards if s.state == ShardState.LOST), ""))
            if self._replica_to(replica, ReplicaState.READY, now, reason, "every shard serving"):
                replica.failures = 0
                replica.tail = []
        else:
            self._replica_to(replica, ReplicaState.STARTING, now,
                             replica.reason if replica.state == ReplicaState.STARTING else "",
                             "a shard not serving yet")

    def _fail(self, replica: Replica, now: float, reason: str, tail: list[str], *, penalty: bool) -> None:
        if replica.state in (ReplicaState.STOPPING, ReplicaState.PENDING):
            return  # on its way out, or given up already (pending → failed is not a transition)
        if replica.state == ReplicaState.DRAINING:  # on its way out anyway: no retry, no backoff
            self.stop_replica(replica, now, f"{replica.reason}; {reason}")
            return
        if penalty:
            replica.failures += 1
            delay = min(self.settings.backoff_max, self.settings.backoff_initial * 2 ** (replica.failures - 1))
        else:
            delay = 0.0
        replica.next_attempt_at = now + delay
        replica.tail = tail or replica.tail
        self._replica_to(replica, ReplicaState.FAILED, now, reason, "a shard failed")
        for shard in replica.shards:
            if shard.state in HOLDING:
                self._stop(replica, shard, "another shard of the replica failed")
        self.log.append(f"replica {replica.id} failed: {reason}" + (f"; retrying in {delay:g}s" if delay else ""))

    def _maybe_forget(self, replica: Replica) -> None:
        if replica.gone():
            self._pop(replica.id)
            self.log.append(f"replica {replica.id} stopped")

    def _stop(self, replica: Replica, shard: Shard, reason: str, drain: bool = False) -> None:
        if shard.state in GONE:
            return
        if self._shard_to(shard, ShardState.STOPPING, f"stop of replica {replica.id}"):
            shard.stop_sent = False
            shard.reason = reason
            shard.drain = drain

    def stop_replica(self, replica: Replica, now: float, reason: str, *, drain: bool = False) -> None:
        """Stop every shard; `drain`: the agents get Drain (a move's retirement, out of rotation already)."""
        self.generation += 1
        self._replica_to(replica, ReplicaState.STOPPING, now, reason, "stop")
        for shard in replica.shards:
            self._stop(replica, shard, reason, drain)
        self.log.append(f"stopping replica {replica.id}: {reason}")
        self._maybe_forget(replica)
