"""Issue 39's NVSwitch fabric-manager check: what the agent reads of the node (the NVSwitches on the
PCI bus, the nv-fabricmanager process in /proc) in the shapes the kernel writes them, and doctor's
healthy / warn / crit / unknown from it with NVML's GPU fabric state beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.hostfacts import fabric_manager_running, nvswitch_count, read_host_facts
from llmgw.errors import UsageError
from llmgw.verdict import Status
from llmgw.wire import messages as m
from tests.unit.test_doctor_gpu import facts, read, run

OK, WARN, CRIT, UNKNOWN = Status.OK, Status.WARN, Status.CRIT, Status.UNKNOWN


def pci(sysfs: Path, bdf: str, vendor: str, device: str, klass: str, driver: str | None) -> None:
    """One PCI function as the kernel's pci-sysfs.c prints it: vendor/device "0x%04x", class
    "0x%06x"; /sys/bus/pci/devices/BDF a link into /sys/devices, `driver` a link to the bound one."""
    real = sysfs / "devices" / "pci0000:00" / bdf
    real.mkdir(parents=True)
    (real / "vendor").write_text(vendor + "\n")
    (real / "device").write_text(device + "\n")
    (real / "class").write_text(klass + "\n")
    if driver:
        (sysfs / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (real / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")
    (sysfs / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
    (sysfs / "bus" / "pci" / "devices" / bdf).symlink_to(f"../../../devices/pci0000:00/{bdf}")


def test_nvswitches_are_nvidia_other_bridges_the_nvswitch_driver_may_bind(tmp_path):
    """`lspci -Dnn` on an HGX H100: "0000:07:00.0 Bridge [0680]: NVIDIA Corporation GH100 [H100
    NVSwitch] [10de:22a3]"; a GPU is class 0x030200; an MCP61's Ethernet is also 10de class 0680
    ("Bridge [0680]: nVidia Corporation MCP61 Ethernet [10de:03ef]", bound to forcedeth)."""
    sysfs = tmp_path / "sys"
    assert nvswitch_count(str(sysfs)) is None  # no PCI bus to read
    pci(sysfs, "0000:07:00.0", "0x10de", "0x22a3", "0x068000", "nvidia-nvswitch")
    pci(sysfs, "0000:08:00.0", "0x10de", "0x22a3", "0x068000", None)  # the driver not loaded yet
    pci(sysfs, "0000:18:00.0", "0x10de", "0x2330", "0x030200", "nvidia")  # an H100 SXM GPU
    pci(sysfs, "0000:00:07.0", "0x10de", "0x03ef", "0x068000", "forcedeth")
    pci(sysfs, "0000:0c:00.0", "0x15b3", "0x1021", "0x020700", "mlx5_core")  # a ConnectX-7
    assert nvswitch_count(str(sysfs)) == 2


def proc_entry(proc: Path, pid: int, comm: str, cmdline: str | None) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "comm").write_text(comm + "\n")
    if cmdline is not None:
        (proc / str(pid) / "cmdline").write_text(cmdline)


def test_the_fabric_manager_is_found_by_its_truncated_comm_and_argv0(tmp_path):
    """comm holds 15 characters ("Main PID: 1234 (nv-fabricmanage)" in systemctl status); argv[0]
    tells the daemon from a tool whose name starts the same."""
    proc = tmp_path / "proc"
    assert fabric_manager_running(str(proc)) is None  # no /proc to list
    proc_entry(proc, 4242, "llmgw", "/usr/bin/python3\0-m\0llmgw\0agent\0")
    assert fabric_manager_running(str(proc)) is None  # hidepid=: only our own processes, no PID 1
    proc_entry(proc, 1, "systemd", "/sbin/init\0")
    proc_entry(proc, 812, "nvidia-persiste", "/usr/bin/nvidia-persistenced\0--user\0nvidia-persistenced\0")
    (proc / "self").mkdir()
    assert fabric_manager_running(str(proc)) is False
    proc_entry(proc, 3001, "nv-fabricmanage", "/usr/bin/nv-fabricmanager-ctl\0")
    assert fabric_manager_running(str(proc)) is False
    proc_entry(proc, 2939, "nv-fabricmanage",
               "/usr/bin/nv-fabricmanager\0-c\0/usr/share/nvidia/nvswitch/fabricmanager.cfg\0")
    assert fabric_manager_running(str(proc)) is True
    os.unlink(proc / "2939" / "cmdline")  # hidepid: another user's cmdline unreadable, comm to go by
    assert fabric_manager_running(str(proc)) is True


def nvswitch_node(manager: bool | None, boards: dict[int, dict[str, object]] | None = None, switches: int | None = 4):
    n = facts(read(boards))
    n.host = m.HostFacts(nvswitches=switches, fabric_manager=manager)
    return n


DONE = {0: {"fabric": (3, 0)}, 1: {"fabric": (3, 0)}}


def test_an_nvswitch_board_with_its_fabric_manager_running_and_the_fabric_set_up_is_healthy():
    assert run("fabric-manager", nvswitch_node(True, DONE)) == [
        (OK, "", "4 NVSwitches, nv-fabricmanager running; 2 GPUs: NVSwitch fabric set up")]
    # An A100 HGX: no GPU fabric info in NVML, the process is what there is to grade.
    assert run("fabric-manager", nvswitch_node(True)) == [(OK, "", "4 NVSwitches, nv-fabricmanager running")]


def test_nvswitches_without_a_fabric_manager_are_critical():
    [(status, subject, finding)] = run("fabric-manager", nvswitch_node(False))
    assert (status, subject) == (CRIT, "") and "4 NVSwitches and no nv-fabricmanager process" in finding
    stopped = run("fabric-manager", nvswitch_node(False, {0: {"fabric": (1, 0)}, 1: {"fabric": (2, 0)}}))
    # The process first, then the GPU not set up; the one still in progress says nothing more
    # while nothing is setting it up.
    assert [(s, subject) for s, subject, _ in stopped] == [(CRIT, ""), (CRIT, "GPU 0")]


def test_a_fabric_still_being_set_up_by_a_running_manager_warns():
    found = run("fabric-manager", nvswitch_node(True, {0: {"fabric": (2, 0)}, 1: {"fabric": (3, 0)}}))
    assert [(s, subject) for s, subject, _ in found] == [(WARN, "GPU 0")]


def test_a_failed_setup_is_critical_and_the_status_is_read_only_once_complete():
    found = run("fabric-manager", nvswitch_node(True, {0: {"fabric": (3, 0)}, 1: {"fabric": (3, 3)}}))
    assert [(s, subject) for s, subject, _ in found] == [(CRIT, "GPU 1")] and "NVML status 3" in found[0][2]
    # NVML: status "must be checked only if state returns complete": a stale one in progress is not a failure.
    found = run("fabric-manager", nvswitch_node(True, {0: {"fabric": (2, 3)}, 1: {"fabric": (3, 0)}}))
    assert [(s, subject) for s, subject, _ in found] == [(WARN, "GPU 0")]


def test_no_nvswitches_no_fabric_manager_needed_and_an_older_agent_as_before():
    assert run("fabric-manager", nvswitch_node(False, switches=0))[0][0] == OK
    assert run("fabric-manager", nvswitch_node(None, DONE, switches=None)) == [(OK, "",
                                                                                "2 GPUs: NVSwitch fabric set up")]
    [(status, _, finding)] = run("fabric-manager", nvswitch_node(None))
    assert status == UNKNOWN and "cannot tell whether nv-fabricmanager runs" in finding


def test_a_simulated_nvswitch_node_runs_its_fabric_manager_and_the_sim_can_stop_it(tmp_path):
    from llmgw.sim.node import NodeSpec, write_node
    from llmgw.sim.node_faults import set_fabric_manager

    root = str(tmp_path / "n")
    write_node(root, NodeSpec(node_id="n", gpus=2, ib_ports=0))  # nv18: an NVSwitch baseboard
    sysfs = os.path.join(root, "sys")
    host = read_host_facts(str(tmp_path / "work"), "", sysfs)
    assert (host.nvswitches, host.fabric_manager) == (4, True)
    assert set_fabric_manager(root, False) == "nv-fabricmanager stopped"
    n = nvswitch_node(None, DONE)
    n.host = read_host_facts(str(tmp_path / "work"), "", sysfs)
    assert [s for s, _, _ in run("fabric-manager", n)] == [CRIT]
    set_fabric_manager(root, True)
    assert read_host_facts(str(tmp_path / "work"), "", sysfs).fabric_manager is True
    bridged = str(tmp_path / "pcie")
    write_node(bridged, NodeSpec(node_id="p", gpus=2, ib_ports=0, nvlink="pairs-nv12"))
    bridged_host = read_host_facts(str(tmp_path / "work"), "", os.path.join(bridged, "sys"))
    # No NVSwitch on the bus: no fabric manager wanted, so /proc is not read for one.
    assert (bridged_host.nvswitches, bridged_host.fabric_manager) == (0, None)
    with pytest.raises(UsageError, match="no NVSwitches"):
        set_fabric_manager(bridged, False)
