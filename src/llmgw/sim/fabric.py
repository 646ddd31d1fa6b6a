"""A simulated InfiniBand fabric: a rail-optimised fat tree printed as `ibnetdiscover` and
`saquery SMIR` would print it. No I/O: a spec in, the two texts out.

Layout (NVIDIA's rail-optimised SuperPOD design, scaled down): nodes come in groups of
`group_size`; each group has one leaf per rail, and adapter N (`mlx5_N`) of every node in the group
is cabled to the group's leaf for rail N. Every leaf has one cable to every spine of its pod; with
`core` > 0 the groups form pods of `groups_per_pod`, each with its own `spines`, and every spine has
one cable to every core switch (three tiers); without core there is one pod (two tiers).

The adapters are the simulated nodes' own: GUID `sim.identity.node_guid(node, N)` (port GUID = node
GUID, as the node's gids/0 says), LID `port_lid(node, N)`, description `<node> mlx5_N`, and a cable
degraded on the node (`llmgw sim node --degraded`) trains at one lane (`degrade_rate`), so the
fabric and the nodes' sysfs tell the same story. Switch LIDs count up from 1 (the subnet manager
runs on the first spine, which the nodes' `sm_lid` 1 names); LIDs are cosmetic here and may
repeat in large fabrics, since everything is keyed by GUID.

Faults: `degraded` (node or node:mlx5_N cables at 1x), `degraded_uplinks` (the first N
leaf-to-spine cables at 1x, below their parallel siblings), `misrail` (a node's first two
adapters swap leaves), `no_standby` (only the master SM), `failover` (the standby became master
and the old master is gone).
"""

from __future__ import annotations

import hashlib
import math
import os
import shlex

import msgspec

from llmgw.errors import UsageError
from llmgw.fsutil import atomic_write
from llmgw.sim.identity import node_guid, port_lid

MELLANOX_OUI = 0x0C42A1
SPEEDS = ("SDR", "DDR", "QDR", "FDR10", "FDR", "EDR", "HDR", "NDR", "XDR")
SWITCH_DEVID = {"NDR": "0xd2f2", "XDR": "0xd2f4", "HDR": "0xd2f0", "EDR": "0xcb20"}
CA_DEVID = {"XDR": "0x1023", "NDR": "0x1021", "HDR": "0x101b", "EDR": "0x1017"}
HEADER_DATE = "Tue Dec  1 08:00:00 2026"  # fixed: the same spec prints the same text
SM_PRIORITY = (14, 13)  # master, standby


class FabricSpec(msgspec.Struct, kw_only=True):
    nodes: list[str]
    rails: int = 4
    group_size: int = 32
    spines: int = 4
    core: int = 0
    groups_per_pod: int = 4
    width: str = "4x"
    speed: str = "NDR"
    degraded: list[str] = []  # "node" (its last adapter) or "node:mlx5_N"
    degraded_uplinks: int = 0
    misrail: list[str] = []
    no_standby: bool = False
    failover: bool = False


class SimSwitch(msgspec.Struct, kw_only=True):
    guid: str
    name: str
    tier: str
    lid: int


class SimFabric(msgspec.Struct, kw_only=True):
    ibnetdiscover: str
    smir: str
    switches: list[SimSwitch]
    nodes: list[str]
    leaf_of: dict[str, str]  # "node mlx5_N" → leaf name it is cabled to
    subnet_managers: list[str]  # GUIDs, master first
    master: str


def _switch_guid(name: str) -> int:
    bits = int.from_bytes(hashlib.sha256(("switch\0" + name).encode()).digest()[:8], "big") & ((1 << 40) - 1)
    return (MELLANOX_OUI << 40) | bits


class _Sw:
    def __init__(self, name: str, tier: str, lid: int) -> None:
        self.name = name
        self.tier = tier
        self.lid = lid
        self.guid = _switch_guid(name)
        self.ports: list[tuple[str, object, int, str]] = []  # (kind "H"/"S", peer, peer port, rate)

    @property
    def description(self) -> str:
        return f"MF0;{self.name}:MQM9700/U1"

    def add(self, kind: str, peer: object, peer_port: int, rate: str) -> int:
        self.ports.append((kind, peer, peer_port, rate))
        return len(self.ports)


class _Adapter:
    def __init__(self, node: str, index: int) -> None:
        self.node = node
        self.index = index
        self.guid = node_guid(node, index)
        self.lid = port_lid(node, index)
        self.description = f"{node} mlx5_{index}"
        self.leaf: _Sw | None = None
        self.leaf_port = 0
        self.rate = ""


def validate(spec: FabricSpec) -> None:
    if not spec.nodes:
        raise UsageError("--nodes: at least one node")
    if len(set(spec.nodes)) != len(spec.nodes):
        raise UsageError("--node-ids: every node id once")
    if not 1 <= spec.rails <= 32:
        raise UsageError(f"--rails {spec.rails}: use 1 to 32 (the simulated node's device limit)")
    if spec.group_size < 1 or spec.spines < 1 or spec.core < 0 or spec.groups_per_pod < 1:
        raise UsageError("--group-size, --spines and --groups-per-pod must be 1 or more, --core 0 or more")
    if spec.speed not in SPEEDS or spec.width not in ("1x", "2x", "4x", "8x", "12x"):
        raise UsageError(f"--rate {spec.width}{spec.speed}: write it like 4xNDR (speeds: {', '.join(SPEEDS)})")
    known = set(spec.nodes)
    for item in spec.degraded + spec.misrail:
        node = item.split(":", 1)[0]
        if node not in known:
            raise UsageError(f"{item!r} names no simulated node (nodes: {', '.join(spec.nodes[:5])}, …)")
    for node in spec.misrail:
        if spec.rails < 2:
            raise UsageError(f"--misrail {node}: needs at least 2 rails")
    if spec.no_standby and spec.failover:
        raise UsageError("--no-standby and --failover: choose one (a failover already leaves no standby)")


def generate(spec: FabricSpec) -> SimFabric:
    validate(spec)
    rate = spec.width + spec.speed
    slow = "1x" + spec.speed
    groups = math.ceil(len(spec.nodes) / spec.group_size)
    pods = math.ceil(groups / spec.groups_per_pod) if spec.core else 1
    lid = iter(range(1, 1 << 16))

    spines = [[_Sw(f"spine-p{p + 1}-{s + 1}" if spec.core else f"spine-{s + 1}", "spine", next(lid))
               for s in range(spec.spines)] for p in range(pods)]
    cores = [_Sw(f"core-{c + 1}", "core", next(lid)) for c in range(spec.core)]
    leaves = [[_Sw(f"leaf-g{g + 1}-r{r}", "leaf", next(lid)) for r in range(spec.rails)] for g in range(groups)]

    degraded: set[tuple[str, int]] = set()
    for item in spec.degraded:
        node, _, device = item.partition(":")
        index = spec.rails - 1
        if device:
            if not device.startswith("mlx5_") or not device[5:].isdigit() or int(device[5:]) >= spec.rails:
                raise UsageError(f"--degrade {item}: the device is mlx5_0 … mlx5_{spec.rails - 1}")
            index = int(device[5:])
        degraded.add((node, index))
    misrail = set(spec.misrail)

    adapters: list[_Adapter] = []
    for n, node in enumerate(spec.nodes):
        group = leaves[n // spec.group_size]
        for r in range(spec.rails):
            adapter = _Adapter(node, r)
            leaf_rail = {0: 1, 1: 0}.get(r, r) if node in misrail else r
            adapter.leaf = group[leaf_rail]
            adapter.rate = slow if (node, r) in degraded else rate
            adapter.leaf_port = adapter.leaf.add("H", adapter, 1, adapter.rate)
            adapters.append(adapter)

    uplinks_left = spec.degraded_uplinks
    for g, group in enumerate(leaves):
        for leaf in group:
            for spine in spines[g // spec.groups_per_pod if spec.core else 0]:
                link_rate = slow if uplinks_left > 0 else rate
                uplinks_left -= 1
                port = leaf.add("S", spine, len(spine.ports) + 1, link_rate)
                spine.add("S", leaf, port, link_rate)
    for pod in spines:
        for spine in pod:
            for core in cores:
                port = spine.add("S", core, len(core.ports) + 1, rate)
                core.add("S", spine, port, rate)

    switches = [s for pod in spines for s in pod] + cores + [s for group in leaves for s in group]
    sm_switches = sorted(switches[:2] if len(switches) > 1 else switches[:1], key=lambda s: s.guid)
    return SimFabric(
        ibnetdiscover=_ibnetdiscover(switches, adapters, spec),
        smir=_smir(sm_switches, spec),
        switches=[SimSwitch(guid=f"0x{s.guid:016x}", name=s.name, tier=s.tier, lid=s.lid) for s in switches],
        nodes=list(spec.nodes),
        leaf_of={a.description: a.leaf.name for a in adapters if a.leaf is not None},
        subnet_managers=[f"0x{s.guid:016x}" for s in _sm_order(sm_switches, spec)],
        master=f"0x{_sm_order(sm_switches, spec)[0].guid:016x}",
    )


def _sm_order(sm_switches: list[_Sw], spec: FabricSpec) -> list[_Sw]:
    """Master first. Normally the lowest GUID is master; after a failover the other one is, and
    the old master is gone; without a standby only the master is left."""
    if spec.failover and len(sm_switches) > 1:
        return [sm_switches[1]]
    if spec.no_standby:
        return sm_switches[:1]
    return sm_switches


def _ibnetdiscover(switches: list[_Sw], adapters: list[_Adapter], spec: FabricSpec) -> str:
    out: list[str] = []
    first = adapters[0].guid if adapters else switches[0].guid
    out.append(f"#\n# Topology file: generated on {HEADER_DATE}\n#\n"
               f"# Initiated from node {first:016x} port {first:016x}\n")
    sw_devid = SWITCH_DEVID.get(spec.speed, "0xd2f2")
    for sw in switches:
        out.append(f"\nvendid=0x2c9\ndevid={sw_devid}\nsysimgguid=0x{sw.guid:x}\n"
                   f"switchguid=0x{sw.guid:x}({sw.guid:x})\n"
                   f'Switch\t{len(sw.ports)} "S-{sw.guid:016x}"\t\t# "{sw.description}" enhanced port 0 '
                   f"lid {sw.lid} lmc 0\n")
        for port, (kind, peer, peer_port, link_rate) in enumerate(sw.ports, 1):
            if kind == "H":
                assert isinstance(peer, _Adapter)
                out.append(f'[{port}]\t"H-{peer.guid:016x}"[{peer_port}]({peer.guid:x}) \t\t# "{peer.description}" '
                           f"lid {peer.lid} {link_rate}\n")
            else:
                assert isinstance(peer, _Sw)
                out.append(f'[{port}]\t"S-{peer.guid:016x}"[{peer_port}]\t\t# "{peer.description}" lid {peer.lid} '
                           f"{link_rate}\n")
    ca_devid = CA_DEVID.get(spec.speed, "0x1021")
    for a in adapters:
        assert a.leaf is not None
        out.append(f"\nvendid=0x2c9\ndevid={ca_devid}\nsysimgguid=0x{a.guid:x}\ncaguid=0x{a.guid:x}\n"
                   f'Ca\t1 "H-{a.guid:016x}"\t\t# "{a.description}"\n'
                   f'[1]({a.guid:x}) \t"S-{a.leaf.guid:016x}"[{a.leaf_port}]\t\t# lid {a.lid} lmc 0 '
                   f'"{a.leaf.description}" lid {a.leaf.lid} {a.rate}\n')
    return "".join(out)


def _smir(sm_switches: list[_Sw], spec: FabricSpec) -> str:
    """saquery.c's dump_one_smi_record, once per SM the SA knows."""
    out = []
    for i, sw in enumerate(_sm_order(sm_switches, spec)):
        state = 3 if i == 0 else 2
        out.append(
            "SMInfoRecord dump:\n"
            "\t\tRID\n"
            f"\t\tLID...................{sw.lid}\n"
            "\t\tSMInfo dump:\n"
            f"\t\tGUID..................0x{sw.guid:016x}\n"
            f"\t\tSM_Key................0x{0:016x}\n"
            f"\t\tActCount..............{1000 + i}\n"
            f"\t\tPriority..............{SM_PRIORITY[min(i, 1)]}\n"
            f"\t\tSMState...............{state}\n"
        )
    return "".join(out)


# ---- stand-in tools on simulated nodes ---------------------------------------------------------

STANDIN = """#!/bin/sh
# Written by `llmgw sim node --fabric`: prints the simulated fabric as the real {tool} would.
{body}
"""


def write_standins(bin_dir: str, fabric_dir: str) -> None:
    """`ibnetdiscover` and `saquery` in bin_dir that print fabric_dir's texts, read at each run, so
    a fabric regenerated into the same directory (a degraded cable, a failover) is what the next
    discovery sees."""
    os.makedirs(bin_dir, exist_ok=True)
    topo = shlex.quote(os.path.join(fabric_dir, "ibnetdiscover.txt"))
    smir = shlex.quote(os.path.join(fabric_dir, "smir.txt"))
    scripts = {
        "ibnetdiscover": f"exec cat {topo}",
        "saquery": (f'for a in "$@"; do [ "$a" = SMIR ] && exec cat {smir}; done\n'
                    'echo "saquery: this stand-in answers SMIR only" >&2\nexit 1'),
    }
    for tool, body in scripts.items():
        atomic_write(os.path.join(bin_dir, tool), STANDIN.format(tool=tool, body=body).encode(), mode=0o755)
