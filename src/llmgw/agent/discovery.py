"""What this node has: GPUs (NVML or a simulated inventory), RDMA ports (sysfs), host facts.

Synchronous on purpose: the agent calls these through `trio.to_thread.run_sync`, because NVML
and sysfs reads block. Nothing here may crash the agent: a file that cannot be read is skipped,
a missing NVML library means zero GPUs (logged once, with the reason), and heartbeats call
`read_port_counters` / `read_gpu_health` every few seconds, so those stay cheap.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from llmgw.agent import gpu_affinity, netif, versions
from llmgw.agent.nvml_events import XidWatch, read_kmsg
from llmgw.agent.nvml_read import nvml_gpus, nvml_health
from llmgw.catalog.schema import Discovery
from llmgw.fabric import sysfs
from llmgw.wire.messages import Gpu, GpuHealth, Inventory, Port, PortCounters

log = logging.getLogger(__name__)

GPU_SOURCE_NVML = "nvml"
GPU_SOURCE_SIM = "sim"
GPU_SOURCE_NONE = "none"

SIM_GPU_FORMAT = "llmgw.sim.gpus.v1"


# ---- the simulated GPU inventory (what `llmgw sim node` writes in place of NVML) ---------


class SimGpu(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    uuid: str = ""
    name: str = ""
    memory_mib: int = 0
    pci_bus_id: str = ""
    # Peer GPU index → NVLink count, as NVML discovery would report it.
    nvlink: dict[int, int] = {}
    health: str = "ok"
    temperature_c: int = 0
    utilization_pct: int = 0
    memory_used_mib: int = 0
    power_w: float = 0.0
    # What NVML would report for `ctl doctor`: uncorrected ECC errors, NVLink links down, last Xid.
    ecc_uncorrected: int = 0
    nvlink_down: int = 0
    xid: int = 0
    # Issue 39's board readings, healthy as the H200 of tests/fixtures/real/nvidia-smi-q/ shows
    # them (the temperature thresholds an H100 SXM's); `llmgw sim node set-gpu` injects faults.
    remap_pending: bool = False
    remap_failed: bool = False
    remapped_uncorrectable: int = 0
    retired_pages: int | None = None  # None: the board remaps rows instead (Ampere and later)
    retired_pending: bool = False
    clock_events: list[str] = []
    slowdown_c: int = 89
    shutdown_c: int = 92
    pcie_gen: int = 5
    pcie_gen_max: int = 5
    pcie_width: int = 16
    pcie_width_max: int = 16
    persistence: bool = True
    ecc_enabled: bool = True
    ecc_pending: bool = True
    fabric_state: str = ""  # "": no NVSwitch fabric (NVML: not supported); else FABRIC_STATES' name
    fabric_status: int = 0  # NVML's return code for the fabric's setup (0: success)
    vbios: str = ""  # nvmlDeviceGetVbiosVersion's stand-in


class SimGpuFile(msgspec.Struct, kw_only=True):
    format: str = SIM_GPU_FORMAT
    node_id: str = ""
    driver_version: str = ""  # nvmlSystemGetDriverVersion's stand-in
    cuda_version: str = ""  # nvmlSystemGetCudaDriverVersion's, as nvidia-smi prints it ("12.4")
    gpus: list[SimGpu] = []


# ---- small file helpers ---------------------------------------------------------------------


def _read(path: str, limit: int = 4096) -> str | None:
    """A small file's text, or None when it is missing or unreadable (never raises)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit)
    except (OSError, ValueError):
        return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_once(message: str) -> None:
    with _logged_lock:
        if message in _logged:
            return
        _logged.add(message)
    log.warning("%s", message)


# ---- RDMA ports (sysfs) ------------------------------------------------------------------


def _ib_root(cfg: Discovery) -> str:
    return os.path.join(cfg.sysfs_root, "class", "infiniband")


def _port_dirs(cfg: Discovery) -> Iterable[tuple[str, int, str]]:
    """(device, port, port dir) for every RDMA port, in natural order (mlx5_2 before mlx5_10)."""
    root = _ib_root(cfg)
    for device in sorted(_listdir(root), key=sysfs.natural_key):
        ports_dir = os.path.join(root, device, "ports")
        for name in sorted((n for n in _listdir(ports_dir) if n.isdigit()), key=int):
            yield device, int(name), os.path.join(ports_dir, name)


def _read_files(directory: str, names: Iterable[str]) -> dict[str, str]:
    files: dict[str, str] = {}
    for name in names:
        text = _read(os.path.join(directory, name))
        if text is not None:
            files[name] = text
    return files


def _netdev(cfg: Discovery, device: str, port: int, port_dir: str) -> str:
    """The network interface behind an RDMA port (RoCE: the Ethernet netdev; IB: IPoIB).

    Tried in order: the RoCE GID's netdev (`gid_attrs/ndevs/0`), the interfaces under the
    device's PCI function (`device/net/*`, matched by `dev_port` when there are several),
    then any `/class/net/*` whose `device` resolves to the same PCI function.
    """
    ndev = sysfs.value(_read(os.path.join(port_dir, "gid_attrs", "ndevs", "0")))
    if ndev:
        return ndev
    dev_link = os.path.join(_ib_root(cfg), device, "device")
    candidates = sorted(_listdir(os.path.join(dev_link, "net")), key=sysfs.natural_key)
    net_root = os.path.join(cfg.sysfs_root, "class", "net")
    if not candidates:
        try:
            pci = os.path.realpath(dev_link, strict=True)
        except OSError:
            return ""
        for name in sorted(_listdir(net_root), key=sysfs.natural_key):
            try:
                if os.path.realpath(os.path.join(net_root, name, "device"), strict=True) == pci:
                    candidates.append(name)
            except OSError:
                continue
    if len(candidates) == 1:
        return candidates[0]
    for name in candidates:
        dev_port = sysfs.value(_read(os.path.join(dev_link, "net", name, "dev_port")))
        if not dev_port:
            dev_port = sysfs.value(_read(os.path.join(net_root, name, "dev_port")))
        if dev_port.isdigit() and int(dev_port) == port - 1:
            return name
    return ""


_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def _gid_files(port_dir: str) -> dict[str, str]:
    """`gids/N` and `gid_attrs/types/N` of the entries in use (a ConnectX port lists 255, most
    of them zero; reading a zero entry's type fails with EINVAL, so it is not read)."""
    files: dict[str, str] = {}
    gids_dir = os.path.join(port_dir, "gids")
    for name in sorted((n for n in _listdir(gids_dir) if n.isdigit()), key=int):
        gid = _read(os.path.join(gids_dir, name))
        if gid is None or sysfs.value(gid) in ("", _ZERO_GID):
            continue
        files[f"gids/{name}"] = gid
        kind = _read(os.path.join(port_dir, "gid_attrs", "types", name))
        if kind is not None:
            files[f"gid_attrs/types/{name}"] = kind
    return files


def discover_ports(cfg: Discovery) -> list[Port]:
    ports: list[Port] = []
    for device, port, port_dir in _port_dirs(cfg):
        device_dir = os.path.join(_ib_root(cfg), device)
        node_guid = _read(os.path.join(device_dir, "node_guid")) or ""
        files = _read_files(port_dir, sysfs.PORT_FILES)
        if sysfs.value(files.get("link_layer")) == "Ethernet":
            files.update(_gid_files(port_dir))
        ports.append(
            sysfs.parse_port(
                device,
                port,
                files,
                node_guid=node_guid,
                netdev=_netdev(cfg, device, port, port_dir),
                hca_type=_read(os.path.join(device_dir, "hca_type")) or "",
                fw_ver=_read(os.path.join(device_dir, "fw_ver")) or "",
                pcie=_read_files(os.path.join(device_dir, "device"), sysfs.PCIE_FILES),
            )
        )
    return ports


def _counter_files(port_dir: str) -> dict[str, str]:
    files = _read_files(port_dir, sysfs.COUNTER_FILES)
    for directory in (*sysfs.COUNTER_DIRS, sysfs.HW_COUNTER_DIR):
        names = sorted(set(_listdir(os.path.join(port_dir, directory))) - sysfs.HW_NOT_COUNTERS)[: sysfs.MAX_COUNTERS]
        files.update(_read_files(port_dir, (f"{directory}/{name}" for name in names)))
    return files


def read_port_counters(cfg: Discovery) -> list[PortCounters]:
    """State, phys state, rate and every counter of every port, for heartbeats (about 35 small
    reads per port: 8 ports every 5 s is nothing next to what the engines do)."""
    return [
        sysfs.parse_port_counters(device, port, _counter_files(port_dir))
        for device, port, port_dir in _port_dirs(cfg)
    ]


# ---- host facts ----------------------------------------------------------------------------


def memory_mib(meminfo_path: str = "/proc/meminfo") -> int:
    text = _read(meminfo_path, limit=65536) or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) // 1024
    return 0


def _host_port(server: str) -> tuple[str, int]:
    if "://" not in server:
        server = "//" + server
    try:
        parts = urlsplit(server)
        return parts.hostname or "", parts.port or 443
    except ValueError:
        return "", 0


# A documentation address (RFC 5737): "connecting" a UDP socket to it sends nothing and
# yields the source address of the default route.
_DEFAULT_ROUTE_PROBE = "192.0.2.1"


def _source_address(host: str, port: int) -> str:
    try:
        infos = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)
    except OSError:
        return ""
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(addr)
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return ""


def management_ip(server: str | None = None) -> str:
    """The address this node reaches the server from (best effort; "" if none).

    A UDP "connect" only asks the kernel for a route: no packet leaves the host.
    """
    if server:
        host, port = _host_port(server)
        if host:
            address = _source_address(host, port)
            if address:
                return address
    return _source_address(_DEFAULT_ROUTE_PROBE, 9)


# ---- GPUs: simulated inventory -------------------------------------------------------------

_sim_cache: dict[str, tuple[tuple[int, int], SimGpuFile]] = {}
_sim_decoder = msgspec.json.Decoder(SimGpuFile)


def read_sim_gpus(path: str) -> SimGpuFile | None:
    """The simulated inventory, re-parsed only when the file changed; None if unusable."""
    try:
        st = os.stat(path)
    except OSError as exc:
        _log_once(f"simulated GPU inventory {path} cannot be read ({exc.strerror}); no GPUs")
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _sim_cache.get(path)
    if cached and cached[0] == stamp:
        return cached[1]
    try:
        with open(path, "rb") as fh:
            data = _sim_decoder.decode(fh.read())
    except (OSError, msgspec.DecodeError) as exc:
        _log_once(f"simulated GPU inventory {path} is not valid ({exc}); no GPUs")
        return None
    if data.format != SIM_GPU_FORMAT:
        _log_once(
            f"simulated GPU inventory {path} has format {data.format!r}, want {SIM_GPU_FORMAT!r}; no GPUs"
        )
        return None
    _sim_cache[path] = (stamp, data)
    return data


def _sim_gpus(path: str) -> list[Gpu] | None:
    data = read_sim_gpus(path)
    if data is None:
        return None
    return [
        Gpu(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            memory_mib=g.memory_mib,
            nvlink=dict(g.nvlink),
            pci_bus_id=g.pci_bus_id,
            health=g.health,
            vbios=g.vbios,
        )
        for g in sorted(data.gpus, key=lambda g: g.index)
    ]


# ---- GPUs: NVML ----------------------------------------------------------------------------


class _Nvml:
    """One NVML session for the life of the process (nvmlInit can take seconds on a big box)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: Any = None
        self.reason = ""  # why NVML is not usable; "" while untried or ready

    def start(self, retry: bool) -> Any:
        """The initialised pynvml module, or None (the reason is logged once)."""
        with self.lock:
            if self.module is not None:
                return self.module
            if self.reason and not retry:
                return None
            module, reason = _nvml_init()
            self.module, self.reason = module, reason
        if module is None:
            _log_once(f"no GPUs from NVML: {reason}")
        return module


def _nvml_init() -> tuple[Any, str]:
    try:
        import pynvml
    except ImportError:
        return None, "the nvidia-ml-py package is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None, "libnvidia-ml.so.1 not found (no NVIDIA driver installed on this node)"
    except pynvml.NVMLError_DriverNotLoaded:
        return None, "the NVIDIA kernel driver is not loaded"
    except pynvml.NVMLError_NoPermission:
        return None, "no permission to open the NVIDIA devices"
    except pynvml.NVMLError as exc:
        return None, f"nvmlInit failed: {exc}"
    except Exception as exc:  # a broken install must not take the agent down
        return None, f"nvmlInit failed: {type(exc).__name__}: {exc}"
    return pynvml, ""


_nvml = _Nvml()
_xids = XidWatch(kernel_log=read_kmsg)


def gpu_driver(cfg: Discovery) -> str:
    """The NVIDIA driver version ("" when NVML is not there or cannot say)."""
    if cfg.gpus == "none":
        return ""
    if cfg.gpus == "nvml":
        nv = _nvml.start(retry=False)
        try:
            return str(nv.nvmlSystemGetDriverVersion()) if nv is not None else ""
        except Exception:
            return ""
    data = read_sim_gpus(cfg.gpus)
    return data.driver_version if data is not None else ""


def cuda_driver(cfg: Discovery, gpus: list[Gpu]) -> str:
    """The CUDA version the driver supports, and each GPU's VBIOS into `gpus` (issue 39)."""
    if cfg.gpus == "nvml":
        nv = _nvml.start(retry=False)
        if nv is None:
            return ""
        versions.read_vbios(nv, gpus)
        return versions.read_cuda(nv)
    data = read_sim_gpus(cfg.gpus) if cfg.gpus != "none" else None
    return data.cuda_version if data is not None else ""


# ---- GPUs: dispatch --------------------------------------------------------------------


def discover_gpus(cfg: Discovery) -> tuple[list[Gpu], str]:
    """(GPUs, gpu_source). Never raises: trouble means no GPUs, with the reason logged once."""
    if cfg.gpus == "none":
        return [], GPU_SOURCE_NONE
    if cfg.gpus == "nvml":
        nv = _nvml.start(retry=True)
        if nv is None:
            return [], GPU_SOURCE_NONE
        try:
            return nvml_gpus(nv), GPU_SOURCE_NVML
        except Exception as exc:
            _log_once(f"no GPUs from NVML: listing devices failed ({type(exc).__name__}: {exc})")
            return [], GPU_SOURCE_NONE
    gpus = _sim_gpus(cfg.gpus)
    if gpus is None:
        return [], GPU_SOURCE_NONE
    return gpus, GPU_SOURCE_SIM


def read_gpu_health(cfg: Discovery) -> list[GpuHealth]:
    """Temperature, utilisation and memory used per GPU, for heartbeats. Never raises."""
    if cfg.gpus == "none":
        return []
    if cfg.gpus == "nvml":
        nv = _nvml.start(retry=False)
        if nv is None:
            return []
        try:
            health = nvml_health(nv)
            xids = _xids.poll(nv)  # None: this driver delivers no Xid events (xid stays unread)
            for h in health:
                h.xid = None if xids is None else xids.get(h.index, 0)
            return health
        except Exception as exc:
            _log_once(f"GPU health from NVML failed ({type(exc).__name__}: {exc})")
            return []
    data = read_sim_gpus(cfg.gpus)
    if data is None:
        return []
    return [
        GpuHealth(
            index=g.index,
            health=g.health,
            temperature_c=g.temperature_c,
            utilization_pct=g.utilization_pct,
            memory_used_mib=g.memory_used_mib,
            power_w=g.power_w or None,
            ecc_uncorrected=g.ecc_uncorrected,
            nvlink_down=g.nvlink_down if g.nvlink else None,
            xid=g.xid,
            board_read=True,
            remap_pending=None if g.retired_pages is not None else g.remap_pending,
            remap_failed=None if g.retired_pages is not None else g.remap_failed,
            remapped_uncorrectable=None if g.retired_pages is not None else g.remapped_uncorrectable,
            retired_pages=g.retired_pages,
            retired_pending=g.retired_pending if g.retired_pages is not None else None,
            clock_events=list(g.clock_events),
            slowdown_c=g.slowdown_c or None,
            shutdown_c=g.shutdown_c or None,
            pcie_gen=g.pcie_gen or None,
            pcie_gen_max=g.pcie_gen_max or None,
            pcie_width=g.pcie_width or None,
            pcie_width_max=g.pcie_width_max or None,
            persistence=g.persistence,
            ecc_enabled=g.ecc_enabled,
            ecc_pending=g.ecc_pending,
            fabric_state=g.fabric_state or None,
            fabric_status=g.fabric_status if g.fabric_state else None,
        )
        for g in sorted(data.gpus, key=lambda g: g.index)
    ]


# ---- all of it -------------------------------------------------------------------------------


def discover(cfg: Discovery, server: str | None = None, advertise_host: str = "") -> Inventory:
    """The node's inventory for `Register`. `server` (URL or host) picks the management IP (the
    address this node reaches the server from); the interface reported is the one holding
    `advertise_host` (where engines listen and ranks bootstrap; the management IP without one)."""
    gpus, source = discover_gpus(cfg)
    note = ""
    if source == GPU_SOURCE_NONE:
        if cfg.gpus == "none":
            note = "CPU-only node (discovery.gpus: none)"
        elif cfg.gpus == "nvml":
            note = _nvml.reason or "NVML reports no GPUs"
        else:
            note = f"simulated GPU inventory {cfg.gpus} is missing or invalid"
    mgmt_ip = management_ip(server)
    interface, _, how = netif.management_interface(advertise_host or mgmt_ip)
    ports = gpu_affinity.with_gpu_affinity(cfg.sysfs_root, discover_ports(cfg), gpus)
    return Inventory(
        hostname=socket.gethostname(),
        gpus=gpus,
        ports=ports,
        cpus=os.cpu_count() or 0,
        memory_mib=memory_mib(),
        mgmt_ip=mgmt_ip,
        gpu_source=source,
        gpu_note=note,
        mgmt_interface=interface,
        mgmt_interface_source=how,
        gpu_driver=gpu_driver(cfg) if gpus else "",
        cuda_driver=cuda_driver(cfg, gpus) if gpus else "",
        rdma_stack=versions.rdma_stack(cfg.sysfs_root) if ports else "",
    )
