"""What NVML says about each GPU: its NVLink peers (inventory) and its health (heartbeats).

Synchronous, like the rest of discovery (the agent calls it from a worker thread), and given an
initialised pynvml module (discovery.py holds the one NVML session). A query NVML refuses for one
GPU or link leaves that reading out; nothing here raises for a GPU that misbehaves.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

from llmgw.wire.messages import CLOCK_EVENTS, FABRIC_STATES, Gpu, GpuHealth

log = logging.getLogger("llmgw.agent.discovery")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_once(message: str) -> None:
    with _logged_lock:
        if message in _logged:
            return
        _logged.add(message)
    log.warning("%s", message)


def _pci_key(info: Any) -> tuple[int, int, int]:
    return (int(info.domain), int(info.bus), int(info.device))


def nvml_gpus(nv: ModuleType | Any) -> list[Gpu]:
    """GPUs and their NVLink peers from an initialised pynvml module.

    Direct GPU↔GPU links are counted per peer. Links to an NVSwitch connect a GPU to every
    other GPU on the switches, as `nvidia-smi topo -m` shows (NV18 on an HGX H100): each pair
    of switch-attached GPUs gets the smaller of their two switch link counts.
    """
    count = int(nv.nvmlDeviceGetCount())
    handles: dict[int, Any] = {}
    gpus: dict[int, Gpu] = {}
    by_pci: dict[tuple[int, int, int], int] = {}
    for index in range(count):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            gpus[index] = Gpu(index=index, health="error")
            _log_once(f"GPU {index}: NVML cannot open it ({exc})")
            continue
        handles[index] = handle
        gpu = Gpu(index=index)
        try:
            gpu.uuid = str(nv.nvmlDeviceGetUUID(handle))
            gpu.name = str(nv.nvmlDeviceGetName(handle))
            gpu.memory_mib = int(nv.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)
            pci = nv.nvmlDeviceGetPciInfo(handle)
            gpu.pci_bus_id = str(pci.busId)
            by_pci[_pci_key(pci)] = index
        except nv.NVMLError as exc:
            gpu.health = "error"
            _log_once(f"GPU {index}: NVML query failed ({exc})")
        gpus[index] = gpu

    peers: dict[int, Counter[int]] = {i: Counter() for i in handles}
    switch_links: Counter[int] = Counter()
    max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))
    switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    for index, handle in handles.items():
        for link in range(max_links):
            try:
                if nv.nvmlDeviceGetNvLinkState(handle, link) != enabled:
                    continue
            except nv.NVMLError:
                continue  # no such link, or NVLink not supported on this GPU
            try:
                peer = by_pci.get(_pci_key(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)))
            except nv.NVMLError:
                peer = None  # some switch-attached GPUs cannot name the far end's PCI address
            if peer is not None and peer != index:
                peers[index][peer] += 1
                continue
            try:
                kind = nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            except (nv.NVMLError, AttributeError):
                continue  # cannot tell an NVSwitch from a CPU NPU: do not guess
            if kind == switch_type:
                switch_links[index] += 1
    switched = sorted(switch_links)
    for a in switched:
        for b in switched:
            if a != b:
                peers[a][b] = max(peers[a][b], min(switch_links[a], switch_links[b]))
    for index, counter in peers.items():
        gpus[index].nvlink = {peer: n for peer, n in sorted(counter.items()) if n > 0}
    return [gpus[i] for i in sorted(gpus)]


def nvml_health(nv: ModuleType | Any) -> list[GpuHealth]:
    out: list[GpuHealth] = []
    for index in range(int(nv.nvmlDeviceGetCount())):
        health = GpuHealth(index=index)
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            health.health = (
                "lost" if isinstance(exc, getattr(nv, "NVMLError_GpuIsLost", ())) else "error"
            )
            out.append(health)
            continue
        temperature = _temperature(nv, handle)
        if temperature is not None:
            health.temperature_c = temperature
        try:
            health.utilization_pct = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nv.NVMLError:
            pass
        try:
            health.power_w = round(int(nv.nvmlDeviceGetPowerUsage(handle)) / 1000, 1)  # milliwatts
        except nv.NVMLError:
            pass
        try:
            health.memory_used_mib = int(nv.nvmlDeviceGetMemoryInfo(handle).used) // (1024 * 1024)
        except nv.NVMLError as exc:
            if isinstance(exc, getattr(nv, "NVMLError_GpuIsLost", ())):
                health.health = "lost"
        try:
            health.ecc_uncorrected = int(nv.nvmlDeviceGetTotalEccErrors(
                handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        except (nv.NVMLError, AttributeError):
            pass  # ECC off or not supported (most PCIe consumer boards): not read
        health.nvlink_down = _nvlink_down(nv, handle, index)
        read_board(nv, handle, health)
        out.append(health)
    return out


def _ask(nv: ModuleType | Any, query: Callable[[], Any]) -> Any:
    """One NVML query, or None where this GPU, driver or nvidia-ml-py cannot answer it
    (NotSupported on a consumer board, a function older bindings lack). The query is written
    out as a call (`lambda: nv.nvmlX(handle)`) so tests/unit/test_nvml_api.py sees its name."""
    try:
        return query()
    except (nv.NVMLError, AttributeError):
        return None


def _temperature(nv: ModuleType | Any, handle: Any) -> int | None:
    """The GPU's temperature, °C. nvidia-ml-py 13 marks nvmlDeviceGetTemperature "DEPRECATED: Use
    nvmlDeviceGetTemperatureV instead; will be removed in CUDA 14.0"; a driver older than the V
    call answers FunctionNotFound, and then the old one is asked."""
    value = _ask(nv, lambda: nv.nvmlDeviceGetTemperatureV(handle, nv.NVML_TEMPERATURE_GPU))
    if value is None:
        value = _ask(nv, lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
    return None if value is None else int(value)


def _positive(value: Any) -> int | None:
    return int(value) if value is not None and int(value) > 0 else None


def read_board(nv: ModuleType | Any, handle: Any, health: GpuHealth) -> None:
    """What issue 39's doctor checks read, each left None where NVML cannot say: row remapping
    (Ampere and later; retired pages where it is not supported), clock event reasons, the card's
    slowdown and shutdown temperatures, the PCIe link, persistence and ECC modes. About ten cheap
    queries per GPU, from the heartbeat's worker thread like the rest."""
    health.board_read = True
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    # nvidia-ml-py returns (corrRows, uncRows, isPending, failureOccurred); NVML's reference: a
    # pending remap needs a GPU reset to take effect, failureOccurred is set if one ever failed
    # (Ampere and later; NotSupported on a MIG GPU with active instances: then retired pages).
    rows = _ask(nv, lambda: nv.nvmlDeviceGetRemappedRows(handle))
    if rows is not None:
        _, uncorrectable, pending, failed = rows
        health.remapped_uncorrectable, health.remap_pending, health.remap_failed = (
            int(uncorrectable), bool(pending), bool(failed))
    else:
        single = getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0)
        double = getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)
        pages = [_ask(nv, lambda: nv.nvmlDeviceGetRetiredPages(handle, single)),
                 _ask(nv, lambda: nv.nvmlDeviceGetRetiredPages(handle, double))]
        if any(p is not None for p in pages):
            health.retired_pages = sum(len(p) for p in pages if p is not None)
            pending = _ask(nv, lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(handle))
            health.retired_pending = None if pending is None else pending == enabled
    # nvidia-ml-py 12.535 renamed "throttle reasons" to "clocks event reasons"; same bits.
    reasons = _ask(nv, lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(handle))
    if reasons is None:
        reasons = _ask(nv, lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    if reasons is not None:
        health.clock_events = [name for bit, name in CLOCK_EVENTS.items() if int(reasons) & bit]
    slowdown = getattr(nv, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)
    shutdown = getattr(nv, "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)
    # 0 or less: no such threshold on this board (or a driver that answers in T.Limit terms).
    health.slowdown_c = _positive(_ask(nv, lambda: nv.nvmlDeviceGetTemperatureThreshold(handle, slowdown)))
    health.shutdown_c = _positive(_ask(nv, lambda: nv.nvmlDeviceGetTemperatureThreshold(handle, shutdown)))
    # "Max" is what this device can train at in this system ("a generation 2 PCIe device attached
    # to a generation 1 PCIe bus ... reports generation 1", NVML's Device Queries); the card's own
    # maximum is nvmlDeviceGetGpuMaxPcieLinkGeneration. Current drops at idle to save power.
    health.pcie_gen = _positive(_ask(nv, lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(handle)))
    health.pcie_gen_max = _positive(_ask(nv, lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(handle)))
    health.pcie_width = _positive(_ask(nv, lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(handle)))
    health.pcie_width_max = _positive(_ask(nv, lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(handle)))
    # Both return nvmlEnableState_t values; nvmlDeviceGetEccMode returns [current, pending].
    persistence = _ask(nv, lambda: nv.nvmlDeviceGetPersistenceMode(handle))
    if persistence is not None:
        health.persistence = persistence == enabled
    ecc = _ask(nv, lambda: nv.nvmlDeviceGetEccMode(handle))
    if ecc is not None:
        health.ecc_enabled, health.ecc_pending = ecc[0] == enabled, ecc[1] == enabled
    _read_fabric(nv, handle, health)


def _read_fabric(nv: ModuleType | Any, handle: Any, health: GpuHealth) -> None:
    """The NVSwitch fabric's state for this GPU: the fabric manager sets it up at boot, and until
    it has (or when it failed) CUDA cannot start on the GPU. The caller passes the struct NVML
    fills in (pynvml's nvmlDeviceGetGpuFabricInfo[V] hands its argument straight to C, so it goes
    by reference).

    The versioned call first: nvidia-ml-py 13 marks nvmlDeviceGetGpuFabricInfo "DEPRECATED: Use
    nvmlDeviceGetGpuFabricInfoV instead; will be removed in CUDA 14.0", and its
    c_nvmlGpuFabricInfoV_t (nvmlGpuFabricInfo_v2_t) sets its own `version` field in __init__. A
    driver older than the V call (R550) answers FunctionNotFound, an NVMLError: then the first one.
    Both structs have `state` (NVML_GPU_FABRIC_STATE_*) and `status`, which NVML's API reference
    (nvmlGpuFabricInfo_t, docs.nvidia.com/deploy/nvml-api/structnvmlGpuFabricInfo__t.html) says
    "must be checked only if state returns complete" (doctor's fabric-manager check does so)."""
    info: Any = None
    versioned = getattr(nv, "c_nvmlGpuFabricInfoV_t", None)
    if versioned is not None:
        info = versioned()
        if _ask(nv, lambda: nv.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))) is None:
            info = None
    if info is None:
        try:
            info = nv.c_nvmlGpuFabricInfo_t()
        except (AttributeError, TypeError):
            return  # nvidia-ml-py older than GPU fabric info
        if _ask(nv, lambda: nv.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))) is None:
            return
    state = FABRIC_STATES.get(int(info.state))
    if state is not None and state != "not_supported":
        health.fabric_state, health.fabric_status = state, int(info.status)


class LinkMemory:
    """The NVLink links NVML has shown up since the agent started, per GPU index and link.

    NVML lists every link a GPU's silicon has (NVML_NVLINK_MAX_LINKS, 18 on Hopper), cabled or
    not: an H100 PCIe board with three NVLink bridges has 12 links up and 6 that were never
    connected, and reports all 6 as NVML_FEATURE_DISABLED, exactly as it reports a link that
    went down. Counting every inactive link as down made such a board "6 NVLink links down"
    (critical) for ever. A link is down only when it was up before (seen here) or NVML names the
    device at its far end (`nvmlDeviceGetNvLinkRemotePciInfo`) and it is not up.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.up: set[tuple[int, int]] = set()

    def saw(self, index: int, link: int, up: bool) -> bool:
        """Record one reading; whether this link has been up before (now included)."""
        with self.lock:
            if up:
                self.up.add((index, link))
                return True
            return (index, link) in self.up


_links = LinkMemory()


def _has_far_end(nv: ModuleType | Any, handle: Any, link: int) -> bool:
    """NVML names a device at the link's far end (a cable or bridge is there). An uncabled link
    answers with an error or an all-zero PCI address."""
    try:
        info = nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
    except nv.NVMLError:
        return False
    try:
        return _pci_key(info) != (0, 0, 0)
    except (AttributeError, TypeError, ValueError):
        return False


def _nvlink_down(nv: ModuleType | Any, handle: Any, index: int = -1, memory: LinkMemory | None = None) -> int | None:
    """Links of this GPU that are not up although they are connected (see LinkMemory); None when
    NVML lists no NVLink for it to ask about. A link that trained down before the agent started
    and names no far end is not counted here: it shows as fewer links to a peer than the others
    have (`nvml_gpus`), which doctor's nvlink check reports."""
    memory = _links if memory is None else memory
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    down, known = 0, False
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            up = nv.nvmlDeviceGetNvLinkState(handle, link) == enabled
        except nv.NVMLError:
            continue  # no such link, or NVLink not supported on this GPU
        known = True
        if memory.saw(index, link, up) and not up:
            down += 1  # it was up before
        elif not up and _has_far_end(nv, handle, link):
            down += 1
    return down if known else None
