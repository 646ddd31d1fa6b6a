"""A server and three agents as real processes: join, drop out, come back, survive a restart."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.harness import Proc, Server, ctl_json, make_sim_node, start_agent, wait_until


def states(server: Server) -> dict[str, str]:
    return {n["id"]: n["state"] for n in ctl_json(server.url, "nodes")}


def test_three_agents_liveness_and_server_restart(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path)
    procs.append(server.start())
    agents: dict[str, Proc] = {}
    configs: dict[str, Path] = {}
    for i in (1, 2, 3):
        node = f"gpu-0{i}"
        configs[node] = make_sim_node(tmp_path, node, server.fleet_url)
        agents[node] = start_agent(tmp_path, node, configs[node])
        procs.append(agents[node])
    everyone = [*procs]

    wait_until(lambda: all(n.get("state") == "ready" for n in server.nodes().values()) and len(server.nodes()) == 3,
               "three nodes ready", procs=everyone)
    # The operator's view, through the real CLI.
    listed = ctl_json(server.url, "nodes")
    assert sorted(n["id"] for n in listed) == ["gpu-01", "gpu-02", "gpu-03"]
    assert {n["state"] for n in listed} == {"ready"}
    assert all(n["gpus"] == 8 and n["ports"] == 4 for n in listed)
    assert all(n["last_heartbeat_age"] is not None for n in wait_until(
        lambda: [n for n in server.nodes().values() if n["last_heartbeat_age"] is not None] or None,
        "a heartbeat", procs=everyone) )

    # kill -9 one agent: unreachable, then lost (lost_after is 2 s in the test config).
    agents["gpu-02"].kill9()
    alive = [p for p in everyone if p is not agents["gpu-02"]]
    wait_until(lambda: server.nodes()["gpu-02"]["state"] == "unreachable", "gpu-02 unreachable", procs=alive)
    assert states(server)["gpu-01"] == "ready"
    wait_until(lambda: server.nodes()["gpu-02"]["state"] == "lost", "gpu-02 lost", procs=alive)
    assert states(server) == {"gpu-01": "ready", "gpu-02": "lost", "gpu-03": "ready"}

    # Start it again: ready.
    agents["gpu-02"] = start_agent(tmp_path, "gpu-02", configs["gpu-02"])
    procs.append(agents["gpu-02"])
    everyone = [server.proc, *agents.values()]
    wait_until(lambda: server.nodes()["gpu-02"]["state"] == "ready", "gpu-02 ready again", procs=everyone)

    # Restart the server without touching the agents: all three come back on their own.
    pids = {n: a.pid for n, a in agents.items()}
    assert server.proc is not None
    assert server.proc.stop() == 0
    procs.append(server.start())
    wait_until(lambda: states(server) == {"gpu-01": "ready", "gpu-02": "ready", "gpu-03": "ready"},
               "all three ready after the server restart", procs=[server.proc, *agents.values()])
    assert {n: a.pid for n, a in agents.items()} == pids and all(a.alive() for a in agents.values())
    assert "the server is shutting down" in agents["gpu-01"].log()
