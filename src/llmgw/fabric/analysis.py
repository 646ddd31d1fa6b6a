"""What a parsed topology means: switch tiers, which adapter is which node's, degraded cables,
rail alignment, and the problems an operator should read. Pure: a `Topology` in, a `FabricMap` out.

- **Tiers.** A switch's tier is its distance from the host adapters: switches with a host
  cable are leaves (0), the next hop spines (1), anything further core (2+). SHARP aggregation
  nodes (`Mellanox Technologies Aggregation Node`, a CA inside every Quantum switch) are not
  hosts, or every spine with one would read as a leaf. A switch no adapter reaches is `unreached`.
- **Adapters.** A node description is `<hostname> <device>` when the host set it (`stage114 mlx4_0`,
  `compute-00-01 HCA-1`); the firmware default (`MT25408 ConnectX Mellanox Technologies`) names no
  node. What the agents report (GUID → node, device) wins over any description.
- **Degraded cables.** No tool marks a cable degraded: it shows only as a width or speed below
  what the rest of its kind run at. Links fall into kinds (host cables, inter-switch cables,
  aggregation-node and loopback cables); each kind's norm is its most common width and its most
  common speed (a tie goes to the lower, so a mixed fabric is not flagged wholesale), taken from
  the whole fabric when a kind has fewer than MIN_NORM links. An inter-switch link below a
  parallel link between the same two switches is degraded too. The samples' notes decide the
  rule: `1xSDR` among `4xSDR`, `4xDDR` among `4xQDR` hosts, `4xSDR` HCAs on a `4xHDR` fabric.
- **Rails.** In a rail-optimised fabric the Nth adapter (by device name: `mlx5_3`) of every node in
  a group reaches one leaf, a different leaf for each N. Each leaf's rail is the device most
  adapters on it have; an adapter on a leaf of another rail is a violation, named with the leaf
  its rail uses in its node's group. A fabric where that rule fits fewer than RAIL_FIT of the
  adapters is not rail-optimised and has no rails (and no violations).
"""

from __future__ import annotations

import enum
import functools
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping

import msgspec

from llmgw.fabric.topology import (
    SPEED_RANK,
    SPEEDS,
    WIDTHS,
    Link,
    Node,
    NodeKind,
    Topology,
    lanes,
    link_gbps,
)

MIN_NORM = 3  # a kind with fewer links takes the fabric's norm
RAIL_FIT = 0.6  # share of multi-adapter nodes' adapters on their rail's leaf for a fabric to count as rail-optimised
MAX_NATURAL = 65_536  # natural sort keys remembered (device and switch names repeat)
MAX_LINE_PROBLEMS = 20  # unreadable lines listed one by one; the rest are counted
TIER_NAMES = ("leaf", "spine")
AGGREGATION = "Aggregation Node"
_HOST_DESC = re.compile(
    r"(\S+)\s+(mlx\d+_\d+|mlx\d+|HCA-\d+|hfi\d+_\d+|qib\d+|mthca\d+|irdma\d+|bnxt_re\d+|ib\d+|rdma\d+)$", re.ASCII
)
_LANES = {w: lanes(w) for w in WIDTHS}
_VENDOR_WORDS = ("Mellanox", "Technologies", "NVIDIA", "Intel", "Voltaire", "QLogic", "ConnectX")


class ProblemKind(enum.StrEnum):
    UNREADABLE_LINE = "unreadable_line"
    TRUNCATED = "truncated"
    REDACTED = "redacted"
    DEGRADED_LINK = "degraded_link"
    RAIL_VIOLATION = "rail_violation"
    NO_STANDBY = "no_standby"
    SM_DISAGREE = "sm_disagree"
    NO_SM = "no_sm"
    MASTER_CHANGED = "master_changed"
    MAP_DISAGREES = "map_disagrees"  # a node's own port reading against the dump (fabric/crosscheck.py)


class LinkKind(enum.StrEnum):
    HOST = "host"
    SWITCH = "switch"
    AGGREGATION = "aggregation"
    LOOP = "loop"


class Problem(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    kind: ProblemKind
    message: str
    line: int = 0


class SwitchInfo(msgspec.Struct, kw_only=True, gc=False):
    guid: str
    description: str
    tier: str  # leaf | spine | core | unreached
    level: int  # hops from the nearest host adapter's leaf; -1 unreached
    lid: int = 0
    ports: int = 0
    seen: bool = True


class AdapterInfo(msgspec.Struct, kw_only=True, gc=False):
    guid: str
    node: str | None  # None: neither the agents nor the description name one
    device: str = ""
    description: str = ""
    lid: int = 0
    seen: bool = True


class LinkEnd(msgspec.Struct, kw_only=True, gc=False):
    guid: str
    port: int
    kind: NodeKind
    name: str  # the node (adapters) or the description (switches)


class LinkInfo(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    a: LinkEnd
    b: LinkEnd
    kind: LinkKind
    width: str
    speed: str
    rate_gbps: float
    degraded: bool
    reason: str = ""


class RailInfo(msgspec.Struct, kw_only=True, gc=False):
    group: str
    rail: str  # the device every node's adapter on this rail has (`mlx5_3`)
    leaves: list[str]  # GUIDs
    adapters: int


class RailViolation(msgspec.Struct, kw_only=True, gc=False):
    node: str
    adapter: str  # device (`mlx5_3`)
    guid: str
    leaf: str  # GUID of the leaf it reaches
    leaf_description: str
    rail_leaf: str  # GUID of the leaf its rail uses in its group; "" when the group has none
    rail_leaf_description: str = ""


class Summary(msgspec.Struct, kw_only=True, gc=False):
    switches: int
    adapters: int
    aggregation_nodes: int
    links: int
    degraded_links: int
    tiers: dict[str, int]
    rail_optimised: bool
    unreadable_lines: int


class FabricMap(msgspec.Struct, kw_only=True, gc=False):
    format: str
    summary: Summary
    switches: list[SwitchInfo]
    adapters: list[AdapterInfo]
    links: list[LinkInfo]
    rails: list[RailInfo]
    rail_violations: list[RailViolation]
    problems: list[Problem]
    # Nodes not judged for rails: their adapters are counted or named unlike most nodes' (a UFM
    # host's `HCA-1`, a storage box with 1 adapter of 4), so their rank by name means nothing.
    rails_apart: list[str] = []


def host_of(description: str) -> tuple[str | None, str]:
    """(node, device) a node description names: `stage114 mlx4_0` → ("stage114", "mlx4_0");
    a firmware default or an aggregation node → (None, "")."""
    text = description.strip()
    match = _HOST_DESC.fullmatch(text)
    if match:
        return match[1], match[2]
    if text and " " not in text and not any(w in text for w in _VENDOR_WORDS):
        return text, ""
    return None, ""


def is_aggregation(node: Node) -> bool:
    return node.kind is NodeKind.CA and AGGREGATION in node.description


def tier_name(level: int) -> str:
    if level < 0:
        return "unreached"
    return TIER_NAMES[level] if level < len(TIER_NAMES) else "core"


def analyse(topo: Topology, known: Mapping[str, tuple[str, str]] | None = None) -> FabricMap:
    """The map of one topology. `known`: adapter GUID (node or port GUID, `0x…`) → (node, device)
    as the agents report them; they win over descriptions."""
    known = known or {}
    nodes = topo.nodes
    hosts: dict[str, tuple[str | None, str]] = {}  # CA key → (node, device)
    for node in nodes.values():
        if node.kind is NodeKind.CA and not is_aggregation(node):
            hosts[node.key] = known.get(node.key) or host_of(node.description)
    if known:  # a port GUID the agents know names the adapter too
        for link in topo.links:
            for side, guid in ((link.a, link.a_port_guid), (link.b, link.b_port_guid)):
                if guid and guid in known and side.key in hosts:
                    hosts[side.key] = known[guid]

    aggregation = {key for key, node in nodes.items() if is_aggregation(node)}
    kinds = [_link_kind(nodes, aggregation, link) for link in topo.links]
    levels = _levels(topo, hosts, kinds)
    degraded = _degraded(topo.links, kinds)

    switches = [
        SwitchInfo(guid=n.key, description=n.description, tier=tier_name(levels.get(n.key, -1)),
                   level=levels.get(n.key, -1), lid=n.lid, ports=n.ports, seen=n.seen)
        for n in nodes.values() if n.kind is NodeKind.SWITCH
    ]
    adapters = [
        AdapterInfo(guid=key, node=hosts[key][0], device=hosts[key][1], description=nodes[key].description,
                    lid=nodes[key].lid, seen=nodes[key].seen)
        for key in hosts
    ]

    ends: dict[tuple[str, int], LinkEnd] = {}

    def end(key: str, port: int) -> LinkEnd:
        found = ends.get((key, port))
        if found is None:
            host = hosts.get(key)
            node = nodes[key]
            name = f"{host[0]} {host[1]}".strip() if host is not None and host[0] else node.description
            found = ends[(key, port)] = LinkEnd(guid=key, port=port, kind=node.kind, name=name)
        return found

    gbps: dict[tuple[str, str], float] = {}
    links = []
    for link, kind in zip(topo.links, kinds, strict=True):
        reason = degraded.get(id(link), "")
        rate = gbps.get((link.width, link.speed))
        if rate is None:
            rate = gbps[(link.width, link.speed)] = link_gbps(link.width, link.speed)
        links.append(LinkInfo(a=end(link.a.key, link.a.port), b=end(link.b.key, link.b.port), kind=kind,
                              width=link.width, speed=link.speed, rate_gbps=rate, degraded=bool(reason),
                              reason=reason))

    apart: list[str] = []
    rails, violations, optimised = _rails(topo, hosts, kinds, apart)
    problems = _problems(topo, links, violations, nodes)
    tiers = Counter(s.tier for s in switches)
    summary = Summary(
        switches=len(switches), adapters=len(adapters),
        aggregation_nodes=len(aggregation),
        links=len(links), degraded_links=sum(1 for link in links if link.degraded),
        tiers={name: tiers[name] for name in (*TIER_NAMES, "core", "unreached") if name in tiers},
        rail_optimised=optimised, unreadable_lines=len(topo.problems),
    )
    return FabricMap(format=topo.format, summary=summary, switches=switches, adapters=adapters, links=links,
                     rails=rails, rail_violations=violations, problems=problems, rails_apart=apart)


def _link_kind(nodes: Mapping[str, Node], aggregation: set[str], link: Link) -> LinkKind:
    a, b = link.a.key, link.b.key
    if a == b:
        return LinkKind.LOOP
    if nodes[a].kind is NodeKind.SWITCH and nodes[b].kind is NodeKind.SWITCH:
        return LinkKind.SWITCH
    if a in aggregation or b in aggregation:
        return LinkKind.AGGREGATION
    return LinkKind.HOST


def _levels(topo: Topology, hosts: Mapping[str, object], kinds: list[LinkKind]) -> dict[str, int]:
    """Hops from the leaves (switches with a host cable), breadth first over switch links."""
    nodes = topo.nodes
    neighbours: dict[str, list[str]] = defaultdict(list)
    level: dict[str, int] = {}
    for link, kind in zip(topo.links, kinds, strict=True):
        a, b = link.a.key, link.b.key
        if kind is LinkKind.SWITCH:
            neighbours[a].append(b)
            neighbours[b].append(a)
        elif kind is LinkKind.HOST:
            for here, there in ((a, b), (b, a)):
                if there in hosts and nodes[here].kind is NodeKind.SWITCH:
                    level[here] = 0
    frontier = list(level)
    depth = 0
    while frontier:
        depth += 1
        following = []
        for key in frontier:
            for other in neighbours.get(key, ()):
                if other not in level:
                    level[other] = depth
                    following.append(other)
        frontier = following
    return level


def _norm(values: Iterable[int]) -> int | None:
    """The most common value; a tie goes to the lower."""
    counts = Counter(values)
    if not counts:
        return None
    top = max(counts.values())
    return min(v for v, c in counts.items() if c == top)


def _degraded(links: list[Link], kinds: list[LinkKind]) -> dict[int, str]:
    widths: dict[LinkKind, list[int]] = defaultdict(list)
    speeds: dict[LinkKind, list[int]] = defaultdict(list)
    for link, kind in zip(links, kinds, strict=True):
        width = _LANES.get(link.width, 0)
        if width:
            widths[kind].append(width)
        if link.speed in SPEED_RANK:
            speeds[kind].append(SPEED_RANK[link.speed])
    every_width = [w for kind, ws in widths.items() if kind is not LinkKind.LOOP for w in ws]
    every_speed = [s for kind, ss in speeds.items() if kind is not LinkKind.LOOP for s in ss]
    fabric_width, fabric_speed = _norm(every_width), _norm(every_speed)
    norms: dict[LinkKind, tuple[int | None, int | None]] = {}
    for kind in LinkKind:
        w = _norm(widths[kind]) if len(widths[kind]) >= MIN_NORM else fabric_width
        s = _norm(speeds[kind]) if len(speeds[kind]) >= MIN_NORM else fabric_speed
        norms[kind] = (w, s)

    found: dict[int, str] = {}
    for link, kind in zip(links, kinds, strict=True):
        width_norm, speed_norm = norms[kind]
        width, speed = _LANES.get(link.width, 0), SPEED_RANK.get(link.speed)
        reasons = []
        if width and width_norm and width < width_norm:
            reasons.append(f"{link.width} where {width_norm}x is the norm")
        if speed is not None and speed_norm is not None and speed < speed_norm:
            reasons.append(f"{link.speed} where {SPEEDS[speed_norm]} is the norm")
        if reasons:
            found[id(link)] = f"{' and '.join(reasons)} for {kind.value} links"

    siblings: dict[tuple[str, str], list[Link]] = defaultdict(list)
    for link, kind in zip(links, kinds, strict=True):
        if kind is LinkKind.SWITCH:
            siblings[(link.a.key, link.b.key) if link.a.key < link.b.key else (link.b.key, link.a.key)].append(link)
    for group in siblings.values():
        if len(group) < 2:
            continue
        best = max(group, key=_rank)
        for link in group:
            if id(link) not in found and _rank(link) < _rank(best):
                found[id(link)] = (f"{link.width}{link.speed} where {len(group) - 1} parallel links run up to "
                                   f"{best.width}{best.speed}")
    return found


def _rank(link: Link) -> tuple[float, int]:
    return (link_gbps(link.width, link.speed), SPEED_RANK.get(link.speed, -1))


_DIGITS = re.compile(r"(\d{1,18})", re.ASCII)


@functools.lru_cache(maxsize=MAX_NATURAL)
def _natural(text: str) -> tuple[tuple[int, str], ...]:
    """Sort key that puts mlx5_2 before mlx5_10; every element is (number, text) so keys compare."""
    return tuple((int(p), "") if i % 2 else (-1, p) for i, p in enumerate(_DIGITS.split(text)))


def _shape(devices: Iterable[str]) -> tuple[str, ...]:
    """How a node's adapters look: their names with the numbers taken out (`mlx5_#`, `HCA-#`)."""
    return tuple(sorted(re.sub(r"\d+", "#", d) for d in devices))


def _rails(topo: Topology, hosts: Mapping[str, tuple[str | None, str]],
           kinds: list[LinkKind], apart: list[str]) -> tuple[list[RailInfo], list[RailViolation], bool]:
    nodes = topo.nodes
    switch = NodeKind.SWITCH
    # node → [(device, adapter key, leaf key)] for its adapters cabled to a switch
    cabled: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for link, kind in zip(topo.links, kinds, strict=True):
        if kind is not LinkKind.HOST:
            continue
        a, b = link.a.key, link.b.key
        if nodes[b].kind is switch:
            here, there, port = a, b, link.a.port
        elif nodes[a].kind is switch:
            here, there, port = b, a, link.b.port
        else:
            continue
        host = hosts.get(here)
        if host is None or host[0] is None:
            continue
        cabled[host[0]].append((host[1] if port == 1 else f"{host[1]}/{port}", here, there))
    # The Nth adapter of a node, by device name (mlx5_0 < mlx5_2 < mlx5_10), then GUID.
    entries: list[tuple[str, int, str, str, str]] = []  # node, rank, device, adapter, leaf
    # Rails are judged among nodes that look alike: the commonest shape (adapter count and naming).
    shapes = {node: _shape(i[0] for i in items) for node, items in cabled.items() if len(items) >= 2}
    common = Counter(shapes.values()).most_common(1)[0][0] if shapes else ()
    apart.extend(sorted((n for n, shape in shapes.items() if shape != common), key=_natural))
    for node, items in cabled.items():
        if len(items) < 2 or shapes.get(node) != common:
            continue
        for rank, (device, adapter, leaf) in enumerate(sorted(items, key=lambda i: (_natural(i[0]), i[1]))):
            entries.append((node, rank, device or f"adapter {rank}", adapter, leaf))
    if len({e[0] for e in entries}) < 2:
        return [], [], False

    on_leaf: dict[str, Counter[int]] = defaultdict(Counter)
    for _, rank, _, _, leaf in entries:
        on_leaf[leaf][rank] += 1
    leaf_rail = {leaf: min(r for r, c in counts.items() if c == max(counts.values()))
                 for leaf, counts in on_leaf.items()}
    matched = [e for e in entries if leaf_rail[e[4]] == e[1]]
    if len(matched) <= RAIL_FIT * len(entries) or len(set(leaf_rail.values())) < 2:
        return [], [], False

    # Groups: leaves joined by a node whose adapters sit on their rails' leaves.
    parent: dict[str, str] = {leaf: leaf for leaf in leaf_rail}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    node_leaves: dict[str, list[str]] = defaultdict(list)
    for node, _, _, _, leaf in matched:
        node_leaves[node].append(leaf)
    for leaves in node_leaves.values():
        for leaf in leaves[1:]:
            parent[find(leaf)] = find(leaves[0])
    members: dict[str, list[str]] = defaultdict(list)
    for leaf in leaf_rail:
        members[find(leaf)].append(leaf)
    described = {leaf: _natural(nodes[leaf].description) + _natural(leaf) for leaf in leaf_rail}
    ordered = sorted(members.values(), key=lambda ls: min(described[leaf] for leaf in ls))
    group_of = {leaf: f"group-{i}" for i, leaves in enumerate(ordered, 1) for leaf in leaves}

    rail_leaves: dict[tuple[str, int], list[str]] = defaultdict(list)  # (group, rank) → leaves
    for leaf in sorted(leaf_rail, key=described.__getitem__):
        rail_leaves[(group_of[leaf], leaf_rail[leaf])].append(leaf)
    devices: dict[tuple[str, int], Counter[str]] = defaultdict(Counter)
    for _, rank, device, _, leaf in matched:
        devices[(group_of[leaf], rank)][device] += 1
    rails = [
        RailInfo(group=g, rail=devices[(g, r)].most_common(1)[0][0] if devices[(g, r)] else f"adapter {r}",
                 leaves=leaves, adapters=sum(devices[(g, r)].values()))
        for (g, r), leaves in sorted(rail_leaves.items(), key=lambda item: (_natural(item[0][0]), item[0][1]))
    ]

    violations = []
    for node, rank, device, adapter, leaf in entries:
        if leaf_rail[leaf] == rank:
            continue
        home = node_leaves.get(node)
        # A node none of whose adapters is on its rail (both swapped on a 2-rail node, the commonest
        # miscabling) has no home from its matches: the leaf it is cabled to says its group.
        group = group_of[home[0]] if home else group_of[leaf]
        candidates = rail_leaves.get((group, rank), [])
        expected = candidates[0] if candidates else ""
        violations.append(RailViolation(
            node=node, adapter=device, guid=adapter, leaf=leaf, leaf_description=nodes[leaf].description,
            rail_leaf=expected, rail_leaf_description=nodes[expected].description if expected else "",
        ))
    violations.sort(key=lambda v: (_natural(v.node), _natural(v.adapter)))
    return rails, violations, True


def degraded_problem(link: LinkInfo) -> Problem:
    return Problem(kind=ProblemKind.DEGRADED_LINK,
                   message=f"{link.a.name} [{link.a.port}] ↔ {link.b.name} [{link.b.port}]: {link.reason}")


def _problems(topo: Topology, links: list[LinkInfo], violations: list[RailViolation],
              nodes: Mapping[str, Node]) -> list[Problem]:
    problems = [
        Problem(kind=ProblemKind.UNREADABLE_LINE, line=p.line, message=f"line {p.line}: {p.reason}: {p.text}")
        for p in topo.problems[:MAX_LINE_PROBLEMS]
    ]
    if len(topo.problems) > MAX_LINE_PROBLEMS:
        problems.append(Problem(kind=ProblemKind.UNREADABLE_LINE,
                                message=f"and {len(topo.problems) - MAX_LINE_PROBLEMS} more unreadable lines"))
    unseen = [n for n in nodes.values() if not n.seen]
    if unseen and topo.format != "ibnetdiscover-ports":
        problems.append(Problem(
            kind=ProblemKind.TRUNCATED,
            message=f"{len(unseen)} nodes are named by other blocks but have no block of their own "
                    f"(a file cut short?), e.g. {unseen[0].description or unseen[0].key}",
        ))
    if topo.redacted:
        problems.append(Problem(kind=ProblemKind.REDACTED,
                                message="GUIDs are redacted: nodes are told apart by their descriptions"))
    problems.extend(degraded_problem(link) for link in links if link.degraded)
    for v in violations:
        where = (f"its rail uses {v.rail_leaf_description} ({v.rail_leaf})" if v.rail_leaf
                 else "no leaf carries this rail for the node's group")
        problems.append(Problem(
            kind=ProblemKind.RAIL_VIOLATION,
            message=f"{v.node} {v.adapter} reaches {v.leaf_description} ({v.leaf}); {where}",
        ))
    return problems
