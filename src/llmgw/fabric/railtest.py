"""`ctl fabric-test A B`'s pure core: which adapter of A is tested against which of B, and the grade.

Pairing follows NCCL's rail-to-rail rule (NCCL_CROSS_NIC=0, its default on rail-optimised fabrics):
the Nth usable port of a fabric on A talks to the Nth usable port of the same fabric on B. The usable
ports are the ones the agents advertise (FabricStatus.ports, in NCCL_IB_HCA order), so the test
measures exactly the links a multi-node engine would use; a port left out of a fabric (down,
missing) is the doctor's finding, and here a rail with no partner, graded crit.

Each rail is graded against what the slower of its two ports can carry (fabric/linkrate.py): the
port's data rate, not the figure sysfs prints (4X QDR prints 40 and carries 32 after 8b/10b; 4X
FDR prints 56 and carries 54.5 after 64b/66b), capped by the HCA's PCIe link where the agent read
it (an EDR card in an x8 gen3 slot moves 57.6 Gb/s, not 100: graded against 57.6, and the detail
says "limited by PCIe gen3 x8" instead of blaming the cable). Then verdict.grade_ratio: ok ≥ 90 %,
warn ≥ 70 %, crit below or when the run failed. 90 % because a healthy link measures 92-98 % of its
data rate with ib_write_bw (tests/fixtures/real/perftest: 392.34 of 400 Gb/s NDR, 92.40 of 100 Gb/s
RoCE, 196.69 of 200 Gb/s NDR200, 50.61 of FDR's 54.5). Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from llmgw.fabric.linkrate import Capacity
from llmgw.fabric.perftest import Table
from llmgw.verdict import Status, exit_code, grade_ratio, worst
from llmgw.wire.messages import FabricStatus


class Rail(msgspec.Struct, frozen=True, kw_only=True):
    index: int  # 0-based, across fabrics
    fabric: str
    kind: str  # infiniband | roce
    a: str  # "mlx5_0:1", the client side
    b: str  # the server side ("" when A's port has no partner)
    expected_gbps: float = 0.0  # what the slower port can carry (its link's data rate, or its PCIe link's)
    a_gbps: float = 0.0  # each port's own link data rate
    b_gbps: float = 0.0
    link_gbps: float = 0.0  # the slower link's data rate (expected_gbps unless PCIe is lower)
    limit: str = ""  # what sets expected_gbps when it is not the link: "PCIe gen3 x8 on B (57.6 Gb/s; ...)"
    # how the link figure was reached, where its encoding costs: "40 Gb/s signalling, 8b/10b carries 32"
    basis: str = ""

    @property
    def name(self) -> str:
        return f"{self.fabric}#{self.index}"


class RailResult(msgspec.Struct, kw_only=True, omit_defaults=False):
    rail: int
    fabric: str
    a: str
    b: str
    measured_gbps: float | None = None
    peak_gbps: float | None = None
    expected_gbps: float = 0.0
    ratio: float | None = None
    status: str = Status.UNKNOWN.value
    detail: str = ""  # why not ok, one line
    limited_by: str = ""  # what caps expected_gbps below the link: "PCIe gen3 x8 on B (57.6 Gb/s of payload)"
    size: int = 0  # the message size measured
    duration: float = 0.0
    notes: list[str] = []  # what the agents said on the way (perftest installed, GID index chosen)


def split_port(name: str) -> tuple[str, int]:
    """`mlx5_0:1` → ("mlx5_0", 1)."""
    device, _, number = name.partition(":")
    return device, int(number) if number.isdigit() else 1


def _capacity(value: float | Capacity | None) -> Capacity:
    if isinstance(value, Capacity):
        return value
    return Capacity(gbps=float(value or 0.0), link_gbps=float(value or 0.0))


def _limit(ca: Capacity, cb: Capacity) -> tuple[float, float, str, str]:
    """(expected, the link's figure, what limits it beyond the link, how the link figure was reached)."""
    ends = [(side, c) for side, c in (("A", ca), ("B", cb)) if c.gbps > 0]
    if not ends:
        return 0.0, 0.0, "", ""
    side, slow = min(ends, key=lambda e: e[1].gbps)
    link = min(c.link_gbps for _, c in ends)
    limit = ""
    if slow.gbps < link:
        limit = f"PCIe {slow.pcie} on {side} ({slow.pcie_gbps:g} Gb/s of payload"
        limit += f"; the card can do {slow.pcie_max}: check the slot or riser)" if slow.pcie_max else ")"
    basis = ""
    enc = next((c for _, c in ends if c.encoding and c.link_gbps == link), None)
    if enc is not None:
        basis = f"{enc.signalling_gbps:g} Gb/s signalling, {enc.encoding} carries {enc.link_gbps:g}"
    return slow.gbps, link, limit, basis


def pair_rails(a: Sequence[FabricStatus], b: Sequence[FabricStatus],
               a_rates: Mapping[str, float | Capacity], b_rates: Mapping[str, float | Capacity]
               ) -> tuple[list[Rail], list[str]]:
    """The rails between two nodes, in test order, and why there are none (one line each).

    `a_rates` / `b_rates`: "mlx5_0/1" → what the port carries (linkrate.capacity of its latest
    heartbeat's rate and its HCA's PCIe link; a bare number is taken as the data rate).
    Ethernet (TCP-only) fabrics have no RDMA rail to test.
    """
    rails: list[Rail] = []
    problems: list[str] = []
    b_by_name = {s.name: s for s in b if s.usable and s.kind in ("infiniband", "roce")}
    index = 0
    for fabric in a:
        if not fabric.usable or fabric.kind not in ("infiniband", "roce"):
            continue
        other = b_by_name.get(fabric.name)
        if other is None:
            problems.append(f"fabric {fabric.name}: usable on A, not on B")
            continue
        for i in range(max(len(fabric.ports), len(other.ports))):
            pa = fabric.ports[i] if i < len(fabric.ports) else ""
            pb = other.ports[i] if i < len(other.ports) else ""
            ca = _capacity(a_rates.get(pa.replace(":", "/")) if pa else None)
            cb = _capacity(b_rates.get(pb.replace(":", "/")) if pb else None)
            expected, link, limit, basis = _limit(ca, cb)
            rails.append(Rail(index=index, fabric=fabric.name, kind=fabric.kind, a=pa, b=pb, expected_gbps=expected,
                              a_gbps=ca.link_gbps, b_gbps=cb.link_gbps, link_gbps=link, limit=limit, basis=basis))
            index += 1
    if not rails and not problems:
        problems.append("no usable InfiniBand or RoCE fabric on both nodes")
    return rails, problems


def grade(rail: Rail, table: Table | None, error: str = "", *, ok_at: float = 0.9, warn_at: float = 0.7) -> RailResult:
    """One rail's result: the client's table against the rail's expected rate."""
    out = RailResult(rail=rail.index, fabric=rail.fabric, a=rail.a, b=rail.b, expected_gbps=rail.expected_gbps,
                     limited_by=rail.limit)
    if not rail.a or not rail.b:
        out.status = Status.CRIT.value
        missing = "A" if not rail.a else "B"
        out.detail = f"no partner on {missing}: the fabric has fewer usable ports there (see `ctl doctor`)"
        return out
    if error:
        out.status = Status.CRIT.value
        out.detail = error
        return out
    best = table.result if table is not None else None
    if best is None:
        out.status = Status.CRIT.value
        extra = f" ({table.warnings[-1]})" if table is not None and table.warnings else ""
        out.detail = "ib_write_bw printed no result row" + extra
        return out
    out.measured_gbps = best.average_gbps
    out.peak_gbps = best.peak_gbps if best.peak_gbps > 0 or table is None or table.peak_measured else None
    out.size = best.size
    status = grade_ratio(best.average_gbps, rail.expected_gbps, ok_at=ok_at, warn_at=warn_at)
    out.status = status.value
    if rail.expected_gbps > 0:
        out.ratio = round(best.average_gbps / rail.expected_gbps, 4)
    if status is Status.UNKNOWN:
        out.detail = "the ports' rate is not known (no heartbeat reading): measured, not graded"
    elif status is not Status.OK:
        if rail.limit:
            out.detail = (f"{best.average_gbps:g} Gb/s is {out.ratio:.0%} of the {rail.expected_gbps:g} Gb/s this rail "
                          f"carries (ok from {ok_at:.0%}), limited by {rail.limit}: check both ports' counters and "
                          "the HCA's PCIe errors (`ctl doctor`)")
        else:
            out.detail = (f"{best.average_gbps:g} Gb/s is {out.ratio:.0%} of the link's {rail.expected_gbps:g} Gb/s "
                          f"(ok from {ok_at:.0%}{'; ' + rail.basis if rail.basis else ''}): check the cable and both "
                          "ports' counters")
    elif rail.a_gbps > 0 and rail.b_gbps > 0 and rail.a_gbps != rail.b_gbps:
        # The rail carries what its slower port allows, but one end runs below the other: a
        # degraded cable (1X instead of 4X) looks exactly like this.
        out.status = Status.WARN.value
        slow = ("A", rail.a, rail.a_gbps) if rail.a_gbps < rail.b_gbps else ("B", rail.b, rail.b_gbps)
        out.detail = (f"the ports differ: {slow[1]} on {slow[0]} runs at {slow[2]:g} Gb/s, its partner at "
                      f"{max(rail.a_gbps, rail.b_gbps):g} (a degraded link?); measured {best.average_gbps:g} Gb/s")
    elif rail.limit:
        # Healthy for what it can carry, and the operator hears what that is: not the cable, the slot.
        out.detail = f"limited by {rail.limit}, not by the link ({rail.link_gbps:g} Gb/s)"
    return out


def overall(results: Sequence[RailResult]) -> tuple[str, int]:
    """The run's status and exit code (Nagios): the worst rail's; no rail at all is unknown."""
    if not results:
        return Status.UNKNOWN.value, exit_code([Status.UNKNOWN])
    statuses = [Status(r.status) for r in results]
    return worst(statuses).value, exit_code(statuses)


# ---- the rules the server holds each side to (issue 40, findings 6 and 7) -------------------------

# The TCP ports B's answer may name for its ib_write_bw server. perftest's default is 18515 and the
# agent picks one the kernel hands out (Linux: 32768-60999); below 1024 is a system service (ssh on
# 22, a resolver on 53), which A's client must never be sent to.
TCP_PORTS = range(1024, 65536)


def client_target(b: str, registered_host: str, tcp_port: object) -> tuple[str, int, str]:
    """Where A's ib_write_bw client dials: (host, port, "") or ("", 0, why not, one line).

    The host is the server's record of B (its registered endpoint host: the advertise_host the
    server accepted, or the address its stream comes from), never anything B's answer says; the
    port is the one B's agent answered, if it is a TCP port an unprivileged ib_write_bw listens on.
    """
    if type(tcp_port) is not int or tcp_port not in TCP_PORTS:
        shown = repr(tcp_port)[:40]
        return "", 0, (f"{b} answered TCP port {shown} for its ib_write_bw server: outside "
                       f"{TCP_PORTS.start}-{TCP_PORTS.stop - 1}, so it is not passed to the client; refused")
    host = registered_host.strip()
    if not host or host.startswith("-") or any(c.isspace() for c in host):
        return "", 0, f"the server has no usable address on record for {b} (got {host[:60]!r}); refused"
    return host, tcp_port, ""


class Phase(msgspec.Struct, kw_only=True):
    """One wait of a fabric test, its deadline fixed when it starts (times are the caller's clock).

    `deadline` is when the wait gives up: the run's own timeout plus a grace. A phase that may
    install perftest (prepare) has a `ceiling` too, also fixed at the start: the agent's first
    "progress" (installing) moves the deadline there, and nothing moves it past. Before this a
    node sending "progress" every few minutes held the test, and every test behind it, forever.
    """

    name: str  # "prepare", "ready", "client", "server done": what the operator reads
    started: float
    deadline: float
    ceiling: float

    @property
    def seconds(self) -> float:
        """How long the phase may last, as it stands now."""
        return self.deadline - self.started

    def progressed(self) -> None:
        """The agent said it is still at it (installing): the deadline is now the ceiling."""
        self.deadline = max(self.deadline, self.ceiling)


def phase(name: str, now: float, within: float, grace: float, install: float = 0.0) -> Phase:
    """A phase starting at `now` that has `within` (+ `grace`) seconds, or up to `install` seconds
    from `now` once the agent says it is installing."""
    deadline = now + max(within, 0.0) + max(grace, 0.0)
    return Phase(name=name, started=now, deadline=deadline, ceiling=max(deadline, now + max(install, 0.0)))


def lock_order(*nodes: str) -> list[str]:
    """The order a test takes its nodes' locks in: by name, so two tests sharing nodes never each
    hold one the other waits for (A→B beside B→A)."""
    return sorted(set(nodes))
