"""`GET /api/v1/doctor`: the facts doctor's checks grade, taken from the control plane, and the
checks run off the event loop with a deadline (issue 14).

Two steps, so that neither the gateway nor heartbeats wait on a fleet of any size:
- on the event loop, `facts()` takes references to what the registry, reconciler and fabric map
  hold now (the registry replaces a node's readings on each heartbeat and never edits them in
  place, so a reference stays a consistent snapshot): one small struct per node and replica,
  about 2 ms for 1,000 nodes, a tenth of building `GET /api/v1/nodes` (bench/bench_doctor.py);
- in a worker thread, `llmgw.doctor.run` grades them, stopping at DEADLINE: a check the deadline
  leaves unrun is `unknown`, and if the worker itself does not come back in time the answer is
  one `unknown` per check ("did not finish"), never a hang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from llmgw import doctor
from llmgw.doctor.facts import (
    CLUSTER,
    ClusterFacts,
    FabricFacts,
    FabricProblemFact,
    Finding,
    ModelFacts,
    NodeFacts,
    ProfileNeeds,
    ReplicaFacts,
    Report,
    report,
)
from llmgw.server.alertmetrics import CheckResults
from llmgw.server.fabric_service import FabricService
from llmgw.server.reconcile import Reconciler
from llmgw.server.registry import Node, NodeRegistry
from llmgw.verdict import Status
from llmgw.wire import messages as m

log = logging.getLogger("llmgw.server.doctor")

# The whole run's budget: cron and Nagios call doctor with timeouts of 10 s or more; 1,000 nodes
# take well under a second (bench/bench_doctor.py).
DEADLINE = 5.0
GRACE = 2.0  # beyond DEADLINE, for the worker thread to come back before it is given up


def node_facts(node: Node, now: float, wall: float, interval: float) -> NodeFacts:
    hb = node.heartbeat
    # The oldest kept reading is the baseline, once the latest is another (a second heartbeat).
    history = node.port_history
    before = history[0] if history and history[0][1] is not node.ports else None
    latest_at = node.last_heartbeat if node.last_heartbeat is not None else now
    return NodeFacts(
        id=node.id,
        state=node.state,
        reason=node.reason,
        connected=node.connected,
        last_heartbeat_age=None if node.last_heartbeat is None else round(now - node.last_heartbeat, 3),
        heartbeat_interval=interval,
        inventory=node.inventory,
        fabric_status=node.fabric_status,
        gpus=hb.gpus if hb is not None else None,
        ports=list(node.ports.values()),
        ports_before=list(before[1].values()) if before is not None else None,
        window=latest_at - before[0] if before is not None else 0.0,
        host=hb.host if hb is not None else None,
        cert_days_left=round((node.cert_not_after - wall) / 86400, 2) if node.cert_not_after else None,
        clock_skew=min(node.clock_skews, key=abs) if node.clock_skews else None,
    )


def fabric_facts(service: FabricService) -> list[FabricFacts]:
    """Each fabric's subnet-manager and topology problems (INIT ports are graded per node)."""
    out = []
    by_id = {f.id: f for f in service.report.fabrics}
    for fabric_id in service.fabric_ids():
        fabric = by_id.get(fabric_id)
        topology = service.topologies.get(fabric_id)
        problems = [FabricProblemFact(kind=p.kind.value, message=p.message)
                    for p in (fabric.problems if fabric else [])]
        if topology is not None:
            problems += [FabricProblemFact(kind=p.kind.value, message=p.message) for p in topology.map.problems]
        if fabric_id in service.errors:
            problems.append(FabricProblemFact(kind="tool_failed", message=service.errors[fabric_id]))
        out.append(FabricFacts(id=fabric_id, problems=problems,
                               master=fabric.master.guid if fabric and fabric.master else "",
                               standbys=len(fabric.standbys) if fabric else 0, discovered=topology is not None))
    return out


class DoctorService:
    def __init__(self, registry: NodeRegistry, reconciler: Reconciler, fabrics: FabricService | None = None, *,
                 clock: Callable[[], float] = trio.current_time, wall: Callable[[], float] = time.time,
                 deadline: float = DEADLINE, results: CheckResults | None = None) -> None:
        self.registry = registry
        self.reconciler = reconciler
        self.fabrics = fabrics
        self.results = results  # where the last full report goes (llmgw.server.alertmetrics)
        self.clock = clock
        self.wall = wall
        self.deadline = deadline

    def facts(self, node: str | None = None) -> ClusterFacts:
        """What the checks read, now (on the event loop: references, no copies of readings)."""
        now, wall = self.clock(), self.wall()
        interval = self.registry.heartbeat_interval
        nodes = self.registry.nodes
        chosen = [nodes[node]] if node in nodes else [] if node is not None else list(nodes.values())
        facts = ClusterFacts(nodes=[node_facts(n, now, wall, interval) for n in chosen])
        if node is not None:
            return facts
        facts.fabric_discovery = any(m.FEATURE_DISCOVER in n.features for n in nodes.values() if n.connected)
        facts.models = [ModelFacts(name=model.name, replicas=model.replicas,
                                   profiles=[ProfileNeeds(gpus=p.gpus, gpu_kind=p.gpu_kind,
                                                          gpu_memory_mib=p.gpu_memory_mib)
                                             for p in model.profiles])
                        for model in self.reconciler.models.values()]
        facts.replicas = [
            ReplicaFacts(id=r.id, model=r.model, state=str(r.state), reason=r.reason, state_age=now - r.state_since,
                         failures=r.failures, nodes=sorted({s.node for s in r.shards}),
                         retry_in=r.next_attempt_at - now if r.next_attempt_at > now else None)
            for r in self.reconciler.replicas.values()
        ]
        if self.fabrics is not None:
            facts.fabrics = fabric_facts(self.fabrics)
        return facts

    async def report(self, node: str | None = None, check: str | None = None,
                     checks: frozenset[str] | None = None) -> Report:
        """`checks` (doctor.catalog.select of only=/skip=) or `check` narrow the run to those checks."""
        started = self.clock()
        facts = self.facts(node)
        deadline = time.monotonic() + self.deadline

        def grade() -> list[Finding]:
            return doctor.run(facts, clock=time.monotonic, deadline=deadline, node=node, check=check, checks=checks)

        found: list[Finding] | None = None
        with trio.move_on_after(self.deadline + GRACE):
            found = await trio.to_thread.run_sync(grade, abandon_on_cancel=True)
        if found is None:
            log.warning("doctor's checks did not finish in %.0fs; answering unknown", self.deadline + GRACE)
            found = [Finding(node=CLUSTER, check=check or "(all)", status=Status.UNKNOWN,
                             finding=f"the checks did not finish in {self.deadline + GRACE:g}s",
                             action="the server is overloaded: its log and /metrics say more")]
        done = report(found, nodes=len(facts.nodes), took=self.clock() - started)
        if node is None and check is None and checks is None and self.results is not None:
            self.results.doctor_done(done)  # the whole fleet's verdict, on /metrics
        return done
