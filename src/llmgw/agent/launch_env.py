"""The environment each engine shard gets for its collectives (NCCL, Gloo). Pure.

Left alone, NCCL guesses: every IB adapter it finds (a down one or a storage rail included),
the first interface that is not `lo` or `docker*` for its bootstrap sockets, GID index 0 on
RoCE (a RoCE v1 link-local GID, not routable). Each guess hangs a multi-node engine in its first
collective. So the agent sets, from what it discovered on this node:

- `NCCL_IB_HCA`: the shard's fabric's usable adapter ports, `=mlx5_0:1,mlx5_1:1`. The leading
  `=` asks NCCL for exact names: its default is prefix matching, where `mlx5_1` also takes
  mlx5_10 .. mlx5_17 (NCCL docs, "Environment Variables").
- `NCCL_SOCKET_IFNAME` (`=name`, exact as above) and `GLOO_SOCKET_IFNAME` (a plain name: Gloo
  takes one interface): the management interface, the one holding the address the agent
  reaches the server from, which the other ranks reach too.
- `NCCL_IB_GID_INDEX` on RoCE only: the index of the RoCE v2 GID holding an IPv4-mapped
  address (gid_attrs/types + gids) when it is the same on every usable port; when ports differ it
  is left unset with `NCCL_IB_ROCE_VERSION_NUM=2`, and NCCL >= 2.21 picks per device.
- `NCCL_IB_TC` (the traffic class of RoCE's lossless priority, e.g. 106 for DSCP 26 with ECN on a
  PFC-enabled priority) is the network's choice, not the node's: the agent derives none, a
  profile's `env:` sets it, and the launch report lists it beside the derived keys.

A profile's `env:` wins over any of these; what was derived and what was overridden is
reported back (ShardStatus.launch_env) and shown by the API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from llmgw.fabric.declared import LINK_LAYER
from llmgw.wire.messages import EnvSetting, FabricStatus, Port


class LaunchError(Exception):
    """The shard cannot get a working environment here; the message is what the operator sees
    (the supervisor turns it into a failed shard, as the engines' own LaunchError)."""


class LaunchFacts(msgspec.Struct):
    """What the agent knows when it launches: its fabrics' verdicts (latest heartbeat), its
    ports as discovered (GID tables), its management interface. Empty: nothing to derive."""

    fabrics: list[FabricStatus] = []
    ports: list[Port] = []
    interface: str = ""


DERIVED_KEYS = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_GID_INDEX",
                "NCCL_IB_ROCE_VERSION_NUM", "NCCL_IB_TC")


def pick_fabric(wanted: str, statuses: Sequence[FabricStatus]) -> FabricStatus | None:
    """The fabric a shard's ranks use: the one the server named (it must be usable here), or,
    for a shard that named none, the node's first usable RDMA fabric (None: sockets only)."""
    if wanted:
        found = next((s for s in statuses if s.name == wanted), None)
        if found is None:
            raise LaunchError(f"fabric {wanted!r} is not declared on this node (its agent config's fabrics: "
                              f"{', '.join(s.name for s in statuses) or 'none'})")
        if not found.usable:
            raise LaunchError(f"fabric {wanted!r} is not usable on this node: {'; '.join(found.problems)}")
        return found
    return next((s for s in statuses if s.usable and s.kind in LINK_LAYER and s.ports), None)


def derive(fabric: FabricStatus | None, ports: Sequence[Port], mgmt_interface: str) -> dict[str, str]:
    """The variables this node's discovery supports for one shard (see the module docstring)."""
    env: dict[str, str] = {}
    if mgmt_interface:
        env["NCCL_SOCKET_IFNAME"] = "=" + mgmt_interface
        env["GLOO_SOCKET_IFNAME"] = mgmt_interface
    if fabric is None or not fabric.ports:
        return env
    env["NCCL_IB_HCA"] = "=" + ",".join(fabric.ports)
    if fabric.kind == "roce":
        by_name = {f"{p.device}:{p.port}": p for p in ports}
        indexes: dict[int, list[str]] = {}
        for name in fabric.ports:
            port = by_name.get(name)
            index = port.roce_v2_ipv4_gid_index if port is not None else -1
            if index < 0:
                raise LaunchError(f"fabric {fabric.name}: {name} has no RoCE v2 GID with an IPv4 address "
                                  "(no IPv4 address on its interface?); NCCL would pick a GID the other nodes cannot reach")
            indexes.setdefault(index, []).append(name)
        if len(indexes) > 1:
            # NCCL >= 2.21 picks the GID per device when NCCL_IB_GID_INDEX is unset (-1), taking a
            # RoCE v2 one (NCCL_IB_ROCE_VERSION_NUM, default 2): NVIDIA/nccl v2.31.2-1
            # src/transport/net_ib/connect.cc, NCCL_PARAM(IbGidIndex, "IB_GID_INDEX", -1) and
            # NCCL_PARAM(IbRoceVersionNum, "IB_ROCE_VERSION_NUM", 2). One number would be wrong
            # for some port, so none is set and the version is said explicitly.
            env["NCCL_IB_ROCE_VERSION_NUM"] = "2"
        else:
            env["NCCL_IB_GID_INDEX"] = str(next(iter(indexes)))
    return env


def settings(derived: Mapping[str, str], profile_env: Mapping[str, str]) -> list[EnvSetting]:
    """What the engine gets for each derived key, and whether the profile overrode it."""
    out = []
    for name in DERIVED_KEYS:
        if name in profile_env:
            out.append(EnvSetting(name=name, value=profile_env[name], derived=derived.get(name, ""), overridden=True))
        elif name in derived:
            out.append(EnvSetting(name=name, value=derived[name], derived=derived[name]))
    return out


def apply(env: dict[str, str], derived: Mapping[str, str], profile_env: Mapping[str, str]) -> None:
    """Put the derived variables into `env` (the adapter's, which already holds the profile's),
    never over a key the profile set."""
    for name, value in derived.items():
        if name not in profile_env:
            env[name] = value
