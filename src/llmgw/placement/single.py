"""Single-node placement: which node, which GPUs (NVLink aware), which port. Pure.

When nothing fits, the answer says why for every node ("gpu-03: 2 of 4 GPUs free",
"gpu-07: lost"), so an operator reading `ctl replicas` knows what to change.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import msgspec

from llmgw.placement.gpus import choose_gpus
from llmgw.wire.messages import Gpu


class NodeCapacity(msgspec.Struct, kw_only=True):
    """What placement knows of one node: its GPUs and what is already taken."""

    node_id: str
    state: str  # ready | unreachable | lost
    gpus: list[Gpu] = []
    used_gpus: set[int] = set()
    used_ports: set[int] = set()
    replicas_of_model: int = 0  # replicas of the model being placed already on this node
    can_start: bool = True  # the agent answers Start
    version: str = ""
    # Multi-node placement: the fabrics usable now (advertised, every port ACTIVE), why each
    # other declared one is not, and the node's address (its endpoint host: a master address).
    fabrics: list[str] = []
    fabric_notes: dict[str, str] = {}
    address: str = ""
    # The devices of each usable fabric (`ib` → mlx5_0 …): where placement looks the node up in
    # the fabric map; a fabric not listed means every adapter the map has of the node.
    fabric_devices: dict[str, list[str]] = {}
    # GPUs that take no new work, and why: a CRIT finding of doctor's GPU checks (server/remedy.py).
    unplaceable: dict[int, str] = {}


class Request(msgspec.Struct, kw_only=True):
    replica_id: str
    gpus: int
    gpu_kind: str = ""
    gpu_memory_mib: int = 0


class Placement(msgspec.Struct, frozen=True):
    node_id: str
    gpus: tuple[int, ...]
    port: int


class NoFit(msgspec.Struct, frozen=True):
    reasons: tuple[str, ...]

    def summary(self) -> str:
        if not self.reasons:
            return "no nodes have registered"
        return "; ".join(self.reasons)


def why_not(node: NodeCapacity, req: Request) -> str | None:
    """None when the node could host the request; else the reason, for people."""
    if node.state != "ready":
        return f"{node.node_id}: {node.state}"
    if not node.can_start:
        return f"{node.node_id}: agent {node.version or '(old)'} cannot start engines"
    if req.gpus == 0:
        return None
    if not node.gpus:
        return f"{node.node_id}: no GPUs"
    kind = req.gpu_kind.lower()
    of_kind = [g for g in node.gpus if not kind or kind in g.name.lower()]
    if not of_kind:
        names = sorted({g.name for g in node.gpus})
        return f"{node.node_id}: no {req.gpu_kind} GPUs (has {len(node.gpus)}× {', '.join(names)})"
    big = [g for g in of_kind if g.memory_mib >= req.gpu_memory_mib]
    if not big:
        most = max(g.memory_mib for g in of_kind)
        return f"{node.node_id}: GPUs have {most} MiB, the profile needs {req.gpu_memory_mib} MiB each"
    healthy = [g for g in big if g.health == "ok" and g.index not in node.unplaceable]
    if len(healthy) < req.gpus:
        if len(big) >= req.gpus:
            out = sorted(g.index for g in big if g.index in node.unplaceable)
            why = f" (not placeable: {'; '.join(node.unplaceable[i] for i in out)})" if out else ""
            return (f"{node.node_id}: only {len(healthy)} of {len(big)} matching GPUs are healthy, "
                    f"{req.gpus} needed{why}")
        return f"{node.node_id}: has {len(big)} matching GPUs, {req.gpus} needed"
    free = [g for g in healthy if g.index not in node.used_gpus]
    if len(free) < req.gpus:
        return f"{node.node_id}: {len(free)} of {len(healthy)} GPUs free, {req.gpus} needed"
    return None


def choose_port(replica_id: str, used: set[int], port_range: tuple[int, int]) -> int | None:
    """A free port, starting at an offset derived from the replica id: a retry after a
    'port in use' failure (new attempt, new id hash) does not walk into the same port."""
    lo, hi = port_range
    size = hi - lo + 1
    if size <= 0:
        return None
    start = zlib.crc32(replica_id.encode()) % size
    for i in range(size):
        port = lo + (start + i) % size
        if port not in used:
            return port
    return None


def free_for(node: NodeCapacity, req: Request) -> list[Gpu] | None:
    """The node's free GPUs that suit `req`, or None when the node cannot host it: what
    `why_not` decides, in one loop and without the words (1,000 nodes per placement)."""
    if node.state != "ready" or not node.can_start:
        return None
    kind = req.gpu_kind.lower()
    free = [
        g
        for g in node.gpus
        if g.health == "ok" and g.memory_mib >= req.gpu_memory_mib and g.index not in node.used_gpus
        and g.index not in node.unplaceable
        and (not kind or kind in g.name.lower())
    ]
    return free if len(free) >= req.gpus else None


def place(req: Request, nodes: Sequence[NodeCapacity], port_range: tuple[int, int]) -> Placement | NoFit:
    """Best fit with anti-affinity: spread a model's replicas over nodes, then pack GPUs tight.

    The reasons are worded only when nothing fits: a placement looks at every node once.
    """
    candidates: list[tuple[tuple[int, int, str], NodeCapacity, list[Gpu]]] = []
    for node in nodes:
        free = free_for(node, req)
        if free is not None:
            candidates.append(((node.replicas_of_model, len(free) - req.gpus, node.node_id), node, free))
    candidates.sort(key=lambda c: c[0])
    port_reasons: list[str] = []
    for _, node, free in candidates:
        port = choose_port(req.replica_id, node.used_ports, port_range)
        if port is None:
            port_reasons.append(f"{node.node_id}: no free port in {port_range[0]}-{port_range[1]}")
            continue
        return Placement(node.node_id, choose_gpus(free, req.gpus), port)
    reasons = [why for node in sorted(nodes, key=lambda n: n.node_id) if (why := why_not(node, req)) is not None]
    return NoFit(tuple(reasons + port_reasons))
