"""The simulated engine's log, in vLLM's words and format, so what the agent tails and shows
(`llmgw ctl logs`, a failed start's output tail) reads like a real engine's."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from datetime import datetime

from llmgw import __version__
from llmgw.sim.options import VLLM_VERSION, EngineOptions
from llmgw.sim.scheduler import SimEngine

LogFn = Callable[[str, bool], None]  # (line, is_error)


def default_log(line: str, is_error: bool) -> None:
    stream = sys.stderr if is_error else sys.stdout
    stream.write(line + "\n")
    stream.flush()


def stamp() -> str:
    return datetime.now().strftime("%m-%d %H:%M:%S")


class VllmLog:
    """Lines as vLLM's API server and engine core print them, to `log(line, is_error)`."""

    def __init__(self, log: LogFn | None = None) -> None:
        self._log_fn = log or default_log
        self._pid = os.getpid()
        self._last_stats = (0, 0)

    def info(self, where: str, message: str) -> None:
        self._log_fn(f"(APIServer pid={self._pid}) INFO {stamp()} [{where}] {message}", False)

    def error(self, where: str, message: str) -> None:
        self._log_fn(f"(EngineCore_DP0 pid={self._pid}) ERROR {stamp()} [{where}] {message}", True)

    def raw(self, line: str, is_error: bool = False) -> None:
        self._log_fn(line, is_error)

    def uvicorn(self, message: str) -> None:
        """A line of uvicorn's own (stderr), as in `INFO:     Started server process`."""
        self.raw(f"(APIServer pid={self._pid}) INFO:     {message}", True)

    def banner(self, o: EngineOptions) -> None:
        self.info(
            "api_server.py:1839",
            f"vLLM API server version {VLLM_VERSION} (llmgw sim engine {__version__})",
        )
        self.info(
            "utils.py:233",
            f"non-default args: {{'model': {o.model!r}, 'host': {o.host!r}, 'port': {o.port}}}",
        )
        self.info("model.py:547", "Resolved architecture: SimulatedForCausalLM")
        self.info("model.py:1510", f"Using max model len {o.max_model_len}")

    def loaded(self, o: EngineOptions, url: str) -> None:
        self.info("default_loader.py:267", f"Loading weights took {o.startup_delay_s:.2f} seconds")
        self.info(
            "gpu_model_runner.py:2653",
            f"Model loading took 0.0 GiB and {o.startup_delay_s:.6f} seconds",
        )
        self.info("kv_cache_utils.py:1087", f"GPU KV cache size: {o.kv_cache_tokens:,} tokens")
        self.info(
            "kv_cache_utils.py:1091",
            f"Maximum concurrency for {o.max_model_len:,} tokens per request: "
            f"{o.kv_cache_tokens / o.max_model_len:.2f}x",
        )
        self.info("api_server.py:1880", f"Starting vLLM API server 0 on {url}")
        self.uvicorn(f"Started server process [{self._pid}]")
        self.uvicorn("Waiting for application startup.")
        self.uvicorn("Application startup complete.")

    def load_failure(self, o: EngineOptions) -> None:
        self.error("core.py:708", "EngineCore failed to start.")
        self.error("core.py:708", "Traceback (most recent call last):")
        lines = [
            '  File "vllm/v1/engine/core.py", line 699, in run_engine_core',
            '  File "vllm/model_executor/model_loader/default_loader.py", line 262, in load_weights',
            f"OSError: Error no file named model.safetensors or pytorch_model.bin found in directory "
            f"/models/{o.model} (simulated by llmgw sim engine --fail-startup)",
        ]
        for line in lines:
            self.error("core.py:708", line)
        self.raw(
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore_DP0': 1}",
            True,
        )

    def crash(self, answered: int) -> None:
        self.error(
            "core.py:775",
            f"EngineCore encountered a fatal error (simulated crash after {answered} requests).",
        )

    def handler_bug(self, exc: Exception) -> None:
        """A bug in a request handler, as uvicorn reports an ASGI application's exception."""
        self.error("httptools_impl.py:414", f"Exception in ASGI application: {exc!r}")
        for line in traceback.format_exc().rstrip().splitlines():
            self.error("httptools_impl.py:414", line)

    def access(self, peer: str, method: str, target: str, http10: bool, status: int, reason: str) -> None:
        version = "1.0" if http10 else "1.1"
        self.uvicorn(f'{peer} - "{method} {target} HTTP/{version}" {status} {reason}')

    def stats(self, engine: SimEngine, interval: float) -> None:
        """vLLM's periodic throughput line, when anything happened since the last one."""
        prompt, gen = engine.metrics.prompt_tokens, engine.metrics.generation_tokens
        d_prompt, d_gen = prompt - self._last_stats[0], gen - self._last_stats[1]
        self._last_stats = (prompt, gen)
        if d_prompt or d_gen or engine.running or engine.waiting:
            self.info(
                "loggers.py:123",
                f"Engine 000: Avg prompt throughput: {d_prompt / interval:.1f} tokens/s, "
                f"Avg generation throughput: {d_gen / interval:.1f} tokens/s, "
                f"Running: {engine.running} reqs, Waiting: {engine.waiting} reqs, "
                f"GPU KV cache usage: {engine.kv_usage() * 100:.1f}%, Prefix cache hit rate: 0.0%",
            )
