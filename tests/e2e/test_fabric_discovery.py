"""The fabric map end to end: a real server, agents on simulated nodes whose stand-in
ibnetdiscover and saquery print a simulated two-leaf fabric; the server finds the fabric, names
its adapters by node, sees a cable degrade and the master fail over without splitting the fabric."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import (
    FAST_FLEET,
    SIM_FABRIC_FAST,
    Proc,
    Server,
    ctl,
    make_sim_fabric,
    make_sim_node,
    run_llmgw,
    start_agent,
    wait_until,
)

pytestmark = pytest.mark.e2e

FABRIC_FAST = FAST_FLEET + SIM_FABRIC_FAST
NODES = ["node-1", "node-2", "node-3", "node-4"]


def make_fabric(out: Path, *flags: str) -> dict:
    return make_sim_fabric(out, NODES, *flags)


def test_discovery_failover_and_a_degraded_cable(tmp_path: Path, procs: list[Proc]) -> None:
    fabric_dir = tmp_path / "fabric"
    first = make_fabric(fabric_dir)
    server = Server(tmp_path, FABRIC_FAST)
    procs.append(server.start())
    for node in NODES:
        config = make_sim_node(tmp_path, node, server.fleet_url, "", "--ib-ports", "2", "--fabric", str(fabric_dir))
        procs.append(start_agent(tmp_path, node, config))
    bare = make_sim_node(tmp_path, "node-bare", server.fleet_url, "", "--ib-ports", "2")  # no tools
    procs.append(start_agent(tmp_path, "node-bare", bare))

    def found() -> dict | None:
        fabrics = server.get("/api/v1/fabrics")
        return fabrics[0] if len(fabrics) == 1 and fabrics[0]["topology"] and fabrics[0]["master"] else None

    fabric = wait_until(found, "the fabric found, with its topology and master", procs=procs)
    assert fabric["id"] == min(first["subnet_managers"]) and fabric["master"]["guid"] == first["master"]
    assert fabric["standbys"] and fabric["problems"] == []
    assert fabric["topology"]["switches"] == 6 and fabric["topology"]["adapters"] == 8
    nodes = wait_until(lambda: server.nodes() if len(server.nodes()) == 5 else None, "five nodes", procs=procs)
    assert "discover" in nodes["node-1"]["features"] and "discover" not in nodes["node-bare"]["features"]

    topology = server.get(f"/api/v1/fabrics/{fabric['id']}/topology")
    assert {(a["node"], a["device"]) for a in topology["adapters"]} == {(n, f"mlx5_{d}") for n in NODES for d in (0, 1)}
    assert {s["tier"] for s in topology["switches"]} == {"leaf", "spine"}
    assert topology["summary"]["rail_optimised"] is True

    # The master fails over and a cable of node-2 trains at 1x (the dump and node-2's own sysfs
    # say so alike, as on a real fabric): the fabric keeps its id.
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "node-2"), "mlx5_1", "1", "up",
                     "--rate", "100 Gb/sec (1X NDR)").returncode == 0
    make_fabric(fabric_dir, "--failover", "--degrade", "node-2")

    def changed() -> dict | None:
        detail = server.get(f"/api/v1/fabrics/{fabric['id']}")
        kinds = {p["kind"] for p in detail["problems"]}
        return detail if {"master_changed", "no_standby", "degraded_link"} <= kinds else None

    detail = wait_until(changed, "the failover and the degraded cable seen", procs=procs)
    assert [f["id"] for f in server.get("/api/v1/fabrics")] == [fabric["id"]]  # not split in two
    assert detail["master"]["guid"] != first["master"]
    assert detail["master_changes"] and detail["master_changes"][-1]["old"] == first["master"]
    assert [{link["a"]["name"], link["b"]["name"]} & {"node-2 mlx5_1"} for link in detail["degraded_links"]] == [
        {"node-2 mlx5_1"}]

    text = httpx.get(f"{server.url}/metrics").text
    assert f'llmgw_fabric_master_sm{{fabric="{fabric["id"]}",guid="{detail["master"]["guid"]}"}} 1.0' in text
    assert f'llmgw_fabric_problems{{fabric="{fabric["id"]}",kind="degraded_link"}} 1.0' in text

    table = ctl(server.url, "fabrics")
    assert table.returncode == 0 and fabric["id"] in table.stdout
    one = ctl(server.url, "fabrics", fabric["id"])
    assert one.returncode == 0, one.stderr
    for words in ("degraded cables", "node-2 mlx5_1", "master changes"):
        assert words in one.stdout
    missing = ctl(server.url, "fabrics", "0xdeadbeef")
    assert missing.returncode == 1 and "no fabric" in missing.stderr


def test_a_dump_past_the_servers_message_limit_is_refused_by_the_agent_not_the_stream(
        tmp_path: Path, procs: list[Proc]) -> None:
    """The server reads messages up to fleet.max_message (256 KiB here) and says so in its Welcome;
    an ibnetdiscover dump whose compressed form would not fit comes back as an error naming that
    limit, and the node's stream stays up (a message past the limit would end it at the server)."""
    fabric_dir = tmp_path / "fabric"
    make_fabric(fabric_dir)
    big = (fabric_dir / "ibnetdiscover.txt").read_text() + "# " + os.urandom(512 * 1024).hex() + "\n"
    (fabric_dir / "ibnetdiscover.txt").write_text(big)  # about 1 MB that compresses to about half
    server = Server(tmp_path, FABRIC_FAST)
    procs.append(server.start())
    config = make_sim_node(tmp_path, "node-1", server.fleet_url, "", "--ib-ports", "2", "--fabric", str(fabric_dir))
    agent = start_agent(tmp_path, "node-1", config)
    procs.append(agent)

    def refused() -> str | None:
        fabrics = server.get("/api/v1/fabrics")
        failed = [p["message"] for f in fabrics for p in f["problems"] if p["kind"] == "tool_failed"]
        return failed[0] if failed else None

    message = wait_until(refused, "the oversized dump answered with an error", procs=procs)
    assert "ibnetdiscover" in message and "the server's fleet.max_message is 262,144 bytes" in message, message
    assert server.nodes()["node-1"]["connected"] is True
    assert agent.log().count("registered as node-1") == 1, agent.log()[-2000:]
    assert "exceeds the limit" not in server.proc.log()  # type: ignore[union-attr]
