"""A stand-in `pynvml` module for end-to-end tests of what the agent reads from NVML, copied as
`pynvml.py` into a directory put first on a process's PYTHONPATH (the agent, `ctl doctor --local`).

It answers the calls discovery makes, with nvidia-ml-py's names and return shapes, from a board
described in the JSON file named by LLMGW_FAKE_NVML_BOARD, read again on every call so that a test
can change a link under a running agent:

    {"gpus": [{"bus": 24, "links": [["gpu", 42], ["none", 0], ...]}, ...]}

A link is [kind, far-end PCI bus]: "gpu" (up, to that GPU), "switch" (up, to an NVSwitch),
"none" (a link the GPU has with nothing cabled: NVML_FEATURE_DISABLED and no far end), "down"
(cabled but not up: NVML_FEATURE_DISABLED, the far end still named).

A GPU's optional "board" overrides what issue 39's doctor checks read (BOARD: the real H200 of
tests/fixtures/real/nvidia-smi-q/, driver 580; its temperature limits an H100 SXM's), e.g.
{"remapped": [0, 1, 1, 0], "width": [8, 16]}; a null value makes that query NotSupported.
"""

from __future__ import annotations

import ctypes
import json
import os
from types import SimpleNamespace

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 18
NVML_NVLINK_DEVICE_TYPE_GPU = 0
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1

BOARD = {"remapped": [0, 0, 0, 0], "retired": [], "retired_pending": 0, "reasons": 0x1, "slowdown": 89,
         "shutdown": 92, "gen": [5, 5], "width": [16, 16], "persistence": 1, "ecc": [1, 1], "fabric": [0, 0]}


class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    _fields_ = [("status", ctypes.c_uint), ("state", ctypes.c_uint)]


class c_nvmlGpuFabricInfoV_t(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("status", ctypes.c_uint), ("state", ctypes.c_uint)]

    def __init__(self) -> None:
        super().__init__(version=0x02000024)


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_NoPermission(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


def _board() -> list[dict]:
    with open(os.environ["LLMGW_FAKE_NVML_BOARD"], encoding="utf-8") as fh:
        return json.load(fh)["gpus"]


def _pci(bus: int) -> SimpleNamespace:
    return SimpleNamespace(domain=0, bus=bus, device=0, busId=f"00000000:{bus:02X}:00.0")


def _link(handle: int, link: int) -> list:
    links = _board()[handle]["links"]
    if link >= len(links):
        raise NVMLError("Invalid Argument")
    return links[link]


def nvmlInit() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return "550.54.15"


def nvmlSystemGetCudaDriverVersion() -> int:
    return 12040


def nvmlDeviceGetVbiosVersion(handle: int) -> str:
    return "96.00.A5.00.1A"


def nvmlDeviceGetCount() -> int:
    return len(_board())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetUUID(handle: int) -> str:
    return f"GPU-fake-{handle:04d}"


def nvmlDeviceGetName(handle: int) -> str:
    return "NVIDIA H100 PCIe"


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    return SimpleNamespace(total=81559 * 1024 * 1024, used=1024 * 1024)


def nvmlDeviceGetPciInfo(handle: int) -> SimpleNamespace:
    return _pci(_board()[handle]["bus"])


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    return 40


def nvmlDeviceGetTemperatureV(handle: int, sensor: int) -> int:
    return 40


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=0)


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    return 115_021  # milliwatts, as NVML answers


def nvmlDeviceGetTotalEccErrors(handle: int, kind: int, counter: int) -> int:
    return 0


def nvmlDeviceGetNvLinkState(handle: int, link: int) -> int:
    kind, _ = _link(handle, link)
    return NVML_FEATURE_ENABLED if kind in ("gpu", "switch") else NVML_FEATURE_DISABLED


def nvmlDeviceGetNvLinkRemotePciInfo(handle: int, link: int) -> SimpleNamespace:
    kind, bus = _link(handle, link)
    if kind == "none":
        raise NVMLError_NotSupported("Not Supported")
    return _pci(bus)


def nvmlDeviceGetNvLinkRemoteDeviceType(handle: int, link: int) -> int:
    kind, _ = _link(handle, link)
    if kind == "none":
        raise NVMLError_NotSupported("Not Supported")
    return NVML_NVLINK_DEVICE_TYPE_SWITCH if kind == "switch" else NVML_NVLINK_DEVICE_TYPE_GPU


def _value(handle: int, key: str):
    value = {**BOARD, **_board()[handle].get("board", {})}[key]
    if value is None:
        raise NVMLError_NotSupported("Not Supported")
    return value


def nvmlDeviceGetRemappedRows(device: int) -> tuple:
    return tuple(_value(device, "remapped"))


def nvmlDeviceGetRetiredPages(device: int, sourceFilter: int) -> list:
    return list(_value(device, "retired"))


def nvmlDeviceGetRetiredPagesPendingStatus(device: int) -> int:
    return _value(device, "retired_pending")


def nvmlDeviceGetCurrentClocksEventReasons(handle: int) -> int:
    return _value(handle, "reasons")


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: int) -> int:
    return _value(handle, "reasons")


def nvmlDeviceGetTemperatureThreshold(handle: int, threshold: int) -> int:
    return _value(handle, "shutdown" if threshold == NVML_TEMPERATURE_THRESHOLD_SHUTDOWN else "slowdown")


def nvmlDeviceGetCurrPcieLinkGeneration(handle: int) -> int:
    return _value(handle, "gen")[0]


def nvmlDeviceGetMaxPcieLinkGeneration(handle: int) -> int:
    return _value(handle, "gen")[1]


def nvmlDeviceGetCurrPcieLinkWidth(handle: int) -> int:
    return _value(handle, "width")[0]


def nvmlDeviceGetMaxPcieLinkWidth(handle: int) -> int:
    return _value(handle, "width")[1]


def nvmlDeviceGetPersistenceMode(handle: int) -> int:
    return _value(handle, "persistence")


def nvmlDeviceGetEccMode(handle: int) -> list:
    return list(_value(handle, "ecc"))


def nvmlDeviceGetGpuFabricInfo(device: int, gpuFabricInfo) -> int:
    state, status = _value(device, "fabric")
    info = getattr(gpuFabricInfo, "_obj", None)
    if info is not None:
        info.state, info.status = state, status
    return 0


def nvmlDeviceGetGpuFabricInfoV(device: int, gpuFabricInfo) -> int:
    return nvmlDeviceGetGpuFabricInfo(device, gpuFabricInfo)
