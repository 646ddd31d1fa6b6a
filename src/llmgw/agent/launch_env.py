"""The environment each engine shard gets for its collectives (NCCL, Gloo). Pure.

Left alone, NCCL guesses: every IB adapter it finds (a down one or a storage rail included),
the first interface that is not `lo` or `docker*` for its bootstrap sockets, GID index 0 on
RoCE (a RoCE v1 link-local GID, not routable). Each guess hangs a multi-node engine in its first
collective. So the agent sets, from what it discovered on this node:

- `NCCL_IB_HCA`: the shard's fabric's usable adapter ports, `=mlx5_0:1,mlx5_1:1`. The leading
  `=` asks NCCL for exact names: its default is prefix matching, where `mlx5_1` also takes
  mlx5_10 .. mlx5_17 (NCCL docs, "Environment Variables").
- `NCCL_SOCKET_IFNAME` (`=name`, exact as above) and `GLOO_SOCKET_IFNAME` (a plain name: Gloo
  takes one interface): the interface holding this node's advertise_host, the address the server
  gives the other ranks as the master address when this node is rank 0 (one address per node for
  everything the ranks bootstrap on; netif.py). A multi-node launch where no interface holds it,
  or where the ranks' addresses cannot reach each other (a loopback one beside a routed one), is
  refused with the reason (`check_address`).
- `VLLM_HOST_IP` (vLLM and the simulated engine) or `SGLANG_HOST_IP` (SGLang): that same address.
  vLLM's `get_ip()` (vllm/utils/network_utils.py) returns VLLM_HOST_IP or else the source address
  of a route to 8.8.8.8, and its Ray executor matches the driver's IP against Ray's node IPs
  (vllm/envs.py: "If you are using multi-node inference, you should set this differently on each
  node"); SGLang's `get_local_ip_auto()` reads SGLANG_HOST_IP first (sglang/srt/utils/network.py).
  `VLLM_PORT` is not set: it is a base port vLLM counts up from for its internal ports (envs.py),
  and two shards on one node given the same one would race for them; unset, vLLM asks the
  kernel for free ports.
- `CUDA_DEVICE_ORDER=PCI_BUS_ID`, for every engine: the GPU indexes placement hands out (and
  CUDA_VISIBLE_DEVICES carries) are NVML's, in PCI bus order; CUDA's default order is
  FASTEST_FIRST, which renumbers the GPUs of a board that mixes models, and then a shard runs on
  GPUs placement gave another (vLLM warns of it: vllm/platforms/cuda.py `log_warnings`).
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
from llmgw.netaddr import choose_interface, is_loopback
from llmgw.wire.messages import EnvSetting, FabricStatus, Port, ShardSpec


class LaunchError(Exception):
    """The shard cannot get a working environment here; the message is what the operator sees
    (the supervisor turns it into a failed shard, as the engines' own LaunchError)."""


class LaunchFacts(msgspec.Struct):
    """What the agent knows when it launches: its fabrics' verdicts (latest heartbeat), its
    ports as discovered (GID tables), and its advertise_host with the interface holding it (read
    at the launch). Empty: nothing to derive."""

    fabrics: list[FabricStatus] = []
    ports: list[Port] = []
    interface: str = ""  # the interface holding `address` ("" when none does)
    address: str = ""  # advertise_host as the IP address that interface holds
    advertise_host: str = ""  # as the agent config says it (a name or an address)
    interfaces: dict[str, list[str]] = {}  # every interface's addresses, for the reasons


DERIVED_KEYS = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_GID_INDEX",
                "NCCL_IB_ROCE_VERSION_NUM", "NCCL_IB_TC", "VLLM_HOST_IP", "SGLANG_HOST_IP", "CUDA_DEVICE_ORDER")
# The variable each engine reads its own node's address from (see the module docstring).
HOST_IP_ENV = {"vllm": "VLLM_HOST_IP", "sim": "VLLM_HOST_IP", "sglang": "SGLANG_HOST_IP"}


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
                                  "(no IPv4 address on its interface?); NCCL would pick a GID the other nodes "
                                  "cannot reach")
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


def node_env(engine: str, facts: LaunchFacts) -> dict[str, str]:
    """The variables every rank gets from its node: the GPU order, and its address for the
    engine to announce (when an interface holds it)."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    name = HOST_IP_ENV.get(engine)
    if name and facts.interface and facts.address:
        env[name] = facts.address
    return env


def _where(facts: LaunchFacts) -> str:
    held = "; ".join(f"{name} {', '.join(addresses)}"
                     for name, addresses in sorted(facts.interfaces.items()) if addresses)
    return held or "none readable"


def check_address(spec: ShardSpec, facts: LaunchFacts) -> None:
    """Refuse a rank of a multi-node engine that could not bootstrap: its node's advertise_host
    on no interface here, rank 0's master address not the node's own, or a loopback address on
    one side of a pair of nodes (NCCL would bootstrap on lo and never reach the other)."""
    if spec.world <= 1:
        return
    host = facts.advertise_host or "(unset)"
    if not facts.interface:
        raise LaunchError(f"this node's advertise_host {host} is on no interface here (interfaces: {_where(facts)}); "
                          "the ranks of a multi-node engine bootstrap on it: set advertise_host in the agent config "
                          "to this node's address on the network the nodes share")
    master = spec.master_addr
    if spec.rank == 0:
        if master in (facts.advertise_host, facts.address):
            return
        name, _ = choose_interface(master, facts.interfaces)
        if name and name == facts.interface:
            return  # another address of the same interface (a name that resolves to several)
        where = f"on {name}" if name else "on no interface here"
        raise LaunchError(f"rank 0's master address {master} (from the server) is not this node's advertise_host "
                          f"{host} ({facts.address} on {facts.interface}) but {where}; the ranks would bootstrap on "
                          "two addresses: the server takes the master address from advertise_host (restart the "
                          "agent after changing it)")
    ours, theirs = is_loopback(facts.address), is_loopback(master)
    if ours and not theirs:
        raise LaunchError(f"this node's advertise_host {host} is a loopback address ({facts.interface}), but "
                          f"rank 0 is at {master}: NCCL and Gloo would bootstrap on {facts.interface} and never "
                          "reach it; set advertise_host to this node's address on the network the nodes share")
    if theirs and not ours:
        raise LaunchError(f"rank 0's node advertises a loopback address ({master}) as the master address, which "
                          f"this node ({facts.address}) cannot reach; set advertise_host on rank 0's node to its "
                          "address on the network the nodes share")


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


def prepare(spec: ShardSpec, facts: LaunchFacts, env: dict[str, str]) -> list[EnvSetting]:
    """Everything above for one launch: refuse a rank that could not bootstrap, put the derived
    variables into `env` (the adapter's, profile's included) and say what was set."""
    check_address(spec, facts)
    derived = derive(pick_fabric(spec.fabric, facts.fabrics), facts.ports, facts.interface)
    derived.update(node_env(spec.engine, facts))
    apply(env, derived, spec.env)
    return settings(derived, spec.env)
