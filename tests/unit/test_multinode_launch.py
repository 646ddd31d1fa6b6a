"""What each rank of a multi-node replica is launched with: vLLM (its own multiprocessing and
Ray), SGLang and the simulated engine; and the Ray rank wrapper as a real process with a
stand-in `ray` on PATH."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.agent.engines import LaunchError, adapter_for
from llmgw.agent.engines.multinode import ray_temp_dir
from llmgw.wire.messages import ShardSpec


def spec(engine: str, rank: int, world: int = 2, mode: str = "", args: list[str] | None = None,
         addr: str = "10.0.0.1") -> ShardSpec:
    return ShardSpec(shard_id=f"big-x.1-{rank}", replica_id="big-x", model="big", profile="p", engine=engine, rank=rank,
                     world=world, gpus=list(range(8)), port=20001, master_addr=addr, master_port=20002,
                     engine_mode=mode, args=args or [], source="org/big")


def test_vllm_native_rank0_serves_and_rank1_is_headless():
    vllm = adapter_for("vllm")
    rank0 = vllm.argv(spec("vllm", 0), "10.0.0.1", 20001)
    assert rank0[:3] == ["vllm", "serve", "org/big"]
    joined = " ".join(rank0)
    assert "--tensor-parallel-size 8 " in joined and "--pipeline-parallel-size 2" in joined
    assert "--nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 20002" in joined
    assert "--headless" not in rank0
    rank1 = vllm.argv(spec("vllm", 1), "10.0.0.2", 20001)
    assert "--nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 20002" in " ".join(rank1)
    assert rank1[-1] == "--headless"


def test_vllm_profile_parallelism_is_kept_and_checked():
    vllm = adapter_for("vllm")
    argv = vllm.argv(spec("vllm", 0, args=["--tensor-parallel-size", "16", "--pipeline-parallel-size", "1"]), "h", 1)
    assert argv.count("--tensor-parallel-size") == 1 and argv.count("--pipeline-parallel-size") == 1
    with pytest.raises(LaunchError, match="tensor parallel size 16 but the shard has 8 GPU"):
        vllm.validate(spec("vllm", 0, args=["--tensor-parallel-size", "16"]))


def test_vllm_ray_mode_head_runs_the_engine_workers_join():
    vllm = adapter_for("vllm")
    head = vllm.argv(spec("vllm", 0, mode="ray"), "10.0.0.1", 20001)
    assert head[:3] == [sys.executable, "-m", "llmgw.agent.rayrank"]
    cut = head.index("--")
    engine = head[cut + 1 :]
    assert engine[:2] == ["vllm", "serve"] and "--distributed-executor-backend" in engine and "--nnodes" not in engine
    worker = vllm.argv(spec("vllm", 1, mode="ray"), "10.0.0.2", 20001)
    temp = ray_temp_dir("big-x.1-1")
    assert worker == [sys.executable, "-m", "llmgw.agent.rayrank", "--address", "10.0.0.1", "--port", "20002",
                      "--temp-dir", temp]
    assert head[3:cut] == ["--address", "10.0.0.1", "--port", "20002", "--temp-dir", temp, "--head"]
    assert vllm.executables(spec("vllm", 0, mode="ray"), head) == ["ray", "vllm"]
    assert vllm.executables(spec("vllm", 1, mode="ray"), worker) == ["ray"]


def test_sglang_tp_spans_the_nodes_and_dist_init_addr():
    sglang = adapter_for("sglang")
    argv = " ".join(sglang.argv(spec("sglang", 1), "h", 20001))
    assert "--tp-size 16" in argv
    assert "--nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:20002" in argv
    v6 = " ".join(sglang.argv(spec("sglang", 0, addr="fd00::1"), "h", 20001))
    assert "--dist-init-addr [fd00::1]:20002" in v6


def test_single_node_shards_get_no_multinode_flags():
    for engine in ("vllm", "sglang", "sim"):
        argv = adapter_for(engine).argv(spec(engine, 0, world=1), "h", 1)
        assert not {"--nnodes", "--node-rank", "--headless", "--dist-init-addr"} & set(argv)


def test_sim_engine_takes_vllms_flags():
    argv = adapter_for("sim").argv(spec("sim", 1), "h", 20001)
    assert argv[-9:] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "20002",
                         "--headless"]


# ---- the Ray rank wrapper, for real, with the simulated node's stand-in `ray` -------------------


def test_every_rank_of_a_replica_shares_one_ray_temp_dir_and_no_other_shard_does():
    assert ray_temp_dir("big-x.1.0") == ray_temp_dir("big-x.1.1")
    assert ray_temp_dir("big-x.2.0") != ray_temp_dir("big-x.1.0") != ray_temp_dir("big-y.1.0")
    assert len(ray_temp_dir("a" * 64 + ".1.0")) == len("/tmp/llmgw-ray/") + 12  # Ray's socket paths stay short


@pytest.fixture
def sim_ray(tmp_path: Path) -> tuple[dict[str, str], Path]:
    from llmgw.sim.ray import write_standin

    node = tmp_path / "node"
    write_standin(str(node))
    env = {**os.environ, "PATH": f"{node / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", "VLLM_HOST_IP": "127.0.0.1",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    return env, node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_processes(node: Path) -> list[str]:
    return sorted(p.name for p in (node / "ray-processes").glob("*.pid"))


def rayrank(port: int, temp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmgw.agent.rayrank", "--address", "127.0.0.1", "--port", str(port),
            "--temp-dir", str(temp), *extra]


def test_the_head_runs_its_own_ray_then_the_engine_against_it_and_stops_its_ray(sim_ray, tmp_path):
    env, node = sim_ray
    port, temp = free_port(), tmp_path / "ray-temp"
    engine = "import os, sys; print('engine RAY_ADDRESS=' + os.environ['RAY_ADDRESS'], flush=True); sys.exit(3)"
    done = subprocess.run(rayrank(port, temp, "--head", "--", sys.executable, "-c", engine), env=env, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 3, done.stdout + done.stderr  # the engine's exit is the rank's
    out = done.stdout
    started = next(line for line in out.splitlines() if line.startswith("llmgw: starting this rank's own Ray: "))
    ray = started.split("own Ray: ", 1)[1].split()
    assert ray[:7] == ["ray", "start", "--head", "--port", str(port), "--temp-dir", str(temp)] and "--block" in ray
    for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port", "--node-manager-port",
                 "--object-manager-port", "--metrics-export-port", "--dashboard-agent-grpc-port",
                 "--runtime-env-agent-port"):
        assert int(ray[ray.index(flag) + 1]) > 0, flag  # a port of this shard's, never Ray's fixed default
    assert "--include-dashboard=false" in ray and ray[ray.index("--node-ip-address") + 1] == "127.0.0.1"
    assert ray[ray.index("--min-worker-port") + 1] == "0" and ray[ray.index("--max-worker-port") + 1] == "0"
    assert ray[ray.index("--num-gpus") + 1] == "2"
    assert f"engine RAY_ADDRESS=127.0.0.1:{port}" in out
    assert ray_processes(node) == []  # its Ray is gone with it
    assert "ray stop" not in out
    assert temp.is_dir() and f"Ray's logs of this rank are in {temp}" in done.stderr  # kept: the rank failed


def test_a_worker_waits_for_the_head_joins_it_and_a_sigterm_stops_only_its_own_ray(sim_ray, tmp_path):
    env, node = sim_ray
    port = free_port()
    other = subprocess.Popen([str(node / "bin" / "ray"), "start", "--head", "--port", str(free_port()),
                              "--include-dashboard=false", "--ray-client-server-port", str(free_port()),
                              "--dashboard-agent-listen-port", str(free_port()), "--block"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    worker = subprocess.Popen(rayrank(port, tmp_path / "ray-temp"), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    head: subprocess.Popen[str] | None = None
    try:
        assert worker.stdout is not None
        assert f"waiting for the Ray head at 127.0.0.1:{port}" in worker.stdout.readline()
        assert worker.poll() is None  # no head yet: it waits
        head = subprocess.Popen([str(node / "bin" / "ray"), "start", "--head", "--port", str(port),
                                 "--include-dashboard=false",
                                 "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port",
                                 str(free_port()), "--block"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                text=True)
        assert head.stdout is not None
        while "joined (2 in the cluster)" not in head.stdout.readline():
            assert head.poll() is None
        assert len(ray_processes(node)) == 3  # the other cluster's head, this head, the worker's Ray
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        assert len(ray_processes(node)) == 2 and other.poll() is None and head.poll() is None  # theirs untouched
        assert not (tmp_path / "ray-temp").exists()  # a clean stop leaves no temp dir
    finally:
        for child in (worker, head, other):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
