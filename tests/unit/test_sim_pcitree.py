"""The simulated node's PCIe tree reads as the real HGX box does (issue 39: `fabric-test --gpudirect`
pairs each rail with the GPU nearest its adapter, and the simulation must give it a tree to read)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.agent.gpu_affinity import with_gpu_affinity
from llmgw.fabric.gputopo import nearest_gpus
from llmgw.sim.node import NodeSpec, write_node
from llmgw.wire.messages import Gpu, Port
from tests.unit.test_gpu_affinity import real


def affinity(root: Path, adapters: int) -> dict[str, dict[int, str]]:
    inventory = json.loads((root / "gpus.json").read_text())["gpus"]
    gpus = [Gpu(index=g["index"], pci_bus_id=g["pci_bus_id"]) for g in inventory]
    ports = [Port(device=f"mlx5_{d}", port=1) for d in range(adapters)]
    return {p.device: p.gpu_affinity for p in with_gpu_affinity(str(root / "sys"), ports, gpus)}


def test_an_8_gpu_8_adapter_node_reads_as_the_real_8xh20_box(tmp_path: Path) -> None:
    write_node(str(tmp_path), NodeSpec(node_id="gpu-01", ib_ports=8))
    expected = real("sglang-issue24966-8xh20-nv18-8nic.txt")  # NIC0..7 are mlx5_1..8 there
    assert affinity(tmp_path, 8) == {f"mlx5_{int(dev[5:]) - 1}": row for dev, row in expected.items()}


@pytest.mark.parametrize(("adapters", "nearest"), [(2, {"mlx5_0": 0, "mlx5_1": 4}),
                                                   (4, {"mlx5_0": 0, "mlx5_1": 2, "mlx5_2": 4, "mlx5_3": 6})])
def test_fewer_adapters_spread_over_both_sockets(tmp_path: Path, adapters: int, nearest: dict[str, int]) -> None:
    write_node(str(tmp_path), NodeSpec(node_id="gpu-01", ib_ports=adapters))
    read = affinity(tmp_path, adapters)
    assert nearest_gpus(read, sorted(read)) == nearest
    assert all(read[dev][gpu] == "PIX" for dev, gpu in nearest.items())


def test_a_node_without_gpus_keeps_its_adapters_flat(tmp_path: Path) -> None:
    write_node(str(tmp_path), NodeSpec(node_id="cpu-01", ib_ports=2, gpus=0))
    assert (tmp_path / "sys/devices/pci0000:00/0000:0c:00.0/numa_node").read_text() == "-1\n"
    assert affinity(tmp_path, 2) == {"mlx5_0": {}, "mlx5_1": {}}
