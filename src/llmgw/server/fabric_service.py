"""The server's fabric map: which agent runs which fabric tool when, and what their output means.

Observe → decide → act, level-triggered like the rest of the control plane. Every TICK the service
looks at the connected agents that answer `Discover` (Register.features has `discover`) and their
active InfiniBand ports, and asks:

- `saquery SMIR` through one port per master subnet manager of each known fabric (one port, unless
  ports disagree on the master) every `fabric.sm_interval` (60 s), and through a few ports of no
  known fabric yet (UNKNOWN_PER_TICK), which is how fabrics are found;
- `ibnetdiscover` through one port of each fabric every `fabric.discover_interval` (5 min).

A port belongs to the fabric its last SMIR named, or to the fabric whose topology lists its
adapter's GUID. An agent runs one request at a time, so the service never has two out to one
node; a request unanswered after the tool's timeout (plus GRACE) is forgotten and asked again
next interval. Results are matched to the request by id and node: an unsolicited one is dropped.
Parsing runs off the event loop (`trio.to_thread`): a 4,000-node dump takes about a second.

Fabric identity and subnet-manager problems come from llmgw.fabric.subnet; every master change a
port reports and every SM GUID's fabric are kept in fabric.sqlite (server/fabric_store.py).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.catalog.schema import FabricSettings
from llmgw.fabric.analysis import FabricMap, analyse
from llmgw.fabric.crosscheck import OwnPort, cross_check
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.fabric.locality import Place, Places, merge, places
from llmgw.fabric.subnet import (
    FabricReport,
    MasterChange,
    PortView,
    SmState,
    group_fabrics,
    parse_sm_text,
    remember,
)
from llmgw.fabric.sysfs import parse_guid
from llmgw.server.fabric_store import FabricStore
from llmgw.server.links import Links
from llmgw.server.registry import Node, NodeRegistry
from llmgw.wire import messages as m
from llmgw.wire.ids import printable, quote

log = logging.getLogger("llmgw.server.fabric")

TICK = 2.0  # seconds between looks at the fleet
GRACE = 10.0  # beyond the tool's own timeout, for the agent's queue and the stream
UNKNOWN_PER_TICK = 8  # ports of no known fabric asked for SMIR per tick
TEXT_CAP = 64 * 1024 * 1024  # decompressed output read at most (the agent's own cap)
MAX_QUEUED_RESULTS = 16
DAY = 86400.0
HOUR = 3600.0


class Pending(msgspec.Struct, kw_only=True):
    node: str
    tool: str
    port: str  # "mlx5_0/1"
    fabric: str  # the fabric it was asked for; "" when not known yet
    deadline: float


class TopologyState(msgspec.Struct, kw_only=True):
    map: FabricMap
    at: float  # wall clock
    by: str  # node/port that ran it
    size: int
    places: dict[str, dict[str, Place]] = {}  # node → device → where it is cabled (fabric/locality.py)


def port_key(port: m.Port) -> str:
    return f"{port.device}/{port.port}"


def _port_state(node: Node, port: m.Port) -> str:
    """The port's state from the latest heartbeat (the inventory's is from the Register)."""
    if node.heartbeat is not None:
        for reading in node.heartbeat.ports:
            if reading.device == port.device and reading.port == port.port and reading.state:
                return reading.state.upper()
    return port.state.upper()


class FabricService:
    def __init__(self, registry: NodeRegistry, links: Links, store: FabricStore, settings: FabricSettings, *,
                 clock: Callable[[], float] = trio.current_time, wall: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.links = links  # node id → its live fleet stream (read only: server/links.py)
        self.store = store
        self.settings = settings
        self.clock = clock
        self.wall = wall
        self.known = store.known()
        self.pending: dict[str, Pending] = {}  # request id → what was asked
        self.views: dict[tuple[str, str], tuple[PortView, float]] = {}  # (node, port) → last SMIR, wall time
        self.port_master: dict[tuple[str, str], str] = {}
        self.port_fabric: dict[tuple[str, str], str] = {}
        self.guid_fabric: dict[str, str] = {}  # adapter GUID → fabric, from topologies
        self.topologies: dict[str, TopologyState] = {}
        # What multi-node placement reads (the controller takes it before each pass): every
        # fabric's places merged, rebuilt off the event loop whenever a topology arrives.
        self.places = Places()
        self.errors: dict[str, str] = {}  # fabric → the last tool error
        self.report = FabricReport(fabrics=[], unmanaged=[], problems=[])
        self._last_sm: dict[str, float] = {}
        self._last_topology: dict[str, float] = {}
        self._asked_unknown: dict[tuple[str, str], float] = {}
        self._clashes_logged: set[tuple[str, tuple[str, ...]]] = set()
        self._rotation = 0
        self._requests = 0
        self._results_send, self._results_receive = trio.open_memory_channel[tuple[Pending, m.DiscoverResult]](
            MAX_QUEUED_RESULTS)

    # ---- act -------------------------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._process_results)
            period = max(min(TICK, float(self.settings.sm_interval) / 2, float(self.settings.discover_interval) / 2),
                         0.05)
            while True:
                self.tick()
                await trio.sleep(period)

    def tick(self) -> None:
        now = self.clock()
        for request_id, pending in list(self.pending.items()):
            if now > pending.deadline:
                del self.pending[request_id]
                log.warning("node %s did not answer %s through %s in time; asking again next interval",
                            pending.node, pending.tool, pending.port)
        busy = {p.node for p in self.pending.values()}
        by_fabric: dict[str, list[tuple[str, str]]] = {}
        unknown: list[tuple[str, str]] = []
        for node in sorted(self.registry.nodes.values(), key=lambda n: n.id):
            if node.state != "ready" or not self.links.supports(node.id, m.FEATURE_DISCOVER) or node.id in busy:
                continue
            for port in node.inventory.ports:
                if port.link_layer != "InfiniBand" or _port_state(node, port) != "ACTIVE":
                    continue
                key = (node.id, port_key(port))
                fabric = self.port_fabric.get(key) or self.guid_fabric.get(parse_guid(port.node_guid))
                if fabric:
                    by_fabric.setdefault(fabric, []).append(key)
                else:
                    unknown.append(key)
        self._rotation += 1
        used: set[str] = set()

        def pick(candidates: list[tuple[str, str]]) -> tuple[str, str] | None:
            free = [c for c in candidates if c[0] not in used]
            return free[self._rotation % len(free)] if free else None

        for fabric, candidates in sorted(by_fabric.items()):
            # SMIR first: it is cheap and a failover should not wait behind a sweep. Through one
            # port per master subnet manager the ports last named: ports that disagree on the
            # master (a split subnet) keep being asked, each side, every interval.
            if now - self._last_sm.get(fabric, -1e18) >= float(self.settings.sm_interval):
                by_master: dict[str, list[tuple[str, str]]] = {}
                for key in candidates:
                    by_master.setdefault(self.port_master.get(key, ""), []).append(key)
                chosen = pick(candidates)  # the rotation over every port, as with one master
                if chosen is not None:
                    self._ask(chosen, m.TOOL_SMIR, fabric, now)
                    self._last_sm[fabric] = now
                    used.add(chosen[0])
                    covered = {self.port_master.get(chosen, "")}
                    for master, ports in sorted(by_master.items()):
                        if master and master not in covered and (other := pick(ports)) is not None:
                            self._ask(other, m.TOOL_SMIR, fabric, now)  # the other side of a split
                            used.add(other[0])
            if now - self._last_topology.get(fabric, -1e18) >= float(self.settings.discover_interval):
                chosen = pick(candidates)
                if chosen is not None:
                    self._ask(chosen, m.TOOL_IBNETDISCOVER, fabric, now)
                    self._last_topology[fabric] = now
                    used.add(chosen[0])
        asked = 0
        for key in unknown:
            if asked >= UNKNOWN_PER_TICK:
                break
            if key[0] in used or now - self._asked_unknown.get(key, -1e18) < float(self.settings.sm_interval):
                continue
            self._ask(key, m.TOOL_SMIR, "", now)
            self._asked_unknown[key] = now
            used.add(key[0])
            asked += 1

    def _ask(self, key: tuple[str, str], tool: str, fabric: str, now: float) -> None:
        node, port = key
        device, _, number = port.partition("/")
        self._requests += 1
        request_id = f"fab-{self._requests}"
        timeout = float(self.settings.tool_timeout)
        self.pending[request_id] = Pending(node=node, tool=tool, port=port, fabric=fabric,
                                           deadline=now + timeout + GRACE)
        link = self.links.get(node)
        assert link is not None  # asked only of nodes connected this tick (no await since)
        link.send(m.Discover(request_id=request_id, tool=tool, device=device, port=int(number or 1), timeout=timeout))

    # ---- observe ----------------------------------------------------------------------------------

    def on_result(self, node_id: str, msg: m.DiscoverResult) -> None:
        """From the fleet stream's reader: never blocks it (parsing happens in the worker)."""
        pending = self.pending.get(msg.request_id)
        if pending is None or pending.node != node_id or pending.tool != msg.tool:
            log.info("node %s: a DiscoverResult nobody asked for (%s); dropped", node_id, quote(msg.request_id[:40]))
            return
        del self.pending[msg.request_id]
        try:
            self._results_send.send_nowait((pending, msg))
        except trio.WouldBlock:
            log.warning("node %s: fabric results arrive faster than they are parsed; dropped one", node_id)

    async def _process_results(self) -> None:
        async for pending, msg in self._results_receive:
            try:
                await self._process(pending, msg)
            except Exception:  # one bad dump must not end the fabric map
                log.exception("node %s: cannot use its %s output", pending.node, pending.tool)

    async def _process(self, pending: Pending, msg: m.DiscoverResult) -> None:
        where = f"{pending.node}/{pending.port}"
        if not msg.ok:
            # The agent's words (a tool's stderr): escaped for the log, bounded for the API.
            error = printable((msg.error or "failed")[:500])
            self.errors[pending.fabric or where] = f"{msg.tool} on {where}: {error}"
            log.warning("fabric tool %s on %s: %s", msg.tool, where, error)
            return
        text = await trio.to_thread.run_sync(_text, msg)
        if msg.tool == m.TOOL_SMIR:
            self._smir(pending, text)
            return
        known = self._owners()
        own = self._own_readings(known)
        fabric = pending.fabric or self.port_fabric.get((pending.node, pending.port), "")
        fabric_map, located = await trio.to_thread.run_sync(lambda: _analysed(text, known, fabric, own, where))
        if not fabric:
            return
        self.topologies[fabric] = TopologyState(map=fabric_map, at=self.wall(), by=where, size=len(text),
                                                places=located)
        every = {fid: t.places for fid, t in self.topologies.items()}
        self.places = await trio.to_thread.run_sync(merge, every)
        self.errors.pop(fabric, None)
        for adapter in fabric_map.adapters:
            self.guid_fabric[adapter.guid] = fabric
        log.info("fabric %s: %d switches, %d adapters, %d links (%d degraded), %d rail violations, from %s",
                 fabric, fabric_map.summary.switches, fabric_map.summary.adapters, fabric_map.summary.links,
                 fabric_map.summary.degraded_links, len(fabric_map.rail_violations), where)

    def _owners(self) -> dict[str, tuple[str, str]]:
        """Adapter GUID → (node, device), from what each agent says it has. A GUID two nodes claim
        is neither's: a node cannot take another's place in the fabric map (and so in multi-node
        placement, or on the fabric page) by reporting its adapters' GUIDs."""
        known: dict[str, tuple[str, str]] = {}
        clash: dict[str, set[str]] = {}
        for n in self.registry.nodes.values():
            for p in n.inventory.ports:
                if not p.node_guid:
                    continue
                guid = parse_guid(p.node_guid)
                owner = known.get(guid)
                if guid in clash or (owner is not None and owner[0] != n.id):
                    clash.setdefault(guid, {owner[0]} if owner else set()).add(n.id)
                    known.pop(guid, None)
                else:
                    known[guid] = (n.id, p.device)
        for guid, nodes in clash.items():
            key = (guid, tuple(sorted(nodes)))
            if key not in self._clashes_logged:
                self._clashes_logged.add(key)
                log.warning("adapter GUID %s is reported by nodes %s: placed under neither in the fabric map",
                            guid, ", ".join(quote(x) for x in sorted(nodes)))
        return known

    def _own_readings(self, known: Mapping[str, tuple[str, str]]) -> dict[tuple[str, int], OwnPort]:
        """(adapter GUID, port) → what the adapter's own node reads of that port: the second
        witness for every host cable of a map one node's dump made (fabric/crosscheck.py). Only
        GUIDs one node alone reports (`known`)."""
        out: dict[tuple[str, int], OwnPort] = {}
        for node in self.registry.nodes.values():
            live = {(r.device, r.port): r for r in node.heartbeat.ports} if node.heartbeat is not None else {}
            for port in node.inventory.ports:
                guid = parse_guid(port.node_guid) if port.node_guid else ""
                if port.link_layer != "InfiniBand" or known.get(guid, ("", ""))[0] != node.id:
                    continue
                now = live.get((port.device, port.port))
                out[(guid, port.port)] = OwnPort(
                    node=node.id, device=port.device, port=port.port,
                    state=(now.state if now is not None and now.state else port.state).upper(),
                    phys_state=now.phys_state if now is not None and now.phys_state else port.phys_state,
                    rate_gbps=now.rate_gbps if now is not None and now.rate_gbps else port.rate_gbps)
        return out

    def _smir(self, pending: Pending, text: str) -> None:
        node = self.registry.get(pending.node)
        state, sm_lid = "ACTIVE", 0
        if node is not None:
            for port in node.inventory.ports:
                if port_key(port) == pending.port:
                    state, sm_lid = _port_state(node, port), port.sm_lid
        parsed = parse_sm_text(text)
        key = (pending.node, pending.port)
        now = self.wall()
        self.views[key] = (PortView(node=pending.node, port=pending.port, state=state, sm_lid=sm_lid,
                                    records=tuple(parsed.records),
                                    unreadable=not parsed.records and bool(parsed.problems)), now)
        self.recompute(now)
        master = next((r.guid for r in parsed.records if r.state is SmState.MASTER), "")
        fabric = self.port_fabric.get(key, "")
        previous = self.port_master.get(key, "")
        if master and previous and master != previous and fabric:
            change = MasterChange(fabric=fabric, at=now, old=previous, new=master,
                                  reported_by=f"{pending.node}/{pending.port}")
            log.warning("fabric %s: master subnet manager changed from %s to %s (reported by %s)",
                        fabric, previous, master, change.reported_by)
            self.store.add_changes([change], now)
            self.recompute(now)
        if master:
            self.port_master[key] = master

    def recompute(self, now: float) -> None:
        limit = 3 * float(self.settings.sm_interval)
        views = [view for view, at in self.views.values() if now - at <= limit and view.node in self.links]
        report = group_fabrics(views, self.known, self.store.changes(now - HOUR), now)
        known = remember(report, self.known)
        if known != self.known:
            self.store.remember(known)
            self.known = known
        for fabric in report.fabrics:
            for port in fabric.ports:
                node, _, key = port.partition("/")
                self.port_fabric[(node, key)] = fabric.id
        self.report = report

    # ---- read models (API, metrics) ---------------------------------------------------------------

    def fabric_ids(self) -> list[str]:
        return sorted({f.id for f in self.report.fabrics} | set(self.topologies))

    def unmanaged(self) -> list[str]:
        """Ports up with no subnet manager (INIT), from the nodes' own readings."""
        out = []
        for node in self.registry.nodes.values():
            if node.id not in self.links:
                continue
            for port in node.inventory.ports:
                if port.link_layer == "InfiniBand" and _port_state(node, port) == "INIT":
                    out.append(f"{node.id}/{port_key(port)}")
        return sorted(out)

    def problems(self, fabric_id: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        fabric = next((f for f in self.report.fabrics if f.id == fabric_id), None)
        if fabric is not None:
            out.extend({"kind": p.kind.value, "message": p.message} for p in fabric.problems)
        topology = self.topologies.get(fabric_id)
        if topology is not None:
            out.extend({"kind": p.kind.value, "message": p.message} for p in topology.map.problems)
        unmanaged = [p for p in self.unmanaged() if self._fabric_of(p) == fabric_id]
        if unmanaged:
            out.append({"kind": "no_sm", "message": f"{len(unmanaged)} ports are up with no subnet manager (INIT): "
                                                    + ", ".join(unmanaged[:5])})
        if fabric_id in self.errors:
            out.append({"kind": "tool_failed", "message": self.errors[fabric_id]})
        return out

    def _fabric_of(self, where: str) -> str:
        node_id, _, key = where.partition("/")
        fabric = self.port_fabric.get((node_id, key))
        if fabric:
            return fabric
        node = self.registry.get(node_id)
        if node is not None:
            for port in node.inventory.ports:
                if port_key(port) == key:
                    return self.guid_fabric.get(parse_guid(port.node_guid), "")
        return ""

    def summary(self, fabric_id: str) -> dict[str, Any] | None:
        if fabric_id not in self.fabric_ids():
            return None
        fabric = next((f for f in self.report.fabrics if f.id == fabric_id), None)
        topology = self.topologies.get(fabric_id)
        out: dict[str, Any] = {
            "id": fabric_id,
            "master": msgspec.to_builtins(fabric.master) if fabric and fabric.master else None,
            "standbys": [s.guid for s in fabric.standbys] if fabric else [],
            "subnet_managers": len(fabric.subnet_managers) if fabric else 0,
            "ports": len(fabric.ports) if fabric else 0,
            "discovered_at": topology.at if topology else None,
            "discovered_by": topology.by if topology else "",
            "topology": msgspec.to_builtins(topology.map.summary) if topology else None,
            "problems": self.problems(fabric_id),
        }
        return out

    def detail(self, fabric_id: str) -> dict[str, Any] | None:
        out = self.summary(fabric_id)
        if out is None:
            return None
        fabric = next((f for f in self.report.fabrics if f.id == fabric_id), None)
        topology = self.topologies.get(fabric_id)
        out["subnet_manager_list"] = msgspec.to_builtins(fabric.subnet_managers) if fabric else []
        out["port_list"] = fabric.ports if fabric else []
        out["master_changes"] = msgspec.to_builtins(self.store.changes(self.wall() - DAY, fabric_id))
        out["degraded_links"] = (msgspec.to_builtins([link for link in topology.map.links if link.degraded])
                                 if topology else [])
        out["rail_violations"] = msgspec.to_builtins(topology.map.rail_violations) if topology else []
        return out

    def topology(self, fabric_id: str) -> dict[str, Any] | None:
        topology = self.topologies.get(fabric_id)
        if topology is None:
            return None
        doc: dict[str, Any] = {"id": fabric_id, "discovered_at": topology.at, "discovered_by": topology.by}
        doc.update(msgspec.to_builtins(topology.map))
        return doc


def _analysed(text: str, known: Mapping[str, tuple[str, str]], fabric: str, own: Mapping[tuple[str, int], OwnPort],
              source: str) -> tuple[FabricMap, dict[str, dict[str, Place]]]:
    """Parse, analyse, cross-check against the nodes' own port readings and locate one dump (in
    a worker thread: a 4,000-node fabric takes a second)."""
    fabric_map = cross_check(analyse(parse_topology(text), known), own, source)
    return fabric_map, places(fabric, fabric_map)


def _text(msg: m.DiscoverResult) -> str:
    data = msg.data
    if msg.encoding == "zlib":
        data = zlib.decompressobj().decompress(data, TEXT_CAP)
    return data.decode("utf-8", errors="replace")


class FabricCollector(Collector):
    """llmgw_fabric_master_sm, llmgw_fabric_subnet_managers, llmgw_fabric_problems{fabric,kind}: read at
    scrape time from the service's last report."""

    def __init__(self, service: FabricService) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        master = GaugeMetricFamily("llmgw_fabric_master_sm", "The master subnet manager of each fabric (1), by GUID.",
                                   labels=["fabric", "guid"])
        count = GaugeMetricFamily("llmgw_fabric_subnet_managers", "Subnet managers each fabric lists.",
                                  labels=["fabric"])
        problems = GaugeMetricFamily("llmgw_fabric_problems", "Fabric problems now, by fabric and kind.",
                                     labels=["fabric", "kind"])
        kinds: dict[tuple[str, str], int] = {}
        for fabric in self.service.report.fabrics:
            if fabric.master is not None:
                master.add_metric([fabric.id, fabric.master.guid], 1)
            count.add_metric([fabric.id], len(fabric.subnet_managers))
        for fabric_id in self.service.fabric_ids():
            for problem in self.service.problems(fabric_id):
                key = (fabric_id, problem["kind"])
                kinds[key] = kinds.get(key, 0) + 1
        for loose in self.service.report.problems:  # belongs to no fabric (no_sm is counted per fabric)
            if loose.kind.value == "no_sm":
                continue
            key = ("", loose.kind.value)
            kinds[key] = kinds.get(key, 0) + 1
        for (fabric_id, kind), value in sorted(kinds.items()):
            problems.add_metric([fabric_id, kind], value)
        yield master
        yield count
        yield problems
