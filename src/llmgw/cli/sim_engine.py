"""`llmgw sim engine`: an OpenAI-compatible server that behaves like vLLM."""

from __future__ import annotations

import json
import os
import signal
import sys

import click

from llmgw.errors import LlmgwError

LAUNCH_PREFIX = "llmgw-sim-engine launch:"
# The environment a launch record shows: what the agent derives and placement gives.
LAUNCH_ENV = ("NCCL_", "GLOO_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_", "VLLM_HOST_IP",
              "SGLANG_HOST_IP", "RAY_ADDRESS")


def print_launch() -> None:
    """One line with the argv and the collective-related environment this process got, so a
    test (or an operator reading the engine's log) sees what each rank was really launched with."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(LAUNCH_ENV)}
    print(LAUNCH_PREFIX, json.dumps({"argv": sys.argv[1:], "env": env}), flush=True)



def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from llmgw.sim.options import VERSION_ENV, VLLM_VERSION

    click.echo(os.environ.get(VERSION_ENV) or VLLM_VERSION)
    ctx.exit()


@click.command()
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the vLLM release this engine stands for (LLMGW_SIM_ENGINE_VERSION overrides it) and exit; "
              "the agent reads it before a launch, as it reads vLLM's.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port to listen on; 0 picks a free one. The bound address is printed on stdout as "
    "`llmgw-sim-engine listening on HOST:PORT` as soon as it is bound.",
)
@click.option(
    "--model",
    default="llmgw/sim-model",
    show_default=True,
    help="Model the engine pretends to serve.",
)
@click.option("--served-model-name", default=None, help="Name clients must use (default: --model).")
@click.option("--max-model-len", type=click.IntRange(min=16), default=32768, show_default=True)
@click.option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Requests in the batch at once; more wait (vllm:num_requests_waiting).",
)
@click.option(
    "--ttft-ms",
    type=click.FloatRange(min=0),
    default=20.0,
    show_default=True,
    help="Time to first token, idle engine.",
)
@click.option(
    "--itl-ms",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Inter-token latency, idle engine.",
)
@click.option(
    "--prefill-us-per-token",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Extra TTFT per prompt token.",
)
@click.option(
    "--jitter",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Delays vary by up to this fraction.",
)
@click.option(
    "--load-slowdown",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="A full batch is 1+this times slower than an idle engine.",
)
@click.option("--kv-cache-tokens", type=click.IntRange(min=16), default=39232, show_default=True)
@click.option(
    "--output-tokens",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Answer length unless max_tokens is lower.",
)
@click.option("--embedding-dim", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed for jitter, ids, answers and injected errors.",
)
@click.option(
    "--startup-delay",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds /health answers 503 (loading weights) before the engine is ready.",
)
@click.option(
    "--error-rate",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Fraction of requests answered 500/503.",
)
@click.option(
    "--crash-after",
    type=click.IntRange(min=0),
    default=0,
    help="Exit abruptly (status 1) after answering N requests.",
)
@click.option("--hang", is_flag=True, help="Accept connections and never answer.")
@click.option(
    "--fail-startup",
    is_flag=True,
    help="Print a weight-loading failure and exit 1 after the startup delay.",
)
@click.option(
    "--fixed",
    is_flag=True,
    help="Answer every POST at once with a small fixed completion (benchmarks).",
)
@click.option(
    "--fixed-chunks",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Tokens (stream chunks) of the fixed completion.",
)
@click.option(
    "--access-log/--no-access-log",
    default=False,
    show_default=True,
    help="Log every request like uvicorn.",
)
@click.option(
    "--log-stats-interval",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Seconds between stats lines; 0: none.",
)
@click.option(
    "--shutdown-grace",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Seconds requests get to finish on SIGTERM.",
)
@click.option(
    "--api-key",
    envvar="VLLM_API_KEY",
    default="",
    show_default=False,
    help="Like vLLM: /v1/* answers 401 without `Authorization: Bearer KEY`; /health and /metrics stay open. "
    "[env: VLLM_API_KEY]",
)
@click.option(
    "--fail-if-env-missing",
    "required_env",
    multiple=True,
    metavar="NAME",
    help="Exit 1 at start when this environment variable is not set (repeatable): a test's check "
    "that the agent gave a rank its NCCL_* / GLOO_* environment.",
)
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes the replica spans (vLLM's flag): rank 0 is ready once the others have joined.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This process's rank.")
@click.option("--master-addr", default="127.0.0.1", show_default=True, help="Rank 0's address.")
@click.option("--master-port", type=click.IntRange(min=0, max=65535), default=0, show_default=True,
              help="The port rank 0 listens on for the other ranks.")
@click.option("--headless", is_flag=True, help="A rank above 0: serve no HTTP, join the master, run until stopped.")
@click.option("--pipeline-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Accepted as vLLM takes it (the simulation has no pipeline); in Ray mode, the nodes the "
              "cluster must have before the engine is ready.")
@click.option("--distributed-executor-backend", type=click.Choice(["mp", "ray"]), default="mp", show_default=True,
              help="ray: attach to the Ray cluster at RAY_ADDRESS (`llmgw sim node`'s stand-in `ray`) as vLLM's "
              "Ray executor does; fail when it goes away.")
def engine(
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    headless: bool,
    pipeline_parallel_size: int,
    distributed_executor_backend: str,
    required_env: tuple[str, ...],
    host: str,
    port: int,
    model: str,
    served_model_name: str | None,
    max_model_len: int,
    max_concurrency: int,
    ttft_ms: float,
    itl_ms: float,
    prefill_us_per_token: float,
    jitter: float,
    load_slowdown: float,
    kv_cache_tokens: int,
    output_tokens: int,
    embedding_dim: int,
    seed: int,
    startup_delay: float,
    error_rate: float,
    crash_after: int,
    hang: bool,
    fail_startup: bool,
    fixed: bool,
    fixed_chunks: int,
    access_log: bool,
    log_stats_interval: float,
    shutdown_grace: float,
    api_key: str,
) -> None:
    """Run a simulated vLLM engine: OpenAI API, /health, /metrics, latency and failures.

    \b
    SIGTERM or SIGINT stops it gracefully (exit 0); a second one stops it at once.
    """
    print_launch()
    missing = [name for name in required_env if name not in os.environ]
    if missing:
        raise LlmgwError(f"llmgw-sim-engine: {', '.join(missing)} not set in its environment (--fail-if-env-missing)")
    if nnodes > 1 and not master_port:
        raise click.UsageError("--nnodes above 1 needs --master-port")
    ray_address = ""
    if distributed_executor_backend == "ray":
        ray_address = os.environ.get("RAY_ADDRESS", "")
        if not ray_address:
            # ray.init() without an address attaches to whichever cluster started last on this node.
            raise LlmgwError("llmgw-sim-engine: --distributed-executor-backend ray needs RAY_ADDRESS "
                             "in its environment")
    if headless:
        if node_rank == 0 or nnodes < 2:
            raise click.UsageError("--headless is for ranks above 0 of a replica with --nnodes of 2 or more")
        import trio

        from llmgw.sim.multinode import run_headless

        def say_line(line: str) -> None:
            print(f"llmgw-sim-engine: {line}", flush=True)

        async def headless_main() -> int:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as nursery:
                    code: list[int] = []

                    async def join() -> None:
                        code.append(await run_headless(master_addr, master_port, node_rank, say_line))
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(join)
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        break
            return code[0] if code else 0

        sys.exit(trio.run(headless_main))
    from llmgw.sim.engine import (
        EngineBindFailed,
        EngineOptions,
        EngineStartupFailed,
        run_until_signalled,
    )

    options = EngineOptions(
        host=host,
        port=port,
        model=model,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        max_concurrency=max_concurrency,
        ttft_s=ttft_ms / 1000.0,
        itl_s=itl_ms / 1000.0,
        prefill_s_per_token=prefill_us_per_token / 1e6,
        jitter=jitter,
        load_slowdown=load_slowdown,
        kv_cache_tokens=kv_cache_tokens,
        output_tokens=output_tokens,
        embedding_dim=embedding_dim,
        seed=seed,
        startup_delay_s=startup_delay,
        error_rate=error_rate,
        crash_after=crash_after,
        hang=hang,
        fail_startup=fail_startup,
        fixed=fixed,
        fixed_chunks=fixed_chunks,
        access_log=access_log,
        log_stats_interval_s=log_stats_interval,
        shutdown_grace_s=shutdown_grace,
        api_key=api_key,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        ray_address=ray_address,
        ray_nodes=pipeline_parallel_size,
    )
    import trio

    try:
        trio.run(run_until_signalled, options)
    except (EngineStartupFailed, EngineBindFailed) as exc:
        raise LlmgwError(str(exc)) from None
