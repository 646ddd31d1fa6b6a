"""The most one node's messages may report (`fleet.max_gpus`, `max_ports`, `max_shards`), and
why a message is over it, in words. Pure: the fleet service (fleet/limits.py re-exports these)
and the Register admission (server/admit.py) check with them.

Figures from issue 9's probe of the server before these limits: a Register with 100,000 GPUs
was accepted (+29 MB, kept until `ctl forget`).
"""

from __future__ import annotations

import msgspec

from llmgw.wire import messages as m


class Caps(msgspec.Struct, frozen=True, kw_only=True):
    """The most a node may report (`fleet.max_gpus`, `max_ports`, `max_shards`)."""

    gpus: int = 256  # the largest single-OS GPU boxes today hold 16; NVL72 trays hold 4
    ports: int = 256  # RDMA ports: 8-18 on a GPU node
    shards: int = 1024  # engines on one node


def register_problem(msg: m.Register, caps: Caps) -> str | None:
    """Why this Register is refused for its size, in words; None when it is within the caps."""
    inventory = msg.inventory
    problems = []
    if len(inventory.gpus) > caps.gpus:
        problems.append(f"{len(inventory.gpus):,} GPUs (fleet.max_gpus is {caps.gpus:,})")
    else:
        worst = max((len(g.nvlink) for g in inventory.gpus), default=0)
        if worst > caps.gpus:
            problems.append(f"a GPU with {worst:,} NVLink peers (fleet.max_gpus is {caps.gpus:,})")
    if len(inventory.ports) > caps.ports:
        problems.append(f"{len(inventory.ports):,} ports (fleet.max_ports is {caps.ports:,})")
    if len(msg.shards) > caps.shards:
        problems.append(f"{len(msg.shards):,} shards (fleet.max_shards is {caps.shards:,})")
    fabrics = fabrics_problem(msg.fabrics, msg.fabric_status, caps)
    if fabrics is not None:
        problems.append(fabrics)
    if not problems:
        return None
    return "the Register reports " + " and ".join(problems) + "; raise the limit in the server config if this is real"


# Counters one port may report (sysfs.MAX_COUNTERS: mlx5 has ~30): each is a /metrics series.
MAX_PORT_COUNTERS = 64


def fabrics_problem(fabrics: list[m.FabricDecl], statuses: list[m.FabricStatus], caps: Caps) -> str | None:
    """Fabrics are declared per adapter: more of them than ports (or lines of reasons) is made up."""
    worst = max((len(s.problems) + len(s.ports) for s in statuses), default=0)
    if max(len(fabrics), len(statuses)) > caps.ports or worst > 2 * caps.ports:
        return (f"{max(len(fabrics), len(statuses)):,} fabrics with up to {worst:,} ports and reasons each "
                f"(fleet.max_ports is {caps.ports:,})")
    return None


def heartbeat_problem(msg: m.Heartbeat, caps: Caps) -> str | None:
    if len(msg.gpus) > caps.gpus or len(msg.ports) > caps.ports:
        return (f"a Heartbeat with {len(msg.gpus):,} GPUs and {len(msg.ports):,} ports "
                f"(fleet.max_gpus is {caps.gpus:,}, fleet.max_ports {caps.ports:,})")
    if msg.shards is not None and len(msg.shards) > caps.shards:
        return f"a Heartbeat listing {len(msg.shards):,} shards (fleet.max_shards is {caps.shards:,})"
    counters = max((max(len(p.counters), len(p.hw_counters)) for p in msg.ports), default=0)
    if counters > MAX_PORT_COUNTERS:
        return f"a Heartbeat with a port of {counters:,} counters (at most {MAX_PORT_COUNTERS})"
    return None
