"""What each rank of a multi-node replica is launched with: vLLM (its own multiprocessing and
Ray), SGLang and the simulated engine; and the Ray rank wrapper as a real process with a
stand-in `ray` on PATH."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.engines import LaunchError, adapter_for
from llmgw.wire.messages import ShardSpec


def spec(engine: str, rank: int, world: int = 2, mode: str = "", args: list[str] | None = None, addr: str = "10.0.0.1") -> ShardSpec:
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
    assert head[3:cut] == ["--address", "10.0.0.1", "--port", "20002", "--head"]
    engine = head[cut + 1 :]
    assert engine[:2] == ["vllm", "serve"] and "--distributed-executor-backend" in engine and "--nnodes" not in engine
    worker = vllm.argv(spec("vllm", 1, mode="ray"), "10.0.0.2", 20001)
    assert worker == [sys.executable, "-m", "llmgw.agent.rayrank", "--address", "10.0.0.1", "--port", "20002"]
    assert vllm.executables(spec("vllm", 0, mode="ray"), head) == ["ray", "vllm"]
    assert vllm.executables(spec("vllm", 1, mode="ray"), worker) == ["ray"]


def test_sglang_tp_spans_the_nodes_and_dist_init_addr():
    sglang = adapter_for("sglang")
    argv = " ".join(sglang.argv(spec("sglang", 1), "h", 20001))
    assert "--tp 16" in argv
    assert "--nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:20002" in argv
    v6 = " ".join(sglang.argv(spec("sglang", 0, addr="fd00::1"), "h", 20001))
    assert "--dist-init-addr [fd00::1]:20002" in v6


def test_single_node_shards_get_no_multinode_flags():
    for engine in ("vllm", "sglang", "sim"):
        argv = adapter_for(engine).argv(spec(engine, 0, world=1), "h", 1)
        assert not {"--nnodes", "--node-rank", "--headless", "--dist-init-addr"} & set(argv)


def test_sim_engine_takes_vllms_flags():
    argv = adapter_for("sim").argv(spec("sim", 1), "h", 20001)
    assert argv[-9:] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "20002", "--headless"]


# ---- the Ray rank wrapper, for real ----------------------------------------------------------


@pytest.fixture
def fake_ray(tmp_path: Path) -> tuple[dict[str, str], Path]:
    calls = tmp_path / "calls"
    ray = tmp_path / "bin" / "ray"
    ray.parent.mkdir()
    ray.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 0\n")
    ray.chmod(0o755)
    env = {**os.environ, "PATH": f"{ray.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return env, calls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ray_worker_waits_for_the_head_then_joins(fake_ray):
    env, calls = fake_ray
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "llmgw.agent.rayrank", "--address", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert worker.stdout is not None
        assert "waiting for the Ray head at 127.0.0.1" in worker.stdout.readline()
        assert not calls.exists() and worker.poll() is None  # no head yet: it waits
        with socket.socket() as head:
            head.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            head.bind(("127.0.0.1", port))
            head.listen()
            assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert calls.read_text().splitlines() == [f"start --address 127.0.0.1:{port} --block", "stop --force"]


def test_ray_head_starts_ray_then_the_engine_and_stops_ray_after(fake_ray):
    env, calls = fake_ray
    started = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "llmgw.agent.rayrank", "--address", "10.0.0.1", "--port", "6380", "--head",
                           "--", sys.executable, "-c", "import sys; sys.exit(3)"], env=env, timeout=60).returncode
    assert code == 3  # the engine's exit is the rank's
    assert calls.read_text().splitlines() == ["start --head --port 6380 --node-ip-address 10.0.0.1", "stop --force"]
    assert time.monotonic() - started < 30
