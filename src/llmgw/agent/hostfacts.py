"""The host facts `ctl doctor` grades (issue 14): the agent's memlock limit, the model cache's
free space, GPUDirect RDMA's kernel modules, the NVSwitches and the fabric manager (issue 39).
Synchronous (statvfs can block on a network file system): the agent calls it in the heartbeat's
worker thread, `ctl doctor --local` directly. Never raises: a fact that cannot be read is None,
which doctor reports as unknown with the reason.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from llmgw.wire.messages import MEMLOCK_UNLIMITED, HostFacts

# `llmgw sim node` writes this file at the top of its fake sysfs tree: the adapters under it are
# simulated, so the memlock limit RDMA needs does not apply to them (a real /sys has no such file).
SIM_MARKER = "llmgw-sim-node"


def memlock_bytes() -> int | None:
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError):
        return None
    return MEMLOCK_UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)


def _existing(path: Path) -> Path:
    """The path, or its nearest existing parent (the cache is made on the first download)."""
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def disk_space(path: Path) -> tuple[int | None, int | None]:
    """(free to an unprivileged user, total) bytes of the file system holding `path`."""
    try:
        st = os.statvfs(_existing(path))
    except OSError:
        return None, None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def model_cache_dir(work_dir: str, model_cache: str) -> Path:
    """Where weights go: `model_cache`, else WORK_DIR/models (as agent/weights.py decides)."""
    return Path(model_cache) if model_cache else Path(work_dir) / "models"


# Kernel modules that let an RDMA adapter read and write GPU memory (GPUDirect RDMA): the driver's
# own since R470, and Mellanox's older out-of-tree one.
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")


def gpu_rdma(sysfs_root: str, proc_version: str = "/proc/driver/nvidia/version") -> tuple[list[str], bool | None]:
    """(peer-memory modules loaded, the NVIDIA driver is the open kernel modules' flavour: None
    when there is no NVIDIA driver to ask). A loaded or built-in module has /sys/module/NAME;
    the open flavour's version line reads "NVIDIA UNIX Open Kernel Module for x86_64  580.…"."""
    loaded = [name for name in PEERMEM_MODULES if os.path.isdir(os.path.join(sysfs_root, "module", name))]
    try:
        with open(proc_version, encoding="utf-8", errors="replace") as fh:
            first = fh.readline()
    except OSError:
        return loaded, None
    return loaded, "Open Kernel Module" in first


# NVSwitches on the PCI bus: NVIDIA's vendor id with the "other bridge" class, the one match the
# nvswitch kernel driver binds (open-gpu-kernel-modules kernel-open/nvidia/linux_nvswitch.c:
# nvswitch_pci_table, vendor PCI_VENDOR_ID_NVIDIA, class PCI_CLASS_BRIDGE_OTHER << 8, every bit
# compared); `lspci -nn` on an HGX H100 shows them as "Bridge [0680]: NVIDIA Corporation GH100
# [H100 NVSwitch] [10de:22a3]". NVIDIA's old MCP chipsets put their Ethernet in the same class,
# bound to forcedeth: a device bound to another driver is not counted.
NVIDIA_VENDOR = "0x10de"
BRIDGE_OTHER_CLASS = "0x068000"
NVSWITCH_DRIVER = "nvidia-nvswitch"
# The fabric manager's process: the nvidia-fabricmanager service runs /usr/bin/nv-fabricmanager
# (NVIDIA's Fabric Manager user guide). /proc/PID/comm holds at most 15 characters (the kernel's
# TASK_COMM_LEN, 16 with the NUL), so it reads "nv-fabricmanage", as systemctl status' "Main PID:
# 1234 (nv-fabricmanage)" shows; argv[0] in /proc/PID/cmdline tells it from nv-fabricmanager-ctl.
FABRIC_MANAGER = "nv-fabricmanager"
COMM_LEN = 15


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def nvswitch_count(sysfs_root: str) -> int | None:
    """NVSwitch devices under SYSFS/bus/pci/devices (None: no PCI bus to read)."""
    devices = os.path.join(sysfs_root, "bus", "pci", "devices")
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return None
    count = 0
    for name in names:
        path = os.path.join(devices, name)
        if ((_read_text(os.path.join(path, "vendor")) or "").strip().lower() != NVIDIA_VENDOR
                or (_read_text(os.path.join(path, "class")) or "").strip().lower() != BRIDGE_OTHER_CLASS):
            continue
        driver = os.path.join(path, "driver")
        if os.path.lexists(driver) and os.path.basename(os.path.realpath(driver)) != NVSWITCH_DRIVER:
            continue  # an MCP chipset's Ethernet (forcedeth), not a switch
        count += 1
    return count


def fabric_manager_running(proc_root: str = "/proc") -> bool | None:
    """Whether an nv-fabricmanager process runs (None: /proc cannot be listed, or shows only the
    agent's own processes: mounted hidepid=, where PID 1 is hidden from other users too). Reads
    each process' comm, and its cmdline only where the comm matches: no shelling to systemctl."""
    try:
        pids = [name for name in os.listdir(proc_root) if name.isdigit()]
    except OSError:
        return None
    if "1" not in pids:
        return None  # other users' processes are hidden: a fabric manager would be too
    for pid in pids:
        comm = (_read_text(os.path.join(proc_root, pid, "comm")) or "").strip()
        if comm != FABRIC_MANAGER[:COMM_LEN]:
            continue
        argv = (_read_text(os.path.join(proc_root, pid, "cmdline")) or "").split("\0")[0]
        if not argv or os.path.basename(argv) == FABRIC_MANAGER:
            return True  # an unreadable cmdline (hidepid) leaves the comm to go by
    return False


# `llmgw sim node` keeps its stand-in /proc (the fabric manager's process) in its sysfs tree.
SIM_PROC = "proc"


def read_host_facts(work_dir: str, model_cache: str, sysfs_root: str) -> HostFacts:
    cache = model_cache_dir(work_dir, model_cache)
    free, total = disk_space(cache)
    simulated = os.path.exists(os.path.join(sysfs_root, SIM_MARKER))
    modules, open_driver = gpu_rdma(sysfs_root, os.path.join(sysfs_root, "nvidia-version") if simulated
                                    else "/proc/driver/nvidia/version")
    switches = nvswitch_count(sysfs_root)
    # Every process' comm is read only where a fabric manager is wanted (or the bus could not be
    # read): on a node without NVSwitches that is thousands of reads a heartbeat for nothing.
    manager = None if switches == 0 else fabric_manager_running(
        os.path.join(sysfs_root, SIM_PROC) if simulated else "/proc")
    return HostFacts(
        gpu_rdma_modules=modules,
        nvidia_open=open_driver,
        nvswitches=switches,
        fabric_manager=manager,
        memlock_bytes=memlock_bytes(),
        rdma_simulated=simulated,
        model_cache=str(cache.absolute()),
        cache_free_bytes=free,
        cache_total_bytes=total,
    )
