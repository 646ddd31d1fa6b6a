"""The reconciler's *observe* step: what nodes report (Register, ShardStatus, a heartbeat's shard
list, node state changes) becomes the observed state of shards, and of their replicas. Pure.

A node speaks only for its own shards (issue 19): every message naming a shard passes `_foreign`
and `_bad_endpoint` before it changes anything, and what it is refused comes back as `Refusal`s.

Level-triggered: agents resend their whole shard list every few heartbeats (`resync_every`), and
`on_resync` compares it with what this server believes, so a divergence (a ShardStatus lost, an
engine the agent forgot) heals within those heartbeats and without a reconnect, as a Kubernetes
controller's periodic resync heals what an event missed. A resync never disowns a shard the
agent has not spoken of yet (its Start may still be on its way) and never re-sends a Stop (the
Stop travels on the same stream, ahead of the heartbeat's answer).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from llmgw.netaddr import url_host
from llmgw.server.replicas import (
    REFUSED_ENDPOINT,
    REFUSED_FOREIGN,
    Refusal,
    Replica,
    ReplicaBook,
    Settings,
    Shard,
)
from llmgw.server.states import ENDED, HOLDING, ReplicaState, ShardState, shard_state
from llmgw.wire import messages as m


class Observer(ReplicaBook):
    """Applies what the fleet reports to the book (the reconciler is one)."""

    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        super().__init__(settings, rng)
        self.endpoint_hosts: dict[str, str] = {}  # node -> the host its engines are reached on

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
                           f"{node_id} sent {kind} for shard {shard_id} with endpoint {reported!r}, but its engines "
                           f"are reached at {expected or 'an address not known yet'!r}; refused")
        return None

    # -- Register and resync -------------------------------------------------------------------------

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
        self.generation += 1
        refused, _ = self._compare(node_id, "Register", reports, now, wall_now)
        return refused

    def on_resync(self, node_id: str, reports: Iterable[m.ShardReport], now: float,
                  wall_now: float | None = None) -> tuple[list[Refusal], bool]:
        """A heartbeat's full shard list: the same comparison as a Register's, minus what may
        still be in flight on the stream. Returns the refusals and whether anything changed
        (a resync that finds nothing new costs no reconcile pass)."""
        refused, changed = self._compare(node_id, "Heartbeat", reports, now, wall_now)
        if changed:
            self.generation += 1
        return refused, changed

    def _compare(self, node_id: str, kind: str, reports: Iterable[m.ShardReport], now: float,
                 wall_now: float | None) -> tuple[list[Refusal], bool]:
        register = kind == "Register"
        refused: list[Refusal] = []
        changed = False
        reported: set[str] = set()
        for report in reports:
            spec = report.spec
            found = self._find_shard(spec.shard_id)
            if found is not None:
                replica, shard = found
                foreign = self._foreign(node_id, kind, shard)
                if foreign is not None:
                    refused.append(foreign)
                    continue
                reported.add(spec.shard_id)
                bad = self._bad_endpoint(node_id, kind, shard.shard_id, shard.port, report.endpoint)
                if bad is not None:
                    refused.append(bad)
                    continue
                shard.pid = report.pid or shard.pid
                shard.launch_env = list(report.launch_env) or shard.launch_env
                shard.acked = True
                if report.endpoint:
                    shard.endpoint = self.endpoint_for(node_id, shard.port)
                if shard.state == ShardState.STOPPING and report.state in HOLDING:
                    if register:
                        shard.stop_sent = False  # the Stop may have been lost with the old stream: send again
                    continue
                if report.state != shard.state:
                    before = shard.state
                    self._apply_shard_state(replica, shard, report.state, now, reason=report.reason,
                                            tail=list(report.tail), exit_code=report.exit_code,
                                            cause=f"{kind} from {node_id}")
                    changed = changed or shard.state != before
                continue
            reported.add(spec.shard_id)
            if report.state not in HOLDING:
                if register:  # a resync repeats it every few heartbeats: said once, at the Register
                    self.log.append(f"{node_id} reports {spec.shard_id} {report.state}: nothing to adopt")
                continue
            low, high = self.settings.port_range
            bad = self._bad_endpoint(node_id, kind, spec.shard_id, spec.port, report.endpoint)
            if bad is None and not low <= spec.port <= high:
                bad = Refusal(node_id, kind, spec.shard_id, REFUSED_ENDPOINT,
                              f"{node_id} reports shard {spec.shard_id} on port {spec.port}, outside the port range "
                              f"{low}-{high}; not adopted")
            if bad is not None:
                refused.append(bad)
                continue
            age = max(0.0, wall_now - report.started_at) if wall_now and report.started_at else 0.0
            self._adopt(node_id, report, now, now - age)
            changed = True
        for replica in self._on(node_id):
            for shard in replica.shards:
                if shard.node != node_id or shard.shard_id in reported or shard.state in ENDED:
                    continue
                if not register and not shard.acked:
                    continue  # its Start may still be on the way to the agent
                changed = True
                if shard.state == ShardState.LOST:
                    # Back without it: the engine went away while its node was lost (lost.py
                    # kept its replica serving on, or had given it up already).
                    self._shard_to(shard, ShardState.EXITED, f"{kind} from {node_id} without it")
                    shard.reason = "gone while its node was lost"
                    if replica.state == ReplicaState.STOPPING:
                        self._maybe_forget(replica)
                    elif replica.state in (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.DRAINING):
                        self._fail(replica, now, f"{node_id} is back without {shard.shard_id} (the engine went away "
                                   "while the node was lost)", [], penalty=False)
                    continue
                if shard.state == ShardState.STOPPING:
                    self._shard_to(shard, ShardState.STOPPED, f"{kind} from {node_id} without it")
                    self._maybe_forget(replica)
                elif not shard.acked and shard.state == ShardState.STARTING:
                    # The Start never reached the agent (the stream broke): try again, no penalty.
                    self._shard_to(shard, ShardState.LOST, f"Register from {node_id} without it")
                    self._fail(replica, now, f"{node_id} never received the start of {shard.shard_id}; retrying", [],
                               penalty=False)
                else:
                    self._shard_to(shard, ShardState.LOST, f"{kind} from {node_id} without it")
                    why = ("the engine went away while the agent was disconnected" if register
                           else "its agent no longer lists it")
                    self._fail(replica, now, f"{node_id} no longer runs {shard.shard_id} ({why})", [], penalty=False)
        return refused, changed

    def _adopt(self, node_id: str, report: m.ShardReport, now: float, started: float) -> None:
        spec = report.spec
        rid = spec.replica_id
        existing = self.replicas.get(rid)
        seen_at = now
        claimed = False
        if existing is not None and existing.adopted and _same_attempt(existing, spec):
            # Another rank of a multi-node replica adopted from another node: one replica again.
            self._set_shards(existing, [*existing.shards, self._adopted_shard(node_id, report, started, seen_at)])
            self.log.append(f"adopted {spec.shard_id} (rank {spec.rank} of {spec.world}) running on {node_id} "
                            f"into replica {rid}")
            self._derive(existing, now)
            return
        if existing is not None:
            past = existing.past.get(spec.shard_id)
            returning = False
            if past is not None and past[0] == node_id:  # its own earlier engine, back
                returning = True
                seen_at = past[1]  # as old as this server saw it to be, not as the report claims
            mine = returning or (bool(existing.shards) and all(s.node == node_id for s in existing.shards))
            alive = existing.state in (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.DRAINING,
                                      ReplicaState.STOPPING) or any(
                s.state in HOLDING for s in existing.shards)
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
        shard = self._adopted_shard(node_id, report, started, seen_at)
        replica = Replica(
            id=rid,
            model=spec.model,
            profile=spec.profile,
            state=ReplicaState.STARTING,
            created_at=started,
            state_since=now,
            adopted=True,
            claimed=claimed,
            shards=[shard],
        )
        self._put(replica)
        self.log.append(f"adopted {spec.shard_id} ({spec.model}, {report.state}) running on {node_id} as replica {rid}")
        self._derive(replica, now)

    def _adopted_shard(self, node_id: str, report: m.ShardReport, started: float, seen_at: float) -> Shard:
        spec = report.spec
        return Shard(
            shard_id=spec.shard_id,
            node=node_id,
            rank=spec.rank,
            gpus=list(spec.gpus),
            port=spec.port,
            state=ShardState(report.state),
            pid=report.pid,
            endpoint=self.endpoint_for(node_id, spec.port) if report.endpoint else "",
            started_at=started,
            seen_at=seen_at,
            acked=True,
            spec=spec,
            launch_env=list(report.launch_env),
        )

    # -- events ------------------------------------------------------------------------------------

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
        if msg.launch_env:
            shard.launch_env = list(msg.launch_env)
        if msg.endpoint:
            shard.endpoint = self.endpoint_for(node_id, shard.port)
        self._apply_shard_state(replica, shard, msg.state, now, msg.reason, list(msg.tail), msg.exit_code,
                                cause=f"ShardStatus from {node_id}")
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
        cause: str,
    ) -> None:
        previous = shard.state
        if previous == ShardState.STOPPING and state in HOLDING:
            return  # still running: it stays "stopping" until the agent says it stopped
        if previous in ENDED and state == previous:
            return  # an end already known, told again (a status and a resync of the same exit)
        if not self._shard_to(shard, state, cause):
            return
        shard.reason = reason
        if exit_code is not None:
            shard.exit_code = exit_code
        if previous == ShardState.LOST and shard.state in HOLDING and shard.state != ShardState.STOPPING and (
                replica.state in (ReplicaState.STOPPING, ReplicaState.FAILED, ReplicaState.PENDING)):
            # Back from a lost node into a replica given up meanwhile (its other ranks stopped,
            # or on its way out): this engine serves nobody now, and holds its GPUs until stopped.
            self._stop(replica, shard, f"back after its node was lost, but replica {replica.id} is {replica.state}")
            return
        if replica.state == ReplicaState.STOPPING:
            self._maybe_forget(replica)
            return
        if (replica.state == ReplicaState.PENDING
                or (previous == ShardState.LOST and replica.state == ReplicaState.FAILED)):
            # given up already: the end of a rank lost meanwhile fails nothing twice (no illegal pending → failed)
            return
        if previous == ShardState.LOST and replica.state == ReplicaState.READY and shard.state in HOLDING:
            self.log.append(f"replica {replica.id}: {shard.shard_id} back on {shard.node}")
        new = shard_state(state)
        if new in (ShardState.FAILED, ShardState.EXITED):
            why = reason or (
                f"engine exited with code {exit_code}" if exit_code is not None else f"engine {state}"
            )
            self._fail(replica, now, f"{shard.node}: {why}", tail, penalty=True)
            return
        if new in (ShardState.STOPPING, ShardState.STOPPED) and previous != ShardState.STOPPING:
            # Stopped on the node's side (its agent is shutting down with its engines), not a
            # crash: the replica goes elsewhere at once, and the shard stays counted until the
            # engine is really gone.
            self._fail(replica, now, f"{shard.node}: engine {state} by its agent ({reason or 'no reason given'})", tail,
                       penalty=False)
            return
        self._derive(replica, now)


def _same_attempt(replica: Replica, spec: m.ShardSpec) -> bool:
    """`spec` is a rank this replica lacks, of the same multi-node attempt (`<replica>.<attempt>.<rank>`)."""
    if spec.world <= 1 or any(s.rank == spec.rank for s in replica.shards):
        return False
    attempt = spec.shard_id.rpartition(".")[0]
    return all(s.spec is not None and s.spec.world == spec.world and s.shard_id.rpartition(".")[0] == attempt
               for s in replica.shards)
