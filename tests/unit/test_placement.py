"""Placement: node choice, NVLink-aware GPU choice, ports, and reasons when nothing fits."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.placement import NodeCapacity, NoFit, Placement, Request, choose_gpus, choose_port, place
from llmgw.placement.gpus import choose
from llmgw.wire.messages import Gpu

H100 = "NVIDIA H100 80GB HBM3"
A100_40 = "NVIDIA A100-SXM4-40GB"


def nv18(n: int = 8, name: str = H100, memory: int = 81559) -> list[Gpu]:
    return [Gpu(index=i, name=name, memory_mib=memory, nvlink={j: 18 for j in range(n) if j != i}) for i in range(n)]


def pairs(n: int = 4) -> list[Gpu]:
    """PCIe box with NVLink bridges joining 0-1 and 2-3 (NV4), like the RTX A6000 fixture."""
    peer = {0: 1, 1: 0, 2: 3, 3: 2}
    return [Gpu(index=i, name="RTX A6000", memory_mib=49140, nvlink={peer[i]: 4}) for i in range(n)]


def node(node_id: str, gpus: list[Gpu], used: set[int] | None = None, state: str = "ready", **kw) -> NodeCapacity:
    return NodeCapacity(node_id=node_id, state=state, gpus=gpus, used_gpus=used or set(), **kw)


PORTS = (20000, 20099)


def test_best_fit_packs_the_fuller_node() -> None:
    nodes = [node("gpu-01", nv18(), used={0, 1, 2, 3, 4, 5}), node("gpu-02", nv18())]
    result = place(Request(replica_id="r1", gpus=2), nodes, PORTS)
    assert isinstance(result, Placement) and result.node_id == "gpu-01" and result.gpus == (6, 7)


def test_replicas_of_a_model_spread_before_packing() -> None:
    nodes = [node("gpu-01", nv18(), used={0}, replicas_of_model=1), node("gpu-02", nv18())]
    result = place(Request(replica_id="r2", gpus=1), nodes, PORTS)
    assert isinstance(result, Placement) and result.node_id == "gpu-02"


def test_tp2_takes_an_nvlink_pair_not_two_strangers() -> None:
    result = place(Request(replica_id="r", gpus=2), [node("ws", pairs(), used={0})], PORTS)
    # GPU 1 lost its partner; 2-3 is the bridged pair.
    assert isinstance(result, Placement) and result.gpus == (2, 3)


def test_single_gpu_takes_the_one_least_useful_to_a_group() -> None:
    # With 0 used, GPU 1 is an orphan of its pair: a 1-GPU replica should take it, not break 2-3.
    assert choose_gpus([g for g in pairs() if g.index != 0], 1) == (1,)


def test_no_nvlink_takes_lowest_indexes() -> None:
    gpus = [Gpu(index=i, name="L4", memory_mib=23034) for i in range(4)]
    assert choose_gpus(gpus[1:], 2) == (1, 2)


@given(st.sets(st.integers(min_value=0, max_value=7), max_size=7), st.integers(min_value=1, max_value=8))
def test_choose_gpus_returns_free_distinct_gpus(used: set[int], n: int) -> None:
    free = [g for g in nv18() if g.index not in used]
    chosen = choose_gpus(free, n)
    assert len(chosen) == min(n, len(free)) and len(set(chosen)) == len(chosen)
    assert not set(chosen) & used


def test_reasons_for_every_node() -> None:
    nodes = [
        node("gpu-01", nv18(4), used={0, 1}),
        node("gpu-02", nv18(8, A100_40, 40960)),
        node("gpu-03", [], state="lost"),
        node("gpu-04", nv18(4), state="unreachable"),
        node("gpu-05", []),
        node("gpu-06", nv18(8), can_start=False, version="0.0.1"),
    ]
    result = place(Request(replica_id="r", gpus=4, gpu_kind="H100"), nodes, PORTS)
    assert isinstance(result, NoFit)
    assert result.reasons == (
        "gpu-01: 2 of 4 GPUs free, 4 needed",
        f"gpu-02: no H100 GPUs (has 8× {A100_40})",
        "gpu-03: lost",
        "gpu-04: unreachable",
        "gpu-05: no GPUs",
        "gpu-06: agent 0.0.1 cannot start engines",
    )
    memory = place(Request(replica_id="r", gpus=1, gpu_memory_mib=80000), [node("gpu-02", nv18(8, A100_40, 40960))],
                   PORTS)
    assert isinstance(memory, NoFit) and memory.reasons == ("gpu-02: GPUs have 40960 MiB, the profile needs 80000 MiB "
                                                            "each",)


def test_unhealthy_gpus_are_not_used() -> None:
    gpus = nv18(2)
    gpus[0].health = "lost"
    result = place(Request(replica_id="r", gpus=2), [node("gpu-01", gpus)], PORTS)
    assert isinstance(result, NoFit) and "only 1 of 2 matching GPUs are healthy" in result.reasons[0]


def test_zero_gpu_profile_fits_anywhere_ready() -> None:
    result = place(Request(replica_id="r", gpus=0), [node("cpu-01", [])], PORTS)
    assert isinstance(result, Placement) and result.gpus == ()


def test_ports_avoid_used_and_differ_between_attempts() -> None:
    used = set(range(20000, 20099))
    assert choose_port("r.1", used, PORTS) == 20099
    assert choose_port("r.1", set(range(20000, 20100)), PORTS) is None
    ports = {choose_port(f"model-abcde.{attempt}", set(), (20000, 29999)) for attempt in range(1, 6)}
    assert len(ports) == 5


def test_no_free_port_is_a_reason() -> None:
    result = place(Request(replica_id="r", gpus=1), [node("gpu-01", nv18(), used_ports=set(range(20000, 20100)))],
                   PORTS)
    assert isinstance(result, NoFit) and result.reasons == ("gpu-01: no free port in 20000-20099",)


def test_exhaustive_choice_is_optimal_on_small_boxes() -> None:
    gpus = pairs()
    best = choose_gpus(gpus, 2)
    def links(group: tuple[int, ...]) -> int:
        return sum(gpus[a].nvlink.get(b, 0) for a, b in itertools.combinations(group, 2))
    assert links(best) == max(links(c) for c in itertools.combinations(range(4), 2))


# -- GPU choice in bounded work (issue 9: 16 GPUs choosing 8 took 0.82 s; 2,000 GPUs froze the server)


def cliques(total: int, size: int, links: int = 18) -> list[Gpu]:
    """`total` GPUs in NVLink cliques of `size` (NVSwitch boxes; size 2 = bridged pairs)."""
    return [
        Gpu(index=i, name=H100, memory_mib=81559,
            nvlink={j: links for j in range(i // size * size, (i // size + 1) * size) if j != i})
        for i in range(total)
    ]


def linear_bound(gpus: list[Gpu]) -> int:
    """Work proportional to what the node reported: its GPUs and their NVLink entries."""
    return 8 * (len(gpus) + sum(len(g.nvlink) for g in gpus)) + 1000


def brute_force(free: list[Gpu], n: int) -> tuple[int, int]:
    """(most internal links, fewest cut) over every n-subset: the reference."""
    index = {g.index: g for g in free}

    def w(a: int, b: int) -> int:
        return max(index[a].nvlink.get(b, 0), index[b].nvlink.get(a, 0))

    best = (-1, 0)
    for group in itertools.combinations(sorted(index), n):
        rest = [i for i in index if i not in group]
        internal = sum(w(a, b) for a, b in itertools.combinations(group, 2))
        cut = sum(w(a, b) for a in group for b in rest)
        best = max(best, (internal, -cut))
    return best[0], -best[1]


def test_16_fully_linked_choosing_8_is_cheap() -> None:
    choice = choose(nv18(16), 8)
    assert choice.gpus == tuple(range(8)) and choice.internal == 28 * 18
    # Every subset (12,870 of them, ~28 lookups each) was the old way: ~360,000 steps.
    assert choice.steps <= linear_bound(nv18(16)) < 5_000


def test_2000_gpus_choose_in_linear_work() -> None:
    boxes = cliques(2000, 8)  # 250 NVSwitch cliques of 8
    choice = choose(boxes, 8)
    assert choice.gpus == tuple(range(8)) and (choice.internal, choice.cut) == (28 * 18, 0)
    assert choice.steps <= linear_bound(boxes)

    # GPU 0 of every box taken: 7 from one box and 1 from the next beats 8 strangers.
    partial = [g for g in boxes if g.index % 8]
    choice = choose(partial, 8)
    assert (choice.internal, choice.cut) == (21 * 18, 6 * 18) and choice.steps <= linear_bound(partial)

    # Bridged pairs: two whole pairs, nothing cut.
    bridged = cliques(2000, 2, links=4)
    choice = choose(bridged, 4)
    assert (choice.internal, choice.cut) == (8, 0) and choice.steps <= linear_bound(bridged)

    # No structure to exploit (a chain): the greedy path stays linear and takes a run of 8.
    chain = [Gpu(index=i, nvlink={j: 4 for j in (i - 1, i + 1) if 0 <= j < 2000}) for i in range(2000)]
    choice = choose(chain, 8)
    assert choice.internal == 7 * 4 and choice.steps <= linear_bound(chain)

    plain = [Gpu(index=i, name="L4") for i in range(2000)]
    assert choose(plain, 8).gpus == tuple(range(8)) and choose(plain, 8).steps <= 100


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([(16, 8), (16, 4), (16, 2), (12, 4), (12, 2)]),
    st.sets(st.integers(min_value=0, max_value=15), max_size=8),
    st.integers(min_value=1, max_value=10),
)
def test_structured_choice_matches_every_subset_on_real_shapes(shape: tuple[int, int], used: set[int], n: int) -> None:
    total, size = shape
    free = [g for g in cliques(total, size, 18 if size > 2 else 4) if g.index not in used]
    n = min(n, len(free))
    choice = choose(free, n, exhaustive_limit=0)  # the structured path, even on a small box
    assert len(set(choice.gpus)) == n and not set(choice.gpus) & used
    assert (choice.internal, choice.cut) == brute_force(free, n)
