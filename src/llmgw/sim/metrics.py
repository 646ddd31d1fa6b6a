"""vLLM's Prometheus metrics for the simulated engine. Pure: counts in, exposition text out.

Names, help texts, label sets and histogram buckets follow vLLM's V1 `PrometheusStatLogger`
(vllm/v1/metrics/loggers.py) and the real scrape in
tests/fixtures/real/vllm-metrics/vllm-v1-qwen15-05b-idle-full.txt: every series carries
`engine` and `model_name`, labels are written sorted, counters come with a `_created` gauge.
This is hand-rolled instead of prometheus_client because the fixed-response benchmark counts
every request and a plain integer add is the cheapest way to do that.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM sizes its token-count histograms."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(float(v) for v in out)
            out.append(value)
        exponent += 1


class Histogram:
    """A Prometheus histogram: per-bucket counts (not cumulative until rendered), sum, count."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: the first bucket whose bound is >= value, i.e. `le` semantics.
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        total = 0
        out = []
        for c in self.counts:
            total += c
            out.append(total)
        return out


class EngineMetrics:
    """Everything `/metrics` shows apart from the three live gauges, which are read at scrape time."""

    def __init__(self, *, max_model_len: int, created: float) -> None:
        self.created = created
        tokens = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.request_prompt_tokens = Histogram(tokens)
        self.request_generation_tokens = Histogram(tokens)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = Histogram(tokens)
        self.request_params_n = Histogram(N_BUCKETS)
        self.request_params_max_tokens = Histogram(tokens)
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.time_per_output_token = Histogram(TOKEN_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = Histogram(TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = Histogram(REQUEST_LATENCY_BUCKETS)

    def record_token_gap(self, seconds: float) -> None:
        """One decode step of one request: the gap since its previous token."""
        self.inter_token_latency.observe(seconds)
        self.time_per_output_token.observe(seconds)
        self.iteration_tokens.observe(1)

    def record_finished(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int,
        n: int,
        queue_s: float,
        ttft_s: float | None,
        e2e_s: float,
        prefill_s: float,
        decode_s: float,
    ) -> None:
        """One request left the engine (finished or aborted): what vLLM records at that point."""
        self.request_success[finish_reason] = self.request_success.get(finish_reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.prefix_cache_queries += prompt_tokens
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_max_num_generation_tokens.observe(max_tokens)
        self.request_params_max_tokens.observe(max_tokens)
        self.request_params_n.observe(n)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        self.e2e_request_latency.observe(e2e_s)
        self.request_queue_time.observe(queue_s)
        self.request_inference_time.observe(prefill_s + decode_s)
        self.request_prefill_time.observe(prefill_s)
        self.request_decode_time.observe(decode_s)
        if generation_tokens > 1:
            self.request_time_per_output_token.observe(decode_s / (generation_tokens - 1))


# ---- exposition -------------------------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs)) + "}"


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


class _Writer:
    def __init__(self, base: list[tuple[str, str]]) -> None:
        self.base = base
        self.lines: list[str] = []

    def header(self, name: str, kind: str, doc: str) -> None:
        self.lines.append(f"# HELP {name} {doc}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, extra: Iterable[tuple[str, str]] = ()) -> None:
        self.lines.append(f"{name}{_labels([*self.base, *extra])} {_num(value)}")

    def gauge(self, name: str, doc: str, value: float) -> None:
        self.header(name, "gauge", doc)
        self.sample(name, value)

    def created(
        self,
        name: str,
        doc: str,
        created: float,
        extras: Sequence[Sequence[tuple[str, str]]] = ((),),
    ) -> None:
        self.header(f"{name}_created", "gauge", doc)
        for extra in extras:
            self.sample(f"{name}_created", created, extra)

    def counter(self, name: str, doc: str, value: float, created: float) -> None:
        self.header(f"{name}_total", "counter", doc)
        self.sample(f"{name}_total", value)
        self.created(name, doc, created)

    def histogram(self, name: str, doc: str, hist: Histogram, created: float) -> None:
        self.header(name, "histogram", doc)
        for bound, total in zip((*hist.buckets, float("inf")), hist.cumulative(), strict=True):
            self.sample(f"{name}_bucket", total, [("le", _num(bound))])
        self.sample(f"{name}_count", hist.count)
        self.sample(f"{name}_sum", hist.sum)
        self.created(name, doc, created)


def render_metrics(
    metrics: EngineMetrics,
    *,
    model_name: str,
    running: int,
    waiting: int,
    kv_cache_usage: float,
    cache_config: dict[str, str] | None = None,
    engine: str = "0",
) -> str:
    """The text of one scrape, in Prometheus exposition format 0.0.4."""
    m = metrics
    c = m.created
    w = _Writer([("engine", engine), ("model_name", model_name)])
    w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
    w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
    w.gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage
    )
    w.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        m.prefix_cache_queries,
        c,
    )
    w.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        m.prefix_cache_hits,
        c,
    )
    w.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        m.num_preemptions,
        c,
    )
    w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens, c)
    w.counter(
        "vllm:generation_tokens", "Number of generation tokens processed.", m.generation_tokens, c
    )

    doc = "Count of successfully processed requests."
    w.header("vllm:request_success_total", "counter", doc)
    reasons = [*FINISH_REASONS, *sorted(set(m.request_success) - set(FINISH_REASONS))]
    for reason in reasons:
        w.sample(
            "vllm:request_success_total",
            m.request_success.get(reason, 0),
            [("finished_reason", reason)],
        )
    w.created("vllm:request_success", doc, c, [[("finished_reason", r)] for r in reasons])

    w.histogram(
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        m.request_prompt_tokens,
        c,
    )
    w.histogram(
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        m.request_generation_tokens,
        c,
    )
    w.histogram(
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        m.iteration_tokens,
        c,
    )
    w.histogram(
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        m.request_max_num_generation_tokens,
        c,
    )
    w.histogram(
        "vllm:request_params_n", "Histogram of the n request parameter.", m.request_params_n, c
    )
    w.histogram(
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        m.request_params_max_tokens,
        c,
    )
    w.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        m.time_to_first_token,
        c,
    )
    w.histogram(
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds."
        "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
        m.time_per_output_token,
        c,
    )
    w.histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        m.inter_token_latency,
        c,
    )
    w.histogram(
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        m.request_time_per_output_token,
        c,
    )
    w.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        m.e2e_request_latency,
        c,
    )
    w.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        m.request_queue_time,
        c,
    )
    w.histogram(
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        m.request_inference_time,
        c,
    )
    w.histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        m.request_prefill_time,
        c,
    )
    w.histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        m.request_decode_time,
        c,
    )
    if cache_config:
        w.header("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
        # vLLM writes this one with the engine label but without model_name.
        w.lines.append(
            "vllm:cache_config_info" + _labels([("engine", engine), *cache_config.items()]) + " 1.0"
        )
    w.lines.append("")
    return "\n".join(w.lines)
