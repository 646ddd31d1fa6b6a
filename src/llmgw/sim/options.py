"""What `llmgw sim engine` takes, and how it fails: options and errors shared by its parts."""

from __future__ import annotations

import msgspec

from llmgw.sim.latency import LatencyParams

LISTENING_PREFIX = "llmgw-sim-engine listening on"
# The vLLM release whose server this one imitates: the first that takes every flag its ranks take
# (--nnodes, --node-rank, --master-addr, --master-port: 0.11.1; agent/engines/versions.py).
VLLM_VERSION = "0.11.1"
# `llmgw sim engine --version` says this instead when set: a test's engine that is too old.
VERSION_ENV = "LLMGW_SIM_ENGINE_VERSION"


class EngineOptions(msgspec.Struct, kw_only=True, frozen=True):
    """Everything `llmgw sim engine` takes; times are in seconds."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port, printed in the listening line
    model: str = "llmgw/sim-model"
    served_model_name: str | None = None  # the name clients use; defaults to `model`
    max_model_len: int = 32768
    max_concurrency: int = 256
    ttft_s: float = 0.020
    itl_s: float = 0.005
    prefill_s_per_token: float = 0.00001
    jitter: float = 0.2
    load_slowdown: float = 1.0
    kv_cache_tokens: int = 39232
    output_tokens: int = 16  # the answer's length when max_tokens does not cut it short
    embedding_dim: int = 256
    seed: int = 0
    startup_delay_s: float = 0.0
    error_rate: float = 0.0  # fraction of inference requests answered 500 or 503
    crash_after: int = 0  # exit abruptly once this many inference requests were answered
    hang: bool = False  # accept connections and never answer
    fail_startup: bool = False  # print a load failure and exit non-zero after the startup delay
    fixed: bool = False  # answer every POST at once with a fixed small completion
    fixed_chunks: int = 4  # tokens (stream chunks) of the fixed completion
    access_log: bool = False
    log_stats_interval_s: float = 10.0  # 0: never
    shutdown_grace_s: float = 2.0
    # Like vLLM's --api-key (or VLLM_API_KEY): /v1/* answers 401 without
    # `Authorization: Bearer <key>`; /health, /metrics, /version and /ping stay open.
    api_key: str = ""
    # One rank of a multi-node replica, with vLLM's flags (sim/multinode.py): rank 0 waits for
    # the other nnodes-1 to join on master_addr:master_port before /health answers 200.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Ray mode (`--distributed-executor-backend ray`): the cluster (RAY_ADDRESS) and the nodes it
    # must have (the pipeline-parallel size) before /health answers 200 (sim/multinode.py).
    ray_address: str = ""
    ray_nodes: int = 1

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    def latency_params(self) -> LatencyParams:
        return LatencyParams(
            ttft_s=self.ttft_s,
            itl_s=self.itl_s,
            prefill_s_per_token=self.prefill_s_per_token,
            jitter=self.jitter,
            max_concurrency=self.max_concurrency,
            load_slowdown=self.load_slowdown,
            kv_cache_tokens=self.kv_cache_tokens,
        )


class SimulatedCrash(Exception):
    """Raised by `serve_engine` when `crash_after` requests were answered (in-process use)."""


class EngineStartupFailed(Exception):
    """Raised by `serve_engine` when `fail_startup` is set, after the startup delay."""


class EngineBindFailed(Exception):
    """The listening address cannot be bound (in use, not local, not permitted)."""
