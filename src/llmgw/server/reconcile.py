"""The reconciler's decisions: desired (catalog) vs. actual (what agents report). Pure.

Level-triggered: `reconcile(nodes, now)` looks at the whole picture every time and returns
the Start/Stop messages to send; the server calls it on every change and on a tick. The
fleet is the source of truth (DESIGN.md): replicas are rebuilt from agents' reports after a
server restart (adoption) and forgotten when no agent reports them (disown).

Cost: replicas are indexed by model, by node and by shard id, so a message costs what it
touches, not models × replicas (10,000 models once meant 23 s stalls on every pass, issue 9);
a pass computes GPU and port usage once, not once per pending replica. A pass is a generator
(`steps`): it yields after each placement, and the driver lets the event loop run between
steps, so a pass placing a thousand replicas never holds the gateway or heartbeats. Anything
may change between two steps; every step re-checks what it acts on.
"""

from __future__ import annotations

import random
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

import msgspec

from llmgw.catalog.schema import Model, Profile
from llmgw.netaddr import url_host
from llmgw.placement import NodeCapacity, NoFit, Request, place
from llmgw.wire import messages as m

ReplicaState = Literal["pending", "starting", "ready", "failed", "stopping"]
# Shard states that hold GPUs and a port. "unhealthy": ready once, its agent's health checks now
# fail (a hung engine); the gateway's own health checks decide whether it gets traffic.
HOLDING = frozenset({"starting", "ready", "unhealthy", "stopping"})
SERVING = frozenset({"ready", "unhealthy"})
GONE = frozenset({"stopped", "failed", "exited", "lost"})
_SURPLUS_ORDER = {"pending": 0, "failed": 1, "starting": 2, "ready": 3, "stopping": 4}


class Shard(msgspec.Struct, kw_only=True):
    shard_id: str
    node: str
    rank: int = 0
    gpus: list[int] = []
    port: int = 0
    endpoint: str = ""
    state: str = "starting"
    pid: int = 0
    exit_code: int | None = None
    reason: str = ""
    started_at: float = 0.0
    # When this server first knew the shard (placed or adopted), by its own clock: the surplus
    # rule goes by this, never by a start time a report claims (issue 19).
    seen_at: float = 0.0
    acked: bool = False  # the agent has said something about this shard
    stop_sent: bool = False
    spec: m.ShardSpec | None = None


class Replica(msgspec.Struct, kw_only=True):
    id: str
    model: str
    profile: str = ""
    state: ReplicaState = "pending"
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

    def set_state(self, state: ReplicaState, now: float, reason: str = "") -> None:
        if state != self.state:
            self.state = state
            self.state_since = now
        self.reason = reason

    @property
    def started_at(self) -> float:
        return max((s.started_at for s in self.shards), default=self.created_at)

    @property
    def seen_at(self) -> float:
        return max((s.seen_at for s in self.shards), default=self.created_at)


PAST_SHARDS = 8
REFUSED_FOREIGN = "foreign shard"
REFUSED_ENDPOINT = "endpoint"


class Refusal(msgspec.Struct, frozen=True):
    """A node's message about a shard that the reconciler did not act on, and why (issue 19).

    `reason` is the metric label (`llmgw_fleet_refused_total{reason}`), `detail` the log line.
    """

    node: str
    kind: str  # the message type: Register, ShardStatus, Progress
    shard_id: str
    reason: str
    detail: str


class StartShard(msgspec.Struct, frozen=True):
    node: str
    spec: m.ShardSpec


class StopShard(msgspec.Struct, frozen=True):
    node: str
    shard_id: str
    grace: float
    reason: str


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


class _Usage:
    """GPU and port usage of every node, computed once per pass and kept current as the pass
    places replicas; recomputed when something outside the pass changed the picture."""

    def __init__(self, nodes: Sequence[NodeInfo], replicas: Iterable[Replica], generation: int) -> None:
        self.generation = generation
        self.of_model: dict[str, dict[str, int]] = {}
        self.capacities: list[NodeCapacity] = [
            NodeCapacity(
                node_id=n.node_id,
                state=n.state if n.connected or n.state != "ready" else "unreachable",
                gpus=n.gpus,
                used_gpus=set(),
                used_ports=set(),
                can_start=m.FEATURE_START in n.features,
                version=n.version,
            )
            for n in sorted(nodes, key=lambda n: n.node_id)
        ]
        self.by_node = {c.node_id: c for c in self.capacities}
        for replica in replicas:
            for shard in replica.shards:
                if shard.state in HOLDING:
                    self.hold(replica.model, shard.node, shard.gpus, shard.port)

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


class Settings(msgspec.Struct, kw_only=True):
    backoff_initial: float = 2.0
    backoff_max: float = 300.0
    port_range: tuple[int, int] = (20000, 29999)


def _slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug[:40] or "model"


def new_engine_key() -> str:
    """A shard's engine API key: 256 random bits, URL-safe (it travels in a header)."""
    return secrets.token_urlsafe(32)


class Reconciler:
    def __init__(self, models: Sequence[Model], settings: Settings, rng: random.Random | None = None,
                 new_key: Callable[[], str] = new_engine_key) -> None:
        self.settings = settings
        self.rng = rng or random.Random()
        self.new_key = new_key
        self.models: dict[str, Model] = {}
        # Change replicas only through _put/_pop/_set_shards: they keep the indexes.
        self.replicas: dict[str, Replica] = {}
        self._of_model: dict[str, set[str]] = {}  # model → replica ids
        self._on_node: dict[str, set[str]] = {}  # node → ids of replicas with a shard there
        self._owner: dict[str, str] = {}  # shard id → replica id
        self.generation = 0  # bumped by every input: a pass in progress re-reads usage
        self.log: list[str] = []  # human-readable decisions since the last drain_log()
        self.endpoint_hosts: dict[str, str] = {}  # node -> the host its engines are reached on
        self.set_catalog(models)

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

    def _unindex_shards(self, replica: Replica) -> None:
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

    def of_model(self, model: str) -> list[Replica]:
        """The replicas of one model (for the API and the gateway's 503 text), oldest first."""
        found = [self.replicas[rid] for rid in self._of_model.get(model, ()) if rid in self.replicas]
        return sorted(found, key=lambda r: (r.created_at, r.id))

    def _on(self, node_id: str) -> list[Replica]:
        return [self.replicas[rid] for rid in sorted(self._on_node.get(node_id, ())) if rid in self.replicas]

    # -- inputs -------------------------------------------------------------------------------

    def set_catalog(self, models: Sequence[Model]) -> None:
        self.generation += 1
        self.models = {model.name: model for model in models}

    def _new_id(self, model: str) -> str:
        alphabet = "bcdfghjklmnpqrstvwxz2456789"
        while True:
            rid = f"{_slug(model)}-{''.join(self.rng.choice(alphabet) for _ in range(5))}"
            if rid not in self.replicas:
                return rid

    def _find_shard(self, shard_id: str) -> tuple[Replica, Shard] | None:
        replica = self.replicas.get(self._owner.get(shard_id, ""))
        if replica is None:
            return None
        for shard in replica.shards:
            if shard.shard_id == shard_id:
                return replica, shard
        return None

    def endpoint_for(self, node_id: str, port: int) -> str:
        """The one address the gateway may use for an engine on `node_id`: the host the server
        decided for the node and the port from the shard's spec ("" while the host is unknown)."""
        host = self.endpoint_hosts.get(node_id, "")
        return f"http://{url_host(host)}:{port}" if host and port else ""

    def _foreign(self, node_id: str, kind: str, shard: Shard) -> Refusal | None:
        """A node speaks only for its own shards: every agent->server message naming a shard
        goes through this before it changes anything."""
        if shard.node == node_id:
            return None
        return Refusal(node_id, kind, shard.shard_id, REFUSED_FOREIGN,
                       f"{node_id} sent {kind} for shard {shard.shard_id}, which runs on {shard.node}; refused")

    def _bad_endpoint(self, node_id: str, kind: str, shard_id: str, port: int, reported: str) -> Refusal | None:
        """An endpoint a node reports must be the one the server derives (its host, the spec's port)."""
        expected = self.endpoint_for(node_id, port)
        if reported and reported != expected:
            return Refusal(node_id, kind, shard_id, REFUSED_ENDPOINT,
                           f"{node_id} sent {kind} for shard {shard_id} with endpoint {reported!r}, but its engines are "
                           f"reached at {expected or 'an address not known yet'!r}; refused")
        return None

    def owner(self, shard_id: str) -> str | None:
        """The node a shard runs on, or None for a shard nobody here knows."""
        found = self._find_shard(shard_id)
        return found[1].node if found is not None else None

    def on_register(
        self,
        node_id: str,
        reports: Iterable[m.ShardReport],
        now: float,
        wall_now: float | None = None,
        endpoint_host: str | None = None,
    ) -> list[Refusal]:
        """Adopt what the node runs and we do not know; disown what we think it runs and it does not.

        `wall_now` (unix time) lets an adopted engine keep its real age: reports carry the
        wall-clock launch time, the reconciler counts in `now`'s clock. `endpoint_host` is the
        host the server decided for this node's engines. Returns the reports refused: a shard
        of another node, an endpoint that is not the node's.
        """
        if endpoint_host is not None:
            self.endpoint_hosts[node_id] = endpoint_host
        refused: list[Refusal] = []
        self.generation += 1
        reported: set[str] = set()
        for report in reports:
            spec = report.spec
            found = self._find_shard(spec.shard_id)
            if found is not None:
                replica, shard = found
                foreign = self._foreign(node_id, "Register", shard)
                if foreign is not None:
                    refused.append(foreign)
                    continue
                reported.add(spec.shard_id)
                bad = self._bad_endpoint(node_id, "Register", shard.shard_id, shard.port, report.endpoint)
                if bad is not None:
                    refused.append(bad)
                    continue
                shard.pid = report.pid or shard.pid
                shard.acked = True
                if report.endpoint:
                    shard.endpoint = self.endpoint_for(node_id, shard.port)
                if shard.state == "stopping" and report.state in HOLDING:
                    shard.stop_sent = False  # the Stop may have been lost with the old stream: send again
                    continue
                if report.state != shard.state:
                    self._apply_shard_state(
                        replica, shard, report.state, now, reason=report.reason, tail=list(report.tail), exit_code=report.exit_code
                    )
                continue
            reported.add(spec.shard_id)
            if report.state not in HOLDING:
                self.log.append(f"{node_id} reports {spec.shard_id} {report.state}: nothing to adopt")
                continue
            low, high = self.settings.port_range
            bad = self._bad_endpoint(node_id, "Register", spec.shard_id, spec.port, report.endpoint)
            if bad is None and not low <= spec.port <= high:
                bad = Refusal(node_id, "Register", spec.shard_id, REFUSED_ENDPOINT,
                              f"{node_id} reports shard {spec.shard_id} on port {spec.port}, outside the port range "
                              f"{low}-{high}; not adopted")
            if bad is not None:
                refused.append(bad)
                continue
            age = max(0.0, wall_now - report.started_at) if wall_now and report.started_at else 0.0
            self._adopt(node_id, report, now, now - age)
        for replica in self._on(node_id):
            for shard in replica.shards:
                if shard.node != node_id or shard.shard_id in reported or shard.state in GONE:
                    continue
                if shard.state == "stopping":
                    shard.state = "stopped"
                    self._maybe_forget(replica)
                elif not shard.acked and shard.state == "starting":
                    # The Start never reached the agent (the stream broke): try again, no penalty.
                    shard.state = "lost"
                    self._fail(replica, now, f"{node_id} never received the start of {shard.shard_id}; retrying", [], penalty=False)
                else:
                    shard.state = "lost"
                    self._fail(
                        replica,
                        now,
                        f"{node_id} no longer runs {shard.shard_id} (the engine went away while the agent was disconnected)",
                        [],
                        penalty=False,
                    )
        return refused

    def _adopt(self, node_id: str, report: m.ShardReport, now: float, started: float) -> None:
        spec = report.spec
        rid = spec.replica_id
        existing = self.replicas.get(rid)
        seen_at = now
        claimed = False
        if existing is not None:
            past = existing.past.get(spec.shard_id)
            returning = False
            if past is not None and past[0] == node_id:  # its own earlier engine, back
                returning = True
                seen_at = past[1]  # as old as this server saw it to be, not as the report claims
            mine = returning or (bool(existing.shards) and all(s.node == node_id for s in existing.shards))
            alive = existing.state in ("ready", "starting", "stopping") or any(s.state in HOLDING for s in existing.shards)
            if alive or not mine:
                # Both alive (or still being stopped): keep both, the surplus rule picks one by
                # what this server saw, never by a claimed start time. A replica of another
                # node is never superseded by this node's report (issue 19).
                rid = self._new_id(spec.model)
                claimed = not returning
            else:
                # The one we knew here is failed or pending: the reported engine supersedes it.
                for shard in existing.shards:
                    if shard.state in HOLDING:
                        self._stop(existing, shard, "superseded by an adopted engine")
                self._pop(rid)
        shard = Shard(
            shard_id=spec.shard_id,
            node=node_id,
            rank=spec.rank,
            gpus=list(spec.gpus),
            port=spec.port,
            state=report.state,
            pid=report.pid,
            endpoint=self.endpoint_for(node_id, spec.port) if report.endpoint else "",
            started_at=started,
            seen_at=seen_at,
            acked=True,
            spec=spec,
        )
        replica = Replica(
            id=rid,
            model=spec.model,
            profile=spec.profile,
            state="starting",
            created_at=started,
            state_since=now,
            adopted=True,
            claimed=claimed,
            shards=[shard],
        )
        self._put(replica)
        self.log.append(f"adopted {spec.shard_id} ({spec.model}, {report.state}) running on {node_id} as replica {rid}")
        self._derive(replica, now)

    def on_shard_status(self, node_id: str, msg: m.ShardStatus, now: float) -> list[Refusal]:
        self.generation += 1
        found = self._find_shard(msg.shard_id)
        if found is None:
            return []
        replica, shard = found
        bad = self._foreign(node_id, "ShardStatus", shard) or self._bad_endpoint(
            node_id, "ShardStatus", shard.shard_id, shard.port, msg.endpoint
        )
        if bad is not None:
            return [bad]
        shard.acked = True
        if msg.pid:
            shard.pid = msg.pid
        if msg.endpoint:
            shard.endpoint = self.endpoint_for(node_id, shard.port)
        self._apply_shard_state(replica, shard, msg.state, now, msg.reason, list(msg.tail), msg.exit_code)
        return []

    def on_progress(self, node_id: str, msg: m.Progress, now: float) -> list[Refusal]:
        """Download progress changes nothing yet; a node's report about another's shard is refused."""
        found = self._find_shard(msg.shard_id)
        if found is None:
            return []
        foreign = self._foreign(node_id, "Progress", found[1])
        return [foreign] if foreign is not None else []

    def _apply_shard_state(
        self,
        replica: Replica,
        shard: Shard,
        state: str,
        now: float,
        reason: str,
        tail: list[str],
        exit_code: int | None,
    ) -> None:
        previous = shard.state
        if previous == "stopping" and state in HOLDING:
            return  # still running: it stays "stopping" until the agent says it stopped
        shard.state = state
        shard.reason = reason
        if exit_code is not None:
            shard.exit_code = exit_code
        if replica.state == "stopping":
            self._maybe_forget(replica)
            return
        if state in ("failed", "exited"):
            why = reason or (
                f"engine exited with code {exit_code}" if exit_code is not None else f"engine {state}"
            )
            self._fail(replica, now, f"{shard.node}: {why}", tail, penalty=True)
            return
        if state in ("stopping", "stopped") and previous != "stopping":
            # Stopped on the node's side (its agent is shutting down with its engines), not a
            # crash: the replica goes elsewhere at once, and the shard stays counted until the
            # engine is really gone.
            self._fail(replica, now, f"{shard.node}: engine {state} by its agent ({reason or 'no reason given'})", tail,
                       penalty=False)
            return
        self._derive(replica, now)

    def on_node_state(self, node_id: str, state: str, now: float) -> None:
        if state != "lost":
            return  # unreachable: engines may well still serve; never stop them for that
        self.generation += 1
        for replica in self._on(node_id):
            for shard in replica.shards:
                if shard.node == node_id and shard.state not in GONE:
                    shard.state = "lost"
                    if replica.state == "stopping":
                        self._maybe_forget(replica)
                    else:
                        self._fail(replica, now, f"node {node_id} is lost", [], penalty=False)

    # -- state derivation -----------------------------------------------------------------

    def _derive(self, replica: Replica, now: float) -> None:
        if replica.state in ("stopping", "failed") or not replica.shards:
            return
        states = {s.state for s in replica.shards}
        if states <= SERVING:
            if replica.state != "ready":
                self.log.append(f"replica {replica.id} ready")
            # An unhealthy shard's reason (since when) shows on the replica (`ctl replicas`).
            replica.set_state("ready", now, next((f"{s.node}: {s.reason}" for s in replica.shards if s.state == "unhealthy"), ""))
            replica.failures = 0
            replica.tail = []
        else:
            replica.set_state("starting", now, replica.reason if replica.state == "starting" else "")

    def _fail(self, replica: Replica, now: float, reason: str, tail: list[str], *, penalty: bool) -> None:
        if replica.state == "stopping":
            return
        if penalty:
            replica.failures += 1
            delay = min(self.settings.backoff_max, self.settings.backoff_initial * 2 ** (replica.failures - 1))
        else:
            delay = 0.0
        replica.next_attempt_at = now + delay
        replica.tail = tail or replica.tail
        replica.set_state("failed", now, reason)
        for shard in replica.shards:
            if shard.state in HOLDING:
                self._stop(replica, shard, "another shard of the replica failed")
        self.log.append(f"replica {replica.id} failed: {reason}" + (f"; retrying in {delay:g}s" if delay else ""))

    def _maybe_forget(self, replica: Replica) -> None:
        if all(s.state in GONE for s in replica.shards):
            self._pop(replica.id)
            self.log.append(f"replica {replica.id} stopped")

    def _stop(self, replica: Replica, shard: Shard, reason: str) -> None:
        if shard.state in GONE:
            return
        shard.state = "stopping"
        shard.stop_sent = False
        shard.reason = reason

    def stop_replica(self, replica: Replica, now: float, reason: str) -> None:
        self.generation += 1
        replica.set_state("stopping", now, reason)
        for shard in replica.shards:
            self._stop(replica, shard, reason)
        self.log.append(f"stopping replica {replica.id}: {reason}")
        self._maybe_forget(replica)

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
        # Failed replicas whose backoff passed go back to pending (their shards are gone).
        for replica in self.replicas.values():
            if replica.state == "failed" and now >= replica.next_attempt_at and all(
                s.state in GONE for s in replica.shards
            ):
                replica.set_state("pending", now, replica.reason)
        # Anything whose model or profile left the catalog is stopped.
        for replica in list(self.replicas.values()):
            if replica.state == "stopping":
                continue
            model = self.models.get(replica.model)
            if model is None:
                self.stop_replica(replica, now, f"model {replica.model} left the catalog")
            elif replica.profile and replica.state != "pending" and replica.profile not in {p.name for p in model.profiles}:
                self.stop_replica(replica, now, f"profile {replica.profile} left model {replica.model}")
        # Counts: add missing replicas, stop surplus ones (a step every 100 models).
        for i, model in enumerate(list(self.models.values())):
            if i % 100 == 99:
                yield None
            ids = self._of_model.get(model.name, ())
            active = [r for r in map(self.replicas.__getitem__, ids) if r.state != "stopping"]
            for _ in range(model.replicas - len(active)):
                rid = self._new_id(model.name)
                self._put(Replica(id=rid, model=model.name, created_at=now, state_since=now))
                self.log.append(f"new replica {rid} for {model.name}")
            if len(active) > model.replicas:
                # Stopped first: a replica that exists only because a node reused another's id,
                # then by state, then the one this server saw last (never a claimed start time).
                active.sort(key=lambda r: (not r.claimed, _SURPLUS_ORDER[r.state], -r.seen_at, r.id))
                for replica in active[: len(active) - model.replicas]:
                    if replica.state == "pending" or all(s.state in GONE for s in replica.shards):
                        self._pop(replica.id)
                        self.log.append(f"dropped surplus replica {replica.id}")
                    else:
                        self.stop_replica(replica, now, f"surplus: {model.name} wants {model.replicas}")
        # Place pending replicas, oldest first; one step each.
        pending = sorted((r for r in self.replicas.values() if r.state == "pending"), key=lambda r: (r.created_at, r.id))
        usage: _Usage | None = None
        for replica in pending:
            if replica.state != "pending" or self.replicas.get(replica.id) is not replica or replica.model not in self.models:
                continue  # changed while the pass let others run
            if usage is None or usage.generation != self.generation:
                usage = _Usage(nodes, self.replicas.values(), self.generation)
            start = self._place(replica, usage, now)
            yield start
        # Send stops that are due: a shard marked stopping on a connected node.
        for replica in list(self.replicas.values()):
            for shard in replica.shards:
                if shard.state == "stopping" and not shard.stop_sent:
                    node = by_id.get(shard.node)
                    if node is not None and node.connected and node.state == "ready":
                        grace = shard.spec.stop_grace if shard.spec else 5.0
                        shard.stop_sent = True
                        yield StopShard(shard.node, shard.shard_id, grace, shard.reason)
                    elif node is None or node.state == "lost":
                        shard.state = "lost"
                        self._maybe_forget(replica)
            if replica.state == "stopping":
                self._maybe_forget(replica)

    def _place(self, replica: Replica, usage: _Usage, now: float) -> StartShard | None:
        model = self.models[replica.model]
        if not model.profiles:
            replica.reason = f"model {model.name} has no profiles"
            return None
        capacities = usage.for_model(model.name)
        reasons: list[str] = []
        attempt = replica.attempt + 1
        for profile in model.profiles:
            shard_id = f"{replica.id}.{attempt}"
            result = place(
                Request(replica_id=shard_id, gpus=profile.gpus, gpu_kind=profile.gpu_kind, gpu_memory_mib=profile.gpu_memory_mib),
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
            for old in replica.shards:
                replica.past[old.shard_id] = (old.node, old.seen_at)
            for stale in list(replica.past)[: max(0, len(replica.past) - PAST_SHARDS)]:
                del replica.past[stale]
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
            replica.set_state("starting", now, "")
            self.log.append(f"placed {shard_id} ({model.name}/{profile.name}) on {result.node_id} GPUs {list(result.gpus)} port {result.port}")
            return StartShard(result.node_id, spec)
        waiting = "; ".join(reasons)
        if replica.failures and replica.reason and not replica.reason.startswith("no placement"):
            waiting = f"{waiting} (last failure: {replica.reason})" if waiting else replica.reason
        replica.set_state("pending", now, f"no placement: {waiting}" if reasons else waiting)
        return None

    def next_deadline(self) -> float | None:
        """When a backoff expires next (the driver wakes then, besides its tick)."""
        # Only a replica that can go back to pending then: one whose shards are still being
        # stopped waits for that (a status wakes the loop), not for a deadline already past.
        times = [
            r.next_attempt_at
            for r in self.replicas.values()
            if r.state == "failed" and all(s.state in GONE for s in r.shards)
        ]
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
        source=model.source or model.name,
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
