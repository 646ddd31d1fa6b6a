"""Placement: node choice, NVLink-aware GPU choice, ports, and reasons when nothing fits."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from llmgw.placement import NodeCapacity, NoFit, Placement, Request, choose_gpus, choose_port, place
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
    memory = place(Request(replica_id="r", gpus=1, gpu_memory_mib=80000), [node("gpu-02", nv18(8, A100_40, 40960))], PORTS)
    assert isinstance(memory, NoFit) and memory.reasons == ("gpu-02: GPUs have 40960 MiB, the profile needs 80000 MiB each",)


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
    result = place(Request(replica_id="r", gpus=1), [node("gpu-01", nv18(), used_ports=set(range(20000, 20100)))], PORTS)
    assert isinstance(result, NoFit) and result.reasons == ("gpu-01: no free port in 20000-20099",)


def test_exhaustive_choice_is_optimal_on_small_boxes() -> None:
    gpus = pairs()
    best = choose_gpus(gpus, 2)
    def links(group: tuple[int, ...]) -> int:
        return sum(gpus[a].nvlink.get(b, 0) for a, b in itertools.combinations(group, 2))
    assert links(best) == max(links(c) for c in itertools.combinations(range(4), 2))
