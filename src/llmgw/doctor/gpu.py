"""Doctor's GPU board checks (issue 39): what `dcgmi diag -r 1` and NHC's nvidia-smi checks
look at beyond health and Xids. Findings from heartbeat readings (wire GpuHealth, PortCounters),
no I/O. An agent older than these checks sends none of it (GpuHealth.board_read False): unknown,
with that reason. A reading NVML cannot give on this board is None; a check with nothing to grade
on any GPU says so in an ok line, not an unknown, because a consumer board legitimately has no
row remapper or ECC.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.doctor.facts import Finding, NodeFacts
from llmgw.fabric.linkrate import capacity, pcie_name
from llmgw.verdict import Status
from llmgw.wire import messages as m

OK, WARN, CRIT, UNKNOWN = Status.OK, Status.WARN, Status.CRIT, Status.UNKNOWN

# Temperature: within 5 °C of the card's own slowdown threshold the next load step slows the
# clocks: an SRE wants to hear before, not after. Shutdown is close above slowdown (89 °C and
# 92 °C on an H100 SXM, nvmlDeviceGetTemperatureThreshold), so within 2 °C of it the card is
# already slowing and one step from power-off: critical. The thresholds are each card's own.
TEMP_MARGIN = 5
SHUTDOWN_MARGIN = 2
# Pages retired by dynamic page retirement (boards before Ampere's row remapper): NVIDIA's page
# retirement guide counts a board with 60 or more retired pages as due for replacement.
RETIRED_PAGES_RMA = 60
# Clock event reasons that mean the hardware is holding the clocks down (nvidia-smi -q's
# "Clocks Event Reasons"), most specific first, and what to look at for each. sw_power_cap,
# gpu_idle, applications_clocks and sync_boost are the driver doing its job.
SLOWDOWNS: dict[str, tuple[str, str]] = {
    "hw_thermal": ("HW thermal slowdown", "the card is over its temperature limit: check fans, airflow and the "
                   "chassis' cooling (nvidia-smi -q -d TEMPERATURE,PERFORMANCE)"),
    "hw_power_brake": ("HW power brake slowdown", "the board's power brake is asserted by the system (a power supply "
                       "failed or the chassis caps power): check the PSUs and the BMC's event log"),
    "hw_slowdown": ("HW slowdown", "thermal or power brake slowdown: check cooling and the power supplies "
                    "(nvidia-smi -q -d PERFORMANCE)"),
    "sw_thermal": ("SW thermal slowdown", "the driver slows the clocks to stay under the temperature limit: check "
                   "cooling (nvidia-smi -q -d TEMPERATURE)"),
}

GpuCheck = Callable[[NodeFacts, object], list[Finding]]


def _f(n: NodeFacts, check: str, status: Status, finding: str, action: str = "", subject: str = "") -> Finding:
    return Finding(node=n.id, check=check, status=status, finding=finding, action=action if status != OK else "",
                   subject=subject)


def no_gpu_readings(n: NodeFacts, check: str) -> list[Finding] | None:
    """The finding when there is nothing to grade (no GPUs, no readings), else None."""
    if not n.inventory.gpus:
        if n.inventory.gpu_source == "none" and not n.inventory.gpu_note.startswith("CPU-only"):
            return [_f(n, check, UNKNOWN, "no GPU readings: NVML not reachable (see the nvml check)",
                       "make NVML work on the node (the nvml check says why it does not)")]
        return [_f(n, check, OK, "no GPUs")]
    if n.gpus is None:
        return [_f(n, check, UNKNOWN, "no heartbeat with GPU readings yet", "wait a heartbeat, or check the agent")]
    return None


def old_agent(n: NodeFacts, check: str, what: str) -> list[Finding] | None:
    """The unknown finding when no GPU's reading comes from an agent that reads the board."""
    if any(h.board_read for h in n.gpus or []):
        return None
    return [_f(n, check, UNKNOWN, f"the agent does not report {what} (older than this server?)",
               "upgrade llmgw on the node and restart the agent")]


def _gpus(n: NodeFacts) -> list[m.GpuHealth]:
    return sorted(n.gpus or [], key=lambda h: h.index)


def _indexes(items: list[int]) -> str:
    return ("GPU " if len(items) == 1 else "GPUs ") + ", ".join(map(str, items))


def check_row_remap(n: NodeFacts, ctx: object) -> list[Finding]:
    """Row remapping per GPU (nvmlDeviceGetRemappedRows; retired pages on boards before Ampere).
    CRIT: a remap pending (reset the GPU) or failed (RMA), 60+ retired pages. WARN: a page
    retirement pending."""
    empty = no_gpu_readings(n, "row-remap") or old_agent(n, "row-remap", "row remapping")
    if empty is not None:
        return empty
    out: list[Finding] = []
    read = 0
    for h in _gpus(n):
        subject = f"GPU {h.index}"
        read += h.remap_pending is not None or h.retired_pages is not None
        if h.remap_failed:
            out.append(_f(n, "row-remap", CRIT, f"{subject}: row remapping failed (a memory bank has no spare row "
                          "left)", f"move work off {n.id}; the card needs an RMA "
                          "(nvidia-smi -q -d ROW_REMAPPER for the ticket)", subject))
        elif h.remap_pending:
            rows = (f" ({h.remapped_uncorrectable} rows remapped for uncorrectable errors)"
                    if h.remapped_uncorrectable else "")
            out.append(_f(n, "row-remap", CRIT, f"{subject}: a row remap is pending{rows}: the faulty row is only "
                          "replaced at the next GPU reset", f"move work off {n.id}, then reset the GPU "
                          f"(nvidia-smi -r -i {h.index}); if it fails again, RMA", subject))
        if h.retired_pages is not None and h.retired_pages >= RETIRED_PAGES_RMA:
            out.append(_f(n, "row-remap", CRIT, f"{subject}: {h.retired_pages} retired memory pages (replace at "
                          f"{RETIRED_PAGES_RMA})", f"move work off {n.id}; RMA the card", subject))
        elif h.retired_pending:
            out.append(_f(n, "row-remap", WARN, f"{subject}: a retired page is pending: it stays in use until the "
                          "driver reloads", "drain the node and reload the driver (or reboot)", subject))
    if out:
        return out
    if not read:
        return [_f(n, "row-remap", OK, "row remapping and page retirement not reported by these GPUs "
                   "(boards without them)")]
    return [_f(n, "row-remap", OK, f"{read} GPUs: no pending or failed row remaps")]


def check_clocks(n: NodeFacts, ctx: object) -> list[Finding]:
    """Clock event reasons per GPU (nvmlDeviceGetCurrentClocksEventReasons). WARN: HW slowdown,
    HW thermal, HW power brake or SW thermal slowdown active, naming the reason."""
    empty = no_gpu_readings(n, "clocks") or old_agent(n, "clocks", "clock event reasons")
    if empty is not None:
        return empty
    out: list[Finding] = []
    read = [h for h in _gpus(n) if h.clock_events is not None]
    for h in read:
        active = [name for name in SLOWDOWNS if name in (h.clock_events or [])]
        if "hw_slowdown" in active and ({"hw_thermal", "hw_power_brake"} & set(active)):
            active.remove("hw_slowdown")  # NVML sets it with either; name the specific one
        if active:
            reasons = ", ".join(SLOWDOWNS[name][0] for name in active)
            out.append(_f(n, "clocks", WARN, f"GPU {h.index}: clocks held down: {reasons}",
                          SLOWDOWNS[active[0]][1], f"GPU {h.index}"))
    if out:
        return out
    if not read:
        return [_f(n, "clocks", OK, "clock event reasons not reported by these GPUs")]
    capped = [h.index for h in read if "sw_power_cap" in (h.clock_events or [])]
    note = f"; {_indexes(capped)} at the power cap (the driver's own limit)" if capped else ""
    return [_f(n, "clocks", OK, f"{len(read)} GPUs: no hardware or thermal slowdown{note}")]


def check_temperature(n: NodeFacts, ctx: object) -> list[Finding]:
    """GPU temperature against the card's own thresholds (nvmlDeviceGetTemperatureThreshold).
    CRIT: within 2 °C of shutdown. WARN: within 5 °C of slowdown, or over it."""
    empty = no_gpu_readings(n, "temperature") or old_agent(n, "temperature", "temperature thresholds")
    if empty is not None:
        return empty
    out: list[Finding] = []
    action = "check fans, airflow and the chassis' cooling; nvidia-smi -q -d TEMPERATURE"
    read = [h for h in _gpus(n) if h.temperature_c > 0]
    for h in read:
        t, slow, shut, subject = h.temperature_c, h.slowdown_c, h.shutdown_c, f"GPU {h.index}"
        if shut is not None and t >= shut - SHUTDOWN_MARGIN:
            out.append(_f(n, "temperature", CRIT, f"{subject} at {t} °C, its shutdown temperature is {shut} °C",
                          f"move work off {n.id} now; " + action, subject))
        elif slow is not None and t >= slow:
            out.append(_f(n, "temperature", WARN, f"{subject} at {t} °C, at or over its slowdown temperature "
                          f"({slow} °C): the hardware slows its clocks", action, subject))
        elif slow is not None and t >= slow - TEMP_MARGIN:
            out.append(_f(n, "temperature", WARN, f"{subject} at {t} °C, {slow - t} °C below its slowdown "
                          f"temperature ({slow} °C)", action, subject))
    if out:
        return out
    if not read:
        return [_f(n, "temperature", OK, "GPU temperatures not reported")]
    hot = max(read, key=lambda h: h.temperature_c)
    limits = [f"slowdown {hot.slowdown_c} °C" if hot.slowdown_c else "",
              f"shutdown {hot.shutdown_c} °C" if hot.shutdown_c else ""]
    limit = ", ".join(x for x in limits if x) or "the card reports no thresholds"
    return [_f(n, "temperature", OK, f"hottest GPU {hot.index} at {hot.temperature_c} °C ({limit})")]


def _link(gen: int | None, width: int | None) -> str:
    return " ".join(x for x in (f"Gen{gen}" if gen else "", f"x{width}" if width else "") if x)


def check_pcie(n: NodeFacts, ctx: object) -> list[Finding]:
    """PCIe link width and generation of every GPU (NVML, each heartbeat) and HCA (sysfs
    current_link_* against max_link_*, when the agent registers). WARN: fewer lanes than the card
    and slot allow, or a lower speed (a GPU's only while busy), with what an HCA's link carries
    against its port's data rate (fabric/linkrate.py, as fabric-test grades it)."""
    out: list[Finding] = []
    slot = ("reseat the card (or its riser); check the slot's lane and bifurcation settings in the BIOS; "
            "`lspci -vv -s {bus}` shows LnkSta against LnkCap")
    gpus = _gpus(n) if n.gpus is not None else []
    buses = {g.index: g.pci_bus_id for g in n.inventory.gpus}
    read_gpus = [h for h in gpus if h.pcie_width is not None or h.pcie_gen is not None]
    for h in read_gpus:
        subject, bus = f"GPU {h.index}", buses.get(h.index) or "<bus>"
        now, best = _link(h.pcie_gen, h.pcie_width), _link(h.pcie_gen_max, h.pcie_width_max)
        narrow = h.pcie_width is not None and h.pcie_width_max is not None and h.pcie_width < h.pcie_width_max
        # An idle GPU lowers its link speed to save power; only a busy one below its best is a fault.
        slow = (h.pcie_gen is not None and h.pcie_gen_max is not None and h.pcie_gen < h.pcie_gen_max
                and h.utilization_pct > 0)
        if narrow or slow:
            why = f"x{h.pcie_width} of x{h.pcie_width_max} lanes" if narrow else "busy, below its best speed"
            out.append(_f(n, "pcie", WARN, f"{subject}: PCIe {now}, the card and slot allow {best} ({why})",
                          slot.format(bus=bus), subject))
    seen: set[str] = set()
    for p in n.inventory.ports:  # read when the agent registers (discovery.discover_ports)
        if p.device in seen or not (p.pcie_width and p.pcie_speed_gts):
            continue
        seen.add(p.device)
        narrow = 0 < p.pcie_width < p.pcie_max_width
        slow = 0 < p.pcie_speed_gts < p.pcie_max_speed_gts
        if not (narrow or slow):
            continue
        cap = capacity(p.rate_gbps, p.speed, p.link_layer, pcie_speed=p.pcie_speed_gts, pcie_width=p.pcie_width,
                       pcie_max_speed=p.pcie_max_speed_gts, pcie_max_width=p.pcie_max_width)
        limit = (f"; it carries ~{cap.pcie_gbps:.0f} Gb/s, less than the port's {cap.link_gbps:g}"
                 if cap.pcie_limited else "")
        out.append(_f(n, "pcie", WARN, f"{p.device}: PCIe {cap.pcie}, the card allows "
                      f"{pcie_name(p.pcie_max_speed_gts, p.pcie_max_width) or 'more'}{limit}",
                      slot.format(bus=f"$(basename $(readlink /sys/class/infiniband/{p.device}/device))"), p.device))
    if out:
        return out
    if not read_gpus and not seen:
        older = old_agent(n, "pcie", "PCIe links") if n.inventory.gpus and n.gpus is not None else None
        if older is not None:
            return older
        return [_f(n, "pcie", OK,
                   "PCIe links not reported" if n.inventory.gpus or n.inventory.ports else "no GPUs or HCAs")]
    parts = [f"{len(read_gpus)} GPUs" if read_gpus else "", f"{len(seen)} HCAs" if seen else ""]
    return [_f(n, "pcie", OK, f"{' and '.join(x for x in parts if x)} at their full PCIe width"
               + ("; idle GPUs may run a lower speed to save power" if read_gpus else ""))]


def check_gpu_modes(n: NodeFacts, ctx: object) -> list[Finding]:
    """Persistence and ECC modes (nvmlDeviceGetPersistenceMode, nvmlDeviceGetEccMode). WARN:
    persistence off, ECC off, an ECC mode change pending for the next reset."""
    empty = no_gpu_readings(n, "gpu-modes") or old_agent(n, "gpu-modes", "persistence and ECC modes")
    if empty is not None:
        return empty
    gpus = _gpus(n)
    out: list[Finding] = []
    off = [h.index for h in gpus if h.persistence is False]
    if off:
        out.append(_f(n, "gpu-modes", WARN, f"{_indexes(off)}: persistence mode off: the driver tears the GPU "
                      "down whenever no process holds it, so every engine start waits for it to initialise",
                      "systemctl enable --now nvidia-persistenced (or nvidia-smi -pm 1)", _indexes(off)))
    no_ecc = [h.index for h in gpus if h.ecc_enabled is False and h.ecc_pending is not True]
    if no_ecc:
        out.append(_f(n, "gpu-modes", WARN, f"{_indexes(no_ecc)}: ECC off: memory errors go uncorrected and "
                      "unreported, into the model's results", "nvidia-smi -e 1, then reset the GPUs (or reboot)",
                      _indexes(no_ecc)))
    for h in gpus:
        if h.ecc_enabled is not None and h.ecc_pending is not None and h.ecc_enabled != h.ecc_pending:
            change = "on to off" if h.ecc_enabled else "off to on"
            out.append(_f(n, "gpu-modes", WARN, f"GPU {h.index}: ECC mode changes from {change} at the next reset "
                          "(a pending change: the node runs differently after its next reboot)",
                          "reset the GPU to apply it, or nvidia-smi -e to set it back", f"GPU {h.index}"))
    if out:
        return out
    read = [h for h in gpus if h.persistence is not None or h.ecc_enabled is not None]
    if not read:
        return [_f(n, "gpu-modes", OK, "persistence and ECC modes not reported by these GPUs")]
    ecc = "ECC on" if any(h.ecc_enabled for h in read) else "no ECC reported"
    return [_f(n, "gpu-modes", OK, f"{len(read)} GPUs: persistence mode on, {ecc}, no pending mode change")]


def check_fabric_manager(n: NodeFacts, ctx: object) -> list[Finding]:
    """The NVSwitch fabric. Where the node has NVSwitches (the agent counts them on the PCI bus),
    the fabric manager (nv-fabricmanager, the nvidia-fabricmanager service) must run: it programs
    the switches at boot, and until it has CUDA cannot start on the GPUs. Per GPU, NVML's GPU
    fabric info (Hopper and later) says whether the GPU's part is set up. CRIT: NVSwitches and no
    fabric manager running; a GPU's fabric not set up, or its setup failed. WARN: still being set
    up (while the fabric manager runs)."""
    action = ("systemctl status nvidia-fabricmanager; journalctl -u nvidia-fabricmanager (its version must be "
              "the driver's); then restart it, or reboot the node")
    host = n.host
    switches = host.nvswitches if host is not None else None
    manager = host.fabric_manager if host is not None else None
    out: list[Finding] = []
    if switches and manager is False:
        out.append(_f(n, "fabric-manager", CRIT, f"{switches} NVSwitches and no nv-fabricmanager process: the "
                      "NVSwitch fabric is not set up, so CUDA cannot start on the GPUs", action))
    empty = no_gpu_readings(n, "fabric-manager") or old_agent(n, "fabric-manager", "the NVSwitch fabric's state")
    if empty is not None:
        return out + empty if out else empty
    switched = [h for h in _gpus(n) if h.fabric_state is not None]
    for h in switched:
        subject = f"GPU {h.index}"
        if h.fabric_state == "not_started":
            out.append(_f(n, "fabric-manager", CRIT, f"{subject}: the NVSwitch fabric is not set up (is "
                          "nvidia-fabricmanager running?): CUDA cannot start on this GPU", action, subject))
        elif h.fabric_state == "in_progress" and manager is not False:
            out.append(_f(n, "fabric-manager", WARN, f"{subject}: the NVSwitch fabric is still being set up",
                          "check again in a minute; if it stays, " + action, subject))
        elif h.fabric_state == "completed" and h.fabric_status:
            # NVML: the status "must be checked only if state returns complete".
            out.append(_f(n, "fabric-manager", CRIT, f"{subject}: the fabric manager failed to set up the NVSwitch "
                          f"fabric (NVML status {h.fabric_status}): CUDA cannot start on this GPU", action, subject))
    if out:
        return out
    done = f"{len(switched)} GPUs: NVSwitch fabric set up" if switched else ""
    if switches and manager:
        return [_f(n, "fabric-manager", OK,
                   f"{switches} NVSwitches, nv-fabricmanager running" + (f"; {done}" if done else ""))]
    if switches and not switched:
        return [_f(n, "fabric-manager", UNKNOWN, f"{switches} NVSwitches; cannot tell whether nv-fabricmanager runs "
                   "(/proc not readable by the agent) and NVML reports no GPU fabric state",
                   "systemctl status nvidia-fabricmanager")]
    if not switched:
        return [_f(n, "fabric-manager", OK, "no NVSwitch fabric reported (PCIe or bridged GPUs, or a driver "
                   "without GPU fabric info)")]
    return [_f(n, "fabric-manager", OK, done)]


def check_gpudirect(n: NodeFacts, ctx: object) -> list[Finding]:
    """GPUDirect RDMA where a node has both GPUs and RDMA adapters (/sys/module/nvidia_peermem,
    or the open kernel modules' dma-buf). WARN: neither, so NCCL over InfiniBand/RoCE stages every
    GPU buffer through host memory."""
    h = n.host
    if not n.inventory.gpus or not n.inventory.ports:
        return [_f(n, "gpudirect", OK, "no GPUDirect RDMA expected (" + ("no GPUs" if not n.inventory.gpus
                   else "no RDMA adapters") + ")")]
    if h is None or h.gpu_rdma_modules is None:
        return [_f(n, "gpudirect", UNKNOWN, "the agent does not report GPUDirect RDMA's modules (older than this "
                   "server?)", "upgrade llmgw on the node and restart the agent")]
    if h.gpu_rdma_modules:
        return [_f(n, "gpudirect", OK, f"GPUDirect RDMA: {', '.join(h.gpu_rdma_modules)} loaded")]
    if h.nvidia_open:
        return [_f(n, "gpudirect", OK, "GPUDirect RDMA through dma-buf (open kernel modules; NCCL uses it on "
                   "Linux 5.12 and later)")]
    return [_f(n, "gpudirect", WARN, "no GPUDirect RDMA: nvidia_peermem is not loaded and the driver offers no "
               "dma-buf, so NCCL over InfiniBand/RoCE copies every GPU buffer through host memory",
               "modprobe nvidia_peermem, and list it in /etc/modules-load.d/ so it loads at boot")]


GPU_CHECKS: dict[str, GpuCheck] = {
    "row-remap": check_row_remap,
    "clocks": check_clocks,
    "temperature": check_temperature,
    "pcie": check_pcie,
    "gpu-modes": check_gpu_modes,
    "fabric-manager": check_fabric_manager,
    "gpudirect": check_gpudirect,
}
