"""A simulated node: a fake sysfs tree and a GPU inventory that the agent's real discovery reads.

Every value is written in the format the kernel (or NVML) gives, so the parser that reads a
real node reads this one; nothing in discovery knows it is looking at a simulation except the
GPU source. GUIDs and LIDs are derived from the node id, so the same node id always gives the
same node and different node ids give different GUIDs (a fabric simulator can call
`node_guid` / `port_lid` to stay consistent with what a node wrote).

`plan_node` is pure (spec in, files out); `write_node` puts a plan on disk atomically.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import msgspec
import yaml

from llmgw.agent.discovery import SimGpu, SimGpuFile
from llmgw.agent.hostfacts import SIM_MARKER
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig
from llmgw.errors import UsageError
from llmgw.fabric import sysfs
from llmgw.fabric.linkrate import data_gbps
from llmgw.fsutil import atomic_write
from llmgw.sim.identity import (
    MAX_RDMA_DEVICES,
    NVIDIA_OUI,
    digest,
    gpu_bus_id,
    gpu_uuid,
    node_guid,
    port_lid,
    sysfs_guid,
)
from llmgw.sim.node_faults import SIM_CUDA_VERSION, SIM_VBIOS, hw_counter_files, nvswitch_tree
from llmgw.sim.pcie import pcie_files
from llmgw.sim.pcitree import gpu_files, layout

SM_LID = 1
SIM_DRIVER_VERSION = "550.54.15"  # what NVML reports on a DGX H100 of the samples' time

# hca_type, fw_ver, board_id of the HCA generation that runs at each speed.
HCA_BY_SPEED = {
    "XDR": ("MT4131", "40.44.1036", "MT_0000001070"),
    "NDR": ("MT4129", "28.39.1002", "MT_0000000838"),
    "HDR": ("MT4123", "20.39.1002", "MT_0000000223"),
    "EDR": ("MT4119", "16.35.2000", "MT_0000000008"),
}
DEFAULT_HCA = ("MT4099", "2.42.5000", "MT_1090120019")

COUNTERS = (
    "VL15_dropped",
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
)
# What a flapping, width-degraded cable has accumulated.
DEGRADED_COUNTERS = {
    "symbol_error": 1873,
    "link_error_recovery": 4,
    "link_downed": 2,
    "port_rcv_errors": 57,
}


class NodeSpec(msgspec.Struct, kw_only=True):
    node_id: str
    gpus: int = 8
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    gpu_memory_mib: int = 81559
    nvlink: str = "nv18"  # "nv<N>": every GPU pair joined by N links (NVSwitch); "none"
    ib_ports: int = 4
    ib_rate: str = "400 Gb/sec (4X NDR)"
    roce_ports: int = 0
    roce_rate: str = "200 Gb/sec (4X HDR)"
    degraded: int = 0  # the last N InfiniBand ports run width- (or speed-) degraded
    server: str = ""
    # Adapters declared in the agent's fabrics but absent from sysfs, and devices whose port is
    # left in INIT (no subnet manager): the doors `fabric/declared.py` must close.
    absent: list[str] = []
    init_ports: list[str] = []
    ib_fabric: str = "ib"  # the fabric names agent.yaml declares (nodes sharing one name share the fabric)
    roce_fabric: str = "roce"
    fabric: str = ""  # a `llmgw sim fabric --out` directory: stand-in ibnetdiscover/saquery print it
    # Gb/s the stand-in ib_write_bw measures through an adapter (default: 96 % of its rate).
    bandwidth: dict[str, float] = {}


class WrittenPort(msgspec.Struct, kw_only=True):
    device: str
    port: int
    link_layer: str
    rate: str
    netdev: str
    lid: int
    node_guid: str
    degraded: bool = False


class NodeResult(msgspec.Struct, kw_only=True):
    node_id: str
    dir: str
    agent_config: str
    sysfs_root: str
    gpus_file: str
    gpus: int
    gpu_name: str
    nvlink: str
    ports: list[WrittenPort]


@dataclass
class NodePlan:
    """Everything to write, relative to the node directory."""

    files: dict[str, str] = field(default_factory=dict)  # sys/... → content
    links: dict[str, str] = field(default_factory=dict)  # sys/... → relative target
    gpu_file: SimGpuFile = field(default_factory=SimGpuFile)
    ports: list[WrittenPort] = field(default_factory=list)


# ---- validation --------------------------------------------------------------------------------


def _check_rate(text: str, flag: str) -> sysfs.Rate:
    rate = sysfs.parse_rate(text)
    if not rate.width or rate.speed not in sysfs.LANE_GBPS:
        raise UsageError(
            f"{flag} {text!r} is not a sysfs rate; write it like '400 Gb/sec (4X NDR)' "
            f"(speeds: {', '.join(sysfs.LANE_GBPS)})"
        )
    expected = sysfs.format_rate(int(rate.width[:-1]), rate.speed)
    if sysfs.parse_rate(expected).gbps != rate.gbps:
        raise UsageError(
            f"{flag} {text!r} does not add up: {rate.width} {rate.speed} is {expected!r}"
        )
    return rate


def _nvlink_count(text: str) -> int:
    if text == "none":
        return 0
    match = re.fullmatch(r"(?:pairs-)?nv(\d+)", text.lower())
    if not match or not 1 <= int(match[1]) <= 18:
        raise UsageError(
            f"--nvlink {text!r}: use 'none', 'nv<N>' (every pair, NVSwitch) or 'pairs-nv<N>' "
            "(NVLink bridges joining GPUs 0-1, 2-3, ...) with N from 1 to 18 (nv18 = HGX H100)"
        )
    return int(match[1])


def nvlink_peers(text: str, gpus: int, index: int) -> dict[int, int]:
    """GPU `index`'s NVLink peers: all others (NVSwitch), its bridge partner (pairs-), none."""
    links = _nvlink_count(text)
    if not links:
        return {}
    if text.lower().startswith("pairs-"):
        partner = index ^ 1
        return {partner: links} if partner < gpus else {}
    return {j: links for j in range(gpus) if j != index}


def rdma_devices(spec: NodeSpec) -> list[str]:
    return [f"mlx5_{d}" for d in range(spec.ib_ports + spec.roce_ports)]


def validate(spec: NodeSpec) -> None:
    if not spec.node_id or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.node_id):
        raise UsageError(
            f"node id {spec.node_id!r} (from --node-id or the directory name): "
            "use letters, digits, '.', '_' and '-'"
        )
    if not 0 <= spec.gpus <= 64:
        raise UsageError(f"--gpus {spec.gpus}: use 0 to 64")
    if spec.gpu_memory_mib < 0:
        raise UsageError("--gpu-memory-mib must be 0 or more")
    if spec.ib_ports < 0 or spec.roce_ports < 0:
        raise UsageError("--ib-ports and --roce-ports must be 0 or more")
    if spec.ib_ports + spec.roce_ports > MAX_RDMA_DEVICES:
        raise UsageError(
            f"--ib-ports + --roce-ports is {spec.ib_ports + spec.roce_ports}; at most {MAX_RDMA_DEVICES}"
        )
    if not 0 <= spec.degraded <= spec.ib_ports:
        raise UsageError(f"--degraded {spec.degraded}: use 0 to --ib-ports ({spec.ib_ports})")
    _check_rate(spec.ib_rate, "--ib-rate")
    _check_rate(spec.roce_rate, "--roce-rate")
    _nvlink_count(spec.nvlink)
    present = rdma_devices(spec)
    for name in spec.absent:
        if name in present or not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise UsageError(f"--absent-adapter {name!r}: name an adapter this node does not have "
                             f"({', '.join(present)} exist)")
    for name, gbps in spec.bandwidth.items():
        if name not in present or not 0 <= gbps <= 10_000:
            raise UsageError(f"--bandwidth {name}={gbps:g}: name an adapter of this node "
                             f"({', '.join(present) or 'none'}) and a figure in Gb/s from 0 to 10000")
    for name in spec.init_ports:
        if name not in present:
            raise UsageError(f"--init-port {name!r}: no such adapter ({', '.join(present) or 'none'})")
    if spec.absent and not present:
        raise UsageError("--absent-adapter needs a fabric to declare it in: add --ib-ports or --roce-ports")


# ---- the plan (pure) -----------------------------------------------------------------------


def degrade_rate(rate: sysfs.Rate) -> str:
    """A degraded cable: the link comes up on 1 lane, or one speed lower if it already had 1."""
    width = int(rate.width[:-1])
    if width > 1:
        return sysfs.format_rate(1, rate.speed)
    speeds = [s for s in sysfs.LANE_GBPS if s != "FDR10"]
    lower = speeds[max(0, speeds.index(rate.speed) - 1)] if rate.speed in speeds else "SDR"
    return sysfs.format_rate(1, lower)


def _mac(node_id: str, device_index: int) -> str:
    tail = digest("mac", node_id)[:2] + bytes([device_index & 0xFF])
    raw = NVIDIA_OUI.to_bytes(3, "big") + tail
    return ":".join(f"{b:02x}" for b in raw)


def _ipoib_address(guid: int) -> str:
    """IPoIB's 20-byte hardware address: QPN flags, then the port GID (link-local prefix + GUID)."""
    raw = bytes.fromhex("00001087fe80000000000000") + guid.to_bytes(8, "big")
    return ":".join(f"{b:02x}" for b in raw)


def roce_ipv4(node_id: str, device_index: int) -> str:
    """The IPv4 address on a simulated RoCE netdev: 10.<device+1>.<two bytes of the node id's hash>."""
    a, b = digest("ipv4", node_id)[:2]
    return f"10.{device_index + 1}.{a}.{b % 254 + 1}"


def _ipv4_mapped_gid(address: str) -> str:
    """10.1.2.3 → `0000:0000:0000:0000:0000:ffff:0a01:0203`, as sysfs prints an IPv4-mapped GID."""
    a, b, c, d = (int(x) for x in address.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


# state / phys_state file contents for `set-port` and INIT ports (kernel ib_port_state names).
PORT_STATES = {
    "active": ("4: ACTIVE", "5: LinkUp"),
    "up": ("4: ACTIVE", "5: LinkUp"),
    "init": ("2: INIT", "5: LinkUp"),
    "armed": ("3: ARMED", "5: LinkUp"),
    "down": ("1: DOWN", "3: Disabled"),
    "polling": ("1: DOWN", "2: Polling"),
}


def _link_local_gid(mac: str) -> str:
    octets = [int(x, 16) for x in mac.split(":")]
    eui = [octets[0] ^ 0x02, *octets[1:3], 0xFF, 0xFE, *octets[3:]]
    return "fe80:0000:0000:0000:" + ":".join(
        f"{eui[i]:02x}{eui[i + 1]:02x}" for i in range(0, 8, 2)
    )


def plan_node(spec: NodeSpec) -> NodePlan:
    validate(spec)
    plan = NodePlan()
    files, links = plan.files, plan.links
    ib_rate = _check_rate(spec.ib_rate, "--ib-rate")
    roce_rate = _check_rate(spec.roce_rate, "--roce-rate")
    first_degraded = spec.ib_ports - spec.degraded

    gpu_slots, adapter_slots = layout(spec.gpus, spec.ib_ports + spec.roce_ports)
    slot_files, slot_links = gpu_files(gpu_slots)
    files.update(slot_files)
    links.update(slot_links)
    for d in range(spec.ib_ports + spec.roce_ports):
        roce = d >= spec.ib_ports
        device = f"mlx5_{d}"
        netdev = f"eth{d - spec.ib_ports}" if roce else f"ib{d}"
        rate = roce_rate if roce else ib_rate
        degraded = not roce and d >= first_degraded
        rate_text = (
            degrade_rate(rate) if degraded else sysfs.format_rate(int(rate.width[:-1]), rate.speed)
        )
        guid = node_guid(spec.node_id, d)
        lid = 0 if roce else port_lid(spec.node_id, d)
        mac = _mac(spec.node_id, d)
        slot = adapter_slots[d]
        pci_dir = slot.path
        hca_type, fw_ver, board_id = HCA_BY_SPEED.get(rate.speed, DEFAULT_HCA)

        dev_dir = f"sys/class/infiniband/{device}"
        files[f"{dev_dir}/node_guid"] = sysfs_guid(guid) + "\n"
        files[f"{dev_dir}/sys_image_guid"] = sysfs_guid(guid) + "\n"
        files[f"{dev_dir}/fw_ver"] = fw_ver + "\n"
        files[f"{dev_dir}/hca_type"] = hca_type + "\n"
        files[f"{dev_dir}/board_id"] = board_id + "\n"
        files[f"{dev_dir}/node_type"] = "1: CA\n"
        files[f"{dev_dir}/node_desc"] = f"{spec.node_id} {device}\n"
        links[f"{dev_dir}/device"] = "../../../" + pci_dir.removeprefix("sys/")
        files[f"{pci_dir}/numa_node"] = f"{slot.numa}\n"
        files.update(pcie_files(pci_dir, data_gbps(rate.gbps, rate.speed, "Ethernet" if roce else "InfiniBand")))

        port_dir = f"{dev_dir}/ports/1"
        init = device in spec.init_ports
        if roce:
            gid = _link_local_gid(mac)
            mapped = _ipv4_mapped_gid(roce_ipv4(spec.node_id, d))
            # As a ConnectX fills it for one IPv4 address: v1 and v2 link-local, v1 and v2 IPv4.
            for index, (text, kind) in enumerate(((gid, "IB/RoCE v1"), (gid, "RoCE v2"),
                                                  (mapped, "IB/RoCE v1"), (mapped, "RoCE v2"))):
                files[f"{port_dir}/gids/{index}"] = text + "\n"
                files[f"{port_dir}/gid_attrs/types/{index}"] = kind + "\n"
                files[f"{port_dir}/gid_attrs/ndevs/{index}"] = netdev + "\n"
            files[f"{port_dir}/gids/4"] = "0000:0000:0000:0000:0000:0000:0000:0000\n"  # unused entries read as zeros
        else:
            gid = "fe80:0000:0000:0000:" + sysfs_guid(guid)
        files[f"{port_dir}/gids/0"] = gid + "\n"
        files[f"{port_dir}/state"] = PORT_STATES["init" if init else "active"][0] + "\n"
        files[f"{port_dir}/phys_state"] = PORT_STATES["init" if init else "active"][1] + "\n"
        files[f"{port_dir}/rate"] = rate_text + "\n"
        files[f"{port_dir}/link_layer"] = ("Ethernet" if roce else "InfiniBand") + "\n"
        files[f"{port_dir}/lid"] = f"0x{0 if init else lid:x}\n"
        files[f"{port_dir}/sm_lid"] = f"0x{0 if roce or init else SM_LID:x}\n"
        files[f"{port_dir}/lid_mask_count"] = "0\n"
        files[f"{port_dir}/sm_sl"] = "0\n"
        for counter in COUNTERS:
            count = DEGRADED_COUNTERS.get(counter, 0) if degraded else 0
            files[f"{port_dir}/counters/{counter}"] = f"{count}\n"
        files.update(hw_counter_files(port_dir, roce))

        net_dir = f"{pci_dir}/net/{netdev}"
        files[f"{net_dir}/dev_port"] = "0\n"
        files[f"{net_dir}/address"] = (mac if roce else _ipoib_address(guid)) + "\n"
        files[f"{net_dir}/operstate"] = "up\n"
        files[f"{net_dir}/type"] = ("1" if roce else "32") + "\n"
        links[f"{net_dir}/device"] = "../../../" + slot.bdf
        links[f"sys/class/net/{netdev}"] = "../../" + net_dir.removeprefix("sys/")

        plan.ports.append(
            WrittenPort(
                device=device,
                port=1,
                link_layer="Ethernet" if roce else "InfiniBand",
                rate=rate_text,
                netdev=netdev,
                lid=lid,
                node_guid=f"0x{guid:016x}",
                degraded=degraded,
            )
        )

    # A real /sys has no such file: it tells the agent these adapters pin no memory (memlock).
    files[f"sys/{SIM_MARKER}"] = f"{spec.node_id}\n"
    files["sys/module/nvidia_peermem/initstate"] = "live\n"  # GPUDirect RDMA, as a DGX loads it
    if spec.nvlink.startswith("nv"):  # nv<N>: an NVSwitch baseboard, its fabric manager running
        switch_files, switch_links = nvswitch_tree()
        files.update(switch_files)
        links.update(switch_links)
    plan.gpu_file = SimGpuFile(
        node_id=spec.node_id,
        driver_version=SIM_DRIVER_VERSION, cuda_version=SIM_CUDA_VERSION,
        gpus=[
            SimGpu(
                index=i,
                uuid=gpu_uuid(spec.node_id, i),
                name=spec.gpu_name,
                memory_mib=spec.gpu_memory_mib,
                pci_bus_id=gpu_bus_id(i),
                nvlink=nvlink_peers(spec.nvlink, spec.gpus, i),
                temperature_c=30 + i % 8,
                power_w=72.0 + i,  # an idle H100 SXM draws 70-75 W
                fabric_state="completed" if spec.nvlink.startswith("nv") else "",  # nv<N>: NVSwitches
                utilization_pct=0,
                memory_used_mib=0, vbios=SIM_VBIOS,
            )
            for i in range(spec.gpus)
        ],
    )
    return plan


def agent_config_text(spec: NodeSpec, root: str) -> str:
    data: dict[str, object] = {"node_id": spec.node_id}
    if spec.server:
        data["server"] = spec.server
    data["work_dir"] = os.path.join(root, "work")
    discovery = {
        "sysfs_root": os.path.join(root, "sys"),
        "gpus": os.path.join(root, "gpus.json"),
    }
    fabrics: list[dict[str, object]] = []
    ib = [f"mlx5_{d}" for d in range(spec.ib_ports)]
    roce = [f"mlx5_{d}" for d in range(spec.ib_ports, spec.ib_ports + spec.roce_ports)]
    if ib:
        fabrics.append({"name": spec.ib_fabric, "kind": "infiniband", "devices": ib})
    if roce:
        fabrics.append({"name": spec.roce_fabric, "kind": "roce", "devices": roce})
    if fabrics and spec.absent:
        fabrics[0]["devices"] = [*(ib or roce), *spec.absent]  # declared, not there
    if fabrics:
        data["fabrics"] = fabrics
    if spec.fabric or rdma_devices(spec):
        discovery["tools_dir"] = os.path.join(root, "bin")  # stand-in ib_write_bw (and fabric tools)
    data["discovery"] = discovery
    header = (f"# Written by `llmgw sim node` for {spec.node_id}: "
              f"run `llmgw agent --config {os.path.join(root, 'agent.yaml')}`.\n")
    text = header + yaml.safe_dump(data, sort_keys=False)
    parse_config(text, AgentConfig, "agent.yaml")  # what we write must load
    return text


# ---- writing (I/O) ---------------------------------------------------------------------------

NODE_ENTRIES = ("agent.yaml", "gpus.json", "sys")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _materialise(plan: NodePlan, staging: str) -> None:
    """Write the sys/ part of a plan under `staging` (which stands for the node dir)."""
    for rel, content in sorted(plan.files.items()):
        path = os.path.join(staging, rel.removeprefix("sys/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_file(path, content.encode())
    for rel, target in sorted(plan.links.items()):
        path = os.path.join(staging, rel.removeprefix("sys/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(target, path)


def write_node(directory: str, spec: NodeSpec, force: bool = False) -> NodeResult:
    """Write a simulated node into `directory`; an existing node is replaced only with force.

    sys/ is built under a temporary name and renamed into place, then gpus.json, then
    agent.yaml (last: its presence means the node is complete). Anything else in the
    directory (the agent's work dir) is left alone.
    """
    root = os.path.abspath(directory)
    plan = plan_node(spec)
    config_text = agent_config_text(spec, root)
    if os.path.exists(root) and not os.path.isdir(root):
        raise UsageError(f"--dir {root} exists and is not a directory")
    existing = [e for e in NODE_ENTRIES if os.path.lexists(os.path.join(root, e))]
    if existing and not force:
        raise UsageError(
            f"{root} already holds a simulated node ({existing[0]}); pass --force to replace it"
        )
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".sys.", suffix=".tmp", dir=root)
    except OSError as exc:
        raise UsageError(f"cannot create {root}: {exc.strerror}") from None
    old = ""
    try:
        _materialise(plan, staging)
        sys_dir = os.path.join(root, "sys")
        if os.path.lexists(sys_dir):
            old = tempfile.mkdtemp(prefix=".sys.", suffix=".old", dir=root)
            os.rename(sys_dir, os.path.join(old, "sys"))
        try:
            os.rename(staging, sys_dir)
        except OSError:
            if old:  # put the previous tree back rather than leave the node without one
                os.rename(os.path.join(old, "sys"), sys_dir)
            raise
        _fsync_dir(root)
        atomic_write(
            os.path.join(root, "gpus.json"),
            msgspec.json.format(msgspec.json.encode(plan.gpu_file), indent=2) + b"\n",
        )
        if spec.fabric:
            from llmgw.sim.fabric import write_standins

            write_standins(os.path.join(root, "bin"), os.path.abspath(spec.fabric))
        if rdma_devices(spec):
            write_perftest_standin(root, spec.bandwidth)
        from llmgw.sim.ray import write_standin as write_ray_standin

        write_ray_standin(root)
        atomic_write(os.path.join(root, "agent.yaml"), config_text.encode())
    except OSError as exc:
        raise UsageError(
            f"cannot write the simulated node in {root}: {exc.strerror or exc}"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    return NodeResult(
        node_id=spec.node_id,
        dir=root,
        agent_config=os.path.join(root, "agent.yaml"),
        sysfs_root=os.path.join(root, "sys"),
        gpus_file=os.path.join(root, "gpus.json"),
        gpus=spec.gpus,
        gpu_name=spec.gpu_name,
        nvlink=spec.nvlink,
        ports=plan.ports,
    )


PERFTEST_STANDIN = """#!/bin/sh
# Written by `llmgw sim node`: a stand-in ib_write_bw that pairs with its peer over TCP and prints
# perftest's table for this node's adapters (llmgw/sim/perftest.py).
exec {python} -m llmgw.sim.perftest {node} "$@"
"""


def write_perftest_standin(root: str, bandwidth: dict[str, float]) -> None:
    import shlex
    import sys

    from llmgw.sim.perftest import SETTINGS_FILE

    bin_dir = os.path.join(root, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    atomic_write(os.path.join(root, SETTINGS_FILE),
                 msgspec.json.encode({"bandwidth_gbps": bandwidth}) + b"\n")
    script = PERFTEST_STANDIN.format(python=shlex.quote(sys.executable), node=shlex.quote(root))
    atomic_write(os.path.join(bin_dir, "ib_write_bw"), script.encode(), mode=0o755)


def set_port(directory: str, device: str, port: int, state: str, rate: str = "") -> str:
    """Change a simulated port's state the way the kernel would show it (cable pulled: down;
    subnet manager gone: init; back: up), and with `rate` the rate it trained at (a cable that
    came back at 1x: `100 Gb/sec (1X NDR)`, as `llmgw sim fabric --degrade` prints it in the
    dump). Atomic per file; the running agent reads it on its next heartbeat. Returns the new
    `state` line."""
    if state not in PORT_STATES:
        raise UsageError(f"port state {state!r}: use one of {', '.join(PORT_STATES)}")
    if rate:
        parsed = sysfs.parse_rate(rate)
        if parsed.gbps <= 0 or not parsed.width:
            raise UsageError(f"rate {rate!r}: write it as sysfs does, like '100 Gb/sec (1X NDR)'")
    port_dir = os.path.join(os.path.abspath(directory), "sys", "class", "infiniband", device, "ports", str(port))
    if not os.path.isdir(port_dir):
        raise UsageError(f"no port {device}/{port} in the simulated node {directory} ({port_dir} is not there)")
    state_line, phys_line = PORT_STATES[state]
    try:
        if rate:
            atomic_write(os.path.join(port_dir, "rate"), (rate + "\n").encode())
        atomic_write(os.path.join(port_dir, "phys_state"), (phys_line + "\n").encode())
        atomic_write(os.path.join(port_dir, "state"), (state_line + "\n").encode())
    except OSError as exc:
        raise UsageError(f"cannot change {port_dir}: {exc.strerror or exc}") from None
    return state_line
