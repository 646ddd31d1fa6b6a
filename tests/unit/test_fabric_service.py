"""The server's fabric scheduling without processes: who is asked what, one request per node at
a time, unsolicited results dropped, and a failover keeping the fabric's name across a restart
(the SM GUIDs' fabric is read back from fabric.sqlite)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmgw.catalog.schema import FabricSettings
from llmgw.catalog.units import Duration
from llmgw.server.fabric_service import FabricService
from llmgw.server.fabric_store import FabricStore
from llmgw.server.links import FleetLinks
from llmgw.server.registry import NodeRegistry
from llmgw.sim.fabric import FabricSpec, generate
from llmgw.sim.node import node_guid
from llmgw.wire import messages as m


class FakeSession:
    def __init__(self, features: list[str]) -> None:
        self.features = set(features)
        self.sent: list[m.Discover] = []

    def supports(self, feature: str) -> bool:
        return feature in self.features

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


class FakeFleet:
    def __init__(self) -> None:
        self.sessions: dict[str, FakeSession] = {}  # what each node was sent
        self.links = FleetLinks[FakeSession]()  # what the service sees (the fleet service's)


def setup(tmp_path: Path, nodes: int = 3,
          features: tuple[str, ...] = (m.FEATURE_DISCOVER,)) -> tuple[FabricService, FakeFleet]:
    registry = NodeRegistry(1.0)
    fleet = FakeFleet()
    for i in range(1, nodes + 1):
        node = f"n{i}"
        ports = [m.Port(device=f"mlx5_{d}", port=1, state="ACTIVE", node_guid=f"0x{node_guid(node, d):016x}")
                 for d in range(2)]
        registry.register(m.Register(node_id=node, version="1", features=list(features),
                                     inventory=m.Inventory(ports=ports)), 0.0, i)
        fleet.sessions[node] = FakeSession(list(features))
        fleet.links.add(node, fleet.sessions[node])
    now = [100.0]
    service = FabricService(registry, fleet.links, FabricStore(tmp_path), FabricSettings(sm_interval=Duration(60)),
                            clock=lambda: now[0], wall=lambda: now[0])
    return service, fleet


def sent(fleet: FakeFleet) -> list[tuple[str, str, str]]:
    return [(node, msg.tool, msg.device) for node, s in sorted(fleet.sessions.items()) for msg in s.sent]


def test_ports_of_no_known_fabric_are_asked_for_smir_one_per_node(tmp_path: Path) -> None:
    service, fleet = setup(tmp_path)
    service.tick()
    assert sent(fleet) == [("n1", m.TOOL_SMIR, "mlx5_0"), ("n2", m.TOOL_SMIR, "mlx5_0"), ("n3", m.TOOL_SMIR, "mlx5_0")]
    service.tick()  # every node has a request out: nothing more
    assert len(sent(fleet)) == 3


def test_agents_without_the_feature_are_never_asked(tmp_path: Path) -> None:
    service, fleet = setup(tmp_path, features=())
    service.tick()
    assert sent(fleet) == []


def smir_text(**kw: Any) -> bytes:
    return generate(FabricSpec(nodes=["n1", "n2", "n3"], rails=2, group_size=3, spines=2, **kw)).smir.encode()


async def answer(service: FabricService, fleet: FakeFleet, data: bytes) -> None:
    for session in fleet.sessions.values():
        for msg in session.sent:
            if msg.request_id in service.pending:
                result = m.DiscoverResult(request_id=msg.request_id, tool=msg.tool, device=msg.device, port=msg.port,
                                          ok=True, data=data, size=len(data))
                pending = service.pending.pop(msg.request_id)
                await service._process(pending, result)


async def test_a_failover_after_a_restart_keeps_the_fabric_name(tmp_path: Path) -> None:
    service, fleet = setup(tmp_path)
    service.tick()
    await answer(service, fleet, smir_text())
    (fabric,) = service.report.fabrics
    assert fabric.master is not None and fabric.id == fabric.master.guid and fabric.standbys

    restarted, fleet2 = setup(tmp_path)  # a new server on the same state directory
    restarted.tick()
    await answer(restarted, fleet2, smir_text(failover=True))
    assert [f.id for f in restarted.report.fabrics] == [fabric.id]
    assert restarted.report.fabrics[0].master is not None and restarted.report.fabrics[0].master.guid != fabric.id


async def test_a_master_change_a_port_reports_is_kept(tmp_path: Path) -> None:
    service, fleet = setup(tmp_path, nodes=1)
    service.tick()
    await answer(service, fleet, smir_text())
    service.clock = service.wall = lambda: 200.0
    service.tick()  # the fabric is known now: its SMIR is due again after sm_interval (60 s)
    await answer(service, fleet, smir_text(failover=True))
    changes = service.store.changes(0)
    assert [(c.old, c.new, c.reported_by) for c in changes] == [
        (service.report.fabrics[0].id, service.report.fabrics[0].master.guid, "n1/mlx5_0/1")]  # type: ignore[union-attr]
    kinds = {p["kind"] for p in service.problems(service.report.fabrics[0].id)}
    assert kinds == {"master_changed", "no_standby"}


def test_an_unsolicited_result_is_dropped(tmp_path: Path) -> None:
    service, fleet = setup(tmp_path)
    service.tick()
    request = fleet.sessions["n1"].sent[0]
    service.on_result("n2", m.DiscoverResult(request_id=request.request_id, tool=request.tool, ok=True))
    service.on_result("n1", m.DiscoverResult(request_id="made-up", tool=m.TOOL_SMIR, ok=True))
    assert request.request_id in service.pending  # still waiting for n1's own answer
    service.on_result("n1", m.DiscoverResult(request_id=request.request_id, tool=request.tool, ok=True))
    assert request.request_id not in service.pending
    assert msgspec.json.encode(service.report)  # nothing broke


async def test_a_nodes_words_reach_the_log_escaped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request id or a tool's error is the agent's text: a newline in it starts no log line."""
    service, fleet = setup(tmp_path)
    service.tick()
    request = fleet.sessions["n1"].sent[0]
    forged = "\n2026-12-01 06:00:00,000 INFO llmgw.api: reload requested by operator alice"
    with caplog.at_level(logging.INFO, logger="llmgw"):
        service.on_result("n1", m.DiscoverResult(request_id="x" + forged, tool=m.TOOL_SMIR, ok=True))
        await service._process(service.pending.pop(request.request_id),
                               m.DiscoverResult(request_id=request.request_id, tool=request.tool, ok=False,
                                                error="boom" + forged + "\x1b]0;t\x07"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and not any("\n" in line or "\x1b" in line for line in lines), lines
    assert all("\\n2026-12-01" in line or "\\x0a2026-12-01" in line for line in lines), lines
    assert not any(c in "".join(service.errors.values()) for c in "\n\x1b")


async def test_a_topology_becomes_what_placement_reads(tmp_path: Path) -> None:
    """The dump is parsed, analysed and located off the event loop; placement's view is the
    result, with the node named by its agent's GUIDs and a short cable said so."""
    service, fleet = setup(tmp_path)
    service.tick()
    await answer(service, fleet, smir_text())  # the fabric is known: its topology is asked next
    service.tick()
    topo = generate(FabricSpec(nodes=["n1", "n2", "n3"], rails=2, group_size=3, spines=2, degraded=["n2"]))
    await answer(service, fleet, topo.ibnetdiscover.encode())
    assert sorted(service.places.by_node) == ["n1", "n2", "n3"]
    n2 = service.places.by_node["n2"]
    assert sorted(n2) == ["mlx5_0", "mlx5_1"] and n2["mlx5_1"].short == (
        "cable to leaf-g1-r1 trained 1xNDR (others 4xNDR)")
    assert n2["mlx5_0"].leaf == service.places.by_node["n1"]["mlx5_0"].leaf and not n2["mlx5_0"].short


async def test_a_node_reporting_another_nodes_adapter_guids_takes_no_place(tmp_path: Path) -> None:
    """n4's agent says it has n2's adapters: the GUIDs name neither node, so n4 does not take n2's
    place under its leaf (n2 is still found by its adapters' node descriptions)."""
    service, fleet = setup(tmp_path)
    ports = [m.Port(device=f"mlx5_{d}", port=1, state="ACTIVE", node_guid=f"0x{node_guid('n2', d):016x}")
             for d in range(2)]
    service.registry.register(m.Register(node_id="n4", version="1", inventory=m.Inventory(ports=ports)), 0.0, 4)
    service.tick()
    await answer(service, fleet, smir_text())
    service.tick()
    topo = generate(FabricSpec(nodes=["n1", "n2", "n3"], rails=2, group_size=3, spines=2))
    await answer(service, fleet, topo.ibnetdiscover.encode())
    assert sorted(service.places.by_node) == ["n1", "n2", "n3"], sorted(service.places.by_node)


async def test_smir_goes_through_one_port_per_master_so_a_split_stays_seen(tmp_path: Path) -> None:
    service, fleet = setup(tmp_path)
    service.tick()  # every port of no known fabric yet: one SMIR per node
    for node, session in fleet.sessions.items():
        for msg in session.sent:
            data = smir_text(failover=(node == "n1"))  # n1's port names the other master
            result = m.DiscoverResult(request_id=msg.request_id, tool=msg.tool, device=msg.device, port=msg.port,
                                      ok=True, data=data, size=len(data))
            await service._process(service.pending.pop(msg.request_id), result)
    (fabric,) = service.report.fabrics
    assert "sm_disagree" in {p.kind.value for p in fabric.problems}
    for session in fleet.sessions.values():
        session.sent.clear()
    for minute in (1, 2, 3):  # whichever port the rotation picks, the other side is asked too
        service.clock = service.wall = lambda minute=minute: 100.0 + 61 * minute  # type: ignore[misc]
        service.pending.clear()
        service.tick()
        asked = sorted(p.node for p in service.pending.values() if p.tool == m.TOOL_SMIR and p.fabric == fabric.id)
        # (others: ports of no fabric yet)
        assert len(asked) == 2 and asked[0] == "n1" and asked[1] in ("n2", "n3"), asked
        for session in fleet.sessions.values():
            session.sent.clear()


async def test_a_dump_cannot_mark_another_nodes_cable_degraded(tmp_path: Path) -> None:
    """Whichever node's dump the map comes from, a host cable's rate is held against what the node
    at its end reads (issue 40, finding 10): n2's own heartbeat says its mlx5_1 runs at 400 Gb/s,
    so a dump calling that cable 1xNDR steers no placement away from n2, and the map says who
    disagrees with whom. Where n2 reads the short rate too, the cable stays short."""
    for n2_reads, short in ((400.0, ""), (100.0, "cable to leaf-g1-r1 trained 1xNDR (others 4xNDR)")):
        service, fleet = setup(tmp_path / str(n2_reads))
        node = service.registry.get("n2")
        assert node is not None
        service.registry.heartbeat("n2", node.session, m.Heartbeat(seq=1, ports=[
            m.PortCounters(device=f"mlx5_{d}", port=1, state="ACTIVE", phys_state="LinkUp",
                           rate_gbps=n2_reads if d == 1 else 400.0) for d in range(2)]), 1.0)
        service.tick()
        await answer(service, fleet, smir_text())
        service.tick()
        topo = generate(FabricSpec(nodes=["n1", "n2", "n3"], rails=2, group_size=3, spines=2, degraded=["n2"]))
        await answer(service, fleet, topo.ibnetdiscover.encode())
        assert service.places.by_node["n2"]["mlx5_1"].short == short
        (fabric,) = service.topologies
        said = [p["message"] for p in service.problems(fabric) if p["kind"] == "map_disagrees"]
        by = service.topologies[fabric].by
        if short:
            assert said == []
        else:
            assert said == [f"the dump from {by} has the cable at n2 mlx5_1/1 at 100 Gb/s (1xNDR); n2 reads 400 Gb/s: "
                            "the node's own reading is used"], said
            assert service.detail(fabric)["degraded_links"] == []  # type: ignore[index]
