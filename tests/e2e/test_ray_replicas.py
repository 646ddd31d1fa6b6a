"""Ray-mode replicas end to end: real server, real agents, the agent's rayrank wrapper, the
simulated engine as vLLM's Ray driver and `llmgw sim node`'s stand-in `ray` (llmgw/sim/ray.py),
which binds Ray's ports (its fixed defaults where none is given) and whose `ray stop` stops every
Ray process of the node, as the real one does.

Two replicas of a two-node Ray profile put two Ray-mode shards on each node: each shard gets a Ray
of its own (its ports, its temp dir, its process session), every rank's Ray and engine get the
node's address; stopping one replica stops its Ray processes and no other: the second replica
keeps serving through the gateway.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl,
    engines_config,
    make_sim_node,
    pid_alive,
    replicas,
    wait_until,
)

CATALOG = """\
models:
  - name: big
    replicas: 2
    profiles:
      - name: two-nodes-ray
        engine: sim
        engine_mode: ray
        nodes: 2
        gpus: 1
        args: ["--startup-delay", "0.2"]
"""
TOKEN = "ops-7c2b19"
API = f'api:\n  operator_tokens: ["sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
ALLOW_RAY = "allow:\n  executables: [vllm, python3, ray]\n"
BODY = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def ray_processes(tmp_path: Path) -> dict[int, dict[str, Any]]:
    """The stand-in Ray processes running on the simulated nodes: pid → what it is."""
    out = {}
    for path in tmp_path.glob("gpu-0*/ray-processes/*.pid"):
        if pid_alive(int(path.stem)):
            out[int(path.stem)] = {**json.loads(path.read_text()), "node": path.parent.parent.name}
    return out


def launch_records(tmp_path: Path, shard_id: str) -> list[dict[str, Any]]:
    [log] = list(tmp_path.glob(f"**/logs/{shard_id}.log"))
    return [json.loads(line.split(": ", 1)[1]) for line in log.read_text().splitlines()
            if line.startswith(("llmgw-sim-engine launch: ", "llmgw-sim-ray launch: "))]


def ready(server: Server, count: int) -> list[dict[str, Any]] | None:
    rs = replicas(server)
    return rs if len(rs) == count and all(r["state"] == "ready" for r in rs) else None


def test_two_ray_replicas_share_nodes_and_stopping_one_leaves_the_other_serving(tmp_path: Path,
                                                                                procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG, API), token=TOKEN)
    procs.append(server.start())
    for node in ("gpu-01", "gpu-02"):
        cfg = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT + ALLOW_RAY, "--gpus", "2", "--ib-ports", "2")
        path = f"{tmp_path / node / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"  # the stand-in ray first
        procs.append(Proc(f"agent-{node}", ["agent", "--config", str(cfg), "--insecure", "--stop-engines-on-exit"],
                          tmp_path, env={"PATH": path}))
    both = wait_until(lambda: ready(server, 2), "two Ray-mode replicas ready", procs=procs, deadline=60)
    for replica in both:
        assert {s["node"] for s in replica["shards"]} == {"gpu-01", "gpu-02"}
    running = ray_processes(tmp_path)
    assert sorted(p["node"] for p in running.values()) == ["gpu-01", "gpu-01", "gpu-02", "gpu-02"]
    assert len({p["port"] for p in running.values() if p["head"]}) == 2  # a head (GCS port) per replica

    for replica in both:
        for shard in replica["shards"]:
            records = launch_records(tmp_path, shard["shard_id"])
            ray = next(r for r in records if r["argv"][0] == "start")
            assert ray["argv"][ray["argv"].index("--node-ip-address") + 1] == "127.0.0.1"
            assert ray["env"]["VLLM_HOST_IP"] == "127.0.0.1" and ray["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            if shard["rank"] == 0:
                engine = next(r for r in records if r["argv"][0] != "start")
                master_port = ray["argv"][ray["argv"].index("--port") + 1]
                assert engine["env"]["RAY_ADDRESS"] == f"127.0.0.1:{master_port}"
                assert "--distributed-executor-backend" in engine["argv"]

    # One replica goes; the other's engines and Ray processes stay, and it serves.
    server.config.write_text(server.config.read_text().replace("replicas: 2", "replicas: 1"))
    assert ctl(server.url, "reload", env={"LLMGW_TOKEN": TOKEN}).returncode == 0
    [kept] = wait_until(lambda: ready(server, 1), "one replica left, ready", procs=procs, deadline=60)
    gone = next(r for r in both if r["id"] != kept["id"])
    for shard in gone["shards"]:
        wait_until(lambda shard=shard: not pid_alive(shard["pid"]), f"{shard['shard_id']} stopped", procs=procs)
    left = wait_until(lambda: (now := ray_processes(tmp_path)) and len(now) == 2 and now,
                      "the stopped replica's Ray gone",
                      procs=procs)
    assert set(left) <= set(running)  # the kept replica's Ray processes are the ones that ran before
    kept_before = next(r for r in both if r["id"] == kept["id"])
    assert all(pid_alive(s["pid"]) for s in kept_before["shards"])
    response = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=30)
    assert response.status_code == 200, response.text
    assert ready(server, 1) is not None
