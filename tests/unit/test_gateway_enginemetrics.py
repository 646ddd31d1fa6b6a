"""Engine /metrics parser: real vLLM and SGLang scrapes, cross-checked with prometheus_client."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from llmgw.server.gateway.enginemetrics import (
    FIELDS,
    EngineLoad,
    parse_engine_metrics,
    violations,
)
from tests.realfixtures import REAL


def _real_dir() -> Path:
    return REAL


REAL_FILES = sorted(
    p.name for d in ("vllm-metrics", "sglang-metrics") for p in (_real_dir() / d).iterdir()
)


def _real(name: str) -> str:
    kind = "sglang-metrics" if name.startswith("sglang") else "vllm-metrics"
    return (_real_dir() / kind / name).read_text()


EXPECTED = {
    "vllm-v1-qwen15-05b-idle-full.txt": EngineLoad(
        running=0, waiting=0, kv_cache_usage=0.0, engine="vllm"
    ),
    "vllm-v06-llama31-8b-idle-gpu-cache.txt": EngineLoad(
        running=0, waiting=0, kv_cache_usage=0.0, engine="vllm"
    ),
    # Cut short by its author: no running/waiting samples, the file ends in a bare # HELP line.
    "vllm-v02-mistral7b-rtx3090-excerpt.txt": EngineLoad(
        kv_cache_usage=0.38849487785658, engine="vllm", missing=("running", "waiting")
    ),
    "sglang-docs-llama31-8b.txt": EngineLoad(
        running=162, waiting=2826, kv_cache_usage=0.28, engine="sglang"
    ),
}


def test_every_real_file_has_an_expectation() -> None:
    assert sorted(EXPECTED) == REAL_FILES


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_scrapes(name: str) -> None:
    assert parse_engine_metrics(_real(name)) == EXPECTED[name]


_NAMES = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_cache_usage": (
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
    ),
}


def _reference(text: str) -> dict[str, float]:
    """The same numbers through prometheus_client's full parser."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for field, names in _NAMES.items():
            if family.name in names:
                for sample in family.samples:
                    if field == "kv_cache_usage":
                        out[field] = max(out.get(field, 0.0), sample.value)
                    else:
                        out[field] = out.get(field, 0.0) + sample.value
    return out


@pytest.mark.parametrize("name", REAL_FILES)
def test_agrees_with_prometheus_client(name: str) -> None:
    text = _real(name)
    load = parse_engine_metrics(text)
    ref = _reference(text)
    assert set(ref) == {f for f in FIELDS if f not in load.missing}
    for field, value in ref.items():
        assert getattr(load, field) == pytest.approx(value)


def test_sums_counts_over_label_sets_and_keeps_the_fullest_cache() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="a"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="a"} 4.0',
            'vllm:num_requests_running{engine="0",model_name="b"} 1.0',
            'vllm:num_requests_waiting{engine="0",model_name="a"} 2.0 1712345678000',
            'vllm:num_requests_waiting{engine="1",model_name="a"} 5.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.75',
            # deprecated alias some versions still export alongside: not double counted
            'vllm:gpu_cache_usage_perc{engine="1",model_name="a"} 0.75',
            # a family that starts with one of our names is not ours
            'vllm:num_requests_running_total{model_name="a"} 99',
            "vllm:num_requests_waiting_by_reason 7",
        ]
    )
    load = parse_engine_metrics(text)
    assert (load.running, load.waiting, load.kv_cache_usage) == (8, 7, 0.75)
    assert load.missing == ()


def test_odd_lines_do_not_break_the_scrape() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{model_name="we}ird \\"name\\" # x"} 2',
            "vllm:num_requests_running {} 1",  # space before an empty label block
            "vllm:num_requests_waiting NaN",  # skipped
            "vllm:num_requests_waiting",  # no value
            'vllm:num_requests_waiting{model_name="unterminated 3',
            "vllm:kv_cache_usage_perc +Inf",
            "vllm:kv_cache_usage_perc\t0.25",
        ]
    )
    load = parse_engine_metrics(text)
    assert (load.running, load.waiting, load.kv_cache_usage) == (3, 0, 0.25)
    assert load.missing == ("waiting",)


def test_unknown_engine() -> None:
    load = parse_engine_metrics("# HELP up\nup 1\nprocess_cpu_seconds_total 3.2\n")
    assert not load.known
    assert load.engine == ""
    assert violations(load) == []


_label_value = st.text(alphabet=st.sampled_from(list('abc{}=," #\\\n')), max_size=12).map(
    lambda s: s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
)


@given(
    samples=st.lists(
        st.tuples(
            st.sampled_from([n for names in _NAMES.values() for n in names]),
            _label_value,
            st.floats(min_value=0, max_value=1e6, allow_nan=False),
        ),
        max_size=12,
    )
)
def test_matches_prometheus_client_on_generated_text(
    samples: list[tuple[str, str, float]],
) -> None:
    lines = [
        f'{name}{{model_name="{label}",i="{i}"}} {value!r}'
        for i, (name, label, value) in enumerate(samples)
    ]
    text = "\n".join(lines) + "\n"
    load = parse_engine_metrics(text)
    ref = _reference(text)
    for field in FIELDS:
        if field in ref:
            expected = ref[field]
            got = getattr(load, field)
            if field == "kv_cache_usage":
                assert math.isclose(got, expected)
            else:
                assert got == round(expected)
        else:
            assert field in load.missing


def test_violations() -> None:
    assert violations(EngineLoad(running=10, waiting=0, kv_cache_usage=0.5)) == []
    full = EngineLoad(running=10, waiting=40, kv_cache_usage=0.95)
    assert violations(full) == ["kv cache 95% >= 95%", "40 requests waiting > 32"]
    assert violations(full, kv_cache_limit=0.99, max_waiting=100) == []
    # a family the scrape did not have is not a violation
    assert violations(EngineLoad(kv_cache_usage=1.0, missing=("kv_cache_usage",))) == []
