"""The control plane killed (kill -9) and restarted under load, with its agents away for a while
(after an outage their backoff spreads them over up to 30 s; here they are held with SIGSTOP, the
engines serving on): a gateway that follows it must not take the restarted control plane's
still-empty endpoint set (issue 41, finding 1: 1,133 × 503 over 11 s). It keeps its last set,
says so, and follows the real one once the control plane has settled on the fleet that was there."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import Proc, wait_until
from tests.e2e.test_gateway_remote import connected, start_gateway
from tests.faults.fleet import Fleet, Load

AWAY = 3.0  # seconds the agents stay away after the new control plane listens: longer than its settle (0.5 s)


def control_plane(metrics_url: str) -> str:
    return str(httpx.get(f"{metrics_url}/healthz", timeout=5).json().get("control_plane"))


def test_a_restarted_control_plane_does_not_empty_a_remote_gateway(tmp_path: Path, procs: list[Proc]) -> None:
    fleet = Fleet(tmp_path, procs)
    gw_proc, gw, gw_metrics = start_gateway(tmp_path, "gateway", fleet.server.fleet_url, "--insecure")
    procs.append(gw_proc)
    wait_until(lambda: control_plane(gw_metrics) == "following", "the gateway to follow", procs=[gw_proc])
    with Load(gw) as load:
        load.wait_successes(20, "traffic through the gateway")
        assert fleet.server.proc is not None
        for agent in fleet.agents.values():
            agent.signal(signal.SIGSTOP)  # away: their streams break with the server, they dial only when let go
        fleet.server.proc.kill_group()  # kill -9, as systemd's cgroup kill would take its workers too
        fleet.server.proc.kill9()
        procs.remove(fleet.server.proc)
        wait_until(lambda: connected(gw_metrics) == 0, "the gateway to notice", procs=[gw_proc])
        procs.append(fleet.server.start())
        restarted = time.monotonic()
        wait_until(lambda: control_plane(gw_metrics) == "settling", "the gateway to follow the settling control plane",
                   procs=[gw_proc])
        wait_until(lambda: time.monotonic() - restarted > AWAY, "the agents' time away", deadline=AWAY + 5)
        load.wait_successes(20, "traffic while the control plane settles")
        for agent in fleet.agents.values():
            agent.signal(signal.SIGCONT)
        wait_until(lambda: control_plane(gw_metrics) == "following", "the control plane to settle", procs=procs)
        wait_until(lambda: len(fleet.ready()) == 2, "both replicas adopted")
        load.wait_successes(20, "traffic after settling")
    failures = load.failures()
    unavailable = [o for o in failures if "503" in o.error]
    load.report("control-plane kill -9 and restart, agents away 3 s, through a remote gateway",
                f"{len(unavailable)} × 503; settled {time.monotonic() - restarted:.1f}s after the restart")
    assert not unavailable, unavailable[:3]
    assert not failures, failures[:3]
    log = gw_proc.log()
    assert "the control plane is settling" in log and "keeping the last endpoint set" in log
    assert "the control plane has settled" in log


@pytest.mark.parametrize(("workers", "how"), [(1, "kill -9"), (2, "kill -9"), (2, "kill -9 alone"), (1, "SIGTERM")],
                         ids=["one-process", "local-workers", "local-workers-orphaned", "one-process-sigterm"])
def test_a_restarted_server_serves_its_last_endpoint_set_while_it_settles(tmp_path: Path, procs: list[Proc],
                                                                          workers: int, how: str) -> None:
    """The server's own gateway (one process, or its local workers, started afresh with it) serves
    the endpoint set it last published, kept in its state directory, while its agents are away:
    the port is down only while no server listens, and no request gets a 503 from an empty set.
    "kill -9 alone": the server's pid only, as outside systemd; its workers see it gone and exit
    (test_gateway_workers_orphaned), so the new server's workers serve alone."""
    fleet = Fleet(tmp_path, procs, extra_config=f"  workers: {workers}\n")  # continues FAULT_GATEWAY's section
    with Load(fleet.url) as load:
        load.wait_successes(20, "traffic flowing")
        assert fleet.server.proc is not None
        for agent in fleet.agents.values():
            agent.signal(signal.SIGSTOP)
        if how == "SIGTERM":  # a routine restart: the streams closing on the way down are not what it keeps
            fleet.server.proc.stop(timeout=30)
        elif how == "kill -9 alone":
            fleet.server.proc.kill9()
        else:
            fleet.server.proc.kill_group()  # kill -9 of the server and its workers (systemd's cgroup kill)
            fleet.server.proc.kill9()
        procs.remove(fleet.server.proc)
        procs.append(fleet.server.start())
        listening = time.monotonic()
        wait_until(lambda: time.monotonic() - listening > AWAY, "the agents' time away", deadline=AWAY + 5)
        load.wait_successes(20, "traffic while the server settles")
        for agent in fleet.agents.values():
            agent.signal(signal.SIGCONT)
        wait_until(lambda: len(fleet.ready()) == 2, "both replicas adopted")
        wait_until(lambda: "all 2 known nodes have registered" in fleet.server.proc.log(), "the server to settle")
        load.wait_successes(20, "traffic after settling")
    failures = load.failures(avoidable_only=False)
    unavailable = [o for o in failures if "503" in o.error]
    after = [o for o in failures if o.started > listening]
    load.report(f"server ({'one process' if workers == 1 else f'{workers} local workers'}) {how} and restart, "
                "agents away 3 s", f"{len(unavailable)} × 503; {len(after)} failed after the new server listened "
                f"({len(failures)} while none listened)")
    assert not unavailable, unavailable[:3]
    assert not after, after[:3]
    assert "serving the last settled endpoint set (2 endpoint(s) on 2 node(s) not back yet)" in fleet.server.proc.log()
    if workers > 1:  # its own workers only, each once
        names = [g["name"] for g in fleet.server.get("/api/v1/gateways") if g["kind"] == "worker"]
        assert sorted(names) == ["worker-0", "worker-1"], names
