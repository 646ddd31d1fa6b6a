"""Issue 39's GPU board checks, each healthy / warn / crit, from readings taken the way the agent
takes them: nvml_health over the fake pynvml shaped by the real H200 `nvidia-smi -q`
(tests/fixtures/real/nvidia-smi-q/), or the HCA's sysfs link files in the kernel's format."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from llmgw.agent import discovery
from llmgw.doctor.facts import NodeFacts
from llmgw.doctor.gpu import GPU_CHECKS
from llmgw.doctor.node import NODE_CHECKS, NodeContext, check_gpu_health
from llmgw.doctor.xid import CATALOG, XIDS, explain
from llmgw.verdict import Status
from llmgw.wire import messages as m
from tests.unit.test_discovery import add_board, doctor_nvml

OK, WARN, CRIT, UNKNOWN = Status.OK, Status.WARN, Status.CRIT, Status.UNKNOWN
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "real" / "nvidia-smi-q" / "llmgw-device-1xh200-vm.txt"


def read(boards: dict[int, dict[str, object]] | None = None, temperature: int = 40) -> list[m.GpuHealth]:
    nv = add_board(doctor_nvml([]), boards)
    nv.nvmlDeviceGetTemperature = nv.nvmlDeviceGetTemperatureV = lambda h, sensor: temperature
    return discovery.nvml_health(nv)


def facts(health: list[m.GpuHealth], ports: list[m.PortCounters] | None = None) -> NodeFacts:
    gpus = [m.Gpu(index=h.index, pci_bus_id=f"00000000:{0x18 + h.index:02X}:00.0") for h in health]
    return NodeFacts(id="gpu-01", state="ready", inventory=m.Inventory(gpus=gpus, gpu_source="nvml"),
                     gpus=health, ports=ports or [])


def run(check: str, n: NodeFacts) -> list[tuple[Status, str, str]]:
    return [(f.status, f.subject, f.finding) for f in GPU_CHECKS[check](n, NodeContext())]


def test_the_checks_are_registered_as_node_checks_after_nvlink():
    names = list(NODE_CHECKS)
    assert names[names.index("nvlink") + 1:names.index("nvlink") + 1 + len(GPU_CHECKS)] == list(GPU_CHECKS)


def test_the_fake_board_is_the_real_h200_fixtures():
    """The fake's healthy answers are what the real H200 printed (driver 580)."""
    text = FIXTURE.read_text(encoding="utf-8")
    for line in ("Pending                                        : No",
                 "Remapping Failure Occurred                     : No",
                 "HW Thermal Slowdown                        : Not Active",
                 "Persistence Mode                                   : Enabled",
                 "Max                                    : 16x", "Current                                : 16x"):
        assert line in text, line
    [h, _] = read()
    assert (h.remap_pending, h.remap_failed, h.remapped_uncorrectable, h.retired_pages) == (False, False, 0, None)
    assert h.clock_events == ["gpu_idle"]  # "Idle : Active", every other reason "Not Active"
    assert (h.pcie_gen, h.pcie_gen_max, h.pcie_width, h.pcie_width_max) == (5, 5, 16, 16)
    assert (h.persistence, h.ecc_enabled, h.ecc_pending) == (True, True, True)


def test_a_healthy_h200_passes_every_board_check():
    n = facts(read())
    n.host = m.HostFacts(gpu_rdma_modules=["nvidia_peermem"], nvidia_open=False)
    for check in GPU_CHECKS:
        [(status, _, finding)] = run(check, n)
        assert status == OK, (check, finding)
    assert run("row-remap", n)[0][2] == "2 GPUs: no pending or failed row remaps"
    assert "hottest GPU 0 at 40 °C (slowdown 89 °C, shutdown 92 °C)" in run("temperature", n)[0][2]


# ---- row remapping and retired pages ------------------------------------------------------------


def test_a_pending_row_remap_and_a_failed_one_are_critical():
    n = facts(read({0: {"remapped": (0, 2, 1, 0)}, 1: {"remapped": (0, 0, 0, 1)}}))
    found = run("row-remap", n)
    assert [(s, subject) for s, subject, _ in found] == [(CRIT, "GPU 0"), (CRIT, "GPU 1")]
    assert "pending (2 rows remapped for uncorrectable errors)" in found[0][2]
    assert "failed" in found[1][2] and "RMA" in GPU_CHECKS["row-remap"](n, NodeContext())[1].action


def test_retired_pages_are_read_where_the_board_has_no_row_remapper():
    pages = list(range(30))
    warn = facts(read({0: {"remapped": None, "retired": pages[:3], "retired_pending": 1}}))
    assert warn.gpus is not None and warn.gpus[0].retired_pages == 6  # 3 per cause, both causes
    assert [(s, subject) for s, subject, _ in run("row-remap", warn)] == [(WARN, "GPU 0")]
    crit = facts(read({0: {"remapped": None, "retired": pages, "retired_pending": 0}}))
    [(status, _, finding)] = run("row-remap", crit)
    assert status == CRIT and "60 retired memory pages" in finding


def test_a_board_without_remapper_or_retirement_is_ok_and_says_so():
    n = facts(read({0: {"remapped": None, "retired": None}, 1: {"remapped": None, "retired": None}}))
    [(status, _, finding)] = run("row-remap", n)
    assert status == OK and "not reported" in finding


# ---- clock event reasons and temperature -------------------------------------------------------


@pytest.mark.parametrize(("bits", "reason"), [(0x8 | 0x40, "HW thermal slowdown"),
                                              (0x8 | 0x80, "HW power brake slowdown"),
                                              (0x8, "HW slowdown"), (0x20, "SW thermal slowdown")])
def test_hardware_and_thermal_slowdowns_warn_with_the_reason(bits, reason):
    [(status, subject, finding)] = run("clocks", facts(read({1: {"reasons": bits}})))
    assert (status, subject, finding) == (WARN, "GPU 1", f"GPU 1: clocks held down: {reason}")


def test_the_power_cap_and_idle_are_the_driver_doing_its_job():
    [(status, _, finding)] = run("clocks", facts(read({0: {"reasons": 0x4}, 1: {"reasons": 0x1}})))
    assert status == OK and "GPU 0 at the power cap" in finding


def test_older_bindings_read_the_throttle_reasons():
    nv = add_board(doctor_nvml([]), {0: {"reasons": 0x40 | 0x8}})
    del nv.nvmlDeviceGetCurrentClocksEventReasons
    assert discovery.nvml_health(nv)[0].clock_events == ["hw_slowdown", "hw_thermal"]


@pytest.mark.parametrize(("temperature", "status"),
                         [(80, OK), (84, WARN), (88, WARN), (89, WARN), (90, CRIT), (95, CRIT)])
def test_temperature_against_the_cards_own_thresholds(temperature, status):
    found = run("temperature", facts(read(temperature=temperature)))
    assert {s for s, _, _ in found} == {status}, found


def test_thresholds_are_the_cards_not_one_figure():
    cool_card = facts(read({0: {"slowdown": 75, "shutdown": 85}, 1: {"slowdown": 75, "shutdown": 85}}, temperature=76))
    assert {s for s, _, _ in run("temperature", cool_card)} == {WARN}
    no_thresholds = facts(read({0: {"slowdown": None, "shutdown": None}, 1: {"slowdown": None, "shutdown": None}}, 95))
    [(status, _, finding)] = run("temperature", no_thresholds)
    assert status == OK and "reports no thresholds" in finding


# ---- PCIe -----------------------------------------------------------------------------------


def test_a_gpu_trained_at_x8_warns_an_idle_one_at_a_lower_gen_does_not():
    [(status, subject, finding)] = run("pcie", facts(read({1: {"width": (8, 16)}, 0: {"gen": (1, 5)}})))
    assert (status, subject) == (WARN, "GPU 1") and "PCIe Gen5 x8, the card and slot allow Gen5 x16" in finding


def test_a_busy_gpu_below_its_best_generation_warns():
    health = read({0: {"gen": (3, 5)}})
    health[0].utilization_pct = 90
    [(status, subject, finding)] = run("pcie", facts(health))
    assert (status, subject) == (WARN, "GPU 0") and "Gen3 x16" in finding


def _hca(speed: float, width: int) -> NodeFacts:
    """A node with one NDR HCA whose PCI function reads (speed GT/s, width) of a gen5 x16 card."""
    n = facts(read())
    n.inventory.ports = [m.Port(device="mlx5_2", port=1, state="ACTIVE", rate_gbps=400.0, speed="NDR",
                                pcie_speed_gts=speed, pcie_width=width, pcie_max_speed_gts=32.0, pcie_max_width=16)]
    return n


def test_an_hca_limited_by_its_slot_warns_with_what_the_link_carries():
    [(status, subject, finding)] = run("pcie", _hca(32.0, 16))
    assert (status, subject) == (OK, "") and finding.startswith("2 GPUs and 1 HCAs at their full PCIe width")
    [(status, subject, finding)] = run("pcie", _hca(16.0, 8))
    assert (status, subject) == (WARN, "mlx5_2")
    assert finding == "mlx5_2: PCIe gen4 x8, the card allows gen5 x16; it carries ~115 Gb/s, less than the port's 400"
    [(status, _, finding)] = run("pcie", _hca(16.0, 16))  # gen4 x16 (~230 Gb/s) caps an NDR port too
    assert status == WARN and "less than the port's 400" in finding


def test_an_hca_whose_link_sysfs_cannot_read_is_not_graded():
    [(status, _, _)] = run("pcie", _hca(0.0, 0))
    assert status == OK


# ---- persistence and ECC modes -----------------------------------------------------------


def test_persistence_off_ecc_off_and_a_pending_ecc_change_warn():
    n = facts(read({0: {"persistence": 0}, 1: {"persistence": 0, "ecc": [1, 0]}}))
    found = run("gpu-modes", n)
    assert [(s, subject) for s, subject, _ in found] == [(WARN, "GPUs 0, 1"), (WARN, "GPU 1")]
    assert "persistence mode off" in found[0][2] and "changes from on to off at the next reset" in found[1][2]
    off = run("gpu-modes", facts(read({0: {"ecc": [0, 0]}})))
    assert [(s, subject) for s, subject, _ in off] == [(WARN, "GPU 0")] and "ECC off" in off[0][2]


def test_a_board_without_ecc_is_not_a_finding():
    n = facts(read({0: {"ecc": None}, 1: {"ecc": None}}))
    assert run("gpu-modes", n)[0][0] == OK


# ---- Xids and what an older agent sends ------------------------------------------------------


@pytest.mark.parametrize(("xid", "status"), [(79, CRIT), (109, CRIT), (119, CRIT), (120, CRIT), (140, CRIT),
                                             (143, CRIT), (154, CRIT), (158, CRIT), (149, WARN), (156, WARN),
                                             (13, WARN), (999, WARN)])
def test_current_drivers_xids_have_a_meaning_and_an_action(xid, status):
    n = facts([m.GpuHealth(index=0, xid=xid, ecc_uncorrected=0)])
    [finding] = check_gpu_health(n, NodeContext())
    assert finding.status == status and finding.action and finding.finding.startswith(f"GPU 0: Xid {xid} (")
    assert set(range(143, 151)) <= set(XIDS) and CATALOG in explain(999).meaning


def test_an_older_agent_sends_none_of_it_and_the_checks_say_unknown_with_why():
    old = msgspec.json.decode(b'{"index": 0, "temperature_c": 40, "ecc_uncorrected": 0}', type=m.GpuHealth)
    assert (old.board_read, old.remap_pending, old.clock_events, old.pcie_width) == (False, None, None, None)
    n = facts([old], [m.PortCounters(device="mlx5_0", port=1)])
    n.inventory.ports = [m.Port(device="mlx5_0", port=1)]
    n.host = m.HostFacts()
    for check in GPU_CHECKS:
        [(status, _, finding)] = run(check, n)
        assert status == UNKNOWN and "older than this server" in finding, check


def test_a_new_agent_on_a_board_that_answers_nothing_is_ok():
    none = {k: None
            for k in ("remapped", "retired", "reasons", "slowdown", "shutdown", "gen", "width", "persistence", "ecc")}
    n = facts(read({0: none, 1: none}))
    for check in set(GPU_CHECKS) - {"gpudirect"}:
        [(status, _, finding)] = run(check, n)
        assert status == OK and any(w in finding for w in ("not reported", "no thresholds", "no NVSwitch")), (
            check, finding)


def test_a_simulated_gpu_reads_the_same_fields(tmp_path):
    from llmgw.sim.gpu_faults import set_gpu

    gpus = discovery.SimGpuFile(gpus=[discovery.SimGpu(index=0, temperature_c=30)])
    path = tmp_path / "gpus.json"
    path.write_bytes(msgspec.json.encode(gpus))
    set_gpu(str(tmp_path), 0, remap_pending=True, clock_events=["hw_power_brake"], pcie_width=4)
    [h] = discovery.read_gpu_health(SimpleNamespace(gpus=str(path)))  # type: ignore[arg-type]
    assert (h.remap_pending, h.clock_events, h.pcie_width, h.pcie_width_max) == (True, ["hw_power_brake"], 4, 16)


def test_no_pynvml_leaks_into_sys_modules():
    assert not isinstance(sys.modules.get("pynvml"), SimpleNamespace)


# ---- GPUDirect RDMA -----------------------------------------------------------------------


def test_gpudirect_needs_peermem_or_dma_buf_where_gpus_meet_rdma_adapters(tmp_path):
    from llmgw.agent.hostfacts import gpu_rdma

    sysfs = tmp_path / "sys"
    (sysfs / "module" / "mlx5_ib").mkdir(parents=True)
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    assert gpu_rdma(str(sysfs), str(version)) == ([], False)
    assert gpu_rdma(str(sysfs), str(tmp_path / "none")) == ([], None)
    n = facts(read())
    n.inventory.ports = [m.Port(device="mlx5_0", port=1)]
    n.host = m.HostFacts(gpu_rdma_modules=[], nvidia_open=False)
    [(status, _, finding)] = run("gpudirect", n)
    assert status == WARN and "nvidia_peermem is not loaded" in finding
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n")
    n.host = m.HostFacts(gpu_rdma_modules=[], nvidia_open=gpu_rdma(str(sysfs), str(version))[1])
    assert run("gpudirect", n)[0][0] == OK and "dma-buf" in run("gpudirect", n)[0][2]
    (sysfs / "module" / "nvidia_peermem").mkdir()
    n.host = m.HostFacts(gpu_rdma_modules=gpu_rdma(str(sysfs), str(version))[0])
    assert run("gpudirect", n) == [(OK, "", "GPUDirect RDMA: nvidia_peermem loaded")]
    n.inventory.ports = []
    assert run("gpudirect", n) == [(OK, "", "no GPUDirect RDMA expected (no RDMA adapters)")]


# ---- the NVSwitch fabric --------------------------------------------------------------------


def test_the_fabric_manager_check_reads_nvml_gpu_fabric_info():
    """Through the agent's call (a ctypes struct passed by reference, as pynvml wants it)."""
    without = facts(read())  # the H200 VM: "Fabric State : N/A"
    assert without.gpus is not None and without.gpus[0].fabric_state is None
    assert run("fabric-manager", without)[0][0] == OK and "no NVSwitch" in run("fabric-manager", without)[0][2]
    done = facts(read({0: {"fabric": (3, 0)}, 1: {"fabric": (3, 0)}}))
    assert run("fabric-manager", done) == [(OK, "", "2 GPUs: NVSwitch fabric set up")]
    bad = facts(read({0: {"fabric": (1, 0)}, 1: {"fabric": (3, 1)}}))
    found = run("fabric-manager", bad)
    assert [(s, subject) for s, subject, _ in found] == [(CRIT, "GPU 0"), (CRIT, "GPU 1")]
    assert "is nvidia-fabricmanager running?" in found[0][2] and "NVML status 1" in found[1][2]
    starting = facts(read({0: {"fabric": (2, 0)}, 1: {"fabric": (3, 0)}}))
    assert [(s, subject) for s, subject, _ in run("fabric-manager", starting)] == [(WARN, "GPU 0")]


def test_a_simulated_nvswitch_node_has_its_fabric_set_up(tmp_path):
    from llmgw.sim.gpu_faults import set_gpu
    from llmgw.sim.node import NodeSpec, write_node

    write_node(str(tmp_path / "n"), NodeSpec(node_id="n", gpus=2, ib_ports=0))
    cfg = SimpleNamespace(gpus=str(tmp_path / "n" / "gpus.json"))
    assert [h.fabric_state for h in discovery.read_gpu_health(cfg)] == ["completed", "completed"]  # type: ignore[arg-type]
    set_gpu(str(tmp_path / "n"), 1, fabric_state="not_started")
    health = discovery.read_gpu_health(cfg)  # type: ignore[arg-type]
    assert [(s, subject) for s, subject, _ in run("fabric-manager", facts(health))] == [(CRIT, "GPU 1")]
