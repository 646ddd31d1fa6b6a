"""`llmgw sim node set-gpu`: a simulated GPU goes bad under a running agent — uncorrected ECC
errors, an Xid, NVLink links down, lost, a pending row remap, a clock slowdown, a hot card, a
PCIe link trained narrow, persistence or ECC off — the way NVML would start reporting it. The agent
re-reads gpus.json when it changes (agent/discovery.py), so its next heartbeat carries it and
`ctl doctor` grades it through the real path.
"""

from __future__ import annotations

import os

import msgspec

from llmgw.agent.discovery import SimGpu, SimGpuFile
from llmgw.errors import UsageError
from llmgw.fsutil import atomic_write
from llmgw.wire.messages import CLOCK_EVENTS

HEALTH = ("ok", "error", "lost")


def set_gpu(directory: str, index: int, *, health: str | None = None, ecc: int | None = None, xid: int | None = None,
            nvlink_down: int | None = None, **board: object) -> SimGpu:
    """Change GPU `index` of the simulated node in `directory` (atomic rewrite); returns it.
    `board` sets issue 39's readings by SimGpu field name (remap_pending=True, clock_events=[...],
    pcie_width=8, ...); None leaves one as it is."""
    unknown = sorted(set(board) - set(SimGpu.__struct_fields__))
    if unknown:
        raise UsageError(f"not a simulated GPU reading: {', '.join(unknown)}")
    throttle = board.get("clock_events")
    if isinstance(throttle, list) and not set(throttle) <= set(CLOCK_EVENTS.values()):
        raise UsageError(f"--throttle {', '.join(throttle)}: use {', '.join(CLOCK_EVENTS.values())} or none")
    path = os.path.join(os.path.abspath(directory), "gpus.json")
    try:
        with open(path, "rb") as fh:
            data = msgspec.json.decode(fh.read(), type=SimGpuFile)
    except OSError as exc:
        raise UsageError(f"no simulated node in {directory}: {path}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:
        raise UsageError(f"{path} is not a simulated GPU inventory ({exc})") from None
    if health is not None and health not in HEALTH:
        raise UsageError(f"--health {health!r}: use one of {', '.join(HEALTH)}")
    for i, gpu in enumerate(data.gpus):
        if gpu.index == index:
            changes = {k: v for k, v in (("health", health), ("ecc_uncorrected", ecc), ("xid", xid),
                                         ("nvlink_down", nvlink_down), *board.items()) if v is not None}
            data.gpus[i] = msgspec.structs.replace(gpu, **changes)
            break
    else:
        raise UsageError(f"no GPU {index} in {path} (it has {', '.join(str(g.index) for g in data.gpus) or 'none'})")
    try:
        atomic_write(path, msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    return data.gpus[i]
