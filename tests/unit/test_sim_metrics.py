"""vLLM's /metrics as the simulated engine renders it, checked against a real vLLM scrape."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.sim.metrics import EngineMetrics, Histogram, build_1_2_5_buckets, render_metrics
from tests.realfixtures import REAL

_SCRAPE = REAL / "vllm-metrics" / "vllm-v1-qwen15-05b-idle-full.txt"


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _render(m: EngineMetrics, **kw: object) -> str:
    args: dict[str, object] = {
        "model_name": "Qwen/Qwen1.5-0.5B-Chat",
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": 0.0,
    }
    args.update(kw)
    return render_metrics(m, cache_config={"block_size": "16"}, **args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def real() -> dict[str, object]:
    return _families(_SCRAPE.read_text())


def test_every_vllm_family_of_the_real_scrape_is_rendered_with_its_type(
    real: dict[str, object],
) -> None:
    ours = _families(_render(EngineMetrics(max_model_len=32768, created=1.0)))
    real_vllm = {name: f for name, f in real.items() if name.startswith("vllm:")}
    assert real_vllm, "the fixture has vllm families"
    missing = sorted(set(real_vllm) - set(ours))
    assert not missing
    for name, fam in real_vllm.items():
        assert ours[name].type == fam.type, name  # type: ignore[attr-defined]


def test_histogram_buckets_and_labels_match_the_real_scrape(real: dict[str, object]) -> None:
    ours = _families(_render(EngineMetrics(max_model_len=32768, created=1.0)))
    for name, fam in real.items():
        if not name.startswith("vllm:"):
            continue
        real_samples = {(s.name, tuple(sorted(s.labels.items()))) for s in fam.samples}  # type: ignore[attr-defined]
        our_samples = {(s.name, tuple(sorted(s.labels.items()))) for s in ours[name].samples}  # type: ignore[attr-defined]
        if name == "vllm:cache_config_info":
            continue  # a different engine config, the same shape
        assert our_samples == real_samples, name


def test_the_live_gauges_and_counters_show_what_happened() -> None:
    m = EngineMetrics(max_model_len=32768, created=1.0)
    m.record_finished(
        finish_reason="length",
        prompt_tokens=12,
        generation_tokens=5,
        max_tokens=5,
        n=1,
        queue_s=0.0,
        ttft_s=0.03,
        e2e_s=0.05,
        prefill_s=0.03,
        decode_s=0.02,
    )
    m.record_token_gap(0.005)
    fams = _families(_render(m, model_name="m", running=3, waiting=2, kv_cache_usage=0.25))

    def value(name: str, sample: str | None = None, **labels: str) -> float:
        for s in fams[name].samples:  # type: ignore[attr-defined]
            if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
                assert s.labels["model_name"] == "m" and s.labels["engine"] == "0"
                return s.value
        raise AssertionError(f"no sample {sample or name} {labels}")

    assert value("vllm:num_requests_running") == 3
    assert value("vllm:num_requests_waiting") == 2
    assert value("vllm:kv_cache_usage_perc") == 0.25
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 12
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 5
    assert (
        value("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    )
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 0
    ttft = "vllm:time_to_first_token_seconds"
    assert value(ttft, ttft + "_count") == 1
    assert value(ttft, ttft + "_bucket", le="0.02") == 0
    assert value(ttft, ttft + "_bucket", le="0.04") == 1
    assert value(ttft, ttft + "_bucket", le="+Inf") == 1
    itl = "vllm:inter_token_latency_seconds"
    assert value(itl, itl + "_bucket", le="0.01") == 1


def test_label_values_are_escaped() -> None:
    text = _render(EngineMetrics(max_model_len=100, created=1.0), model_name='we"ird\\name\n')
    fams = _families(text)
    sample = fams["vllm:num_requests_running"].samples[0]  # type: ignore[attr-defined]
    assert sample.labels["model_name"] == 'we"ird\\name\n'


def test_token_buckets_follow_vllms_1_2_5_rule() -> None:
    assert build_1_2_5_buckets(32768)[-1] == 20000.0
    assert build_1_2_5_buckets(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def test_histogram_uses_le_semantics() -> None:
    h = Histogram([1.0, 2.0])
    for v in (0.5, 1.0, 1.5, 2.0, 3.0):
        h.observe(v)
    assert h.cumulative() == [2, 4, 5]
    assert h.count == 5 and h.sum == pytest.approx(8.0)
