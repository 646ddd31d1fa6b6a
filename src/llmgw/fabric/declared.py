"""Declared fabrics checked against the ports a node really has. Pure: ports in, verdicts out.

Fabric membership is configuration (a subnet prefix proves nothing about which cables go
where), but a declaration cannot make an adapter exist or a port come up. An NCCL job given an
adapter whose port is not ACTIVE does not fail at once: it hangs in its first collective. So a
fabric is advertised only when every adapter it declares exists and has an ACTIVE port of the
fabric's link layer; otherwise it is left out, with one line per adapter saying why.

Port states (kernel enum ib_port_state, phys state in brackets) and what they mean here:
ACTIVE (LinkUp) usable; INIT (LinkUp) the link is up but no subnet manager configured it;
ARMED the SM has not activated it yet; DOWN (Polling) no cable or nothing at the far end;
DOWN (Disabled) someone disabled it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from llmgw.fabric.sysfs import natural_key
from llmgw.wire.messages import FabricDecl, FabricStatus, Port, PortCounters

LINK_LAYER = {"infiniband": "InfiniBand", "roce": "Ethernet"}


def explain_state(state: str, phys_state: str) -> str:
    """Why a port that is not ACTIVE cannot carry traffic, for people."""
    state_u = state.upper() or "UNKNOWN"
    phys = f" ({phys_state})" if phys_state else ""
    if state_u == "INIT":
        return f"INIT{phys}: no subnet manager has brought it up"
    if state_u == "ARMED":
        return f"ARMED{phys}: the subnet manager has not activated it yet"
    if state_u == "DOWN" and phys_state.lower() == "polling":
        return "DOWN (Polling): no cable, or nothing at the far end"
    if state_u == "DOWN" and phys_state.lower() == "disabled":
        return "DOWN (Disabled): the port is disabled"
    return f"{state_u}{phys}"


def with_live(ports: Sequence[Port], live: Sequence[PortCounters]) -> list[Port]:
    """The inventory's ports with state, phys state and rate from a fresh reading. A port the
    reading no longer has is gone (its adapter was removed or its driver unloaded)."""
    fresh = {(c.device, c.port): c for c in live}
    out: list[Port] = []
    for port in ports:
        now = fresh.get((port.device, port.port))
        if now is None:
            continue
        out.append(msgspec.structs.replace(port, state=now.state, phys_state=now.phys_state, rate_gbps=now.rate_gbps))
    return out


def check_fabric(decl: FabricDecl, ports: Sequence[Port]) -> FabricStatus:
    status = FabricStatus(name=decl.name, kind=decl.kind, devices=list(decl.devices))
    layer = LINK_LAYER.get(decl.kind)
    if layer is None:
        # An Ethernet (sockets) fabric: nothing RDMA to check; its interfaces are the operator's word.
        status.usable = True
        return status
    by_device: dict[str, list[Port]] = {}
    for port in ports:
        by_device.setdefault(port.device, []).append(port)
    explicit = bool(decl.devices)
    devices = list(decl.devices) if explicit else sorted(
        (d for d, ps in by_device.items() if any(p.link_layer == layer for p in ps)), key=natural_key
    )
    if not devices:
        status.problems.append(f"no {layer} adapters on this node")
        return status
    usable: list[Port] = []
    for device in devices:
        mine = sorted(by_device.get(device, []), key=lambda p: p.port)
        if not mine:
            status.problems.append(f"{device}: no such adapter on this node")
            continue
        of_layer = [p for p in mine if p.link_layer == layer]
        if not of_layer:
            status.problems.append(
                f"{device}: its ports are {', '.join(sorted({p.link_layer for p in mine}))}, "
                f"the fabric is {decl.kind} ({layer})"
            )
            continue
        active = [p for p in of_layer if p.state.upper() == "ACTIVE"]
        if not active:
            status.problems.append(
                f"{device}: no ACTIVE port ("
                + "; ".join(f"port {p.port} {explain_state(p.state, p.phys_state)}" for p in of_layer)
                + ")"
            )
            continue
        usable.extend(active)
    if not explicit and usable:
        usable = _one_subnet(usable, status.problems)
    status.ports = [f"{p.device}:{p.port}" for p in usable]
    status.rate_gbps = min((p.rate_gbps for p in usable), default=0.0)
    # Declared adapters: all of them or the fabric is not advertised (a job would hang on the
    # missing one). Found ones (no devices declared): whichever are up.
    status.usable = bool(usable) and (not explicit or not status.problems)
    return status


def _subnet(port: Port) -> tuple[str, int]:
    """What tells one subnet from another on a port: the subnet prefix (the first 64 bits of
    /sys/class/infiniband/<dev>/ports/<n>/gids/0) and the LID of the SM that manages it
    (ports/<n>/sm_lid). The prefix alone is not enough: most subnets keep the default fe80::."""
    prefix = ":".join(port.gid.split(":")[:4]) if port.gid.count(":") >= 4 else ""
    return prefix, port.sm_lid


def _one_subnet(ports: list[Port], problems: list[str]) -> list[Port]:
    """Found adapters (none declared): the ports of one subnet, never two in one NCCL_IB_HCA (a
    storage HCA or a second fabric's would hang the first collective that crosses them). The
    subnet with the most ports wins, then the fastest, then the one of the first adapter."""
    if ports[0].link_layer != "InfiniBand":
        return ports  # RoCE: Ethernet has no SM; its subnets are IP routing's business
    groups: dict[tuple[str, int], list[Port]] = {}
    for port in ports:
        groups.setdefault(_subnet(port), []).append(port)
    if len(groups) == 1:
        return ports
    order = {id(p): i for i, p in enumerate(ports)}
    best = min(groups.values(), key=lambda g: (-len(g), -min(p.rate_gbps for p in g), order[id(g[0])]))
    left = [p for p in ports if p not in best]
    first = best[0]
    problems.append(f"left out, on another subnet than {first.device}:{first.port} (SM lid {first.sm_lid}): "
                    + ", ".join(f"{p.device}:{p.port} (SM lid {p.sm_lid})" for p in left))
    return best


class Declared(Protocol):
    """A fabric as a config declares it (the catalog's FabricDecl): read, never imported, so that
    the catalog and the fleet protocol stay apart (issue 42)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def devices(self) -> Sequence[str]: ...


def from_config(decls: Sequence[Declared]) -> list[FabricDecl]:
    """The agent config's fabrics as the fleet protocol carries them."""
    return [FabricDecl(name=d.name, kind=d.kind, devices=list(d.devices)) for d in decls]


def check_fabrics(decls: Sequence[FabricDecl], ports: Sequence[Port]) -> list[FabricStatus]:
    return [check_fabric(decl, ports) for decl in decls]


def advertised(statuses: Sequence[FabricStatus]) -> list[FabricDecl]:
    """The fabrics a node advertises: the usable ones, as declared."""
    return [FabricDecl(name=s.name, kind=s.kind, devices=list(s.devices)) for s in statuses if s.usable]


def describe(status: FabricStatus) -> str:
    """One line for the node's log and `ctl nodes`: `ib: not usable: mlx5_3: no such adapter`."""
    if status.usable:
        rate = f", {status.rate_gbps:g} Gb/s" if status.rate_gbps else ""
        left = f"; left out: {'; '.join(status.problems)}" if status.problems else ""
        return f"{status.name}: usable ({', '.join(status.ports) or 'sockets'}{rate}){left}"
    return f"{status.name}: not usable: {'; '.join(status.problems) or 'no usable adapter'}"


def placement_view(fabrics: Sequence[FabricDecl], statuses: Sequence[FabricStatus],
                   ports: Sequence[PortCounters]) -> tuple[list[str], dict[str, str]]:
    """What multi-node placement may use on a node: the fabrics it advertises whose ports are
    all ACTIVE in its latest heartbeat, and why each other declared fabric is not usable."""
    live = {f"{p.device}:{p.port}": p for p in ports}
    by_name = {s.name: s for s in statuses}
    usable: list[str] = []
    notes: dict[str, str] = {}
    for status in statuses:
        if not status.usable:
            notes[status.name] = "; ".join(status.problems) or "no usable adapter"
    for fabric in fabrics:
        found = by_name.get(fabric.name)
        names = found.ports if found is not None else []
        down = [f"{n} {live[n].state}" for n in names if n in live and live[n].state.upper() != "ACTIVE"]
        if down:
            notes[fabric.name] = "ports not ACTIVE: " + ", ".join(down)
        else:
            usable.append(fabric.name)
    return usable, notes


def fabric_devices(statuses: Sequence[FabricStatus]) -> dict[str, list[str]]:
    """Each usable fabric's adapters (`ib` → [mlx5_0, mlx5_1]), from the ports its verdict lists
    (`mlx5_0:1`; a port other than 1 is `mlx5_0/2`, as the fabric map names it): where multi-node
    placement reads the node in the map."""
    out: dict[str, list[str]] = {}
    for status in statuses:
        if status.usable and status.ports:
            names = set()
            for port in status.ports:
                device, _, number = port.rpartition(":")
                names.add(device if number == "1" else f"{device}/{number}" if device else port)
            out[status.name] = sorted(names, key=natural_key)
    return out
