"""The simulated engine proper: batch slots, the latency model's delays, vLLM's metrics. No sockets.

`SimEngine.generate` is one request's life in the batch (wait for a slot, prefill, one token
per inter-token delay); the HTTP side (llmgw.sim.routes) awaits it and writes what it emits.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable

import trio

from llmgw.sim import openai_api as api
from llmgw.sim.latency import LatencyModel, kv_blocks, kv_cache_usage
from llmgw.sim.metrics import EngineMetrics, render_metrics
from llmgw.sim.options import EngineOptions


async def _no_emit(_k: int) -> None:
    return None


class SimEngine:
    """The scheduler side: waits for a batch slot, sleeps the model's delays, counts metrics."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.served_model = options.served_name
        self.latency = LatencyModel(options.latency_params(), options.seed)
        self.metrics = EngineMetrics(max_model_len=options.max_model_len, created=time.time())
        self.running = 0
        self.waiting = 0
        self.kv_blocks_used = 0
        self._slots = trio.Semaphore(options.max_concurrency)
        self._ids = random.Random(options.seed ^ 0x5EED)
        self.rng = random.Random(options.seed ^ 0xFA11)

    def kv_usage(self) -> float:
        return kv_cache_usage(self.kv_blocks_used, self.options.kv_cache_tokens)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{self._ids.getrandbits(64):016x}"

    def render_metrics(self) -> str:
        return render_metrics(
            self.metrics,
            model_name=self.served_model,
            running=self.running,
            waiting=self.waiting,
            kv_cache_usage=self.kv_usage(),
            cache_config={
                "block_size": "16",
                "cache_dtype": "auto",
                "enable_prefix_caching": "True",
                "gpu_memory_utilization": "0.9",
                "num_gpu_blocks": str(self.options.kv_cache_tokens // 16),
            },
        )

    async def generate(
        self, plan: api.GenerationPlan, emit: Callable[[int], Awaitable[None]] = _no_emit
    ) -> None:
        """Run one request through the simulated batch; `emit(k)` is awaited as token k is ready.

        Cancellation (the client went away, the engine stops) aborts the request: it leaves
        the batch and is counted with finished_reason="abort", as vLLM counts it.
        """
        arrival = trio.current_time()
        admitted: float | None = None
        first: float | None = None
        generated = 0
        held = 0
        finish = "abort"
        self.waiting += 1
        try:
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            admitted = trio.current_time()
            self.running += 1
            held = kv_blocks(plan.prompt_tokens)
            self.kv_blocks_used += held
            try:
                await trio.sleep(self.latency.ttft(self.running, plan.longest_prompt))
                last = 0.0
                for k in range(plan.output_tokens):
                    if k:
                        await trio.sleep(self.latency.itl(self.running))
                    now = trio.current_time()
                    if k == 0:
                        first = now
                    else:
                        self.metrics.record_token_gap(now - last)
                    last = now
                    generated = k + 1
                    want = kv_blocks(plan.prompt_tokens + generated * plan.choices)
                    self.kv_blocks_used += want - held
                    held = want
                    await emit(k)
                finish = plan.finish_reason
            finally:
                self.running -= 1
                self.kv_blocks_used -= held
                self._slots.release()
        finally:
            end = trio.current_time()
            start = admitted if admitted is not None else end
            self.metrics.record_finished(
                finish_reason=finish,
                prompt_tokens=plan.prompt_tokens,
                generation_tokens=generated * plan.choices,
                max_tokens=plan.max_tokens,
                n=plan.n,
                queue_s=start - arrival,
                ttft_s=None if first is None else first - arrival,
                e2e_s=end - arrival,
                prefill_s=(first if first is not None else end) - start,
                decode_s=0.0 if first is None else end - first,
            )

    async def pool(self, prompt_tokens: int) -> None:
        """An embeddings request: a batch slot for one prefill, no decode."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        held = kv_blocks(prompt_tokens)
        self.kv_blocks_used += held
        try:
            await trio.sleep(self.latency.ttft(self.running, prompt_tokens))
        finally:
            self.running -= 1
            self.kv_blocks_used -= held
            self._slots.release()
        self.metrics.prompt_tokens += prompt_tokens

    def record_fixed(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Fixed-response mode: counters only, to keep the hot path cheap."""
        m = self.metrics
        m.request_success["stop"] += 1
        m.prompt_tokens += prompt_tokens
        m.generation_tokens += generation_tokens
