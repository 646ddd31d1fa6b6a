"""`fabric-test --gpudirect` pairs each HCA with the GPU nearest it on the PCIe tree (issue 39):
the affinity as the real `nvidia-smi topo -m` samples show it (tests/fixtures/real/nvidia-smi-topo),
the same relations derived from a sysfs tree, and the server's choice from what agents report."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.gpu_affinity import sysfs_bdf, with_gpu_affinity
from llmgw.fabric.gputopo import nearest_gpus, nic_affinity, pcie_affinity
from llmgw.fabric.railtest import Rail
from llmgw.server.fabric_test import _cuda_devices
from llmgw.server.registry import NodeRegistry
from llmgw.wire import messages as m
from tests.realfixtures import REAL

TOPO = REAL / "nvidia-smi-topo"


def real(name: str) -> dict[str, dict[int, str]]:
    return nic_affinity((TOPO / name).read_text())


def test_the_nic_affinity_of_real_topo_matrices() -> None:
    h20 = real("sglang-issue24966-8xh20-nv18-8nic.txt")  # NIC0..7 through the NIC Legend
    assert sorted(h20) == [f"mlx5_{i}" for i in range(1, 9)]
    assert h20["mlx5_1"] == {0: "PIX", 1: "NODE", 2: "NODE", 3: "NODE", 4: "SYS", 5: "SYS", 6: "SYS", 7: "SYS"}
    power9 = real("princeton-traverse-power9-4xv100-nv3-4nic.txt")  # mlx5_N rows, older drivers
    assert power9["mlx5_2"] == {0: "SYS", 1: "SYS", 2: "NODE", 3: "NODE"}
    polaris = real("alcf-polaris-4xa100-nv4-2nic-header-mangled.txt")  # the header line mangled
    assert polaris == {"mlx5_0": {0: "SYS", 1: "SYS", 2: "SYS", 3: "PHB"},
                       "mlx5_1": {0: "SYS", 1: "PHB", 2: "SYS", 3: "SYS"}}
    assert real("stas00-h100-8gpu-ht-tabs-expanded.txt") == {}  # a matrix without NICs


@pytest.mark.parametrize(("fixture", "nearest"), [
    ("sglang-issue24966-8xh20-nv18-8nic.txt", {f"mlx5_{i + 1}": i for i in range(8)}),
    # Polaris: mlx5_0 hangs off GPU3's host bridge; the nth GPU (GPU0) is across the socket (SYS).
    ("alcf-polaris-4xa100-nv4-2nic-header-mangled.txt", {"mlx5_0": 3, "mlx5_1": 1}),
    # POWER9: two NICs on one switch (PIX to each other), both NODE to the same two GPUs: one each.
    ("princeton-traverse-power9-4xv100-nv3-4nic.txt", {"mlx5_0": 0, "mlx5_1": 1, "mlx5_2": 2, "mlx5_3": 3}),
    ("princeton-della-2xa100-pcie-2nic-sys.txt", {"mlx5_0": 0, "mlx5_1": 1}),
])
def test_each_hca_gets_its_nearest_gpu(fixture: str, nearest: dict[str, int]) -> None:
    affinity = real(fixture)
    assert nearest_gpus(affinity, sorted(affinity)) == nearest


def test_pcie_affinity_from_sysfs_paths() -> None:
    gpu = "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0"
    assert pcie_affinity("/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0", 0, gpu,
                         0) == "PIX"
    nested = "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:02.0/0000:1a:00.0/0000:1b:00.0/0000:1c:00.0"
    assert pcie_affinity(nested, 0, gpu, 0) == "PXB"
    assert pcie_affinity("/sys/devices/pci0000:15/0000:15:03.0/0000:20:00.0", 0, gpu, 0) == "PHB"
    assert pcie_affinity("/sys/devices/pci0000:26/0000:26:01.0/0000:27:00.0", 0, gpu, 0) == "NODE"
    assert pcie_affinity("/sys/devices/pci0000:97/0000:97:01.0/0000:98:00.0", 1, gpu, 0) == "SYS"
    assert pcie_affinity("/sys/devices/virtual/net/lo", -1, gpu, -1) == "NODE"  # no PCI place: by NUMA alone


def h20_tree(sysfs: Path) -> list[m.Gpu]:
    """A sysfs tree laid out as the real 8×H20 box's topo matrix says: each GPU and its NIC under
    one PCIe switch (PIX), the four switches of a socket under four host bridges (NODE, as on a
    Sapphire Rapids socket's separate IIO stacks), two sockets (SYS)."""
    gpus = []
    for k in range(8):
        hb = 0x15 + 0x11 * k
        switch = f"devices/pci0000:{hb:02x}/0000:{hb:02x}:01.0/0000:{hb + 1:02x}:00.0"
        for role, port, bus in (("gpu", 0, hb + 3), ("nic", 1, hb + 4)):
            function = f"0000:{bus:02x}:00.0"
            place = sysfs / switch / f"0000:{hb + 2:02x}:{port:02x}.0" / function
            place.mkdir(parents=True)
            (place / "numa_node").write_text(f"{k // 4}\n")
            if role == "gpu":
                links = sysfs / "bus" / "pci" / "devices"
                links.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.relpath(place, links), links / function)
                gpus.append(m.Gpu(index=k, pci_bus_id=f"00000000:{bus:02X}:00.0"))  # as NVML writes it
            else:
                ib = sysfs / "class" / "infiniband" / f"mlx5_{k + 1}"
                ib.mkdir(parents=True)
                os.symlink(os.path.relpath(place, ib), ib / "device")
    return gpus


def test_the_agent_reads_the_real_boxs_affinity_from_sysfs(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    gpus = h20_tree(sysfs)
    assert gpus[0].pci_bus_id == "00000000:18:00.0" and sysfs_bdf(gpus[0].pci_bus_id) == "0000:18:00.0"
    ports = [m.Port(device=f"mlx5_{k}", port=1) for k in range(1, 9)] + [m.Port(device="mlx5_0", port=1)]
    read = {p.device: p.gpu_affinity for p in with_gpu_affinity(str(sysfs), ports, gpus)}
    expected = real("sglang-issue24966-8xh20-nv18-8nic.txt")
    assert {d: read[d] for d in expected} == expected
    assert read["mlx5_0"] == {}  # an adapter sysfs cannot place (no device link): left out
    assert with_gpu_affinity(str(tmp_path / "none"), ports, gpus) == ports  # no GPU placed: nothing added


def _registry(affinity: dict[str, dict[int, str]]) -> NodeRegistry:
    registry = NodeRegistry(heartbeat_interval=5.0)
    for i, node_id in enumerate(("polaris-1", "polaris-2")):
        ports = [m.Port(device=d, port=1, gpu_affinity=affinity.get(d, {})) for d in ("mlx5_0", "mlx5_1")]
        inventory = m.Inventory(gpus=[m.Gpu(index=g) for g in range(4)], ports=ports)
        registry.register(m.Register(node_id=node_id, version="x", inventory=inventory), now=0.0, session=i + 1)
    return registry


RAILS = [Rail(index=0, fabric="ib", kind="infiniband", a="mlx5_0:1", b="mlx5_0:1"),
         Rail(index=1, fabric="ib", kind="infiniband", a="mlx5_1:1", b="mlx5_1:1")]


def test_the_server_puts_each_rails_buffers_in_the_gpu_nearest_its_hca() -> None:
    registry = _registry(real("alcf-polaris-4xa100-nv4-2nic-header-mangled.txt"))
    assert _cuda_devices(registry, "polaris-1", "polaris-2", RAILS) == {
        ("polaris-1", 0): 3, ("polaris-2", 0): 3, ("polaris-1", 1): 1, ("polaris-2", 1): 1}


def test_an_agent_that_cannot_place_its_gpus_pairs_by_position_as_before() -> None:
    assert _cuda_devices(_registry({}), "polaris-1", "polaris-2", RAILS) == {
        ("polaris-1", 0): 0, ("polaris-2", 0): 0, ("polaris-1", 1): 1, ("polaris-2", 1): 1}
