"""A fabric map from one node's dump, held against what every node reads of its own ports. Pure.

The map of a fabric comes from one agent's `ibnetdiscover` (server/fabric_service.py records
which: `discovered_by`). Taken alone, that agent could print a dump in which other nodes' cables
trained short and so steer multi-node placement away from them (issue 40, finding 10). But every
node reads its own ports — sysfs `rate`, `state`, `phys_state` (Documentation/ABI/stable/
sysfs-class-infiniband), sent in each heartbeat — so each host cable has a second witness: the
node at its adapter end.

- Where the map's rate for a host cable differs from the rate its node reads, the map says so (a
  `map_disagrees` problem naming the dump's author and the node), and the node's own reading
  decides whether that cable is degraded: a node can misreport only its own cables, which costs
  nobody but itself.
- Where the map shows a cable at a port its node reads as having no link (`phys_state` Polling,
  Disabled or Sleep; not "anything but LinkUp": a real mlx4 board prints `4: ACTIVE` there), the
  map says so; the cable stays (ibnetdiscover lists only ports with a physical link, so one of the
  two is stale or false).
- Inter-switch cables have no second witness: they show as the dump has them, under its author.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import msgspec

from llmgw.fabric.analysis import (
    FabricMap,
    LinkInfo,
    LinkKind,
    Problem,
    ProblemKind,
    degraded_problem,
)
from llmgw.fabric.topology import NodeKind

NO_LINK = frozenset({"Polling", "Disabled", "Sleep"})  # enum ib_port_phys_state names with no physical link
TOLERANCE = 0.01  # relative: the kernel's rate and width × lane rate agree to the digit


class OwnPort(msgspec.Struct, frozen=True, gc=False):
    """One port as its own node reads it (the latest heartbeat, else the Register's inventory)."""

    node: str
    device: str
    port: int
    state: str  # ACTIVE, INIT, DOWN, …
    phys_state: str  # LinkUp, Polling, Disabled, … ("" when not read)
    rate_gbps: float  # 0 when not read


def _differ(a: float, b: float) -> bool:
    return abs(a - b) > TOLERANCE * max(a, b)


def cross_check(fmap: FabricMap, own: Mapping[tuple[str, int], OwnPort], source: str) -> FabricMap:
    """`fmap` with every host cable held against its node's own reading. `own`: (adapter GUID
    `0x…`, port number) → that port's reading; `source`: whose dump the map is ("node/port")."""
    host_links = [link for link in fmap.links if link.kind is LinkKind.HOST]
    norm_counts = Counter(link.rate_gbps for link in host_links if not link.degraded and link.rate_gbps > 0)
    norm = norm_counts.most_common(1)[0][0] if norm_counts else 0.0
    found: list[Problem] = []
    changed: dict[int, LinkInfo] = {}
    for index, link in enumerate(fmap.links):
        if link.kind is not LinkKind.HOST:
            continue
        end = link.b if link.a.kind is NodeKind.SWITCH else link.a
        reading = own.get((end.guid, end.port))
        if reading is None:
            continue
        where = f"{reading.node} {reading.device}/{reading.port}"
        if reading.phys_state in NO_LINK:
            found.append(Problem(kind=ProblemKind.MAP_DISAGREES,
                                 message=f"the dump from {source} shows a cable at {where}; {reading.node} reads "
                                         f"the port as {reading.state or 'DOWN'} ({reading.phys_state})"))
            continue
        if reading.rate_gbps <= 0 or link.rate_gbps <= 0 or not _differ(reading.rate_gbps, link.rate_gbps):
            continue
        degraded = norm > 0 and reading.rate_gbps < norm and _differ(reading.rate_gbps, norm)
        reason = (f"{reading.node} reads its port at {reading.rate_gbps:g} Gb/s where {norm:g} is the norm"
                  if degraded else "")
        changed[index] = msgspec.structs.replace(link, degraded=degraded, reason=reason)
        found.append(Problem(kind=ProblemKind.MAP_DISAGREES,
                             message=f"the dump from {source} has the cable at {where} at {link.rate_gbps:g} Gb/s "
                                     f"({link.width}{link.speed}); {reading.node} reads {reading.rate_gbps:g} Gb/s: "
                                     f"the node's own reading is used"))
    if not found:
        return fmap
    links = [changed.get(i, link) for i, link in enumerate(fmap.links)]
    rebuilt = (ProblemKind.DEGRADED_LINK, ProblemKind.RAIL_VIOLATION)  # in the order analyse lists them
    problems = [p for p in fmap.problems if p.kind not in rebuilt]
    problems.extend(degraded_problem(link) for link in links if link.degraded)
    problems.extend(p for p in fmap.problems if p.kind is ProblemKind.RAIL_VIOLATION)
    problems.extend(found)
    summary = msgspec.structs.replace(fmap.summary, degraded_links=sum(1 for link in links if link.degraded))
    return msgspec.structs.replace(fmap, links=links, problems=problems, summary=summary)
