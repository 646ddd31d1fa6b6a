"""The settle period after a control-plane start (llmgw.server.settling, issue 41): the pure state,
then the controller that drives it under trio's MockClock, then a reconnect storm of 300 agents
spread over 30 s (their backoff after an outage) against a 10 s `settle`: nothing is placed before
the fleet that was there is back, and nothing is stopped as surplus."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from llmgw.catalog.schema import Model, Profile, ReconcileSettings
from llmgw.server.control import Controller, Settle, make_reconciler
from llmgw.server.known_nodes import KnownNodes
from llmgw.server.links import FleetLinks
from llmgw.server.registry import NodeRegistry
from llmgw.server.settling import Ended, SettlePlan, SettleState
from llmgw.wire import messages as m
from tests.unit.test_reconcile import FEATURES, bring_up, gpus, nodes

# -- the pure state ---------------------------------------------------------------------------------


def plan(known: set[str], expect: tuple[str, ...] = (), settle: float = 10, settle_max: float = 60) -> SettlePlan:
    return SettlePlan(now=100.0, known=known, expect=expect, settle=settle, settle_max=settle_max)


def test_a_restart_settles_when_every_known_node_is_back_not_at_settle() -> None:
    p = plan({"a", "b", "c"})
    assert p.step(100.0, set()) is SettleState.SETTLING
    assert p.step(125.0, {"a", "b"}) is SettleState.SETTLING  # past the 10 s `settle`: still waiting for c
    assert "until c re-registers" in p.note(125.0, {"a", "b"})
    assert p.left(125.0) == pytest.approx(35.0)
    assert p.step(131.0, {"a", "b", "c"}) is SettleState.SETTLED
    assert p.ended is Ended.ALL_BACK and p.ended_at == 131.0 and p.left(131.0) == 0 and p.note(131.0, set()) == ""


def test_a_restart_settles_at_the_bound_when_a_known_node_never_returns() -> None:
    p = plan({"a", "b"})
    assert p.step(159.9, {"a"}) is SettleState.SETTLING
    assert p.step(160.0, {"a"}) is SettleState.SETTLED
    assert p.ended is Ended.BOUND and p.missing_at_end == {"b"}
    # Settled is final: a node that leaves or time that runs backwards changes nothing.
    assert p.step(50.0, set()) is SettleState.SETTLED and p.ended is Ended.BOUND


def test_a_forgotten_node_is_not_waited_for() -> None:
    p = plan({"a", "b"})
    assert p.step(101.0, {"a"}) is SettleState.SETTLING
    p.forget("b")
    assert p.step(101.5, {"a"}) is SettleState.SETTLED and p.ended is Ended.ALL_BACK


def test_a_first_start_waits_settle_or_its_expected_nodes() -> None:
    bare = plan(set())
    assert bare.bound == 10 and bare.step(109.0, {"x"}) is SettleState.SETTLING
    assert bare.step(110.0, {"x"}) is SettleState.SETTLED and bare.ended is Ended.WAITED
    expecting = plan(set(), expect=("a", "b"))
    assert expecting.bound == 10  # a first start's bound is `settle`, not settle_max
    assert expecting.step(103.0, {"a", "b"}) is SettleState.SETTLED and expecting.ended is Ended.ALL_BACK
    assert plan(set(), settle=0).state is SettleState.SETTLED  # settle: 0 places at once
    assert plan({"a"}, settle=300, settle_max=60).bound == 300  # the longer of the two after a restart


# -- the controller under MockClock ----------------------------------------------------------------


class Link:
    def __init__(self, sent: list[tuple[float, str, msgspec.Struct]], node: str) -> None:
        self.sent, self.node = sent, node

    def supports(self, feature: str) -> bool:
        return True

    def send(self, msg: msgspec.Struct) -> None:
        self.sent.append((trio.current_time(), self.node, msg))


def one_gpu_model(n: int) -> list[Model]:
    return [Model(name="small", replicas=n, profiles=[Profile(name="tp1", engine="sim", gpus=1)])]


def restart_fleet(tmp_path: Path, n: int) -> tuple[KnownNodes, dict[str, list[m.ShardReport]]]:
    """n nodes of 2 GPUs, each running one replica of `small` (n replicas), placed by a first
    server; its state directory knows the n nodes. What each agent re-registers with."""
    ids = [f"gpu-{i:03d}" for i in range(n)]
    old = make_reconciler(one_gpu_model(n), ReconcileSettings(), rng=random.Random(1))
    fleet = nodes(*ids)
    for info in fleet:
        info.gpus = gpus(2)
    placed = bring_up(old, fleet)
    assert sorted(s.node for s in placed) == ids  # one per node (spread)
    known = KnownNodes(tmp_path)
    for node in ids:
        known.add(node)
    reports: dict[str, list[m.ShardReport]] = {}
    for s in placed:
        reports.setdefault(s.node, []).append(
            m.ShardReport(spec=s.spec, state="ready", pid=100, endpoint=f"http://{s.node}:{s.spec.port}"))
    return known, reports


async def storm(tmp_path: Path, n: int, arrivals: dict[str, float], settings: ReconcileSettings,
                until: float) -> tuple[Controller, list[tuple[float, str, msgspec.Struct]]]:
    """A restarted server with `n` known nodes; node i re-registers at arrivals[i] (virtual
    seconds after the start). Runs the controller until `until`; returns what it sent."""
    known, reports = restart_fleet(tmp_path, n)
    registry = NodeRegistry(1.0)
    sent: list[tuple[float, str, msgspec.Struct]] = []
    links: FleetLinks[Link] = FleetLinks()
    controller = Controller(make_reconciler(one_gpu_model(n), settings, rng=random.Random(2)), registry,
                            settle=Settle(settings, registry, known), links=links, known=known)
    start = trio.current_time()

    async def agent(node: str, at: float, session: int) -> None:
        await trio.sleep_until(start + at)
        msg = m.Register(node_id=node, version="0.1.0", features=FEATURES, inventory=m.Inventory(gpus=gpus(2)),
                         shards=reports[node])
        registry.register(msg, trio.current_time(), session=session, endpoint_host=node)
        links.add(node, Link(sent, node))
        controller.node_registered(node, msg)

    with trio.move_on_after(until):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(controller.run)
            for i, (node, at) in enumerate(sorted(arrivals.items())):
                nursery.start_soon(agent, node, at, i + 1)
    return controller, [(t - start, node, msg) for t, node, msg in sent]


async def test_a_reconnect_storm_places_nothing_before_the_fleet_is_back_and_stops_nothing(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """300 agents back over 30 s (the agent's backoff reaches 30 s), the default 10 s `settle`:
    the replicas of the nodes still away were placed again at 10 s on the others' free GPUs
    and stopped as surplus when their engines reported (issue 41, finding 3)."""
    n = 300
    rng = random.Random(41)
    arrivals = {f"gpu-{i:03d}": rng.uniform(0.5, 30.0) for i in range(n)}
    last = max(arrivals.values())
    controller, sent = await storm(tmp_path, n, arrivals, ReconcileSettings(), until=last + 20)
    assert not controller.settle.plan.settling and controller.settle.plan.ended is Ended.ALL_BACK
    assert controller.settle.plan.ended_at is not None and controller.settle.plan.ended_at - last < 0.1
    assert controller.passes > 0  # the reconciler ran after settling
    starts = [(t, node) for t, node, msg in sent if isinstance(msg, m.Start)]
    stops = [(t, node) for t, node, msg in sent if isinstance(msg, (m.Stop, m.Drain))]
    assert starts == [] and stops == [], (starts[:5], stops[:5])
    assert len(controller.reconciler.replicas) == n
    assert all(r.state == "ready" for r in controller.reconciler.replicas.values())


async def test_a_known_node_that_never_returns_is_replaced_at_the_bound(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Settling on the fleet has a bound: a node that died with the control plane does not hold
    placement forever. Its replica is placed at settle_max (on a free GPU of another), not before."""
    arrivals = {"gpu-000": 1.0, "gpu-001": 2.0}  # gpu-002 never comes back
    settings = ReconcileSettings()  # settle 10 s, settle_max 60 s
    controller, sent = await storm(tmp_path, 3, arrivals, settings, until=80)
    starts = [(t, node) for t, node, msg in sent if isinstance(msg, m.Start)]
    assert len(starts) == 1, starts
    bound = float(settings.settle_max)
    assert bound <= starts[0][0] < bound + 1, starts
    assert controller.settle.plan.ended is Ended.BOUND and controller.settle.plan.missing_at_end == {"gpu-002"}
    assert not [msg for _, _, msg in sent if isinstance(msg, (m.Stop, m.Drain))]


async def test_the_gateway_feed_says_settling_until_settled(tmp_path: Path,
                                                            autojump_clock: trio.testing.MockClock) -> None:
    """While settling, the endpoint set handed to the gateway (and its followers) is flagged
    `settling` and carries the last published endpoints of the nodes not back yet (from the state
    directory) beside the ones rebuilt; settled, it is the real set, and it is kept."""
    from llmgw.server.last_endpoints import Entry, LastEndpoints
    from llmgw.server.views import GatewayFeed

    last = LastEndpoints(tmp_path)
    last.save({"http://gpu-000:20000": Entry(model="small", node="gpu-000", key="k0"),
               "http://gpu-001:20000": Entry(model="small", node="gpu-001", key="k1")})
    handed: list[tuple[dict[str, set[str]], dict[str, str], bool]] = []
    known, reports = restart_fleet(tmp_path, 2)
    registry = NodeRegistry(1.0)
    settings = ReconcileSettings()
    settle = Settle(settings, registry, known)
    reconciler = make_reconciler(one_gpu_model(2), settings, rng=random.Random(2))
    feed = GatewayFeed(reconciler, settle, trio.current_time, LastEndpoints(tmp_path))
    controller = Controller(reconciler, registry, settle=settle, links=FleetLinks(), known=known,
                            on_pass=lambda: handed.append(feed.endpoint_set()))
    endpoints = {node: rs[0].endpoint for node, rs in reports.items()}

    def register(node: str, session: int) -> None:
        msg = m.Register(node_id=node, version="0.1.0", features=FEATURES, inventory=m.Inventory(gpus=gpus(2)),
                         shards=reports[node])
        registry.register(msg, trio.current_time(), session=session, endpoint_host=node)
        controller.node_registered(node, msg)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(controller.run)
        await trio.sleep(1)  # ok: MockClock time (autojump), no wall-clock wait
        ready, keys, settling = handed[-1]
        assert settling and ready == {"small": {"http://gpu-000:20000", "http://gpu-001:20000"}}
        register("gpu-000", 1)
        await trio.sleep(5)  # ok: MockClock time (autojump), no wall-clock wait
        ready, keys, settling = handed[-1]
        # gpu-000 is back: its own report replaces what was kept of it; gpu-001's kept endpoint stays.
        assert settling and ready == {"small": {endpoints["gpu-000"], "http://gpu-001:20000"}}, ready
        assert keys["http://gpu-001:20000"] == "k1"
        register("gpu-001", 2)
        await trio.sleep(1)  # ok: MockClock time (autojump), no wall-clock wait
        ready, keys, settling = handed[-1]
        assert not settling and ready == {"small": set(endpoints.values())}
        nursery.cancel_scope.cancel()
    assert set(LastEndpoints(tmp_path).entries) == set(endpoints.values())
    assert (tmp_path / "endpoints.json").stat().st_mode & 0o077 == 0  # it holds engine keys


def test_the_kept_set_is_not_overwritten_by_a_shutdown(tmp_path: Path) -> None:
    """Streams closing on the way down empty the ready set: a frozen store keeps the last one."""
    from llmgw.server.last_endpoints import Entry, LastEndpoints

    last = LastEndpoints(tmp_path)
    last.save({"http://gpu-000:20000": Entry(model="small", node="gpu-000", key="k0")})
    last.freeze()
    last.save({})
    assert set(LastEndpoints(tmp_path).entries) == {"http://gpu-000:20000"}
    assert LastEndpoints(tmp_path).unconfirmed({"gpu-000"}) == {}


async def test_a_gateway_keeps_its_endpoints_while_the_control_plane_settles() -> None:
    """GatewayEndpoints.settling: what the control plane names joins the rotation instead of
    replacing it, and followers are told the same; the settled set replaces it."""
    from llmgw.catalog.schema import GatewaySettings, Model
    from llmgw.server.gateway.metrics import GatewayMetrics
    from llmgw.server.gateway.proxy import Gateway
    from llmgw.server.metrics import ServerMetrics
    from llmgw.web.relay import RelayHub

    told: list[tuple[dict[str, list[str]], bool]] = []

    class Followers:
        def publish_config(self, *args: object) -> None:
            pass

        def publish_endpoints(self, ready, keys, *, settling=False) -> None:  # type: ignore[no-untyped-def]
            told.append(({k: sorted(v) for k, v in ready.items()}, settling))

    gw = Gateway(GatewaySettings(), GatewayMetrics(ServerMetrics(lambda: {}).registry), relay_hub=RelayHub(),
                 client_door=lambda request: True, followers=Followers())
    gw.configure([Model(name="chat")], [])
    a, b, c = "http://127.0.0.1:20001", "http://127.0.0.1:20002", "http://127.0.0.1:20003"
    gw.set_endpoints({"chat": {a, b}})
    gw.set_endpoints({}, settling=True)  # a restarted control plane's still-empty set
    assert gw.routes["chat"].dynamic == {a, b}
    gw.set_endpoints({"chat": {c}}, settling=True)  # what it has rebuilt so far joins
    assert gw.routes["chat"].dynamic == {a, b, c}
    gw.set_endpoints({"chat": {b, c}})  # settled: the real set
    assert gw.routes["chat"].dynamic == {b, c}
    assert [s for _, s in told] == [False, True, True, False] and told[1][0] == {}
