"""Where each node's adapters sit in a fabric, for multi-node placement. Pure: a `FabricMap` in.

A replica spanning nodes runs collectives at the pace of its slowest path. Nodes under one leaf
talk through that one switch; nodes under different leaves cross a spine (two more switch hops),
in a three-tier fabric perhaps a core (four). And one cable that trained below its siblings
(`1xNDR` among `4xNDR`) runs every collective of the replica at its rate. So placement needs, for
every node's adapter: the leaf it is cabled to, the groups of leaves above that leaf, and whether
its cable trained short.

- `path`: the leaf's GUID, then for each tier above the leaves the group of leaves joined through
  switches of that tier or below (union-find over inter-switch cables), named by the lowest GUID in
  it. Two adapters whose paths first agree at position k are 2k switch hops apart: 0 the same leaf,
  2 through a spine, 4 through a core. Exact in a fat tree; elsewhere the fewest hops up and down.
- `short`: why the adapter's cable is degraded in the analysis, in the words placement's reasons
  use: "cable to leaf-2 trained 4xDDR (others 4xHDR)". Only host cables: a slow inter-switch
  cable is shared by every node under its leaf and shows in `ctl fabrics`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

import msgspec

from llmgw.fabric.analysis import FabricMap, LinkKind
from llmgw.fabric.topology import NodeKind

_SWITCH_NAME = re.compile(r"MF0;([^:]+):")  # NVIDIA's "MF0;leaf-2:MQM9700/U1": the name the operator set


class Place(msgspec.Struct, frozen=True, gc=False):
    fabric: str
    leaf: str  # GUID
    leaf_name: str
    path: tuple[str, ...]  # leaf GUID, then the group above it at each tier
    short: str = ""  # the cable trained below its kind's norm: why, for people; "" when it did not


class Located(msgspec.Struct, frozen=True, gc=False):
    """Where a set of a node's adapters sits: per tier, the groups they are in (tier 0: their
    leaves), the leaves' names, and the short cables among them in words ("" when none)."""

    levels: tuple[tuple[str, ...], ...]
    leaves: tuple[str, ...]
    short: str = ""


class Places(msgspec.Struct, gc=False):
    """Every analysed fabric's adapters by node and device: what multi-node placement reads.
    `whole`: each node's `locate` over all its adapters, computed once when the view is built
    (off the event loop), since a fabric usually takes every adapter of a node."""

    by_node: dict[str, dict[str, Place]] = {}
    whole: dict[str, Located] = {}


def locate(mine: Sequence[Place]) -> Located:
    """Where these adapters (one node's, of one fabric) sit. One map's paths are all as long;
    zip stops at the shortest should two fabrics' maps differ."""
    levels = tuple(tuple(sorted(set(tier))) for tier in zip(*(p.path for p in mine), strict=False))
    return Located(levels=levels, leaves=tuple(sorted({p.leaf_name for p in mine})),
                   short="; ".join(p.short for p in mine if p.short))


def switch_name(description: str, guid: str) -> str:
    """`MF0;leaf-2:MQM9700/U1` → `leaf-2`; a one-word description (`sp69.cn.a0807`) as it is; a
    firmware default (`Quantum Mellanox Technologies`, on every switch alike) after the GUID."""
    match = _SWITCH_NAME.match(description)
    if match:
        return match[1]
    text = description.strip()
    if text and " " not in text:
        return text
    return f"{guid} ({text})" if text else guid


def places(fabric: str, fmap: FabricMap) -> dict[str, dict[str, Place]]:
    """node → device → where that adapter sits in this fabric, for adapters the map names a node of."""
    names = {s.guid: switch_name(s.description, s.guid) for s in fmap.switches}
    level = {s.guid: s.level for s in fmap.switches}
    top = max((lv for lv in level.values() if lv >= 0), default=0)
    groups = _groups(fmap, level, top)
    adapters = {a.guid: a for a in fmap.adapters if a.node}
    host_links = [link for link in fmap.links if link.kind is LinkKind.HOST]
    norm = Counter(f"{link.width}{link.speed}" for link in host_links if not link.degraded).most_common(1)
    others = norm[0][0] if norm else ""
    out: dict[str, dict[str, Place]] = {}
    for link in host_links:
        if link.a.kind is NodeKind.SWITCH:
            leaf, host = link.a, link.b
        elif link.b.kind is NodeKind.SWITCH:
            leaf, host = link.b, link.a
        else:
            continue
        adapter = adapters.get(host.guid)
        if adapter is None or adapter.node is None:
            continue
        path = (leaf.guid, *(groups[k].get(leaf.guid, leaf.guid) for k in range(1, top + 1)))
        short = ""
        if link.degraded:
            rate = f"{link.width}{link.speed}"
            short = f"cable to {names.get(leaf.guid, leaf.guid)} trained {rate}" + (f" (others {others})" if others
                                                                                    else f" ({link.reason})")
        device = adapter.device if host.port == 1 or not adapter.device else f"{adapter.device}/{host.port}"
        out.setdefault(adapter.node, {})[device or adapter.guid] = Place(
            fabric=fabric, leaf=leaf.guid, leaf_name=names.get(leaf.guid, leaf.guid), path=path, short=short)
    return out


def _groups(fmap: FabricMap, level: Mapping[str, int], top: int) -> list[dict[str, str]]:
    """For each tier k (1 … top): switch GUID → the lowest GUID of its group, the switches joined
    through cables between switches of tier k or below."""
    cables = [(link.a.guid, link.b.guid) for link in fmap.links if link.kind is LinkKind.SWITCH]
    out: list[dict[str, str]] = [{}]
    for k in range(1, top + 1):
        parent = {guid: guid for guid, lv in level.items() if 0 <= lv <= k}
        for a, b in cables:
            if a in parent and b in parent:
                ra, rb = _find(parent, a), _find(parent, b)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)  # the lowest GUID names the group
        out.append({guid: _find(parent, guid) for guid in parent})
    return out


def _find(parent: dict[str, str], x: str) -> str:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def merge(fabrics: Mapping[str, Mapping[str, Mapping[str, Place]]]) -> Places:
    """One view over every fabric's places (fabric → node → device → place), fabrics in id order."""
    by_node: dict[str, dict[str, Place]] = {}
    for fabric in sorted(fabrics):
        for node, devices in fabrics[fabric].items():
            by_node.setdefault(node, {}).update(devices)
    whole = {node: locate([devices[d] for d in sorted(devices)]) for node, devices in by_node.items()}
    return Places(by_node=by_node, whole=whole)
