"""The host facts `ctl doctor` grades (issue 14): the agent's memlock limit, the model cache's
free space, and GPUDirect RDMA's kernel modules (issue 39). Synchronous (statvfs can block on a network file system): the agent calls it in the
heartbeat's worker thread, `ctl doctor --local` directly. Never raises: a fact that cannot be read
is None, which doctor reports as unknown with the reason.
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


def read_host_facts(work_dir: str, model_cache: str, sysfs_root: str) -> HostFacts:
    cache = model_cache_dir(work_dir, model_cache)
    free, total = disk_space(cache)
    simulated = os.path.exists(os.path.join(sysfs_root, SIM_MARKER))
    modules, open_driver = gpu_rdma(sysfs_root, os.path.join(sysfs_root, "nvidia-version") if simulated
                                    else "/proc/driver/nvidia/version")
    return HostFacts(
        gpu_rdma_modules=modules,
        nvidia_open=open_driver,
        memlock_bytes=memlock_bytes(),
        rdma_simulated=simulated,
        model_cache=str(cache.absolute()),
        cache_free_bytes=free,
        cache_total_bytes=total,
    )
