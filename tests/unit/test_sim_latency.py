"""The simulated engine's latency model, and its scheduler under trio's MockClock."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from llmgw.sim import openai_api as api
from llmgw.sim.engine import EngineOptions, SimEngine
from llmgw.sim.latency import LatencyModel, LatencyParams, kv_blocks, kv_cache_usage


def test_idle_engine_delays_are_the_configured_ones_without_jitter() -> None:
    model = LatencyModel(
        LatencyParams(ttft_s=0.02, itl_s=0.005, prefill_s_per_token=0.001, jitter=0.0)
    )
    assert model.ttft(running=1, prompt_tokens=0) == pytest.approx(0.02)
    assert model.ttft(running=1, prompt_tokens=10) == pytest.approx(0.03)
    assert model.itl(running=1) == pytest.approx(0.005)


def test_latency_grows_with_the_batch_up_to_the_slowdown() -> None:
    p = LatencyParams(itl_s=0.01, jitter=0.0, max_concurrency=5, load_slowdown=3.0)
    model = LatencyModel(p)
    itls = [model.itl(running=r) for r in range(1, 6)]
    assert itls == sorted(itls) and len(set(itls)) == 5
    assert itls[0] == pytest.approx(0.01)
    assert itls[-1] == pytest.approx(0.04)  # (1 + load_slowdown) x idle at a full batch
    assert model.itl(running=50) == pytest.approx(0.04)  # beyond the batch it does not grow further


@given(seed=st.integers(0, 2**32), running=st.integers(1, 300), prompt=st.integers(0, 5000))
def test_jitter_stays_in_its_band_and_repeats_with_the_seed(
    seed: int, running: int, prompt: int
) -> None:
    p = LatencyParams(jitter=0.25)
    a, b = LatencyModel(p, seed), LatencyModel(p, seed)
    plain = LatencyModel(LatencyParams(jitter=0.0))
    for _ in range(5):
        ttft = a.ttft(running, prompt)
        assert ttft == b.ttft(running, prompt)
        base = plain.ttft(running, prompt)
        assert 0.75 * base - 1e-12 <= ttft <= 1.25 * base + 1e-12
        itl = a.itl(running)
        assert itl == b.itl(running)
        assert 0.75 * plain.itl(running) - 1e-12 <= itl <= 1.25 * plain.itl(running) + 1e-12


def test_kv_cache_usage_counts_whole_blocks_and_saturates() -> None:
    assert kv_blocks(0) == 0
    assert kv_blocks(1) == 1
    assert kv_blocks(16) == 1
    assert kv_blocks(17) == 2
    assert kv_cache_usage(0, 1600) == 0.0
    assert kv_cache_usage(50, 1600) == pytest.approx(0.5)
    assert kv_cache_usage(500, 1600) == 1.0


def test_a_batch_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        LatencyModel(LatencyParams(max_concurrency=0))


# ---- the scheduler (SimEngine.generate) in virtual time ----------------------------------------


def _plan(tokens: int, prompt_tokens: int = 10) -> api.GenerationPlan:
    return api.GenerationPlan(
        kind="chat",
        model="m",
        stream=True,
        include_usage=False,
        continuous_usage=False,
        prompt_tokens=prompt_tokens,
        longest_prompt=prompt_tokens,
        choices=1,
        n=1,
        output_tokens=tokens,
        max_tokens=tokens,
        finish_reason="length",
        seed=1,
    )


def _engine(**kw: object) -> SimEngine:
    base: dict[str, object] = {
        "ttft_s": 0.1,
        "itl_s": 0.01,
        "prefill_s_per_token": 0.0,
        "jitter": 0.0,
    }
    base.update(kw)
    return SimEngine(EngineOptions(**base))  # type: ignore[arg-type]


async def test_tokens_come_after_ttft_then_every_itl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = _engine()
    start = trio.current_time()
    times: list[float] = []

    async def emit(k: int) -> None:
        times.append(trio.current_time() - start)

    await engine.generate(_plan(4), emit)
    assert times == pytest.approx([0.1, 0.11, 0.12, 0.13])
    m = engine.metrics
    assert m.time_to_first_token.count == 1
    assert m.time_to_first_token.sum == pytest.approx(0.1)
    assert m.inter_token_latency.count == 3
    assert m.inter_token_latency.sum == pytest.approx(0.03)
    assert m.request_success["length"] == 1
    assert m.generation_tokens == 4
    assert m.prompt_tokens == 10
    assert engine.running == 0 and engine.waiting == 0 and engine.kv_blocks_used == 0


async def test_requests_beyond_the_batch_wait_and_are_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = _engine(max_concurrency=1)
    first_token: dict[str, float] = {}
    seen: list[tuple[int, int]] = []

    async def run(name: str) -> None:
        async def emit(k: int) -> None:
            first_token.setdefault(name, trio.current_time())
            seen.append((engine.running, engine.waiting))

        await engine.generate(_plan(3), emit)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(run, "b")
        await trio.testing.wait_all_tasks_blocked()
        assert (engine.running, engine.waiting) == (1, 1)
    # b got its slot only when a finished: a's ttft + 2 itl, then its own ttft.
    assert first_token["a"] - start == pytest.approx(0.1)
    assert first_token["b"] - start == pytest.approx(0.12 + 0.1)
    assert max(r for r, _ in seen) == 1
    assert engine.metrics.request_queue_time.sum == pytest.approx(0.12)
    assert (engine.running, engine.waiting) == (0, 0)


async def test_latency_and_kv_usage_rise_with_load(autojump_clock: trio.testing.MockClock) -> None:
    engine = _engine(max_concurrency=4, load_slowdown=1.0, kv_cache_tokens=16 * 100)
    alone = _engine(max_concurrency=4, load_slowdown=1.0)
    gaps: dict[int, list[float]] = {}
    usage: list[float] = []

    async def run(i: int, eng: SimEngine) -> None:
        last = [0.0]

        async def emit(k: int) -> None:
            now = trio.current_time()
            if k:
                gaps.setdefault(i, []).append(now - last[0])
            last[0] = now
            usage.append(eng.kv_usage())

        await eng.generate(_plan(5, prompt_tokens=100), emit)

    await run(-1, alone)
    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(run, i, engine)
    assert gaps[-1][0] == pytest.approx(0.01)
    under_load = [g for i in range(4) for g in gaps[i]]
    assert max(under_load) == pytest.approx(0.02)  # a full batch: twice the idle latency
    assert all(0.01 - 1e-9 <= g <= 0.02 + 1e-9 for g in under_load)
    assert sum(under_load) / len(under_load) > 1.4 * 0.01  # and it eases as requests finish
    assert max(usage) >= 4 * kv_blocks(100) / 100  # four prompts' blocks held at once
    assert engine.kv_usage() == 0.0


async def test_a_cancelled_request_leaves_the_batch_and_counts_as_abort(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = _engine(max_concurrency=1)
    with trio.move_on_after(0.125):  # during the third token's wait
        await engine.generate(_plan(100))
    assert engine.running == 0 and engine.waiting == 0 and engine.kv_blocks_used == 0
    assert engine.metrics.request_success["abort"] == 1
    assert engine.metrics.generation_tokens == 3
    # and the slot is free again
    with trio.fail_after(1):
        await engine.generate(_plan(1))
    assert engine.metrics.request_success["length"] == 1


async def test_a_request_cancelled_while_waiting_is_not_left_in_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = _engine(max_concurrency=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.generate, _plan(10))
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.05):
            await engine.generate(_plan(10))
        assert engine.waiting == 0 and engine.running == 1
    assert engine.metrics.request_success["abort"] == 1
    assert engine.metrics.request_success["length"] == 1
