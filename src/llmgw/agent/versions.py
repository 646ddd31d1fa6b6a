"""The versions doctor compares across nodes (issue 39): the CUDA version the driver supports, each
GPU's VBIOS, and the RDMA stack. Read once per registration (a driver or firmware change needs
a reboot, which restarts the agent); synchronous, from the agent's worker thread; never raises.

- NVML: nvmlSystemGetCudaDriverVersion (an int, 12040 for CUDA 12.4, as `nvidia-smi` prints
  "CUDA Version: 12.4") and nvmlDeviceGetVbiosVersion per GPU ("96.00.A5.00.1A").
- The RDMA stack: MLNX_OFED's (and DOCA-OFED's) mlx5_core carries a module version,
  /sys/module/mlx5_core/version ("24.10-1.1.4"); the in-box driver has had none since Linux 5.x
  dropped MODULE_VERSION from mlx5, and is then what the kernel is: "in-box, kernel <release>".
"""

from __future__ import annotations

import os
from typing import Any

from llmgw.wire.messages import Gpu


def cuda_text(version: int) -> str:
    """12040 → "12.4", 13000 → "13.0" (nvidia-smi's "CUDA Version"); "" for 0 or less."""
    if version <= 0:
        return ""
    return f"{version // 1000}.{version % 1000 // 10}"


def read_cuda(nv: Any) -> str:
    try:
        return cuda_text(int(nv.nvmlSystemGetCudaDriverVersion()))
    except Exception:  # an older driver, or NVML refusing: not reported
        return ""


def read_vbios(nv: Any, gpus: list[Gpu]) -> None:
    """Each GPU's VBIOS into `gpus` (a GPU NVML cannot open keeps "")."""
    for gpu in gpus:
        try:
            gpu.vbios = str(nv.nvmlDeviceGetVbiosVersion(nv.nvmlDeviceGetHandleByIndex(gpu.index))).strip()
        except Exception:
            continue


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(256).strip()
    except OSError:
        return ""


def rdma_stack(sysfs_root: str) -> str:
    """ "MLNX_OFED 24.10-1.1.4" or "in-box, kernel 6.8.0-45-generic" ("" without a kernel release)."""
    version = _read(os.path.join(sysfs_root, "module", "mlx5_core", "version"))
    if version:
        return f"MLNX_OFED {version}"
    release = os.uname().release
    return f"in-box, kernel {release}" if release else ""
