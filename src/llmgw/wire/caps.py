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
    problems = _count_problems(len(inventory.gpus), len(inventory.ports), len(msg.shards), caps)
    if len(inventory.gpus) <= caps.gpus:
        worst = max((len(g.nvlink) for g in inventory.gpus), default=0)
        if worst > caps.gpus:
            problems.insert(0, f"a GPU with {worst:,} NVLink peers (fleet.max_gpus is {caps.gpus:,})")
    fabrics = fabrics_problem(msg.fabrics, msg.fabric_status, caps)
    if fabrics is not None:
        problems.append(fabrics)
    return _in_words(problems)


def _count_problems(gpus: int, ports: int, shards: int, caps: Caps) -> list[str]:
    problems = []
    if gpus > caps.gpus:
        problems.append(f"{gpus:,} GPUs (fleet.max_gpus is {caps.gpus:,})")
    if ports > caps.ports:
        problems.append(f"{ports:,} ports (fleet.max_ports is {caps.ports:,})")
    if shards > caps.shards:
        problems.append(f"{shards:,} shards (fleet.max_shards is {caps.shards:,})")
    return problems


def _in_words(problems: list[str]) -> str | None:
    if not problems:
        return None
    return "the Register reports " + " and ".join(problems) + "; raise the limit in the server config if this is real"


# -- the census: a Register's list lengths, read without building its entries ------------------
# A Register of 100,000 GPUs (3.5 MB, within fleet.max_message) decodes to some 400,000 small
# objects, ~22 MB. Built only to be refused, they cost more than the time: anything lasting that
# is allocated while they live (a parked task's wait, a timer) lands in their 1 MiB arenas, which
# then never go back to the OS: a refused Register kept ~1 MB of RSS, up to ~26 MB over 30 of
# them (issue 41). The census reads the same bytes into entries of 16 bytes that hold nothing.


class _Entry(msgspec.Struct, gc=False):
    """One entry of a counted list: any JSON object, its fields skipped."""


class _InventoryCensus(msgspec.Struct, gc=False):
    gpus: list[_Entry] = []
    ports: list[_Entry] = []


class RegisterCensus(msgspec.Struct, gc=False):
    """What the caps count in a Register, and who it says it is."""

    type: str = ""
    node_id: str = ""
    inventory: _InventoryCensus = msgspec.field(default_factory=_InventoryCensus)
    shards: list[_Entry] = []


_census_decoder = msgspec.json.Decoder(RegisterCensus)


def register_census(payload: bytes, caps: Caps) -> tuple[str, str] | None:
    """(node id, why) when `payload` is a Register over the GPU, port or shard caps, read without
    decoding its entries; None when it is not a Register, not one that shape, or within those
    caps (then the full decode and `register_problem` judge it, NVLink peers and fabrics too)."""
    try:
        census = _census_decoder.decode(payload)
    except msgspec.DecodeError:
        return None  # malformed or another shape: the real decode says what is wrong
    if census.type != "Register":
        return None
    counts = len(census.inventory.gpus), len(census.inventory.ports), len(census.shards)
    node_id = census.node_id
    del census  # its entries go before the answer is built: nothing lasting among them
    problem = _in_words(_count_problems(*counts, caps))
    return None if problem is None else (node_id, problem)


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
