"""The server's side of `ctl fabric-test` (server/fabric_test.py) under trio's MockClock, with scripted
agents: a node saying "progress" forever is cut at the phase deadline fixed when the phase started,
a test of two other nodes runs while one pair hangs, A→B beside B→A cannot deadlock, and A's client
is sent B's registered host and nothing B's answer names (issue 40, findings 6 and 7). The real
streams are in tests/abuse/test_fabric_test_abuse.py."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from llmgw.server.fabric_test import FabricTests, Refused
from llmgw.server.links import FleetLinks
from llmgw.wire import messages as m

TABLE = (" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
         " 65536      5000             392.38             392.34 \t\t     0.748336\n")


def node(node_id: str, host: str) -> SimpleNamespace:
    return SimpleNamespace(
        node_id=node_id, state="ready", reason="", version="test", endpoint_host=host, address=f"{host}:40000",
        fabric_status=[m.FabricStatus(name="ib", usable=True, ports=["mlx5_0:1"])],
        inventory=m.Inventory(ports=[m.Port(device="mlx5_0", port=1, rate_gbps=400.0)]), ports={})


class Registry:
    def __init__(self, *ids: str) -> None:
        self.nodes = {n: node(n, f"10.0.0.{i + 1}") for i, n in enumerate(ids)}

    def get(self, node_id: str) -> SimpleNamespace | None:
        return self.nodes.get(node_id)


class Session:
    """A scripted agent: `answer(msg)` says what it sends back for each FabricTest."""

    def __init__(self, tests: Callable[[], FabricTests], node_id: str, nursery: trio.Nursery,
                 answer: Callable[[m.FabricTest], Any] | None = None) -> None:
        self.tests, self.node_id, self.nursery = tests, node_id, nursery
        self.answer = answer or honest
        self.got: list[msgspec.Struct] = []

    def supports(self, feature: str) -> bool:
        return True

    def send(self, msg: msgspec.Struct) -> None:
        self.got.append(msg)
        if isinstance(msg, m.FabricTest):
            self.nursery.start_soon(self._reply, msg)

    async def _reply(self, msg: m.FabricTest) -> None:
        async for result in self.answer(msg):
            self.tests().on_result(self.node_id, result)

    def tests_sent(self, role: str) -> list[m.FabricTest]:
        return [x for x in self.got if isinstance(x, m.FabricTest) and x.role == role]


async def honest(msg: m.FabricTest):  # type: ignore[no-untyped-def]
    await trio.sleep(0.5)  # ok: MockClock time (autojump), no wall-clock wait
    if msg.role == "server":
        yield m.FabricTestResult(request_id=msg.request_id, phase="ready", ok=True, tcp_port=18515)
        await trio.sleep(2)  # ok: MockClock time (autojump), no wall-clock wait
    elif msg.role == "client":
        await trio.sleep(2)  # ok: MockClock time (autojump), no wall-clock wait
    yield m.FabricTestResult(request_id=msg.request_id, ok=True, output=TABLE if msg.role != "prepare" else "")


async def progress_forever(msg: m.FabricTest):  # type: ignore[no-untyped-def]
    while True:
        yield m.FabricTestResult(request_id=msg.request_id, phase="progress", ok=True, notes=["installing perftest"])
        await trio.sleep(5)  # ok: MockClock time (autojump), no wall-clock wait


def harness(nursery: trio.Nursery, ids: tuple[str, ...], answers: dict[str, Any],
            **kw: float) -> tuple[FabricTests, dict[str, Session]]:
    box: list[FabricTests] = []
    sessions = {n: Session(lambda: box[0], n, nursery, answers.get(n)) for n in ids}
    links = FleetLinks[Session]()
    for n, session in sessions.items():
        links.add(n, session)
    box.append(FabricTests(Registry(*ids), links, **kw))  # type: ignore[arg-type]
    return box[0], sessions


async def test_progress_forever_is_cut_at_the_install_ceiling_fixed_when_prepare_started(
        autojump_clock: trio.testing.MockClock) -> None:
    events: list[dict[str, Any]] = []

    async def emit(event: dict[str, Any]) -> None:
        events.append(event)

    async with trio.open_nursery() as nursery:
        tests, sessions = harness(nursery, ("gpu-01", "gpu-02"), {"gpu-02": progress_forever}, grace=10,
                                  install_wait=60)
        t0 = trio.current_time()
        report = await tests.run("gpu-01", "gpu-02", emit)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert 60 <= took < 61, took  # gpu-01's prepare took 0.5 s; gpu-02's 60 s, not a second more
    assert report["status"] == "crit" and report["exit_code"] == 2
    [rail] = report["rails"]
    assert rail["detail"] == ("gpu-02 could not get ib_write_bw ready in time: the prepare phase's deadline (60 s, "
                              "fixed when it started) passed"), rail["detail"]
    assert not sessions["gpu-01"].tests_sent("server") and not sessions["gpu-01"].tests_sent("client")
    assert tests.busy() == [] and tests._locks == {}  # nothing held, nothing kept


async def test_a_silent_prepare_gives_up_after_the_grace(autojump_clock: trio.testing.MockClock) -> None:
    async def silent(msg: m.FabricTest):  # type: ignore[no-untyped-def]
        await trio.sleep_forever()
        yield m.FabricTestResult(request_id=msg.request_id)

    async with trio.open_nursery() as nursery:
        tests, _ = harness(nursery, ("a", "b"), {"b": silent}, grace=10, install_wait=600)
        t0 = trio.current_time()
        report = await tests.run("a", "b", _ignore)
        assert 10 <= trio.current_time() - t0 < 11  # no progress said: the install ceiling does not apply
        nursery.cancel_scope.cancel()
    assert "the prepare phase's deadline (10 s" in report["rails"][0]["detail"]


async def _ignore(event: dict[str, Any]) -> None:
    pass


async def test_a_test_of_two_other_nodes_runs_while_one_pair_is_stuck(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        tests, _ = harness(nursery, ("gpu-01", "gpu-02", "gpu-03", "gpu-04"), {"gpu-02": progress_forever},
                           install_wait=600)
        stuck: list[dict[str, Any]] = []

        async def first() -> None:
            stuck.append(await tests.run("gpu-01", "gpu-02", _ignore))

        nursery.start_soon(first)
        await trio.sleep(1)  # ok: MockClock time (autojump), no wall-clock wait
        assert tests.busy() == ["gpu-01", "gpu-02"]
        t0 = trio.current_time()
        other = await tests.run("gpu-03", "gpu-04", _ignore)
        assert trio.current_time() - t0 < 10 and other["status"] == "ok", other
        assert not stuck  # still stuck, alone
        waiting: list[dict[str, Any]] = []

        async def heard(event: dict[str, Any]) -> None:
            waiting.append(event)

        shared = await tests.run("gpu-03", "gpu-01", heard)  # shares gpu-01: waits for the stuck one's deadline
        assert waiting[0] == {"event": "waiting",
                              "message": "gpu-01 is in another fabric test; this one starts after it"}
        assert stuck and stuck[0]["status"] == "crit" and shared["status"] == "ok"
        assert trio.current_time() - t0 < 610
        nursery.cancel_scope.cancel()


async def test_a_to_b_beside_b_to_a_does_not_deadlock(autojump_clock: trio.testing.MockClock) -> None:
    reports: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        tests, _ = harness(nursery, ("gpu-01", "gpu-02"), {})
        with trio.fail_after(120):
            async with trio.open_nursery() as both:
                both.start_soon(lambda: _collect(reports, tests.run("gpu-01", "gpu-02", _ignore)))
                both.start_soon(lambda: _collect(reports, tests.run("gpu-02", "gpu-01", _ignore)))
        nursery.cancel_scope.cancel()
    assert [r["status"] for r in reports] == ["ok", "ok"]


async def _collect(into: list[dict[str, Any]], run: Any) -> None:
    into.append(await run)


async def test_the_client_dials_b_as_registered_and_a_system_port_is_refused(
    autojump_clock: trio.testing.MockClock
) -> None:
    async def forged(msg: m.FabricTest):  # type: ignore[no-untyped-def]
        if msg.role == "server":
            # A newer-looking answer naming another host is decoded without it (unknown fields are ignored).
            raw = msgspec.json.encode({"type": "FabricTestResult", "request_id": msg.request_id, "phase": "ready",
                                       "ok": True, "tcp_port": port[0], "server_host": "169.254.169.254"})
            yield m.decode_agent_message(raw)
            await trio.sleep(1)  # ok: MockClock time (autojump), no wall-clock wait
        yield m.FabricTestResult(request_id=msg.request_id, ok=True, output=TABLE)

    port = [22]
    async with trio.open_nursery() as nursery:
        tests, sessions = harness(nursery, ("gpu-01", "gpu-02"), {"gpu-02": forged})
        refused = await tests.run("gpu-01", "gpu-02", _ignore)
        assert refused["rails"][0]["detail"] == ("gpu-02 answered TCP port 22 for its ib_write_bw server: outside "
                                                 "1024-65535, so it is not passed to the client; refused")
        assert not sessions["gpu-01"].tests_sent("client")  # A was never sent anywhere
        assert any(isinstance(x, m.FabricTestCancel) for x in sessions["gpu-02"].got)  # B's server stopped
        port[0] = 18515
        ok = await tests.run("gpu-01", "gpu-02", _ignore)
        assert ok["status"] == "ok"
        [client] = sessions["gpu-01"].tests_sent("client")
        assert (client.server_host, client.server_port) == ("10.0.0.2", 18515)  # gpu-02 as the server has it
        nursery.cancel_scope.cancel()


async def test_a_node_inventing_notes_reaches_the_operator_at_most_max_notes_times(
        autojump_clock: trio.testing.MockClock) -> None:
    from llmgw.server.fabric_test import MAX_NOTES

    async def chatty(msg: m.FabricTest):  # type: ignore[no-untyped-def]
        for i in range(10_000):
            yield m.FabricTestResult(request_id=msg.request_id, phase="progress", ok=True, notes=[f"note {i}"])
            await trio.sleep(0.001)  # ok: MockClock time (autojump), no wall-clock wait

    heard: list[dict[str, Any]] = []

    async def emit(event: dict[str, Any]) -> None:
        heard.append(event)

    async with trio.open_nursery() as nursery:
        tests, _ = harness(nursery, ("a", "b"), {"b": chatty}, install_wait=30)
        report = await tests.run("a", "b", emit)
        nursery.cancel_scope.cancel()
    assert len([e for e in heard if e["event"] == "note"]) == MAX_NOTES
    assert len(report["notes"]) == MAX_NOTES and report["status"] == "crit"


async def test_runs_are_D_seconds_fitted_to_the_timeout_and_an_old_agent_gets_iterations(
        autojump_clock: trio.testing.MockClock) -> None:
    """Issue 39: every FabricTest carries -D (5 s, or what fits in the rail timeout beside 3 s of
    start-up); where an agent does not list the feature, both sides get -n iterations, said in the notes."""
    from llmgw.server.fabric_test import default_duration

    assert [default_duration(t) for t in (60, 8, 5, 4, 3, 1)] == [5, 5, 2, 1, 0, 0]
    async with trio.open_nursery() as nursery:
        tests, sessions = harness(nursery, ("a", "b"), {})
        report = await tests.run("a", "b", _ignore, rail_timeout=6)
        assert report["duration"] == 3 and {t.duration for t in sessions["b"].tests_sent("server")} == {3}
        assert {t.duration for t in sessions["a"].tests_sent("client")} == {3}
        with pytest.raises(Refused, match="does not fit in the 6 s rail timeout"):
            await tests.run("a", "b", _ignore, rail_timeout=6, duration=4)
        old = sessions["b"]
        old.supports = lambda feature: feature != m.FEATURE_FABRIC_TEST_DURATION  # type: ignore[method-assign]
        before = len(old.tests_sent("server"))
        report = await tests.run("a", "b", _ignore)
        nursery.cancel_scope.cancel()
    assert report["duration"] == 0 and report["notes"][0].startswith("b: agent too old for duration runs (-D)")
    assert {(t.duration, t.iterations) for t in old.tests_sent("server")[before:]} == {(0, 5000)}
