"""A replica spanning two simulated nodes, end to end: real server, real agents, simulated
engines joining like vLLM's ranks (rank 0 waits for rank 1 before /health answers 200).

Asserted on what each launched process received (its launch record: argv and environment),
for InfiniBand and for RoCE with its GID index; ready only when both ranks are; replaced whole
when rank 1 dies (rank 0 keeps answering /health, so only the control plane can take the
half-alive replica out); stopped whole; and a port taken down under a running agent takes its
node out of multi-node placement, with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    bearer,
    ctl,
    engines_config,
    make_sim_node,
    pid_alive,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)

TOKEN = "ops-5e1f2a"
API = f'api:\n  operator_tokens: ["sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
REQUIRED = ["NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"]


def catalog(gpus: int, required: list[str], env: str = "") -> str:
    flags = ", ".join(f'"--fail-if-env-missing", "{name}"' for name in required)
    return f"""\
models:
  - name: big
    replicas: 1
    profiles:
      - name: two-nodes
        engine: sim
        nodes: 2
        gpus: {gpus}
        args: ["--startup-delay", "0.5", {flags}]
""" + (f"        env: {env}\n" if env else "")


def fleet(tmp_path: Path, procs: list[Proc], gpus: int, required: list[str], *node_args: str, heartbeat: str = "0.25s",
          env: str = "") -> Server:
    config = engines_config(catalog(gpus, required, env), API).replace("heartbeat_interval: 0.25s",
                                                                       f"heartbeat_interval: {heartbeat}")
    server = Server(tmp_path, config, token=TOKEN)
    procs.append(server.start())
    for node in ("gpu-01", "gpu-02"):
        cfg = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, *node_args)
        procs.append(start_agent(tmp_path, node, cfg, "--stop-engines-on-exit"))
    return server


def launch_record(tmp_path: Path, shard_id: str) -> dict[str, Any]:
    [log] = list(tmp_path.glob(f"**/logs/{shard_id}.log"))
    for line in log.read_text().splitlines():
        if line.startswith("llmgw-sim-engine launch: "):
            return json.loads(line.split(": ", 1)[1])
    raise AssertionError(f"no launch record in {log}:\n{log.read_text()}")


def ready_replica(server: Server, seen: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The one replica once ready; every replica seen on the way is kept to check an invariant."""
    rs = replicas(server)
    seen.extend(rs)
    return rs[0] if len(rs) == 1 and rs[0]["state"] == "ready" else None


def never_ready_before_both(seen: list[dict[str, Any]]) -> None:
    for r in seen:
        if r["state"] == "ready":
            assert len(r["shards"]) == 2 and all(s["state"] == "ready" for s in r["shards"]), r


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_two_node_replica_ib_launch_ready_replace_stop(tmp_path: Path, procs: list[Proc]) -> None:
    server = fleet(tmp_path, procs, 4, REQUIRED, "--gpus", "4", "--ib-ports", "4")
    seen: list[dict[str, Any]] = []
    replica = wait_until(lambda: ready_replica(server, seen), "the 2-node replica ready", procs=procs)
    never_ready_before_both(seen)
    rank0, rank1 = sorted(replica["shards"], key=lambda s: s["rank"])
    assert (rank0["rank"], rank1["rank"]) == (0, 1) and {rank0["node"], rank1["node"]} == {"gpu-01", "gpu-02"}
    assert replica["endpoint"] == rank0["endpoint"]  # only rank 0 serves

    first, second = launch_record(tmp_path, rank0["shard_id"]), launch_record(tmp_path, rank1["shard_id"])
    for record, rank in ((first, "0"), (second, "1")):
        argv = record["argv"]
        assert arg(argv, "--nnodes") == "2" and arg(argv, "--node-rank") == rank
        assert arg(argv, "--master-addr") == "127.0.0.1"
        assert arg(argv, "--master-port") == arg(first["argv"], "--master-port")
        assert record["env"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"
        assert record["env"]["NCCL_SOCKET_IFNAME"] == "=lo" and record["env"]["GLOO_SOCKET_IFNAME"] == "lo"
        assert "NCCL_IB_GID_INDEX" not in record["env"]  # InfiniBand: none
        assert len(record["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == 4
        # Each rank's own address (its node's advertise_host), and NVML's GPU numbering for CUDA.
        assert record["env"]["VLLM_HOST_IP"] == "127.0.0.1" and record["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "--headless" in second["argv"] and "--headless" not in first["argv"]

    # Rank 1 dies; rank 0 still answers /health. The whole replica goes, a new one comes.
    old = {s["shard_id"]: s["pid"] for s in replica["shards"]}
    os.kill(rank1["pid"], signal.SIGKILL)
    fresh = wait_until(lambda: (r := ready_replica(server, seen))
                       and not set(s["shard_id"] for s in r["shards"]) & set(old) and r,
                       "a new 2-node replica", procs=procs)
    assert len(fresh["shards"]) == 2
    wait_until(lambda: not pid_alive(old[rank0["shard_id"]]), "the old rank 0 stopped", procs=procs)
    never_ready_before_both(seen)

    # A stop stops every rank.
    server.config.write_text(server.config.read_text().replace("replicas: 1", "replicas: 0"))
    assert ctl(server.url, "reload", env={"LLMGW_TOKEN": TOKEN}).returncode == 0
    wait_until(lambda: replicas(server) == [], "the replica gone", procs=procs)
    for shard in fresh["shards"]:
        wait_until(lambda shard=shard: not pid_alive(shard["pid"]), f"rank {shard['rank']} stopped", procs=procs)


def test_two_node_replica_roce_gets_its_gid_index(tmp_path: Path, procs: list[Proc]) -> None:
    server = fleet(tmp_path, procs, 8, [*REQUIRED, "NCCL_IB_GID_INDEX"], "--profile", "roce-8nic")
    replica = wait_until(lambda: ready_replica(server, []), "the 2-node RoCE replica ready", procs=procs)
    for shard in replica["shards"]:
        record = launch_record(tmp_path, shard["shard_id"])
        assert record["env"]["NCCL_IB_GID_INDEX"] == "3"
        assert record["env"]["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{i}:1" for i in range(8))
        env = {e["name"]: e["value"] for e in shard["launch_env"]}
        assert env["NCCL_IB_GID_INDEX"] == "3"


def test_a_rail_down_past_nccls_retry_window_takes_the_replica_out_and_one_back_within_it_costs_nothing(
        tmp_path: Path, procs: list[Proc]) -> None:
    # NCCL_IB_TIMEOUT 18 (NCCL 2.19's default): its queue pairs survive 8.6 s of silence
    # (llmgw.fabric.qpretry), and so does the replica (issue 46: one rail INIT stopped it outright).
    server = fleet(tmp_path, procs, 2, REQUIRED, "--gpus", "2", "--ib-ports", "2", heartbeat="0.5s",
                   env='{NCCL_IB_TIMEOUT: "18"}')
    replica = wait_until(lambda: ready_replica(server, []), "the 2-node replica ready", procs=procs)

    def port_seen(state: str) -> bool:
        return any(p["port"] == "mlx5_1/1" and p["state"].upper() == state
                   for p in server.get("/api/v1/nodes/gpu-02")["port_states"])

    # A blip: down, seen, back, seen — the same replica, the same engines, never out of rotation.
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-02"), "mlx5_1", "1", "down").returncode == 0
    wait_until(lambda: port_seen("DOWN"), "the port seen DOWN", procs=procs, interval=0.05)
    assert replicas(server)[0]["state"] == "ready"
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-02"), "mlx5_1", "1", "up").returncode == 0
    wait_until(lambda: port_seen("ACTIVE"), "the port seen ACTIVE again", procs=procs, interval=0.05)
    [same] = replicas(server)
    assert same["id"] == replica["id"] and same["state"] == "ready"
    assert [s["pid"] for s in same["shards"]] == [s["pid"] for s in replica["shards"]]

    # Down for good: out of rotation once the window has passed, saying why.
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-02"), "mlx5_1", "1", "down").returncode == 0
    wait_until(lambda: port_seen("DOWN"), "the port seen DOWN again", procs=procs, interval=0.05)
    seen_down = time.monotonic()
    wait_until(lambda: replicas(server)[0]["state"] != "ready", "the replica out of rotation", procs=procs,
               interval=0.05,
               deadline=60)
    assert time.monotonic() - seen_down > 5, "left rotation before NCCL's retry window had passed"
    assert server.proc is not None
    wait_until(lambda: "past NCCL's 9s retry window" in server.proc.log(), "the reason in the server's log",
               procs=procs)
    metrics = httpx.get(f"{server.url}/metrics", headers=bearer(TOKEN), timeout=5).text
    assert [line for line in metrics.splitlines() if line.startswith("llmgw_ib_port_active{")
            and 'device="mlx5_1"' in line and 'node="gpu-02"' in line and line.endswith(" 0.0")]
    pending = wait_until(lambda: (rs := replicas(server)) and rs[0]["state"] == "pending" and rs[0],
                         "the replica pending",
                         procs=procs)
    assert "fabric ib: 1 of 2 nodes (gpu-01)" in pending["reason"], pending["reason"]
    assert "gpu-02: fabric ib not usable (mlx5_1: no ACTIVE port (port 1 DOWN (Disabled)" in pending["reason"]
    for shard in replica["shards"]:
        wait_until(lambda shard=shard: not pid_alive(shard["pid"]), "the broken replica's ranks stopped", procs=procs)
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-02"), "mlx5_1", "1", "up").returncode == 0
    wait_until(lambda: ready_replica(server, []), "placed again once the port is up", procs=procs)


def test_a_node_advertising_an_address_it_does_not_hold_is_refused_with_the_reason(tmp_path: Path,
                                                                                   procs: list[Proc]) -> None:
    # gpu-02 advertises a documentation address (RFC 5737) no interface here holds: the ranks of a
    # multi-node engine could not bootstrap on it, so its rank is refused rather than hung.
    config = engines_config(catalog(2, REQUIRED), API)
    server = Server(tmp_path, config, token=TOKEN)
    procs.append(server.start())
    for node, extra in (("gpu-01", ""), ("gpu-02", "advertise_host: 192.0.2.77\n")):
        cfg = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT + extra, "--gpus", "2", "--ib-ports", "2")
        procs.append(start_agent(tmp_path, node, cfg, "--stop-engines-on-exit"))
    refused = "this node's advertise_host 192.0.2.77 is on no interface here"

    def seen() -> str | None:
        for event in server.get("/api/v1/events"):
            if refused in str(event):
                return str(event)
        return None

    event = wait_until(seen, "the rank on gpu-02 refused with the reason", procs=procs)
    assert "set advertise_host in the agent config" in event
    assert all(r["state"] != "ready" for r in replicas(server))


def test_events_of_a_node_hold_its_two_node_replica_its_ports_and_its_drain(tmp_path: Path, procs: list[Proc]) -> None:
    """Issue 46: `events --node` missed the node's own history: a 2-node replica's events carried
    no node, a drain's move was logged under rank 0's node, a port going INIT and back made none."""
    server = fleet(tmp_path, procs, 2, REQUIRED, "--gpus", "2", "--ib-ports", "2")
    replica = wait_until(lambda: ready_replica(server, []), "the 2-node replica ready", procs=procs)
    as_operator = {"LLMGW_TOKEN": TOKEN}

    def events(node: str) -> list[dict[str, Any]]:
        result = ctl(server.url, "events", "--node", node, "-o", "json", env=as_operator)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    for node in ("gpu-01", "gpu-02"):
        mine = [e for e in events(node) if e.get("replica") == replica["id"]]
        assert [e["kind"] for e in mine][:1] == ["placement"], (node, mine)
        assert all(e["nodes"] == ["gpu-01", "gpu-02"] for e in mine), mine
        assert any(f"replica {replica['id']} ready" in e["message"] for e in mine), mine
    table = ctl(server.url, "events", "--node", "gpu-02", env=as_operator).stdout
    assert "gpu-01,gpu-02" in table, table

    # A port goes INIT (its subnet manager gone) and comes back ACTIVE: an event each, on its node only.
    def port_events(node: str) -> list[str]:
        return [e["message"] for e in events(node) if e["kind"] == "port"]

    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-02"), "mlx5_1", "1", "init").returncode == 0
    wait_until(lambda: port_events("gpu-02"), "the port's INIT event", procs=procs)
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-02"), "mlx5_1", "1", "active").returncode == 0
    wait_until(lambda: len(port_events("gpu-02")) == 2, "the port's ACTIVE event", procs=procs)
    assert port_events("gpu-02") == ["port mlx5_1/1 on gpu-02: ACTIVE → INIT (LinkUp)",
                                     "port mlx5_1/1 on gpu-02: INIT → ACTIVE (LinkUp)"]
    assert port_events("gpu-01") == []

    # A drain of the node rank 1 runs on: its move is that node's event (it was rank 0's node's).
    replica = wait_until(lambda: ready_replica(server, []), "the 2-node replica ready again", procs=procs)
    rank1 = next(s["node"] for s in replica["shards"] if s["rank"] == 1)
    rank0 = next(s["node"] for s in replica["shards"] if s["rank"] == 0)
    drained = ctl(server.url, "drain", rank1, "--force", "--timeout", "60", env=as_operator)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    moves = [e for e in events(rank1) if e["kind"] == "drain" and f"move of {replica['id']}" in e["message"]]
    assert moves and all(e["node"] == rank1 and e["nodes"] == ["gpu-01", "gpu-02"] for e in moves), moves
    assert [e["id"] for e in events(rank0) if e in moves] == [e["id"] for e in moves]  # found by either node
