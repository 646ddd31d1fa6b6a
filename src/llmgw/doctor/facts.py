"""What doctor's checks read (facts) and what they say (findings). Pure: msgspec Structs only.

The server builds the facts from its registry, reconciler and fabric map (server/doctor.py);
`ctl doctor --local` builds one node's from the agent's own discovery (agent/selfcheck.py).
Every fact an older agent does not send is None, and the check that needs it says `unknown`
with that reason instead of guessing.
"""

from __future__ import annotations

import msgspec

from llmgw.verdict import Status, exit_code
from llmgw.wire import messages as m

CLUSTER = "(cluster)"  # the group of the fleet-wide findings; no node id has parentheses (wire/ids.py)


class Finding(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of doctor's answer: where, which check, how bad, what was found, what to do."""

    node: str  # a node id, or CLUSTER for the fleet-wide checks
    check: str
    status: Status
    finding: str
    subject: str = ""  # the port, GPU, fabric or model the finding is about
    action: str = ""  # what to do; set whenever the status is not ok


class NodeFacts(msgspec.Struct, kw_only=True):
    id: str
    state: str  # ready | unreachable | lost | local (`--local`: the machine doctor runs on)
    reason: str = ""
    connected: bool = True
    last_heartbeat_age: float | None = None  # None: no heartbeat since it registered
    heartbeat_interval: float = 5.0
    inventory: m.Inventory = msgspec.field(default_factory=m.Inventory)
    fabric_status: list[m.FabricStatus] = []
    gpus: list[m.GpuHealth] | None = None  # the latest heartbeat's; None before the first
    ports: list[m.PortCounters] = []  # the latest reading of each port
    ports_before: list[m.PortCounters] | None = None  # an earlier reading (None: only one so far)
    window: float = 0.0  # seconds between `ports_before` and `ports`
    host: m.HostFacts | None = None
    cert_days_left: float | None = None  # None: the agent dials without a client certificate
    clock_skew: float | None = None  # server minus agent, seconds; None: not measured
    checks_clock: bool = True  # False with --local: there is no server to compare with


class ReplicaFacts(msgspec.Struct, kw_only=True):
    id: str
    model: str
    state: str  # pending | starting | ready | failed | stopping
    reason: str = ""
    state_age: float = 0.0  # seconds in this state
    failures: int = 0
    retry_in: float | None = None
    nodes: list[str] = []


class ProfileNeeds(msgspec.Struct, kw_only=True, frozen=True):
    """What one of a model's profiles asks of a node (the catalog Profile's gpus per node,
    gpu_kind, gpu_memory_mib): the nodes that could host it are the model's placement pool."""

    gpus: int = 1
    gpu_kind: str = ""
    gpu_memory_mib: int = 0


class ModelFacts(msgspec.Struct, kw_only=True):
    name: str
    replicas: int  # desired
    profiles: list[ProfileNeeds] = []  # empty: no profile, never placed (no pool)


class FabricProblemFact(msgspec.Struct, kw_only=True):
    kind: str  # llmgw.fabric.analysis.ProblemKind / subnet.FabricProblemKind values, or tool_failed
    message: str


class FabricFacts(msgspec.Struct, kw_only=True):
    id: str
    problems: list[FabricProblemFact] = []
    master: str = ""  # GUID, "" when none is known
    standbys: int = 0
    discovered: bool = False  # an ibnetdiscover topology is known


class ClusterFacts(msgspec.Struct, kw_only=True):
    nodes: list[NodeFacts] = []
    replicas: list[ReplicaFacts] = []
    models: list[ModelFacts] = []
    fabrics: list[FabricFacts] = []
    fabric_discovery: bool = False  # some agent answers Discover (else no fabric map is expected)


class Summary(msgspec.Struct, kw_only=True):
    ok: int = 0
    warn: int = 0
    crit: int = 0
    unknown: int = 0
    nodes: int = 0


class Report(msgspec.Struct, kw_only=True):
    findings: list[Finding]
    summary: Summary
    status: Status
    exit_code: int
    took: float = 0.0  # seconds the checks ran


def report(findings: list[Finding], nodes: int, took: float = 0.0) -> Report:
    """Findings with their counts, the worst status and the Nagios exit code."""
    counts = Summary(nodes=nodes)
    for f in findings:
        setattr(counts, f.status.value, getattr(counts, f.status.value) + 1)
    statuses = [f.status for f in findings]
    code = exit_code(statuses)
    worst = {0: Status.OK, 1: Status.WARN, 2: Status.CRIT, 3: Status.UNKNOWN}[code]
    return Report(findings=findings, summary=counts, status=worst, exit_code=code, took=round(took, 4))
