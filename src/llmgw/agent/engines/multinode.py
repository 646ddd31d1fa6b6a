"""The flags that make one engine out of processes on several nodes (a shard per node).

- vLLM, its own multiprocessing: every node runs `vllm serve` with `--nnodes N --node-rank R
  --master-addr A --master-port P`; ranks above 0 add `--headless` (no API server: only rank 0
  serves HTTP). Parallelism by default as vLLM's docs advise: tensor parallel within a node,
  pipeline parallel across nodes (`--tensor-parallel-size G --pipeline-parallel-size N`).
- SGLang: `--nnodes N --node-rank R --dist-init-addr A:P`, with `--tp` the total GPU count
  (SGLang's tensor parallelism spans the nodes).
- Ray (`engine_mode: ray`, vLLM): rank 0 starts a Ray head of its own on the master port and runs
  `vllm serve … --distributed-executor-backend ray` against it (RAY_ADDRESS); the other ranks
  join it. Both through the agent's rayrank module, so one process per shard is what the
  supervisor starts, watches and stops, and each shard's Ray is its own (ports, temp dir,
  process session): two Ray-mode shards on a node never touch each other's (rayrank.py).

The master address is rank 0's address on the management network, decided by the server at
placement; a rank is never started without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from llmgw.netaddr import url_host
from llmgw.wire.messages import ShardSpec

MODE_RAY = "ray"
RAY_TEMP_ROOT = "/tmp/llmgw-ray"  # short on purpose: Ray's unix socket paths (107 bytes at most) live under it


def has_flag(args: Sequence[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def vllm_flags(spec: ShardSpec) -> list[str]:
    """What `vllm serve` gets beyond the single-node argv for a shard of a multi-node replica."""
    if spec.world <= 1:
        return []
    out: list[str] = []
    if not has_flag(spec.args, "--pipeline-parallel-size", "-pp"):
        out += ["--pipeline-parallel-size", str(spec.world)]
    if spec.engine_mode == MODE_RAY:
        return [*out, "--distributed-executor-backend", "ray"]
    out += ["--nnodes", str(spec.world), "--node-rank", str(spec.rank),
            "--master-addr", spec.master_addr, "--master-port", str(spec.master_port)]
    if spec.rank > 0:
        out.append("--headless")
    return out


def sglang_flags(spec: ShardSpec) -> list[str]:
    if spec.world <= 1:
        return []
    return ["--nnodes", str(spec.world), "--node-rank", str(spec.rank),
            "--dist-init-addr", f"{url_host(spec.master_addr)}:{spec.master_port}"]


def tensor_parallel(spec: ShardSpec, engine: str) -> int:
    """The tensor-parallel size to set when the profile sets none: GPUs per node for vLLM
    (pipeline across nodes), all GPUs of the replica for SGLang."""
    if engine == "sglang":
        return len(spec.gpus) * max(spec.world, 1)
    return len(spec.gpus)


def ray_temp_dir(shard_id: str) -> str:
    """The Ray temp dir of a replica's attempt: the same on every rank (the shard id less its
    rank: `{replica}.{attempt}.{rank}`), another for every other shard on the node."""
    group = shard_id.rsplit(".", 1)[0]
    return f"{RAY_TEMP_ROOT}/{hashlib.sha256(group.encode()).hexdigest()[:12]}"


def ray_argv(python: str, spec: ShardSpec, engine_argv: list[str]) -> list[str]:
    """`python -m llmgw.agent.rayrank` for one rank: the head (rank 0, then the engine) or a worker."""
    base = [python, "-m", "llmgw.agent.rayrank", "--address", spec.master_addr, "--port", str(spec.master_port),
            "--temp-dir", ray_temp_dir(spec.shard_id)]
    if spec.rank == 0:
        return [*base, "--head", "--", *engine_argv]
    return base
