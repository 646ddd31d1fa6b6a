"""An agent dies (kill -9) or stops (SIGSTOP) past `lost_after`, and a fleet connection is cut
in the middle of a message, under steady openai-client load. The gateway talks to engines
directly, so none of these may cost a client a request; the control plane must heal (replace,
re-adopt, drop the surplus) and leave exactly the engines it wants."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.e2e.harness import Proc, get_json, wait_until
from tests.faults.fleet import CutProxy, Fleet, Load, engine_pids, metric


def _agent_fault(tmp_path: Path, procs: list[Proc], how: str) -> None:
    fleet = Fleet(tmp_path, procs)
    fleet.add_node("gpu-03")  # room for the replacement
    wait_until(lambda: get_json(f"{fleet.url}/api/v1/nodes") and
               {n["id"] for n in get_json(f"{fleet.url}/api/v1/nodes")
                if n["state"] == "ready"} == {"gpu-01", "gpu-02", "gpu-03"},
               "three nodes ready")
    victim = fleet.ready()[0]
    node = victim["shards"][0]["node"]
    agent = fleet.agents[node]
    with Load(fleet.url) as load:
        load.wait_successes(20, "traffic flowing")
        if how == "kill -9":
            agent.kill9()
        else:
            agent.signal(signal.SIGSTOP)
        hit_at = time.monotonic()
        wait_until(lambda: fleet.server.nodes()[node]["state"] == "lost", f"{node} lost", deadline=30)
        lost = time.monotonic() - hit_at
        wait_until(lambda: (ready := fleet.ready()) and len(ready) == 2
                   and all(r["shards"][0]["node"] != node for r in ready)
                              and ready, "a replacement ready elsewhere", deadline=60)
        fleet.wait_ready(2, "both replicas in rotation")
        recovered = time.monotonic() - hit_at
        load.wait_successes(20, "traffic on the replacement")
        # The agent comes back: it adopts the engine it left running, and the surplus replica goes.
        if how == "kill -9":
            procs.remove(agent)
            fleet.start_agent(node)
        else:
            agent.signal(signal.SIGCONT)
        back_at = time.monotonic()
        wait_until(lambda: fleet.server.nodes()[node]["state"] == "ready", f"{node} ready again", deadline=30)
        wait_until(lambda: len(engine_pids(tmp_path)) == 2 and len(fleet.ready()) == 2, "exactly two engines left",
                   deadline=60)
        settled = time.monotonic() - back_at
        load.wait_successes(20, "traffic after the agent came back")
    failures = load.failures()
    load.report(f"agent {how} past lost_after",
                f"{node} lost after {lost:.1f}s, replacement in rotation {recovered:.1f}s after the fault; "
                f"back to exactly 2 engines {settled:.1f}s after the agent returned")
    assert failures == [], failures[:5]
    # Whichever of the adopted engine and its replacement the surplus rule kept, the engines
    # running are exactly those of the ready replicas.
    assert engine_pids(tmp_path) == {r["shards"][0]["pid"] for r in fleet.ready()}


def test_agent_killed(tmp_path: Path, procs: list[Proc]) -> None:
    _agent_fault(tmp_path, procs, "kill -9")


def test_agent_stopped_past_lost_after(tmp_path: Path, procs: list[Proc]) -> None:
    _agent_fault(tmp_path, procs, "SIGSTOP")


def test_fleet_connection_cut_mid_message(tmp_path: Path, procs: list[Proc]) -> None:
    proxy = CutProxy()
    try:
        fleet = Fleet(tmp_path, procs, fleet_via=proxy.start)
        before = {r["id"]: r["shards"][0]["pid"] for r in fleet.ready()}
        registers = metric(fleet.url, "llmgw_fleet_messages_total", type="Register")
        with Load(fleet.url) as load:
            load.wait_successes(20, "traffic flowing")
            proxy.cut()
            cut_at = time.monotonic()
            wait_until(lambda: proxy.cuts >= 1, "a connection cut mid-message", deadline=10)
            wait_until(lambda: metric(fleet.url, "llmgw_fleet_messages_total", type="Register") >= registers
                       + proxy.cuts,
                       "the agents registered again", deadline=30)
            wait_until(lambda: all(n["state"] == "ready" and n["connected"] for n in fleet.server.nodes().values()),
                       "every node ready and connected", deadline=30)
            recovered = time.monotonic() - cut_at
            load.wait_successes(20, "traffic after the cut")
        failures = load.failures()
        load.report("fleet connection cut mid-message",
                    f"{proxy.cuts} agent stream(s) cut; registered and ready again {recovered:.1f}s later")
        assert failures == [], failures[:5]
        # Nothing corrupted: the same replicas on the same engines, nothing restarted or added.
        assert {r["id"]: r["shards"][0]["pid"] for r in fleet.ready()} == before
        assert engine_pids(tmp_path) == set(before.values())
    finally:
        proxy.close()
