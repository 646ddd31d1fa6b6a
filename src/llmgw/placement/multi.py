"""Multi-node placement: N nodes that share a usable fabric, each with the GPUs it needs. Pure.

A replica spanning nodes talks over one fabric; a node whose ports on it are not all ACTIVE
(or that does not have it at all) would hang the replica's first collective, so it is not a
candidate, and the answer says so per node and per fabric ("fabric ib: 1 of 2 nodes (gpu-01);
gpu-02: fabric ib not usable (mlx5_2: no ACTIVE port)"). Within a fabric the nodes are picked
as single-node placement picks one (spread a model's replicas, then pack GPUs tight, NVLink
aware within each node); rank 0 is the first of them. Its address on the management network
is the master address every rank dials, so a node whose address is not known yet cannot be one.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from llmgw.placement.gpus import choose_gpus
from llmgw.placement.single import (
    NodeCapacity,
    NoFit,
    Placement,
    Request,
    _free_for,
    _why_not,
    choose_port,
)
from llmgw.wire.messages import Gpu


class MultiPlacement(msgspec.Struct, frozen=True):
    fabric: str
    ranks: tuple[Placement, ...]  # rank order; rank 0 serves HTTP
    master_addr: str
    master_port: int


def _key(node: NodeCapacity, free: list[Gpu], req: Request) -> tuple[int, int, str]:
    return (node.replicas_of_model, len(free) - req.gpus, node.node_id)


def place_multi(req: Request, count: int, nodes: Sequence[NodeCapacity], port_range: tuple[int, int]) -> MultiPlacement | NoFit:
    """`count` nodes on one usable fabric, `req.gpus` GPUs on each, or why no set of them fits."""
    fits: list[tuple[tuple[int, int, str], NodeCapacity, list[Gpu]]] = []
    for node in nodes:
        free = _free_for(node, req)
        if free is not None and node.address:
            fits.append((_key(node, free, req), node, free))
    by_fabric: dict[str, list[tuple[tuple[int, int, str], NodeCapacity, list[Gpu]]]] = {}
    for entry in fits:
        for fabric in entry[1].fabrics:
            by_fabric.setdefault(fabric, []).append(entry)
    best: tuple[tuple[int, int, str], MultiPlacement] | None = None
    for fabric, entries in sorted(by_fabric.items()):
        if len(entries) < count:
            continue
        group = sorted(entries, key=lambda e: e[0])[:count]
        placement = _ports(req, fabric, group, port_range)
        if placement is None:
            continue
        score = (sum(e[0][0] for e in group), sum(e[0][1] for e in group), fabric)
        if best is None or score < best[0]:
            best = (score, placement)
    if best is not None:
        return best[1]
    return NoFit(tuple(_reasons(req, count, nodes, fits, by_fabric, port_range)))


def _ports(req: Request, fabric: str, group: list[tuple[tuple[int, int, str], NodeCapacity, list[Gpu]]],
           port_range: tuple[int, int]) -> MultiPlacement | None:
    ranks: list[Placement] = []
    master_port = 0
    for rank, (_, node, free) in enumerate(group):
        port = choose_port(f"{req.replica_id}-{rank}", node.used_ports, port_range)
        if port is None:
            return None
        if rank == 0:
            master = choose_port(f"{req.replica_id}-master", node.used_ports | {port}, port_range)
            if master is None:
                return None
            master_port = master
        ranks.append(Placement(node.node_id, choose_gpus(free, req.gpus), port))
    return MultiPlacement(fabric, tuple(ranks), group[0][1].address, master_port)


def _reasons(req: Request, count: int, nodes: Sequence[NodeCapacity],
             fits: list[tuple[tuple[int, int, str], NodeCapacity, list[Gpu]]],
             by_fabric: dict[str, list[tuple[tuple[int, int, str], NodeCapacity, list[Gpu]]]],
             port_range: tuple[int, int]) -> list[str]:
    reasons = [f"needs {count} nodes sharing a usable fabric, {req.gpus} GPUs on each"]
    for fabric, entries in sorted(by_fabric.items()):
        names = ", ".join(sorted(e[1].node_id for e in entries))
        if len(entries) < count:
            reasons.append(f"fabric {fabric}: {len(entries)} of {count} nodes ({names})")
        else:
            reasons.append(f"fabric {fabric}: no free ports in {port_range[0]}-{port_range[1]} on enough of {names}")
    if not by_fabric and fits:
        reasons.append("no two of the nodes that have the GPUs share a usable fabric")
    fitting = {e[1].node_id for e in fits}
    for node in sorted(nodes, key=lambda n: n.node_id):
        why = _why_not(node, req)
        if why is not None:
            reasons.append(why)
        elif not node.address:
            reasons.append(f"{node.node_id}: its address is not known yet (the master address of a multi-node replica)")
        elif node.node_id in fitting and not node.fabrics:
            notes = "; ".join(f"fabric {name} not usable ({why})" for name, why in sorted(node.fabric_notes.items()))
            reasons.append(f"{node.node_id}: {notes or 'no usable fabric'}")
        elif node.fabric_notes:
            notes = "; ".join(f"fabric {name} not usable ({why})" for name, why in sorted(node.fabric_notes.items()))
            reasons.append(f"{node.node_id}: {notes}")
    return reasons
