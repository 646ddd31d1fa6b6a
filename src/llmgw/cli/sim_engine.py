"""`llmgw sim engine`: an OpenAI-compatible server that behaves like vLLM."""

from __future__ import annotations

import errno

import click
import trio

from llmgw.errors import LlmgwError, UsageError


@click.command()
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
def engine(**kw: object) -> None:
    """Run a simulated vLLM engine: OpenAI API, /health, /metrics, latency and failures.

    \b
    SIGTERM or SIGINT stops it gracefully (exit 0); a second one stops it at once.
    """
    from llmgw.sim.engine import EngineOptions, EngineStartupFailed, run_until_signalled

    options = EngineOptions(
        host=str(kw["host"]),
        port=int(kw["port"]),  # type: ignore[call-overload]
        model=str(kw["model"]),
        served_model_name=kw["served_model_name"],  # type: ignore[arg-type]
        max_model_len=kw["max_model_len"],  # type: ignore[arg-type]
        max_concurrency=kw["max_concurrency"],  # type: ignore[arg-type]
        ttft_s=kw["ttft_ms"] / 1000.0,  # type: ignore[operator]
        itl_s=kw["itl_ms"] / 1000.0,  # type: ignore[operator]
        prefill_s_per_token=kw["prefill_us_per_token"] / 1e6,  # type: ignore[operator]
        jitter=kw["jitter"],  # type: ignore[arg-type]
        load_slowdown=kw["load_slowdown"],  # type: ignore[arg-type]
        kv_cache_tokens=kw["kv_cache_tokens"],  # type: ignore[arg-type]
        output_tokens=kw["output_tokens"],  # type: ignore[arg-type]
        embedding_dim=kw["embedding_dim"],  # type: ignore[arg-type]
        seed=kw["seed"],  # type: ignore[arg-type]
        startup_delay_s=kw["startup_delay"],  # type: ignore[arg-type]
        error_rate=kw["error_rate"],  # type: ignore[arg-type]
        crash_after=kw["crash_after"],  # type: ignore[arg-type]
        hang=bool(kw["hang"]),
        fail_startup=bool(kw["fail_startup"]),
        fixed=bool(kw["fixed"]),
        fixed_chunks=kw["fixed_chunks"],  # type: ignore[arg-type]
        access_log=bool(kw["access_log"]),
        log_stats_interval_s=kw["log_stats_interval"],  # type: ignore[arg-type]
        shutdown_grace_s=kw["shutdown_grace"],  # type: ignore[arg-type]
    )
    try:
        trio.run(run_until_signalled, options)
    except EngineStartupFailed as exc:
        raise LlmgwError(str(exc)) from None
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise UsageError(
                f"cannot listen on {options.host}:{options.port}: {exc.strerror}; pick another --port or --host"
            ) from None
        raise
