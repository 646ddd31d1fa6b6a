"""The simulated engine's latency and KV-cache model. Pure: no trio, no clock, no I/O.

A real engine's time to first token grows with the prompt (prefill) and both TTFT and the
inter-token latency grow as the batch fills up; KV-cache usage grows with the tokens the
running requests hold. The engine asks this model for each delay with the load it sees at
that moment, so latency follows load as it changes during a request.
"""

from __future__ import annotations

import random

import msgspec

# vLLM's paged KV cache hands out blocks of this many tokens (the fixture scrape shows
# block_size="16"); a request holds whole blocks.
KV_BLOCK_TOKENS = 16


class LatencyParams(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the model; defaults are fast enough for tests and still look like a GPU."""

    ttft_s: float = 0.020  # time to first token of a short prompt on an idle engine
    itl_s: float = 0.005  # inter-token latency on an idle engine
    prefill_s_per_token: float = 0.00001  # extra TTFT per prompt token
    jitter: float = 0.2  # each delay is scaled by a uniform factor in [1-jitter, 1+jitter]
    max_concurrency: int = 256  # requests in the batch at once (vLLM's max_num_seqs)
    load_slowdown: float = 1.0  # a full batch is (1 + load_slowdown) times slower than idle
    kv_cache_tokens: int = 39232  # capacity; 2452 blocks x 16 as in the fixture scrape


class LatencyModel:
    """Delays for one engine, drawn from a seeded generator so runs repeat."""

    def __init__(self, params: LatencyParams, seed: int = 0) -> None:
        if params.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.params = params
        self._rng = random.Random(seed)

    def load_factor(self, running: int) -> float:
        """1.0 with one request in the batch, 1 + load_slowdown with a full batch."""
        p = self.params
        if p.max_concurrency <= 1:
            return 1.0
        fill = min(max(running - 1, 0), p.max_concurrency - 1) / (p.max_concurrency - 1)
        return 1.0 + p.load_slowdown * fill

    def _jittered(self, base: float) -> float:
        j = self.params.jitter
        if j <= 0.0 or base <= 0.0:
            return max(base, 0.0)
        return max(0.0, base * self._rng.uniform(1.0 - j, 1.0 + j))

    def ttft(self, running: int, prompt_tokens: int) -> float:
        """Seconds from admission to the first token (prefill), `running` including this one."""
        p = self.params
        base = p.ttft_s + p.prefill_s_per_token * max(prompt_tokens, 0)
        return self._jittered(base * self.load_factor(running))

    def itl(self, running: int) -> float:
        """Seconds between two output tokens of one request."""
        return self._jittered(self.params.itl_s * self.load_factor(running))


def kv_blocks(tokens: int) -> int:
    """Blocks a request holding `tokens` tokens occupies."""
    if tokens <= 0:
        return 0
    return -(-tokens // KV_BLOCK_TOKENS)


def kv_cache_usage(blocks_in_use: int, capacity_tokens: int) -> float:
    """vLLM's kv_cache_usage_perc: the fraction (0..1) of KV blocks in use."""
    capacity_blocks = max(capacity_tokens // KV_BLOCK_TOKENS, 1)
    return min(max(blocks_in_use, 0) / capacity_blocks, 1.0)
