"""A stand-in `pynvml` module for end-to-end tests of what the agent reads from NVML, copied as
`pynvml.py` into a directory put first on a process's PYTHONPATH (the agent, `ctl doctor --local`).

It answers the calls discovery makes, with nvidia-ml-py's names and return shapes, from a board
described in the JSON file named by LLMGW_FAKE_NVML_BOARD, read again on every call so that a test
can change a link under a running agent:

    {"gpus": [{"bus": 24, "links": [["gpu", 42], ["none", 0], ...]}, ...]}

A link is [kind, far-end PCI bus]: "gpu" (up, to that GPU), "switch" (up, to an NVSwitch),
"none" (a link the GPU has with nothing cabled: NVML_FEATURE_DISABLED and no far end), "down"
(cabled but not up: NVML_FEATURE_DISABLED, the far end still named).
"""

from __future__ import annotations

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


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=0)


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
