"""Multi-node placement: N nodes that share a usable fabric, each with the GPUs it needs. Pure.

A replica spanning nodes talks over one fabric; a node whose ports on it are not all ACTIVE
(or that does not have it at all) would hang the replica's first collective, so it is not a
candidate, and the answer says so per node and per fabric ("fabric ib: 1 of 2 nodes (gpu-01);
gpu-02: fabric ib not usable (mlx5_2: no ACTIVE port)"). Within a fabric the nodes are picked
as single-node placement picks one (spread a model's replicas, then pack GPUs tight, NVLink
aware within each node); rank 0 is the first of them. Its address (the host its engines are
reached on, its agent's advertise_host) is the master address every rank dials, so a node whose
address is not known yet cannot be one.

With the fabric map (`fabric/locality.py`: where each adapter is cabled, and which cables trained
short) the nodes are picked by where they sit, in this order:

1. nodes whose cable trained short come last: one slow cable paces every collective of the
   replica, so a healthy set wins over any set with one (`gpu-07: cable to leaf-2 trained 4xDDR
   (others 4xHDR)` says why in the placement's notes);
2. nodes under one leaf together (in a rail-optimised fabric: the same leaf on every rail), then
   the fewest switch hops: under one spine before across the core;
3. within that, as without a map: spread the model's replicas, pack GPUs tight.

A node the map does not have (not discovered yet, no map of this fabric) is placed as if the map
said nothing, after the nodes it does place. Cost: one look at every candidate per tier of the
fabric (three tiers: four looks), not a search over sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from llmgw.fabric.locality import Located, Places, locate
from llmgw.placement.gpus import choose_gpus
from llmgw.placement.single import (
    NodeCapacity,
    NoFit,
    Placement,
    Request,
    choose_port,
    free_for,
    why_not,
)
from llmgw.wire.messages import Gpu

MAX_NOTES = 6  # nodes named in a placement's notes; the rest are counted


class MultiPlacement(msgspec.Struct, frozen=True):
    fabric: str
    ranks: tuple[Placement, ...]  # rank order; rank 0 serves HTTP
    master_addr: str
    master_port: int
    # Where the nodes sit and why some came last, for people ("under one leaf: leaf-2";
    # "gpu-07: cable to leaf-2 trained 4xDDR (others 4xHDR)"); empty without a fabric map.
    notes: tuple[str, ...] = ()


Entry = tuple[tuple[int, int, str], NodeCapacity, list[Gpu]]


class _Located(msgspec.Struct, gc=False):
    entry: Entry
    levels: tuple[tuple[str, ...], ...]  # per tier, the groups the node's adapters are in; () unknown
    leaves: tuple[str, ...]  # the leaves' names
    short: str  # why a cable of the node trained short; "" when none did


def _key(node: NodeCapacity, free: list[Gpu], req: Request) -> tuple[int, int, str]:
    return (node.replicas_of_model, len(free) - req.gpus, node.node_id)


def place_multi(req: Request, count: int, nodes: Sequence[NodeCapacity], port_range: tuple[int, int],
                places: Places | None = None) -> MultiPlacement | NoFit:
    """`count` nodes on one usable fabric, `req.gpus` GPUs on each, or why no set of them fits.
    `places`: the fabric map's view (where each node's adapters are cabled); None: no map."""
    fits: list[Entry] = []
    for node in nodes:
        free = free_for(node, req)
        if free is not None and node.address:
            fits.append((_key(node, free, req), node, free))
    by_fabric: dict[str, list[Entry]] = {}
    for entry in fits:
        for fabric in entry[1].fabrics:
            by_fabric.setdefault(fabric, []).append(entry)
    best: tuple[tuple[int, int, int, int, str], MultiPlacement] | None = None
    for fabric, entries in sorted(by_fabric.items()):
        if len(entries) < count:
            continue
        located = [_locate(e, fabric, places) for e in entries]
        picked, hops, notes = _pick(located, count)
        group = [c.entry for c in picked]
        placement = _ports(req, fabric, group, port_range, notes)
        if placement is None:
            continue
        score = (sum(1 for c in picked if c.short), hops, sum(e[0][0] for e in group), sum(e[0][1] for e in group),
                 fabric)
        if best is None or score < best[0]:
            best = (score, placement)
    if best is not None:
        return best[1]
    return NoFit(tuple(_reasons(req, count, nodes, fits, by_fabric, port_range)))


def _locate(entry: Entry, fabric: str, places: Places | None) -> _Located:
    """Where the node's adapters of `fabric` sit, from the map (nothing when the map lacks it)."""
    node = entry[1]
    found: Located | None = None
    if places is not None:
        devices = places.by_node.get(node.node_id, {})
        wanted = node.fabric_devices.get(fabric)
        if devices and (not wanted or devices.keys() == set(wanted)):
            found = places.whole.get(node.node_id)  # every adapter: located when the view was built
        elif devices:
            mine = [devices[d] for d in wanted or () if d in devices]
            found = locate(mine) if mine else None
    if found is None or not found.levels:
        return _Located(entry=entry, levels=(), leaves=(), short="")
    return _Located(entry=entry, levels=found.levels, leaves=found.leaves, short=found.short)


def _pick(located: list[_Located], count: int) -> tuple[list[_Located], int, tuple[str, ...]]:
    """`count` of the candidates by the order in the module's docstring: (chosen, switch hops
    across them, notes). The lowest tier whose group holds enough wins; a group of a higher
    tier wins only by having fewer short cables."""
    depth = max((len(c.levels) for c in located), default=0)
    best: tuple[tuple[int, int, int, int], list[_Located]] | None = None
    for tier in range(depth + 1):  # tier == depth: the whole fabric, nodes the map lacks included
        groups: dict[tuple[str, ...], list[_Located]] = {}
        for c in located:
            if tier == depth:
                groups.setdefault((), []).append(c)
            elif tier < len(c.levels):
                groups.setdefault(c.levels[tier], []).append(c)
        for members in groups.values():
            if len(members) < count:
                continue
            chosen = _fill(members, count, tier)
            score = (sum(1 for c in chosen if c.short), tier, sum(c.entry[0][0] for c in chosen),
                     sum(c.entry[0][1] for c in chosen))
            # A tie goes to the group with the lowest keys (the lowest node ids, as without a map).
            if best is None or ((score, sorted(c.entry[0] for c in chosen))
                                < (best[0], sorted(c.entry[0] for c in best[1]))):
                best = (score, chosen)
        if best is not None and best[0][0] == 0:
            break  # nothing above this tier has fewer short cables
    assert best is not None  # the whole fabric's group holds every candidate, and there are enough
    chosen = best[1]
    hops = _span(chosen)
    return chosen, hops, _notes(located, chosen, hops) if depth else ()


def _fill(members: list[_Located], count: int, tier: int) -> list[_Located]:
    """The best `count` of one group: short cables last, nodes the map lacks after the ones it
    has, the bigger subgroups of the tier below first (more pairs a tier closer), then the
    usual key (spread, pack, id)."""
    if tier == 0:
        return sorted(members, key=lambda c: (bool(c.short), c.entry[0]))[:count]
    below: dict[tuple[str, ...], int] = {}
    lowest: dict[tuple[str, ...], tuple[int, int, str]] = {}  # a tie in size goes to the subgroup with the lowest key
    for c in members:
        if tier - 1 < len(c.levels):
            sub = c.levels[tier - 1]
            below[sub] = below.get(sub, 0) + (not c.short)
            lowest[sub] = min(lowest.get(sub, c.entry[0]), c.entry[0])

    def key(c: _Located) -> tuple[bool, bool, int, tuple[int, int, str], tuple[int, int, str]]:
        sub = c.levels[tier - 1] if tier - 1 < len(c.levels) else ()
        return (bool(c.short), not c.levels, -below.get(sub, 0), lowest.get(sub, c.entry[0]), c.entry[0])

    return sorted(members, key=key)[:count]


def _span(chosen: list[_Located]) -> int:
    """Switch hops between the farthest two of the chosen: 2 × the first tier they all share (0:
    one leaf); 2 × the tiers the map has when they share none, and 2 when the map lacks one of
    them (not known to be farther)."""
    depth = min((len(c.levels) for c in chosen), default=0)
    for tier in range(depth):
        if len({c.levels[tier] for c in chosen}) == 1:
            return 2 * tier
    return 2 * max(depth, 1)


def _notes(located: list[_Located], chosen: list[_Located], hops: int) -> tuple[str, ...]:
    leaves = sorted({name for c in chosen for name in c.leaves})
    unknown = [c.entry[1].node_id for c in chosen if not c.levels]
    if unknown:
        where = f"{len(unknown)} of the nodes not in the fabric map yet ({', '.join(unknown[:MAX_NOTES])})"
    elif hops == 0:
        where = f"under one leaf: {leaves[0]}" if len(leaves) == 1 else f"under the same leaves: {', '.join(leaves)}"
    else:
        where = (f"{hops} switch hops apart ({'through a spine' if hops == 2 else 'through the core'}), "
                 f"leaves {', '.join(leaves)}")
    notes = [where]
    taken = {id(c) for c in chosen}
    short = sorted((c for c in located if c.short), key=lambda c: c.entry[1].node_id)
    for c in short[:MAX_NOTES]:
        notes.append(f"{c.entry[1].node_id}: {c.short}"
                     + ("; placed: no set without it fits" if id(c) in taken else ""))
    if len(short) > MAX_NOTES:
        notes.append(f"and {len(short) - MAX_NOTES} more nodes with a short cable")
    return tuple(notes)


def _ports(req: Request, fabric: str, group: list[Entry], port_range: tuple[int, int],
           notes: tuple[str, ...] = ()) -> MultiPlacement | None:
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
    return MultiPlacement(fabric, tuple(ranks), group[0][1].address, master_port, notes)


def _reasons(req: Request, count: int, nodes: Sequence[NodeCapacity],
             fits: list[Entry], by_fabric: dict[str, list[Entry]],
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
        why = why_not(node, req)
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
