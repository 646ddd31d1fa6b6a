"""Doctor's fleet-wide checks: nodes lost, fabric problems, replicas failing, stuck or not placeable."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.doctor.facts import CLUSTER, ClusterFacts, Finding, ReplicaFacts
from llmgw.doctor.versions import check_driver_versions, check_firmware_versions
from llmgw.verdict import Status

OK, WARN, CRIT, UNKNOWN = Status.OK, Status.WARN, Status.CRIT, Status.UNKNOWN

# A replica starting this long (the reconciler's own start_timeout fails it at the profile's
# limit, 20 min by default) is worth a look: a download crawling, an engine compiling forever.
STUCK_STARTING = 600.0
STUCK_STOPPING = 300.0

# Fabric problem kinds (fabric/analysis.py, fabric/subnet.py, server/fabric_service.py) → status.
FABRIC_STATUS = {
    "no_sm": CRIT,  # ports up with no subnet manager: they carry nothing
    "sm_unreadable": WARN,  # the SM list came back in a format llmgw does not read: not "no SM"
    "sm_disagree": CRIT,  # two masters, or none: the subnet is split or unmanaged
    "no_standby": WARN,  # the next SM failure leaves the fabric unmanaged
    "master_changed": WARN,  # a failover in the last hour: why did the master go?
    "degraded_link": WARN,  # a cable trained below its width or speed
    "rail_violation": WARN,  # an adapter on another rail's leaf: NCCL's rings cross the spine
    "unreadable_line": WARN,
    "truncated": WARN,
    "tool_failed": UNKNOWN,  # ibnetdiscover or saquery failed: the map may be stale
    "map_disagrees": WARN,  # one node's dump says of a cable what the node at its end does not read
}
FABRIC_ACTION = {
    "no_sm": "start a subnet manager on this fabric (opensm on a switch or node)",
    "sm_unreadable": "run `saquery SMIR` (or `sminfo`) on that node by hand: llmgw reads those two formats",
    "sm_disagree": "sminfo through ports on each side; a partitioned fabric or two SMs with the same priority",
    "no_standby": "run a second subnet manager at a lower priority (a standby takes over when the master fails)",
    "master_changed": "the previous master's SM log says why it stopped; `llmgw ctl fabrics` shows the history",
    "degraded_link": "reseat or replace that cable; ibstat on both ends shows its width and speed",
    "rail_violation": "recable the adapter to its rail's leaf (see `llmgw ctl fabrics` for the rail plan)",
    "unreadable_line": "a newer ibnetdiscover format: upgrade llmgw on the server",
    "truncated": "ibnetdiscover was cut short: raise fabric.tool_timeout",
    "tool_failed": "run the tool by hand on that node to see why (ibnetdiscover / saquery SMIR)",
    "map_disagrees": "run ibstat on the node at the cable's end and ibnetdiscover on the dump's author: one of "
                     "them is stale or lies (the node's own reading is what placement uses)",
}

ClusterCheck = Callable[[ClusterFacts], list[Finding]]


def _f(check: str, status: Status, finding: str, action: str = "", subject: str = "") -> Finding:
    return Finding(node=CLUSTER, check=check, status=status, finding=finding, subject=subject,
                   action=action if status != OK else "")


def check_nodes(facts: ClusterFacts) -> list[Finding]:
    nodes = facts.nodes
    if not nodes:
        return [_f("nodes", WARN, "no node has registered", "start `llmgw agent` on the nodes; their log says why "
                   "they cannot connect")]
    gone = [n for n in nodes if n.state != "ready" or not n.connected]
    ready = len(nodes) - len(gone)
    if not gone:
        return [_f("nodes", OK, f"{len(nodes)} nodes, all ready")]
    names = ", ".join(f"{n.id} {n.state}" for n in gone[:8]) + (f" and {len(gone) - 8} more" if len(gone) > 8 else "")
    status = CRIT if ready == 0 else WARN
    return [_f("nodes", status, f"{ready} of {len(nodes)} nodes ready; {names}",
               "the agent check of each says why; `llmgw ctl forget NODE` for one gone for good")]


def check_fabrics(facts: ClusterFacts) -> list[Finding]:
    if not facts.fabrics:
        if not facts.fabric_discovery:
            return [_f("fabrics", OK, "no fabric map: no agent runs ibnetdiscover or saquery (the node checks "
                       "still grade each port)")]
        return [_f("fabrics", OK, "no InfiniBand fabric found yet")]
    out: list[Finding] = []
    for fabric in facts.fabrics:
        problems = [p for p in fabric.problems if p.kind != "redacted"]
        for p in problems:
            out.append(_f("fabrics", FABRIC_STATUS.get(p.kind, WARN), f"fabric {fabric.id}: {p.message}",
                          FABRIC_ACTION.get(p.kind, "`llmgw ctl fabrics` shows the fabric's problems"), fabric.id))
        if not problems:
            topology = "topology known" if fabric.discovered else "no topology yet"
            out.append(_f("fabrics", OK, f"fabric {fabric.id}: master {fabric.master or '?'}, "
                          f"{fabric.standbys} standby, {topology}", subject=fabric.id))
    return out


def _replica_problem(r: ReplicaFacts) -> tuple[str, str] | None:
    """(finding, action) for a replica that is not well, else None."""
    nodes = f" on {', '.join(r.nodes)}" if r.nodes else ""
    if r.state == "failed":
        retry = f", retry in {r.retry_in:.0f}s" if r.retry_in is not None else ""
        return (f"{r.id} failed{nodes} ({r.failures} failures{retry}): {r.reason or 'no reason given'}",
                f"`llmgw ctl replicas` shows its output; `llmgw ctl logs {r.id}`")
    if r.state == "pending":
        return (f"{r.id} cannot be placed: {r.reason or 'no reason given'}",
                "free GPUs, add nodes, or lower the model's replicas or gpus in the catalog")
    if r.state == "starting" and r.state_age >= STUCK_STARTING:
        return (f"{r.id} starting for {r.state_age / 60:.0f} min{nodes}" + (f": {r.reason}" if r.reason else ""),
                f"`llmgw ctl logs {r.id}`; a download or an engine that never answers /health")
    if r.state == "stopping" and r.state_age >= STUCK_STOPPING:
        return (f"{r.id} stopping for {r.state_age / 60:.0f} min{nodes}",
                "the node's agent may be gone: see its agent check")
    return None


def check_replicas(facts: ClusterFacts) -> list[Finding]:
    if not facts.models:
        return [_f("replicas", OK, "no models in the catalog")]
    out: list[Finding] = []
    for model in facts.models:
        mine = [r for r in facts.replicas if r.model == model.name]
        ready = sum(1 for r in mine if r.state == "ready")
        problems = [(r, p) for r in mine if (p := _replica_problem(r)) is not None]
        status = CRIT if model.replicas > 0 and ready == 0 else WARN
        for r, (finding, action) in problems:
            out.append(_f("replicas", status, f"{model.name}: {finding}", action, r.id))
        if not problems:
            starting = sum(1 for r in mine if r.state == "starting")
            note = f", {starting} starting" if starting else ""
            out.append(_f("replicas", OK, f"{model.name}: {ready} of {model.replicas} ready{note}", subject=model.name))
    return out


CLUSTER_CHECKS: dict[str, ClusterCheck] = {
    "nodes": check_nodes,
    "fabrics": check_fabrics,
    "replicas": check_replicas,
    "driver-versions": check_driver_versions,
    "firmware-versions": check_firmware_versions,
}
