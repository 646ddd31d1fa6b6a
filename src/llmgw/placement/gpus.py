"""Which of a node's free GPUs a replica gets: NVLink aware, in bounded work. Pure.

The rule: most NVLink links among the chosen GPUs, then fewest links cut to the GPUs left free
(a 1-GPU replica takes the GPU least useful to a later tensor-parallel group). Scoring every
n-subset is optimal but combinatorial: 16 fully linked GPUs choosing 8 took 0.82 s, and a node
reporting 2,000 GPUs froze the whole server for 16.7 s (issue 9). Real NVLink graphs are small
cliques (NVSwitch boxes: every GPU to every GPU) or bridged pairs (PCIe boxes), so:

- few subsets (at most `EXHAUSTIVE_LIMIT`): score them all (optimal; every 8-GPU box);
- otherwise work per connected component of the NVLink graph: a component that is a clique
  with one link count everywhere gives the same score for any n of its GPUs (take the lowest
  indexes); a small component is searched exhaustively; any other grows greedily from a few
  seeds. Whole components are also combined (largest link density first) when n spans
  several. The best-scoring candidate wins.

Every path counts its steps (`Choice.steps`), so tests bound the work, not the wall clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from math import comb

import msgspec

from llmgw.wire.messages import Gpu

# Subsets scored exhaustively at most (each costs about n²/2 link lookups): 8 GPUs choosing
# any n is at most 70; 12 choosing 6 is 924; 16 choosing 8 (12,870) goes the structured way.
EXHAUSTIVE_LIMIT = 2_000
# Seeds a greedy growth starts from in one component, and components tried as "the one that
# holds the whole group": bounds the work on nodes with thousands of GPUs.
GREEDY_SEEDS = 8
COMPONENT_CANDIDATES = 16

Adjacency = dict[int, dict[int, int]]


class Choice(msgspec.Struct, frozen=True):
    gpus: tuple[int, ...]
    internal: int  # NVLink links among the chosen GPUs
    cut: int  # links from the chosen GPUs to GPUs left free
    steps: int  # work done (link lookups and candidates looked at)


class _Counter:
    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps = 0


def choose_gpus(free: Sequence[Gpu], n: int) -> tuple[int, ...]:
    """Pick n of the free GPUs (see the module docstring for the rule)."""
    return choose(free, n).gpus


def choose(free: Sequence[Gpu], n: int, exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> Choice:
    """`choose_gpus` with its score and the work it took (`exhaustive_limit` lets tests
    force the structured path on boxes small enough to check against every subset)."""
    counter = _Counter()
    ordered = sorted(g.index for g in free)
    if n <= 0:
        return Choice((), 0, 0, 0)
    adj = _adjacency(free, counter)
    if n >= len(ordered):
        return _scored(tuple(ordered), adj, counter)
    if not adj:
        return Choice(tuple(ordered[:n]), 0, 0, counter.steps + n)
    degree = {i: sum(adj.get(i, {}).values()) for i in ordered}
    if comb(len(ordered), n) <= exhaustive_limit:
        return _exhaustive(ordered, n, adj, degree, counter)
    components = _components(ordered, adj, counter)
    candidates: list[tuple[int, ...]] = []
    holders = sorted((c for c in components if len(c) >= n), key=lambda c: (len(c), c[0]))
    for component in holders[:COMPONENT_CANDIDATES]:
        candidates.append(_within(component, n, adj, degree, counter))
    if len(holders) != 1 or len(components) > 1:  # one component holding everything: done above
        candidates.append(_combined(components, n, adj, degree, counter))
        if len(components) <= SUBSET_COMPONENTS:
            candidates.extend(_component_subsets(components, n, adj, degree, counter))
    scored = [_scored(tuple(sorted(c)), adj, counter) for c in candidates]
    best = max(scored, key=lambda c: (c.internal, -c.cut, [-i for i in c.gpus]))
    return Choice(best.gpus, best.internal, best.cut, counter.steps)


def _adjacency(free: Sequence[Gpu], counter: _Counter) -> Adjacency:
    """Links among the free GPUs only, symmetric (the larger count if the two sides disagree)."""
    present = {g.index for g in free}
    adj: Adjacency = {}
    for g in free:
        if not g.nvlink:
            continue
        counter.steps += len(g.nvlink)
        mine = {peer: links for peer, links in g.nvlink.items() if links > 0 and peer != g.index and peer in present}
        if mine:
            adj[g.index] = mine
    for i, links in list(adj.items()):  # make it symmetric
        for j, w in links.items():
            back = adj.setdefault(j, {})
            if back.get(i, 0) < w:
                back[i] = w
        counter.steps += len(links)
    return adj


def _scored(group: tuple[int, ...], adj: Adjacency, counter: _Counter) -> Choice:
    chosen = set(group)
    internal = 0
    total = 0
    for i in group:
        for j, w in adj.get(i, {}).items():
            counter.steps += 1
            total += w
            if j in chosen:
                internal += w
    internal //= 2
    return Choice(group, internal, total - 2 * internal, counter.steps)


def _exhaustive(
    ordered: Sequence[int], n: int, adj: Adjacency, degree: dict[int, int], counter: _Counter
) -> Choice:
    best: tuple[int, ...] = ()
    best_key = (-1, 0)
    for group in itertools.combinations(ordered, n):  # lexicographic: the first best has the lowest indexes
        internal = 0
        for a, b in itertools.combinations(group, 2):
            internal += adj.get(a, {}).get(b, 0)
        counter.steps += n * (n - 1) // 2 + 1
        cut = sum(degree[i] for i in group) - 2 * internal
        key = (internal, -cut)
        if key > best_key:
            best, best_key = group, key
    return Choice(best, best_key[0], -best_key[1], counter.steps)


def _components(ordered: Sequence[int], adj: Adjacency, counter: _Counter) -> list[list[int]]:
    seen: set[int] = set()
    out: list[list[int]] = []
    for start in ordered:
        if start in seen:
            continue
        seen.add(start)
        stack = [start]
        members = []
        while stack:
            i = stack.pop()
            members.append(i)
            links = adj.get(i, {})
            counter.steps += len(links)
            for j in links:
                if j not in seen:
                    seen.add(j)
                    stack.append(j)
        out.append(sorted(members))
    return out


def _uniform_clique(component: Sequence[int], adj: Adjacency, counter: _Counter) -> bool:
    size = len(component)
    weights: set[int] = set()
    for i in component:
        links = adj.get(i, {})
        counter.steps += 1
        if len(links) != size - 1:  # links reach only this component's free GPUs
            return False
        weights.update(links.values())
        counter.steps += len(links)
        if len(weights) > 1:
            return False
    return True


def _within(component: list[int], n: int, adj: Adjacency, degree: dict[int, int], counter: _Counter) -> tuple[int, ...]:
    """The best n GPUs of one connected component."""
    if len(component) == n:
        return tuple(component)
    if len(component) <= 1 or _uniform_clique(component, adj, counter):
        return tuple(component[:n])  # every n-subset scores the same: the lowest indexes
    if comb(len(component), n) <= EXHAUSTIVE_LIMIT:
        return _exhaustive(component, n, adj, degree, counter).gpus
    return _greedy(component, n, adj, degree, counter)


def _greedy(component: list[int], n: int, adj: Adjacency, degree: dict[int, int], counter: _Counter) -> tuple[int, ...]:
    """Grow from a few seeds (the best-connected GPUs): each step adds the GPU with most links
    into the group, then the one whose links cut least (lowest degree), then the lowest index."""
    by_degree = sorted(component, key=lambda i: (degree[i], i))  # a fallback when no GPU links in
    counter.steps += len(component)
    seeds = sorted(component, key=lambda i: (-degree[i], i))[:GREEDY_SEEDS]
    best: tuple[int, ...] = ()
    best_key: tuple[int, int] = (-1, 0)
    for seed in seeds:
        group = [seed]
        chosen = {seed}
        gain: dict[int, int] = {}
        internal = 0
        cursor = 0
        for j, w in adj.get(seed, {}).items():
            counter.steps += 1
            gain[j] = gain.get(j, 0) + w
        while len(group) < n:
            pick: int | None = None
            if gain:
                pick = max(gain, key=lambda j: (gain[j], -degree[j], -j))
                counter.steps += len(gain)
            else:
                while by_degree[cursor] in chosen:
                    cursor += 1
                    counter.steps += 1
                pick = by_degree[cursor]
            internal += gain.pop(pick, 0)
            group.append(pick)
            chosen.add(pick)
            for j, w in adj.get(pick, {}).items():
                counter.steps += 1
                if j not in chosen:
                    gain[j] = gain.get(j, 0) + w
        cut = sum(degree[i] for i in group) - 2 * internal
        key = (internal, -cut)
        if key > best_key:
            best, best_key = tuple(sorted(group)), key
    return best


def _combined(components: list[list[int]], n: int, adj: Adjacency, degree: dict[int, int],
              counter: _Counter) -> tuple[int, ...]:
    """Whole components first (most links per GPU, then largest, then lowest index): they cut
    nothing. The rest comes from the smallest component left that can give it."""

    def density(c: list[int]) -> tuple[float, int, int]:
        links = sum(degree[i] for i in c)
        counter.steps += len(c)
        return (-links / len(c), -len(c), c[0])

    group: list[int] = []
    left: list[list[int]] = []
    for component in sorted(components, key=density):
        counter.steps += 1
        if len(group) + len(component) <= n:
            group.extend(component)
        else:
            left.append(component)
        if len(group) == n:
            return tuple(group)
    need = n - len(group)
    left.sort(key=lambda c: (len(c), c[0]))
    best: tuple[int, ...] = ()
    best_key: tuple[int, int, int] | None = None
    for component in left[:COMPONENT_CANDIDATES]:
        part = _within(component, need, adj, degree, counter)
        scored = _scored(part, adj, counter)
        key = (scored.internal, -scored.cut, -len(component))
        if best_key is None or key > best_key:
            best, best_key = part, key
    return tuple(group) + best


# A box has at most a handful of NVLink groups (8 or 16 GPUs in cliques of 2, 4 or 8): with this
# many or fewer, every set of whole groups is tried with the rest taken from one other group, so
# "4 + 3" beats the greedy "4 + 2 + 1" (16 GPUs in cliques of 4, two busy, 7 wanted).
SUBSET_COMPONENTS = 8


def _component_subsets(
    components: list[list[int]], n: int, adj: Adjacency, degree: dict[int, int], counter: _Counter
) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = []
    k = len(components)
    for mask in range(1 << k):
        counter.steps += 1
        whole = [c for i, c in enumerate(components) if mask >> i & 1]
        size = sum(len(c) for c in whole)
        if size > n:
            continue
        if size == n:
            found.append(tuple(i for c in whole for i in c))
            continue
        need = n - size
        for i, partial in enumerate(components):
            if not mask >> i & 1 and len(partial) > need:
                part = _within(partial, need, adj, degree, counter)
                found.append(tuple(g for c in whole for g in c) + part)
    return found
