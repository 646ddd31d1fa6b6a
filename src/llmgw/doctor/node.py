"""Doctor's checks of one node: findings from its facts, no I/O.

Each check returns one finding when all is well and one per problem otherwise, so that `--quiet`
(cron mail) prints one line per problem. Thresholds state their reason beside them.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from llmgw.doctor.facts import Finding, NodeFacts
from llmgw.doctor.gpu import GPU_CHECKS, no_gpu_readings
from llmgw.doctor.hwcounters import hw_rises
from llmgw.doctor.xid import explain as explain_xid
from llmgw.fabric.declared import explain_state
from llmgw.verdict import Status, grade_ratio
from llmgw.wire import messages as m

OK, WARN, CRIT, UNKNOWN = Status.OK, Status.WARN, Status.CRIT, Status.UNKNOWN

GIB = 1024**3
# A heartbeat late by two intervals is a slow or overloaded agent; the registry calls the node
# unreachable after `unreachable_after` (3) intervals.
LATE_HEARTBEATS = 2.0
# Certificates: the CA issues node certificates for months; two weeks leaves time to reissue,
# three days is an outage waiting for a weekend.
CERT_WARN_DAYS = 14.0
CERT_CRIT_DAYS = 3.0
# Clock skew: TLS and tokens tolerate minutes, but event times and logs of two nodes stop lining
# up beyond a second or two; NTP keeps a node within milliseconds.
SKEW_WARN = 2.0
SKEW_CRIT = 60.0
# Model cache: a 70B model is ~140 GB; below 10 % (or 10 GiB) the next download may not fit.
DISK_WARN_PCT, DISK_WARN_BYTES = 0.10, 10 * GIB
DISK_CRIT_PCT, DISK_CRIT_BYTES = 0.03, 2 * GIB
# Error counters that mean a bad cable, transceiver or port when they rise (perfquery's names).
ERROR_COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
                  "port_rcv_remote_physical_errors", "local_link_integrity_errors",
                  "excessive_buffer_overrun_errors")


class NodeContext(msgspec.Struct, kw_only=True):
    """What a node's checks need from the rest of the fleet: each fabric's rate (its fastest
    ACTIVE port anywhere, the rate its cables are meant to run at)."""

    fabric_rates: dict[str, float] = {}


NodeCheck = Callable[[NodeFacts, NodeContext], list[Finding]]


def _f(n: NodeFacts, check: str, status: Status, finding: str, action: str = "", subject: str = "") -> Finding:
    return Finding(node=n.id, check=check, status=status, finding=finding, action=action if status != OK else "",
                   subject=subject)


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _old_agent(n: NodeFacts, check: str, what: str) -> list[Finding]:
    return [_f(n, check, UNKNOWN, f"the agent does not report {what} (older than this server?)",
               "upgrade llmgw on the node and restart the agent")]


# ---- the agent itself -------------------------------------------------------------------------


def check_agent(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    action = ("on the node: systemctl status llmgw-agent; journalctl -u llmgw-agent; "
              "`llmgw ctl forget " + n.id + "` if it is gone for good")
    if not n.connected or n.state != "ready":
        return [_f(n, "agent", CRIT, f"agent {n.state}" + (f": {n.reason}" if n.reason else ""), action)]
    age = n.last_heartbeat_age
    if age is None:
        return [_f(n, "agent", OK, "connected; no heartbeat yet")]
    if age > LATE_HEARTBEATS * n.heartbeat_interval:
        return [_f(n, "agent", WARN, f"last heartbeat {age:.0f}s ago (expected every {n.heartbeat_interval:g}s)",
                   "the agent or its host is overloaded, or the network drops its stream: check the agent's log")]
    return [_f(n, "agent", OK, f"connected, last heartbeat {age:.1f}s ago")]


# ---- GPUs ---------------------------------------------------------------------------------------


def check_nvml(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    inv = n.inventory
    count = len(inv.gpus)
    if inv.gpu_source == "sim":
        driver = f", driver {inv.gpu_driver}" if inv.gpu_driver else ""
        return [_f(n, "nvml", OK, f"simulated GPUs ({count}, `llmgw sim node`){driver}")]
    if inv.gpu_source == "nvml":
        if not inv.gpu_driver:
            return _old_agent(n, "nvml", f"the NVIDIA driver version (NVML reachable, {count} GPUs)")
        return [_f(n, "nvml", OK, f"NVML reachable: {count} GPUs, driver {inv.gpu_driver}")]
    if inv.gpu_source == "none":
        if inv.gpu_note.startswith("CPU-only"):
            return [_f(n, "nvml", OK, inv.gpu_note)]
        return [_f(n, "nvml", UNKNOWN, f"NVML not reachable: {inv.gpu_note or 'no reason given'}",
                   "install the NVIDIA driver and nvidia-ml-py; `nvidia-smi` must work as the agent's user "
                   "(or set discovery.gpus: none on a CPU-only node)")]
    return _old_agent(n, "nvml", "where its GPUs come from")


def check_gpu_health(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    empty = no_gpu_readings(n, "gpu-health")
    if empty is not None:
        return empty
    readings = {h.index: h for h in n.gpus or []}
    out: list[Finding] = []
    drain = f"move work off {n.id}, then nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT; reset or RMA"
    for gpu in n.inventory.gpus:
        subject = f"GPU {gpu.index}"
        h = readings.get(gpu.index)
        if h is None:
            out.append(_f(n, "gpu-health", CRIT, f"{subject} is in the inventory but not in NVML's readings "
                          "(fallen off the bus?)", drain, subject))
            continue
        if h.health != "ok":
            out.append(_f(n, "gpu-health", CRIT, f"{subject} {h.health}", drain, subject))
        if h.ecc_uncorrected:
            out.append(_f(n, "gpu-health", CRIT, f"{subject}: {h.ecc_uncorrected} uncorrected ECC errors", drain,
                          subject))
        if h.xid:
            xid = explain_xid(h.xid)
            out.append(_f(n, "gpu-health", xid.status, f"{subject}: Xid {h.xid} ({xid.meaning})", xid.action, subject))
    if out:
        return out
    unread = [h.index for h in readings.values() if h.ecc_uncorrected is None]
    note = "" if not unread else ("; ECC not reported" if len(unread) == len(readings) else
                                  f"; ECC not reported for GPU {', '.join(map(str, unread))}")
    if readings and all(h.xid is None for h in readings.values()):
        note += "; Xids not reported (no NVML Xid events on this node)"
    return [_f(n, "gpu-health", OK, f"{len(n.inventory.gpus)} GPUs healthy, no uncorrected ECC errors or Xids{note}")]


def check_nvlink(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    linked = [g for g in n.inventory.gpus if g.nvlink]
    empty = no_gpu_readings(n, "nvlink")
    if empty is not None:
        return empty
    if not linked:
        return [_f(n, "nvlink", OK, "no NVLink (GPUs on PCIe)")]
    readings = {h.index: h for h in n.gpus or []}
    if all(readings.get(g.index) is None or readings[g.index].nvlink_down is None for g in linked):
        return _old_agent(n, "nvlink", "NVLink link states")
    out: list[Finding] = []
    for g in linked:
        h = readings.get(g.index)
        if h is not None and h.nvlink_down:
            out.append(_f(n, "nvlink", CRIT, f"GPU {g.index}: {h.nvlink_down} NVLink links down",
                          "nvidia-smi nvlink --status; drain the node and reset the GPUs (nvidia-smi -r) "
                          "or the NVSwitch fabric",
                          f"GPU {g.index}"))
    totals = {g.index: sum(g.nvlink.values()) for g in linked}
    most = max(totals.values())
    for index, total in sorted(totals.items()):
        if total < most:
            out.append(_f(n, "nvlink", WARN,
                          f"GPU {index} reaches its peers over {total} NVLinks, the others over {most}",
                          "nvidia-smi topo -m; a link trained down at boot: reboot, then the board's service",
                          f"GPU {index}"))
    return out or [_f(n, "nvlink", OK, f"{len(linked)} GPUs, all NVLinks up")]


# ---- adapters and ports ---------------------------------------------------------------------------


def _reading(n: NodeFacts) -> dict[str, m.PortCounters]:
    return {f"{p.device}/{p.port}": p for p in n.ports}


def _declared(n: NodeFacts) -> dict[str, str]:
    """Declared adapter → the fabric that declares it."""
    return {device: f.name for f in n.fabric_status for device in f.devices}


def check_adapters(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    declared = _declared(n)
    if not declared:
        return [_f(n, "adapters", OK, "no RDMA adapter declared in the agent's fabrics")]
    present = {p.device for p in n.inventory.ports}
    out = [_f(n, "adapters", CRIT, f"{device} is declared in fabric {fabric} but this node has no such adapter",
              f"lspci | grep -i mellanox; ibv_devices: a dead or unseated HCA, or its driver not loaded "
              f"(modprobe mlx5_ib); or take {device} out of the agent's fabrics", device)
           for device, fabric in sorted(declared.items()) if device not in present]
    return out or [_f(n, "adapters", OK, f"{len(declared)} declared adapters present")]


def check_ports(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    if not n.inventory.ports:
        return [_f(n, "ports", OK, "no RDMA ports")]
    live = _reading(n)
    declared = _declared(n)
    out: list[Finding] = []
    for port in n.inventory.ports:
        key = f"{port.device}/{port.port}"
        now = live.get(key)
        state = (now.state if now is not None and now.state else port.state).upper()
        phys = now.phys_state if now is not None and now.phys_state else port.phys_state
        if state == "ACTIVE":
            continue
        why = explain_state(state, phys)
        where = f"fabric {declared[port.device]}" if port.device in declared else "no declared fabric"
        if port.link_layer.lower() == "ethernet" and state in ("INIT", "ARMED"):
            # RoCE has no subnet manager: the port's state follows its netdev (carrier, the switch
            # port, the VLAN); NCCL's RoCE traffic also needs the lossless class (PFC/ECN) end to end.
            out.append(_f(n, "ports", CRIT if port.device in declared else WARN,
                          f"{key} {state} ({phys or 'unknown'}) on Ethernet (RoCE) ({where})",
                          f"check the link of {port.device}'s netdev (`ip link`, `ethtool`), the switch port and "
                          "its LLDP neighbour, and PFC/ECN on the lossless priority (`mlnx_qos -i <netdev>`)", key))
        elif state == "INIT":
            out.append(_f(n, "ports", CRIT, f"{key} {why} ({where})",
                          "start a subnet manager on this fabric (opensm on a switch or node; `sminfo` "
                          "through the port says whether one answers)", key))
        elif state == "ARMED":
            out.append(_f(n, "ports", WARN, f"{key} {why} ({where})", "the subnet manager is mid-sweep: check again in "
                          "a minute, else its log", key))
        else:
            out.append(_f(n, "ports", CRIT if port.device in declared else WARN, f"{key} {why} ({where})",
                          f"ibstat {port.device}; check the cable and the switch port", key))
    return out or [_f(n, "ports", OK, f"{len(n.inventory.ports)} ports ACTIVE")]


def active_rates(n: NodeFacts) -> dict[str, list[tuple[str, float]]]:
    """Fabric → (port, rate) of this node's ACTIVE ports on the adapters the fabric declares."""
    live = _reading(n)
    declared = _declared(n)
    out: dict[str, list[tuple[str, float]]] = {}
    for port in n.inventory.ports:
        key = f"{port.device}/{port.port}"
        now = live.get(key)
        state = (now.state if now is not None and now.state else port.state).upper()
        rate = now.rate_gbps if now is not None and now.rate_gbps else port.rate_gbps
        if port.device in declared and state == "ACTIVE" and rate > 0:
            out.setdefault(declared[port.device], []).append((key, rate))
    return out


def check_port_rate(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    rates = active_rates(n)
    if not rates:
        return [_f(n, "port-rate", OK, "no ACTIVE port on a declared fabric")]
    out: list[Finding] = []
    for fabric, ports in sorted(rates.items()):
        expected = ctx.fabric_rates.get(fabric) or max(rate for _, rate in ports)
        for key, rate in ports:
            status = grade_ratio(rate, expected)
            if status != OK:
                out.append(_f(n, "port-rate", status,
                              f"{key} runs at {rate:g} Gb/s; fabric {fabric} runs at {expected:g}",
                              f"ibstat {key.split('/')[0]} shows its width and speed: reseat or replace the cable or "
                              f"transceiver (mlxlink -d {key.split('/')[0]} -c for the link's own view)", key))
    summary = ", ".join(f"{fabric} {max(r for _, r in ports):g} Gb/s" for fabric, ports in sorted(rates.items()))
    return out or [_f(n, "port-rate", OK, f"every port at its fabric's rate ({summary})")]


def _counter(p: m.PortCounters, name: str) -> int | None:
    if name in p.counters:
        return p.counters[name]
    value = getattr(p, name, None)
    return value if isinstance(value, int) else None


def check_counters(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    if not n.ports:
        return [_f(n, "counters", OK if not n.inventory.ports else UNKNOWN,
                   "no RDMA ports" if not n.inventory.ports else "no port reading yet")]
    if n.ports_before is None:
        return [_f(n, "counters", UNKNOWN, "one reading of the error counters so far: a rise shows from the next one",
                   "run doctor again in a minute")]
    before = {f"{p.device}/{p.port}": p for p in n.ports_before}
    known = {f"{p.device}/{p.port}": p for p in n.inventory.ports}
    out: list[Finding] = []
    old: list[str] = []
    for p in n.ports:
        key = f"{p.device}/{p.port}"
        earlier = before.get(key)
        rises: list[str] = []
        crit = False
        for name in ERROR_COUNTERS:
            now = _counter(p, name)
            then = _counter(earlier, name) if earlier is not None else None
            if now and then is not None and now > then:
                rises.append(f"{name} +{now - then}")
                crit = crit or name == "link_downed"
            elif now:
                old.append(f"{key} {name} {now}")
        port = known.get(key)  # RoCE and QP errors, as rates (issue 39)
        hw = hw_rises(p, earlier, n.window, port.netdev if port else "", port is None or port.link_layer == "Ethernet")
        if rises or hw.rises:
            status = CRIT if crit or hw.status == CRIT else WARN
            cable = (f"a cable, transceiver or port going bad: mlxlink -d {p.device} -p {p.port} -c; "
                     "perfquery -x to watch it; replace the cable before it drops the link")
            out.append(_f(n, "counters", status, f"{key}: {', '.join(rises + hw.rises)} in {n.window:.0f}s",
                          "; ".join(a for a in (cable if rises else "", hw.action) if a), key))
    if out:
        return out
    note = (f"; earlier errors, not rising: {', '.join(old[:4])}"
            + (f" and {len(old) - 4} more" if len(old) > 4 else "") if old else "")
    return [_f(n, "counters", OK, f"no error counter rising over {n.window:.0f}s{note}")]


# ---- the host -------------------------------------------------------------------------------------------


def check_memlock(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    h = n.host
    if h is None:
        return _old_agent(n, "memlock", "its memlock limit")
    if h.memlock_bytes is None:
        return [_f(n, "memlock", UNKNOWN, "the agent could not read its memlock limit",
                   "ulimit -l as the agent's user")]
    if h.memlock_bytes == m.MEMLOCK_UNLIMITED:
        return [_f(n, "memlock", OK, "memlock unlimited")]
    limit = _size(h.memlock_bytes)
    if not n.inventory.ports:
        return [_f(n, "memlock", OK, f"memlock {limit}; no RDMA adapters, so none is needed")]
    if h.rdma_simulated:
        return [_f(n, "memlock", OK, f"memlock {limit}; the adapters are simulated and pin no memory")]
    return [_f(n, "memlock", CRIT, f"memlock limited to {limit}: RDMA memory registration (NCCL over "
               "InfiniBand/RoCE) fails", "LimitMEMLOCK=infinity in the agent's systemd unit (deploy/), "
               "then restart the agent; its engines inherit the limit")]


def check_disk(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    h = n.host
    if h is None:
        return _old_agent(n, "disk", "the model cache's free space")
    if h.cache_free_bytes is None or not h.cache_total_bytes:
        return [_f(n, "disk", UNKNOWN, f"cannot read the free space of {h.model_cache or 'the model cache'}",
                   "df as the agent's user")]
    free, total = h.cache_free_bytes, h.cache_total_bytes
    pct = free / total
    text = f"model cache {h.model_cache}: {_size(free)} free of {_size(total)} ({pct:.0%})"
    action = f"remove weights no model uses from {h.model_cache}, or set model_cache to a larger disk"
    if free < DISK_CRIT_BYTES or pct < DISK_CRIT_PCT:
        return [_f(n, "disk", CRIT, text, action)]
    if free < DISK_WARN_BYTES or pct < DISK_WARN_PCT:
        return [_f(n, "disk", WARN, text, action)]
    return [_f(n, "disk", OK, text)]


def check_cert(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    days = n.cert_days_left
    if days is None:
        return [_f(n, "cert", OK, "no client certificate (the agent dials without mutual TLS)")]
    action = (f"`llmgw ctl cert node {n.id}` where the CA is, copy the certificate and key to the node, "
              "restart the agent")
    if days < 0:
        return [_f(n, "cert", CRIT,
                   f"certificate expired {-days:.1f} days ago: the server refuses it at the next connect", action)]
    if days < CERT_CRIT_DAYS:
        return [_f(n, "cert", CRIT, f"certificate expires in {days:.1f} days", action)]
    if days < CERT_WARN_DAYS:
        return [_f(n, "cert", WARN, f"certificate expires in {days:.1f} days", action)]
    return [_f(n, "cert", OK, f"certificate valid for {days:.0f} more days")]


def check_clock(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
    skew = n.clock_skew
    if skew is None:
        return _old_agent(n, "clock", "its clock in heartbeats")
    side = "behind" if skew > 0 else "ahead of"
    text = f"clock {abs(skew):.2f}s {side} the server's"
    action = "run chrony or ntpd on the node and the server (chronyc tracking shows the offset)"
    if abs(skew) >= SKEW_CRIT:
        return [_f(n, "clock", CRIT, text, action)]
    if abs(skew) >= SKEW_WARN:
        return [_f(n, "clock", WARN, text, action)]
    return [_f(n, "clock", OK, text)]


NODE_CHECKS: dict[str, NodeCheck] = {
    "agent": check_agent,
    "nvml": check_nvml,
    "gpu-health": check_gpu_health,
    "nvlink": check_nvlink,
    **GPU_CHECKS,
    "adapters": check_adapters,
    "ports": check_ports,
    "port-rate": check_port_rate,
    "counters": check_counters,
    "memlock": check_memlock,
    "disk": check_disk,
    "cert": check_cert,
    "clock": check_clock,
}
# What needs a server: with --local doctor runs on the node itself.
SERVER_ONLY = ("agent", "clock")


def fabric_rates(nodes: list[NodeFacts]) -> dict[str, float]:
    """Each fabric's rate: the fastest ACTIVE port on it anywhere in the fleet."""
    out: dict[str, float] = {}
    for n in nodes:
        for fabric, ports in active_rates(n).items():
            out[fabric] = max(out.get(fabric, 0.0), *(rate for _, rate in ports))
    return out
