"""Agent discovery on sysfs trees materialised from real fixtures, NVML absent or faked."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from llmgw.agent import discovery, nvml_read
from llmgw.agent.nvml_events import XidWatch
from llmgw.catalog.schema import Discovery
from llmgw.fabric import sysfs
from tests.realfixtures import REAL, load_flat


def materialise(files: dict[str, str], root: Path) -> Path:
    """Write `sys/class/...: content` entries as a real tree; returns the sysfs root."""
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root / "sys"


@pytest.fixture(params=["node-exporter-i40iw-mlx4.txt", "procfs-fixtures-hfi1-mlx4-mlx5.txt"])
def real_tree(request, tmp_path):
    files = load_flat(REAL / "sysfs" / request.param)
    return files, materialise(files, tmp_path)


@pytest.fixture
def fresh_nvml(monkeypatch):
    """A new NVML session and log-once memory, so tests do not see each other's state."""
    monkeypatch.setattr(discovery, "_nvml", discovery._Nvml())
    monkeypatch.setattr(discovery, "_xids", XidWatch())
    monkeypatch.setattr(nvml_read, "_links", nvml_read.LinkMemory())
    monkeypatch.setattr(discovery, "_logged", set())


# ---- ports ---------------------------------------------------------------------------------------


def test_discover_ports_reads_what_the_parser_parses(real_tree):
    files, sys_root = real_tree
    ports = discovery.discover_ports(Discovery(sysfs_root=str(sys_root), gpus="none"))
    assert ports == sysfs.ports_from_tree(files)
    assert len(ports) >= 3
    assert all(p.state == "ACTIVE" and p.rate_gbps > 0 for p in ports)


def test_read_port_counters_on_real_tree(real_tree):
    files, sys_root = real_tree
    counters = discovery.read_port_counters(Discovery(sysfs_root=str(sys_root), gpus="none"))
    assert counters == sysfs.counters_from_tree(files)
    assert {(c.device, c.port) for c in counters} >= {("mlx4_0", 1), ("mlx4_0", 2)}


def test_discover_inventory_on_real_tree(real_tree, fresh_nvml):
    _, sys_root = real_tree
    inv = discovery.discover(
        Discovery(sysfs_root=str(sys_root), gpus="none"), server="127.0.0.1:8443"
    )
    assert inv.hostname == socket.gethostname()
    assert inv.cpus >= 1
    assert inv.memory_mib > 0
    assert inv.mgmt_ip == "127.0.0.1"
    assert inv.gpus == []
    assert inv.gpu_source == "none"
    assert [p.device for p in inv.ports][:1] in (["i40iw0"], ["hfi1_0"])
    # The inventory crosses the wire: it must encode.
    assert msgspec.json.decode(msgspec.json.encode(inv), type=type(inv)) == inv


def test_unreadable_and_missing_files_are_skipped(tmp_path):
    files = load_flat(REAL / "sysfs" / "node-exporter-i40iw-mlx4.txt")
    sys_root = materialise(files, tmp_path)
    rate = sys_root / "class/infiniband/mlx4_0/ports/1/rate"
    rate.unlink()
    rate.mkdir()  # open() fails with IsADirectoryError, as a file that errors on read would
    (sys_root / "class/infiniband/mlx4_0/ports/2/state").unlink()
    cfg = Discovery(sysfs_root=str(sys_root), gpus="none")
    ports = {(p.device, p.port): p for p in discovery.discover_ports(cfg)}
    assert ports[("mlx4_0", 1)].rate_gbps == 0.0
    assert ports[("mlx4_0", 1)].state == "ACTIVE"
    assert ports[("mlx4_0", 2)].state == ""
    assert ports[("mlx4_0", 2)].rate_gbps == 40.0
    assert len(discovery.read_port_counters(cfg)) == 3


def test_no_rdma_at_all(tmp_path):
    cfg = Discovery(sysfs_root=str(tmp_path / "nothing"), gpus="none")
    assert discovery.discover_ports(cfg) == []
    assert discovery.read_port_counters(cfg) == []


def _hca(sys_root: Path, device: str, pci: str, netdevs: dict[str, int], ports: int = 1) -> None:
    dev = sys_root / "class/infiniband" / device
    for port in range(1, ports + 1):
        (dev / "ports" / str(port)).mkdir(parents=True)
        (dev / "ports" / str(port) / "link_layer").write_text("Ethernet\n")
    pci_dir = sys_root / "devices/pci0000:00" / pci
    for name, dev_port in netdevs.items():
        (pci_dir / "net" / name).mkdir(parents=True)
        (pci_dir / "net" / name / "dev_port").write_text(f"{dev_port}\n")
        (sys_root / "class/net").mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../devices/pci0000:00/{pci}/net/{name}", sys_root / "class/net" / name)
        os.symlink(f"../../../{pci}", pci_dir / "net" / name / "device")
    os.symlink(f"../../../devices/pci0000:00/{pci}", dev / "device")


def test_netdev_from_device_net_and_dev_port(tmp_path):
    sys_root = tmp_path / "sys"
    _hca(sys_root, "mlx5_0", "0000:0c:00.0", {"ens1f0np0": 0})
    _hca(sys_root, "mlx4_0", "0000:81:00.0", {"eth3": 1, "eth2": 0}, ports=2)
    ports = discovery.discover_ports(Discovery(sysfs_root=str(sys_root), gpus="none"))
    assert [(p.device, p.port, p.netdev) for p in ports] == [
        ("mlx4_0", 1, "eth2"),
        ("mlx4_0", 2, "eth3"),
        ("mlx5_0", 1, "ens1f0np0"),
    ]


def test_netdev_from_roce_gid_attrs_first(tmp_path):
    sys_root = tmp_path / "sys"
    _hca(sys_root, "mlx5_1", "0000:0d:00.0", {"ens2": 0})
    ndevs = sys_root / "class/infiniband/mlx5_1/ports/1/gid_attrs/ndevs"
    ndevs.mkdir(parents=True)
    (ndevs / "0").write_text("bond0\n")
    [port] = discovery.discover_ports(Discovery(sysfs_root=str(sys_root), gpus="none"))
    assert port.netdev == "bond0"


def test_netdev_from_class_net_device_link(tmp_path):
    """A tree where the HCA's PCI function has no net/ dir, but /class/net/X/device points at it."""
    sys_root = tmp_path / "sys"
    pci = "0000:17:00.0"
    pci_dir = sys_root / "devices/pci0000:00" / pci
    pci_dir.mkdir(parents=True)
    (sys_root / "class/infiniband/mlx5_4/ports/1").mkdir(parents=True)
    os.symlink(f"../../../devices/pci0000:00/{pci}", sys_root / "class/infiniband/mlx5_4/device")
    iface = sys_root / "devices/virtual/net/ib4"
    iface.mkdir(parents=True)
    os.symlink(f"../../../pci0000:00/{pci}", iface / "device")
    (sys_root / "class/net").mkdir(parents=True)
    os.symlink("../../devices/virtual/net/ib4", sys_root / "class/net/ib4")
    [port] = discovery.discover_ports(Discovery(sysfs_root=str(sys_root), gpus="none"))
    assert port.netdev == "ib4"


# ---- host facts ----------------------------------------------------------------------------------


def test_memory_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131923456 kB\nMemFree:         1024 kB\n")
    assert discovery.memory_mib(str(meminfo)) == 131923456 // 1024
    assert discovery.memory_mib(str(tmp_path / "absent")) == 0
    (tmp_path / "odd").write_text("MemTotal: lots\n")
    assert discovery.memory_mib(str(tmp_path / "odd")) == 0


@pytest.mark.parametrize(
    "server", ["127.0.0.1", "127.0.0.1:8443", "https://127.0.0.1:8443", "http://localhost:1"]
)
def test_management_ip_towards_loopback_server(server):
    assert discovery.management_ip(server) in ("127.0.0.1", "::1")


def test_management_ip_never_raises():
    # An unresolvable name falls back to the default route (or "" on a host without one).
    address = discovery.management_ip("https://no-such-host.invalid:8443")
    assert isinstance(address, str)
    assert discovery.management_ip("http://[bad") == discovery.management_ip(None)


# ---- GPUs: NVML absent -------------------------------------------------------------------------


def _nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_nvml_absent_means_no_gpus_not_a_crash(fresh_nvml, caplog):
    cfg = Discovery(sysfs_root="/nonexistent", gpus="nvml")
    caplog.set_level(logging.WARNING, logger="llmgw.agent.discovery")
    inv = discovery.discover(cfg)
    if _nvml_library_present():
        assert inv.gpu_source in ("nvml", "none")
        return
    assert inv.gpus == []
    assert inv.gpu_source == "none"
    assert discovery.read_gpu_health(cfg) == []
    discovery.discover(cfg)
    reasons = [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()]
    assert len(reasons) == 1, reasons
    assert "libnvidia-ml.so.1 not found" in reasons[0]


class _FakeNvmlError(Exception):
    pass


class _LibraryNotFound(_FakeNvmlError):
    pass


class _DriverNotLoaded(_FakeNvmlError):
    pass


class _NoPermission(_FakeNvmlError):
    pass


class _GpuIsLost(_FakeNvmlError):
    pass


def _pci(domain: int, bus: int, device: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        domain=domain, bus=bus, device=device, busId=f"{domain:08X}:{bus:02X}:{device:02X}.0"
    )


def fake_nvml(
    buses: list[int],
    links: dict[int, list[tuple[str, int]]],
    *,
    broken: frozenset[int] = frozenset(),
    init_error: type[Exception] | None = None,
    remote_type: bool = True,
    remote_pci: bool = True,
    uncabled_pci: str = "error",
) -> SimpleNamespace:
    """A pynvml stand-in. links[gpu] = [("gpu", peer_bus) | ("switch", switch_bus) | ("npu", bus)
    | ("none", 0)]: "none" is a link the GPU has but nothing is cabled to (NVML_FEATURE_DISABLED;
    its remote PCI query fails, or with `uncabled_pci="zero"` answers an all-zero address)."""
    kinds = {"gpu": 0, "npu": 1, "switch": 2}

    def handle(index):
        if index in broken:
            raise _GpuIsLost()
        return index

    def link_entry(h, link):
        if link >= len(links.get(h, [])):
            raise _FakeNvmlError("invalid argument")
        return links[h][link]

    def init():
        if init_error is not None:
            raise init_error()

    def remote_pci_info(h, link):
        kind, bus = link_entry(h, link)
        if kind == "none":
            if uncabled_pci == "zero":
                return _pci(0, 0)
            raise _FakeNvmlError("not supported")
        return _pci(0, bus)

    nv = SimpleNamespace(
        NVMLError=_FakeNvmlError,
        NVMLError_LibraryNotFound=_LibraryNotFound,
        NVMLError_DriverNotLoaded=_DriverNotLoaded,
        NVMLError_NoPermission=_NoPermission,
        NVMLError_GpuIsLost=_GpuIsLost,
        NVML_NVLINK_MAX_LINKS=18,
        NVML_FEATURE_ENABLED=1,
        NVML_NVLINK_DEVICE_TYPE_SWITCH=2,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: len(buses),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:08x}",
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(
            total=81559 * 1024 * 1024, used=(h + 1) * 1024 * 1024
        ),
        nvmlDeviceGetPciInfo=lambda h: _pci(0, buses[h]),
        nvmlDeviceGetNvLinkState=lambda h, link: 0 if link_entry(h, link)[0] == "none" else 1,
        nvmlDeviceGetNvLinkRemotePciInfo=remote_pci_info,
        nvmlDeviceGetTemperature=lambda h, sensor: 40 + h,
        nvmlDeviceGetTemperatureV=lambda h, sensor: 40 + h,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=10 * h),
        nvmlDeviceGetPowerUsage=lambda h: 115_021 + 1000 * h,
    )
    if not remote_pci:

        def no_remote_pci(h, link):
            raise _FakeNvmlError("not supported")

        nv.nvmlDeviceGetNvLinkRemotePciInfo = no_remote_pci
    if remote_type:
        nv.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: kinds[link_entry(h, link)[0]]
    return nv


HGX_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
SWITCH_BUSES = [0xE0, 0xE1, 0xE2, 0xE3]


def test_nvml_nvswitch_board_is_all_to_all_nv18():
    # HGX H100: 18 links per GPU spread over 4 NVSwitches (5+4+4+5).
    per_switch = [5, 4, 4, 5]
    links = {
        g: [("switch", SWITCH_BUSES[s]) for s, n in enumerate(per_switch) for _ in range(n)]
        for g in range(8)
    }
    gpus = discovery.nvml_gpus(fake_nvml(HGX_BUSES, links))
    assert len(gpus) == 8
    for gpu in gpus:
        assert gpu.nvlink == {p: 18 for p in range(8) if p != gpu.index}
        assert gpu.memory_mib == 81559
        assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpus[3].pci_bus_id == "00000000:5D:00.0"


def test_nvml_switch_links_without_remote_pci_info():
    links = {g: [("switch", SWITCH_BUSES[0])] * 18 for g in range(2)}
    gpus = discovery.nvml_gpus(fake_nvml(HGX_BUSES[:2], links, remote_pci=False))
    assert [g.nvlink for g in gpus] == [{1: 18}, {0: 18}]


def test_nvml_nvswitch_pair_counts_the_weaker_side():
    links = {g: [("switch", SWITCH_BUSES[0])] * 18 for g in range(3)}
    links[0] = links[0][:17]  # one link of GPU 0 is down
    gpus = discovery.nvml_gpus(fake_nvml(HGX_BUSES[:3], links))
    assert gpus[0].nvlink == {1: 17, 2: 17}
    assert gpus[1].nvlink == {0: 17, 2: 18}


def test_nvml_direct_links_counted_per_peer_and_npu_links_ignored():
    # Workstation: GPU0↔GPU1 by a 4-link bridge; GPU2 alone; GPU0 also has 2 links to a CPU NPU.
    buses = [0x01, 0x21, 0x41]
    links = {0: [("gpu", 0x21)] * 4 + [("npu", 0x99)] * 2, 1: [("gpu", 0x01)] * 4, 2: []}
    gpus = discovery.nvml_gpus(fake_nvml(buses, links))
    assert [g.nvlink for g in gpus] == [{1: 4}, {0: 4}, {}]


def test_nvml_unknown_remote_type_is_not_guessed():
    links = {0: [("switch", 0xE0)] * 18, 1: [("switch", 0xE0)] * 18}
    gpus = discovery.nvml_gpus(fake_nvml([0x18, 0x2A], links, remote_type=False))
    assert [g.nvlink for g in gpus] == [{}, {}]


def test_nvml_lost_gpu_is_reported_not_fatal(fresh_nvml):
    nv = fake_nvml(HGX_BUSES[:3], {0: [], 1: [], 2: []}, broken=frozenset({1}))
    gpus = discovery.nvml_gpus(nv)
    assert [(g.index, g.health) for g in gpus] == [(0, "ok"), (1, "error"), (2, "ok")]
    health = discovery.nvml_health(nv)
    assert [(h.index, h.health) for h in health] == [(0, "ok"), (1, "lost"), (2, "ok")]
    assert health[2].power_w == 117.0  # NVML's milliwatts as watts (issue 46: the describe view's POWER)
    assert (health[2].temperature_c, health[2].utilization_pct, health[2].memory_used_mib) == (
        42,
        20,
        3,
    )


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (_LibraryNotFound, "libnvidia-ml.so.1 not found"),
        (_DriverNotLoaded, "driver is not loaded"),
        (_NoPermission, "no permission"),
        (RuntimeError, "nvmlInit failed"),
    ],
)
def test_nvml_init_failures_give_none_with_reason(fresh_nvml, monkeypatch, caplog, error, reason):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([0x18], {}, init_error=error))
    caplog.set_level(logging.WARNING, logger="llmgw.agent.discovery")
    cfg = Discovery(sysfs_root="/nonexistent", gpus="nvml")
    assert discovery.discover_gpus(cfg) == ([], "none")
    assert discovery.read_gpu_health(cfg) == []
    assert discovery.discover_gpus(cfg) == ([], "none")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert reason in messages[0]


def test_nvml_present_through_discover(fresh_nvml, monkeypatch):
    import sys

    monkeypatch.setitem(
        sys.modules,
        "pynvml",
        fake_nvml(HGX_BUSES[:2], {0: [("gpu", 0x2A)] * 2, 1: [("gpu", 0x18)] * 2}),
    )
    cfg = Discovery(sysfs_root="/nonexistent", gpus="nvml")
    inv = discovery.discover(cfg)
    assert inv.gpu_source == "nvml"
    assert [g.nvlink for g in inv.gpus] == [{1: 2}, {0: 2}]
    assert [h.temperature_c for h in discovery.read_gpu_health(cfg)] == [40, 41]


def doctor_nvml(pending: list[SimpleNamespace]) -> SimpleNamespace:
    """The fake NVML with what doctor reads: ECC counts, a link down, the driver, Xid events."""
    nv = fake_nvml(HGX_BUSES[:2], {0: [("gpu", 0x2A)] * 2, 1: [("gpu", 0x18)] * 2})
    link_state = nv.nvmlDeviceGetNvLinkState
    nv.nvmlDeviceGetNvLinkState = lambda h, link: 0 if (h, link) == (1, 1) else link_state(h, link)
    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC = 1, 0
    nv.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: 3 if (h, kind, counter) == (0, 1, 0) else 0
    nv.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    nv.nvmlSystemGetCudaDriverVersion = lambda: 12040  # an int, as nvidia-ml-py returns it
    nv.nvmlDeviceGetVbiosVersion = lambda h: "96.00.A5.00.1A" if h == 0 else "96.00.A5.00.1B"
    nv.nvmlEventTypeXidCriticalError = 8
    nv.registered = []
    nv.nvmlEventSetCreate = lambda: "event-set"
    nv.nvmlDeviceRegisterEvents = lambda h, kind, event_set: nv.registered.append((h, kind, event_set))
    nv.nvmlDeviceGetIndex = lambda h: h

    def wait(event_set, timeout_ms):
        assert timeout_ms == 0  # never blocks the heartbeat
        if pending:
            return pending.pop(0)
        raise _FakeNvmlError("timeout")

    nv.nvmlEventSetWait = wait
    add_board(nv)
    return nv


# What the H200 of tests/fixtures/real/nvidia-smi-q/llmgw-device-1xh200-vm.txt (driver 580) shows:
# remapped rows 0/0, not pending, no failure; only the Idle clock event reason active; PCIe
# Gen5 x16 of Gen5 x16; persistence on; ECC on and pending on. Driver 580 prints the temperature
# limits in T.Limit terms, so the absolute thresholds here are an H100 SXM's (89 / 92 °C).
H200_BOARD: dict[str, object] = {
    "remapped": (0, 0, 0, 0), "retired": [], "retired_pending": 0, "reasons": 0x1, "slowdown": 89,
    "shutdown": 92, "gen": (5, 5), "width": (16, 16), "persistence": 1, "ecc": [1, 1],
    "fabric": (0, 0),  # (state, status): "Fabric State : N/A" on this board without NVSwitches
}


class _FabricInfo(ctypes.Structure):
    """What nvmlDeviceGetGpuFabricInfo fills in (c_nvmlGpuFabricInfo_t's fields the agent reads)."""

    _fields_ = [("status", ctypes.c_uint), ("state", ctypes.c_uint)]


class _FabricInfoV(ctypes.Structure):
    """c_nvmlGpuFabricInfoV_t's: a version first (its __init__ sets it), then the same fields."""

    _fields_ = [("version", ctypes.c_uint), ("status", ctypes.c_uint), ("state", ctypes.c_uint)]

    def __init__(self) -> None:
        super().__init__(version=0x02000024)  # nvmlGpuFabricInfo_v2


def add_board(nv: SimpleNamespace, boards: dict[int, dict[str, object]] | None = None) -> SimpleNamespace:
    """The fake NVML's answers to issue 39's board queries: H200_BOARD for every GPU, with
    `boards[index]` overriding; a value of None makes that query NotSupported."""

    def value(h: int, key: str) -> object:
        v = {**H200_BOARD, **(boards or {}).get(h, {})}[key]
        if v is None:
            raise _NotSupported("Not Supported")
        return v

    nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 0, 1
    nv.nvmlDeviceGetRemappedRows = lambda h: value(h, "remapped")
    nv.nvmlDeviceGetRetiredPages = lambda h, cause: list(value(h, "retired") or [])
    nv.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: value(h, "retired_pending")
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: value(h, "reasons")
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: value(h, "reasons")
    nv.nvmlDeviceGetTemperatureThreshold = lambda h, kind: value(h, "shutdown" if kind == 0 else "slowdown")
    nv.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: value(h, "gen")[0]
    nv.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: value(h, "gen")[1]
    nv.nvmlDeviceGetCurrPcieLinkWidth = lambda h: value(h, "width")[0]
    nv.nvmlDeviceGetMaxPcieLinkWidth = lambda h: value(h, "width")[1]
    nv.nvmlDeviceGetPersistenceMode = lambda h: value(h, "persistence")
    nv.nvmlDeviceGetEccMode = lambda h: value(h, "ecc")
    nv.c_nvmlGpuFabricInfo_t = _FabricInfo

    def fabric_info(h: int, ref: object) -> int:
        state, status = value(h, "fabric")  # type: ignore[misc]
        info = getattr(ref, "_obj", None)  # ctypes.byref(struct), as the agent passes it
        if info is not None:
            info.state, info.status = state, status
        return 0  # NVML_SUCCESS, as pynvml returns it

    nv.nvmlDeviceGetGpuFabricInfo = fabric_info
    nv.c_nvmlGpuFabricInfoV_t = _FabricInfoV
    nv.nvmlDeviceGetGpuFabricInfoV = fabric_info
    return nv


def test_nvml_gives_doctor_ecc_links_down_the_driver_and_xids(fresh_nvml, monkeypatch):
    import sys

    pending = [SimpleNamespace(device=1, eventData=79)]
    nv = doctor_nvml(pending)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    cfg = Discovery(sysfs_root="/nonexistent", gpus="nvml")
    inv = discovery.discover(cfg)
    assert inv.gpu_driver == "550.54.15"
    assert inv.cuda_driver == "12.4"  # issue 39: what doctor's version checks compare
    assert [g.vbios for g in inv.gpus] == ["96.00.A5.00.1A", "96.00.A5.00.1B"]
    health = discovery.read_gpu_health(cfg)
    assert [(h.ecc_uncorrected, h.nvlink_down, h.xid) for h in health] == [(3, 0, 0), (0, 1, 79)]
    assert nv.registered == [(0, 8, "event-set"), (1, 8, "event-set")]
    again = discovery.read_gpu_health(cfg)  # the Xid is drained, and still reported
    assert [h.xid for h in again] == [0, 79]


def pcie_bridge_board(**kwargs) -> SimpleNamespace:
    """Two H100 PCIe boards joined by three NVLink bridges: 12 of each GPU's 18 links up to the
    other, 6 never cabled (what NVML lists for an H100 NVL pair)."""
    links = {0: [("gpu", 0x2A)] * 12 + [("none", 0)] * 6, 1: [("gpu", 0x18)] * 12 + [("none", 0)] * 6}
    return fake_nvml(HGX_BUSES[:2], links, **kwargs)


@pytest.mark.parametrize("uncabled_pci", ["error", "zero"])
def test_a_pcie_bridge_board_with_uncabled_links_is_healthy(fresh_nvml, uncabled_pci):
    from llmgw.doctor.facts import NodeFacts
    from llmgw.doctor.node import NodeContext, check_nvlink
    from llmgw.wire.messages import Inventory

    nv = pcie_bridge_board(uncabled_pci=uncabled_pci)
    gpus = discovery.nvml_gpus(nv)
    assert [g.nvlink for g in gpus] == [{1: 12}, {0: 12}]
    health = discovery.nvml_health(nv)
    assert [h.nvlink_down for h in health] == [0, 0]
    assert [h.nvlink_down for h in discovery.nvml_health(nv)] == [0, 0]  # and on every heartbeat after
    facts = NodeFacts(id="h100-pcie", state="ready", inventory=Inventory(gpus=gpus, gpu_source="nvml"), gpus=health)
    [finding] = check_nvlink(facts, NodeContext())
    assert (finding.status, finding.finding) == ("ok", "2 GPUs, all NVLinks up")


def test_a_link_that_was_up_is_down_when_it_goes_inactive(fresh_nvml):
    nv = pcie_bridge_board()
    assert [h.nvlink_down for h in discovery.nvml_health(nv)] == [0, 0]
    state = nv.nvmlDeviceGetNvLinkState
    # A bridge pulled: links 8-11 of both GPUs inactive, and NVML no longer names their far end.
    nv.nvmlDeviceGetNvLinkState = lambda h, link: 0 if 8 <= link < 12 else state(h, link)
    remote = nv.nvmlDeviceGetNvLinkRemotePciInfo

    def no_far_end(h, link):
        if 8 <= link < 12:
            raise _FakeNvmlError("not supported")
        return remote(h, link)

    nv.nvmlDeviceGetNvLinkRemotePciInfo = no_far_end
    assert [h.nvlink_down for h in discovery.nvml_health(nv)] == [4, 4]
    # A fresh agent never saw them up: not down, but fewer links than before (doctor warns).
    fresh = nvml_read.LinkMemory()
    assert nvml_read._nvlink_down(nv, 0, 0, fresh) == 0


def test_an_inactive_link_with_a_far_end_is_down_from_the_first_reading(fresh_nvml):
    nv = pcie_bridge_board()
    state = nv.nvmlDeviceGetNvLinkState
    nv.nvmlDeviceGetNvLinkState = lambda h, link: 0 if (h, link) == (0, 3) else state(h, link)
    assert [h.nvlink_down for h in discovery.nvml_health(nv)] == [1, 0]


def test_without_xid_events_or_ecc_doctor_is_told_not_read(fresh_nvml, monkeypatch):
    import sys

    nv = fake_nvml(HGX_BUSES[:1], {0: []})  # no event sets, no ECC query, no NVLink
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    [health] = discovery.read_gpu_health(Discovery(sysfs_root="/nonexistent", gpus="nvml"))
    assert (health.ecc_uncorrected, health.nvlink_down, health.xid) == (None, None, None)


class _NotSupported(_FakeNvmlError):
    pass


def test_a_gpu_without_nvlink_answers_not_supported_for_every_link(fresh_nvml):
    """What the device machine's H200 (a VM, driver 580.159.04, docs/device-check.md) answered:
    nvmlDeviceGetNvLinkState raises NVMLError_NotSupported for every link index, where the fake
    of a box without NVLink raises its plain error past the last link. Both are no NVLink: no
    peers, links down not read (None), and doctor says PCIe, not a link down."""
    from llmgw.doctor.facts import NodeFacts
    from llmgw.doctor.node import NodeContext, check_nvlink
    from llmgw.wire.messages import Inventory

    nv = fake_nvml(HGX_BUSES[:1], {0: []})
    nv.NVMLError_NotSupported = _NotSupported
    asked: list[int] = []

    def not_supported(h, link):
        asked.append(link)
        raise _NotSupported("Not Supported")

    nv.nvmlDeviceGetNvLinkState = not_supported
    nv.nvmlDeviceGetNvLinkRemotePciInfo = not_supported
    gpus = discovery.nvml_gpus(nv)
    assert [g.nvlink for g in gpus] == [{}]
    [health] = discovery.nvml_health(nv)
    assert health.nvlink_down is None
    assert asked and max(asked) < nv.NVML_NVLINK_MAX_LINKS
    facts = NodeFacts(id="h200-vm", state="ready", inventory=Inventory(gpus=gpus, gpu_source="nvml"), gpus=[health])
    [finding] = check_nvlink(facts, NodeContext())
    assert (finding.status, finding.finding) == ("ok", "no NVLink (GPUs on PCIe)")


def test_an_xid_is_reported_for_an_hour_then_forgotten():
    now = [0.0]
    pending = [SimpleNamespace(device=0, eventData=13)]
    watch = XidWatch(clock=lambda: now[0])
    nv = doctor_nvml(pending)
    assert watch.poll(nv) == {0: 13}
    now[0] = 3599.0
    assert watch.poll(nv) == {0: 13}
    now[0] = 3601.0
    assert watch.poll(nv) == {}


# ---- GPUs: simulated file ----------------------------------------------------------------------


def _write_sim(path: Path, gpus: list[discovery.SimGpu]) -> None:
    path.write_bytes(msgspec.json.encode(discovery.SimGpuFile(node_id="n1", gpus=gpus)))


def test_sim_gpu_file_is_read_and_reread_when_changed(tmp_path, fresh_nvml):
    path = tmp_path / "gpus.json"
    _write_sim(
        path, [discovery.SimGpu(index=1, nvlink={0: 4}), discovery.SimGpu(index=0, nvlink={1: 4})]
    )
    cfg = Discovery(sysfs_root=str(tmp_path), gpus=str(path))
    gpus, source = discovery.discover_gpus(cfg)
    assert source == "sim"
    assert [(g.index, g.nvlink) for g in gpus] == [(0, {1: 4}), (1, {0: 4})]
    _write_sim(
        path, [discovery.SimGpu(index=0, temperature_c=77, health="degraded-with-a-longer-text")]
    )
    [health] = discovery.read_gpu_health(cfg)
    assert (health.temperature_c, health.health) == (77, "degraded-with-a-longer-text")


@pytest.mark.parametrize(
    "content",
    [None, b"{not json", b'{"format": "other", "gpus": []}', b'{"gpus": [{"index": "x"}]}'],
)
def test_sim_gpu_file_trouble_means_no_gpus(tmp_path, fresh_nvml, caplog, content):
    path = tmp_path / "gpus.json"
    if content is not None:
        path.write_bytes(content)
    caplog.set_level(logging.WARNING, logger="llmgw.agent.discovery")
    cfg = Discovery(sysfs_root=str(tmp_path), gpus=str(path))
    assert discovery.discover_gpus(cfg) == ([], "none")
    assert discovery.read_gpu_health(cfg) == []
    assert len(caplog.records) == 1
    assert str(path) in caplog.records[0].getMessage()
