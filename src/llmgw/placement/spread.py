"""Spreading as a standing rule (issue 18): which replica to move so that no two replicas of one
model share a node (or a leaf switch) while another node could take one. Pure: values in, at most
one move per model out, time passed in as a number.

First placement already spreads (single.py prefers the node with the fewest replicas of the
model), but only over the nodes there at that moment: a node that registers 0.4 s after the
settle period (the demo's gpu-02) was never used, and one node's failure took the whole model
down. This module revisits it on every pass; the move itself is the reconciler's move primitive
(server/moves.py: the successor placed and ready first, then the old one drained).

The rules, each a guard against churn:
- a model is looked at only when 2 or more of its replicas share a *domain* (a node; with
  `leaves`, the leaf switches a node's adapters are cabled to, when the fabric map knows them —
  a node it does not know is its own domain) and a ready, uncordoned node in a domain holding at
  least two fewer of them could take one (so a move always improves the spread and never
  ping-pongs: 2 + 1 over two nodes stays put);
- at most one move per model at a time (none while one of its moves is unfinished);
- none within `cooldown` (default 5 min) of the model's last spread move, so a node that flaps
  does not move a replica back and forth;
- none while the model has fewer ready replicas than it wants: a move takes capacity away for a
  moment and must never deepen an outage.
Multi-node replicas (one replica over several nodes) are not moved by this rule: their placement
is bound by the fabric, and they are left to placement.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Literal

import msgspec

SpreadMode = Literal["nodes", "leaves", "off"]
DEFAULT_COOLDOWN = 300.0  # seconds; the 5 min (a flapping node's churn bound)


class SpreadReplica(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    nodes: tuple[str, ...]  # every node it has a shard on (one for a single-node replica)
    ready: bool


class SpreadModel(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    desired: int  # the catalog's replica count
    replicas: tuple[SpreadReplica, ...]  # those that hold nodes, not those on their way out
    moving: bool = False  # one of its moves (any kind) is unfinished
    last_move_at: float | None = None  # when its last spread move was asked


class SpreadNode(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    ready: bool  # registered, connected, heartbeating
    cordoned: bool = False
    leaves: tuple[str, ...] = ()  # the leaf switches its adapters reach (fabric/locality.py); () unknown


class SpreadMove(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    replica: str  # the replica to replace
    node: str  # where it runs now
    avoid: tuple[str, ...]  # nodes its successor must not go to (its domain, and any no better)
    to: tuple[str, ...]  # the nodes that could take it, best first (the successor's placement decides)
    reason: str  # for people and the event log


def domain_of(node: SpreadNode | None, node_id: str, mode: SpreadMode) -> str:
    """The failure domain a replica on `node_id` belongs to: the node, or its leaves."""
    if mode == "leaves" and node is not None and node.leaves:
        return "leaf " + "+".join(sorted(node.leaves))
    return node_id


def _counts(model: SpreadModel, nodes: Mapping[str, SpreadNode],
            mode: SpreadMode) -> tuple[Counter[str], dict[str, list[SpreadReplica]]]:
    counts: Counter[str] = Counter()
    held: dict[str, list[SpreadReplica]] = defaultdict(list)
    for replica in model.replicas:
        if len(replica.nodes) != 1:
            continue  # a multi-node replica: left to placement
        domain = domain_of(nodes.get(replica.nodes[0]), replica.nodes[0], mode)
        counts[domain] += 1
        held[domain].append(replica)
    return counts, held


def _eligible(model: SpreadModel, now: float, cooldown: float) -> bool:
    if model.moving or model.desired < 2:
        return False
    if sum(1 for r in model.replicas if r.ready) < model.desired:
        return False  # below its desired ready count: never take capacity away
    return model.last_move_at is None or now - model.last_move_at >= cooldown


def crowded(models: Iterable[SpreadModel], nodes: Sequence[SpreadNode], mode: SpreadMode, now: float,
            cooldown: float = DEFAULT_COOLDOWN) -> list[str]:
    """The models that would move one replica if a node could take it: the only ones whose room
    the caller needs to work out (placement per node is the costly part, so it is asked for few)."""
    if mode == "off":
        return []
    by_id = {n.node_id: n for n in nodes}
    out = []
    for model in models:
        if not _eligible(model, now, cooldown):
            continue
        counts, _ = _counts(model, by_id, mode)
        if counts and max(counts.values()) >= 2:
            out.append(model.name)
    return out


def decide(models: Iterable[SpreadModel], nodes: Sequence[SpreadNode], mode: SpreadMode, now: float,
           fits: Mapping[str, Collection[str]], cooldown: float = DEFAULT_COOLDOWN) -> list[SpreadMove]:
    """At most one move per model. `fits`: model → the nodes where one more of its replicas would
    fit now (free GPUs of the right kind, a port; the caller asks placement); a model missing
    from it has no room anywhere."""
    if mode == "off":
        return []
    by_id = {n.node_id: n for n in nodes}
    usable = [n for n in sorted(nodes, key=lambda n: n.node_id) if n.ready and not n.cordoned]
    moves = []
    for model in models:
        if not _eligible(model, now, cooldown):
            continue
        counts, held = _counts(model, by_id, mode)
        if not counts:
            continue
        top = max(counts.values())
        if top < 2:
            continue
        room = set(fits.get(model.name, ()))
        # Where a replica may go: a usable node with room, in a domain holding two fewer at least.
        to = sorted((n for n in usable if n.node_id in room and counts[domain_of(n, n.node_id, mode)] + 2 <= top),
                    key=lambda n: (counts[domain_of(n, n.node_id, mode)], n.node_id))
        if not to:
            continue
        # The most crowded domain (first by name on a tie); its ready replica with the latest id moves.
        source = min((d for d, c in counts.items() if c == top), key=lambda d: d)
        movable = sorted((r for r in held[source] if r.ready), key=lambda r: r.id)
        if not movable:
            continue
        replica = movable[-1]
        avoid = sorted(n.node_id for n in nodes if counts[domain_of(n, n.node_id, mode)] + 2 > top)
        total = sum(counts.values())
        reason = (f"spread: {top} of {total} replicas of {model.name} on {source}; "
                  f"{to[0].node_id} can take one" + (f" (or {len(to) - 1} more)" if len(to) > 1 else ""))
        moves.append(SpreadMove(model=model.name, replica=replica.id, node=replica.nodes[0], avoid=tuple(avoid),
                                to=tuple(n.node_id for n in to), reason=reason))
    return moves
