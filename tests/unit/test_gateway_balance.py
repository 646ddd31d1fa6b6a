"""Balancer: p2c least-outstanding and prefix affinity with bounded loads."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.server.gateway.balance import Balancer, Pick, prompt_prefix
from llmgw.server.gateway.breaker import BreakerState
from llmgw.server.gateway.enginemetrics import EngineLoad


def make(n: int, policy: str = "least-outstanding", seed: int = 0, **kw: object) -> Balancer:
    b = Balancer(policy, rng=random.Random(seed), **kw)  # type: ignore[arg-type]
    for i in range(n):
        b.add(f"e{i}")
    return b


def hold(b: Balancer, endpoint: str, n: int) -> list[Pick]:
    """Put n requests in flight on one endpoint (by excluding all the others)."""
    others = [e for e in b.endpoints if e != endpoint]
    picks = [b.pick(0.0, exclude=others) for _ in range(n)]
    assert all(p is not None and p.endpoint == endpoint for p in picks)
    return picks  # type: ignore[return-value]


# ---- least outstanding (p2c) ------------------------------------------------------------


def test_p2c_picks_the_less_loaded_of_two() -> None:
    b = make(2)
    hold(b, "e0", 3)
    for _ in range(20):
        pick = b.pick(0.0)
        assert pick is not None and pick.endpoint == "e1"
        b.release(pick, 0.0, ok=True)


def test_p2c_never_picks_the_most_loaded() -> None:
    b = make(5, seed=3)
    hold(b, "e4", 2)
    seen = Counter()
    for _ in range(500):
        pick = b.pick(0.0)
        assert pick is not None
        seen[pick.endpoint] += 1
        b.release(pick, 0.0, ok=True)
    assert seen["e4"] == 0
    assert set(seen) == {"e0", "e1", "e2", "e3"}  # the rest share the traffic


def test_p2c_spreads_in_flight_requests_evenly() -> None:
    b = make(4, seed=1)
    for _ in range(400):
        assert b.pick(0.0) is not None
    counts = [b.outstanding(e) for e in b.endpoints]
    assert sum(counts) == 400 and max(counts) - min(counts) <= 3


def test_ties_are_broken_by_scraped_load() -> None:
    b = make(2)
    b.update_load("e0", EngineLoad(running=10, waiting=2, kv_cache_usage=0.3, engine="vllm"))
    b.update_load("e1", EngineLoad(running=4, waiting=0, kv_cache_usage=0.9, engine="vllm"))
    for _ in range(20):
        pick = b.pick(0.0)
        assert pick is not None and pick.endpoint == "e1"
        b.release(pick, 0.0, ok=True)
    # own in-flight count first, scraped load second
    hold(b, "e1", 1)
    pick = b.pick(0.0)
    assert pick is not None and pick.endpoint == "e0"


def test_unknown_load_loses_ties_to_a_known_one() -> None:
    b = make(2)
    b.update_load("e0", EngineLoad(running=50, engine="vllm"))
    b.update_load("e1", None)  # scrape failed
    pick = b.pick(0.0)
    assert pick is not None and pick.endpoint == "e0"


@pytest.mark.parametrize("policy", ["least-outstanding", "prefix-affinity"])
def test_excluded_endpoints_are_skipped(policy: str) -> None:
    b = make(3, policy)
    for i in range(50):
        pick = b.pick(0.0, key=f"k{i}", exclude={"e0", "e2"})
        assert pick is not None and pick.endpoint == "e1"
        b.release(pick, 0.0, ok=True)
    assert b.pick(0.0, key="k", exclude={"e0", "e1", "e2"}) is None


@pytest.mark.parametrize("policy", ["least-outstanding", "prefix-affinity"])
def test_open_breakers_are_skipped_until_the_probe(policy: str) -> None:
    b = make(3, policy, breaker_failures=2, breaker_cooldown=10)
    for _ in range(2):
        pick = b.pick(0.0, exclude={"e1", "e2"})
        assert pick is not None
        b.release(pick, 0.0, ok=False, reason="connect refused")
    assert b.breaker("e0").state is BreakerState.OPEN
    for i in range(50):
        pick = b.pick(5.0, key=f"k{i}")
        assert pick is not None and pick.endpoint != "e0"
        b.release(pick, 5.0, ok=True)
    # after the cool-down one probe goes through, and only one
    probe = b.pick(10.0, exclude={"e1", "e2"})
    assert probe is not None and probe.endpoint == "e0"
    assert b.breaker("e0").state is BreakerState.HALF_OPEN
    assert b.pick(10.0, exclude={"e1", "e2"}) is None
    b.release(probe, 11.0, ok=True)
    assert b.breaker("e0").state is BreakerState.CLOSED
    status = {s.endpoint: s for s in b.status()}
    assert status["e0"].breaker == "closed" and status["e0"].breaker_state == 0


def test_all_breakers_open_means_no_endpoint() -> None:
    b = make(2, breaker_failures=1)
    for e in ("e0", "e1"):
        pick = b.pick(0.0, exclude={x for x in b.endpoints if x != e})
        assert pick is not None
        b.release(pick, 0.0, ok=False)
    assert b.pick(1.0) is None
    assert [s.breaker_state for s in b.status()] == [1, 1]


@pytest.mark.parametrize("policy", ["least-outstanding", "prefix-affinity"])
def test_violations_are_least_preferred_until_they_clear(policy: str) -> None:
    b = make(3, policy)
    full = EngineLoad(running=5, kv_cache_usage=0.97, engine="vllm")
    queued = EngineLoad(running=5, waiting=500, engine="vllm")
    b.update_load("e0", full)
    b.update_load("e1", queued)
    for i in range(30):
        pick = b.pick(0.0, key=f"k{i}")
        assert pick is not None and pick.endpoint == "e2"  # even with 29 in flight there
    # with the clean endpoint excluded, a violating one is still better than nothing
    pick = b.pick(0.0, key="k", exclude={"e2"})
    assert pick is not None and pick.endpoint in {"e0", "e1"}
    # cleared by the next scrape
    b.update_load("e0", EngineLoad(running=5, kv_cache_usage=0.5, engine="vllm"))
    pick = b.pick(0.0, key="k", exclude={"e2"})
    assert pick is not None and pick.endpoint == "e0"
    assert {s.endpoint: s.violations for s in b.status()}["e1"] == ["500 requests waiting > 32"]


def test_release_is_idempotent_and_survives_removal() -> None:
    b = make(2)
    pick = b.pick(0.0)
    assert pick is not None
    b.release(pick, 0.0, ok=True)
    b.release(pick, 0.0, ok=True)
    assert b.outstanding(pick.endpoint) == 0
    pick = b.pick(0.0)
    assert pick is not None
    b.remove(pick.endpoint)
    b.add(pick.endpoint)  # same id back: a fresh endpoint
    b.release(pick, 0.0, ok=False)
    assert b.outstanding(pick.endpoint) == 0
    assert b.breaker(pick.endpoint).consecutive_failures == 0


def test_set_endpoints_keeps_state_of_those_that_stay() -> None:
    b = make(3)
    hold(b, "e1", 2)
    b.set_endpoints(["e1", "e3"])
    assert b.endpoints == ["e1", "e3"]
    assert b.outstanding("e1") == 2 and b.outstanding("e3") == 0


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown balancer policy"):
        Balancer("round-robin")  # type: ignore[arg-type]


# ---- prefix affinity with bounded load --------------------------------------------------


def test_same_prefix_same_endpoint_under_the_bound() -> None:
    b = make(5, "prefix-affinity")
    for key in [f"system prompt {i}" for i in range(40)]:
        owner = b.owner(key)
        for _ in range(3):  # sequential requests: each finishes before the next
            pick = b.pick(0.0, key=key)
            assert pick is not None and pick.endpoint == owner
            b.release(pick, 0.0, ok=True)
    # keys spread over the endpoints
    assert len({b.owner(f"system prompt {i}") for i in range(40)}) == 5


def test_no_key_falls_back_to_p2c() -> None:
    b = make(2, "prefix-affinity")
    hold(b, "e0", 2)
    pick = b.pick(0.0, key=None)
    assert pick is not None and pick.endpoint == "e1"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    c=st.sampled_from([1.1, 1.25, 1.5, 2.0]),
    ops=st.lists(
        st.tuples(st.sampled_from(["hot", "hot", "hot", "a", "b", "c"]), st.booleans()),
        min_size=1,
        max_size=120,
    ),
)
def test_hot_prefix_spills_and_no_endpoint_exceeds_the_bound(
    n: int, c: float, ops: list[tuple[str, bool]]
) -> None:
    b = make(n, "prefix-affinity", load_factor=c)
    rng = random.Random(7)
    held: list[Pick] = []
    for key, release_one in ops:
        if release_one and held:
            b.release(held.pop(rng.randrange(len(held))), 0.0, ok=True)
        pick = b.pick(0.0, key=key)
        assert pick is not None
        held.append(pick)
        total = len(held)
        bound = math.ceil(c * total / n)
        assert all(b.outstanding(e) <= bound for e in b.endpoints)


def test_hot_prefix_prefers_its_owner_then_walks_the_ring() -> None:
    b = make(4, "prefix-affinity", load_factor=1.25)
    owner = b.owner("hot")
    picks = [b.pick(0.0, key="hot") for _ in range(40)]
    assert all(p is not None for p in picks)
    counts = Counter(p.endpoint for p in picks if p is not None)
    assert len(counts) == 4  # spilled everywhere
    assert counts[owner] == max(counts.values())
    assert max(counts.values()) <= math.ceil(1.25 * 40 / 4)


_keys = st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=60, unique=True)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 10), keys=_keys, victim=st.integers(0, 9))
def test_removing_an_endpoint_moves_only_its_keys(n: int, keys: list[str], victim: int) -> None:
    b = make(n, "prefix-affinity")
    gone = f"e{victim % n}"

    def route(key: str) -> str:
        pick = b.pick(0.0, key=key)
        assert pick is not None
        b.release(pick, 0.0, ok=True)
        return pick.endpoint

    before = {k: route(k) for k in keys}
    b.remove(gone)
    after = {k: route(k) for k in keys}
    for k in keys:
        if before[k] != gone:
            assert after[k] == before[k]
        else:
            assert after[k] != gone
    b.add(gone)  # and back: everything returns to where it was
    assert {k: route(k) for k in keys} == before


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), keys=_keys)
def test_adding_an_endpoint_only_takes_keys_for_itself(n: int, keys: list[str]) -> None:
    b = make(n, "prefix-affinity")
    before = {k: b.owner(k) for k in keys}
    b.add("new")
    for k in keys:
        assert b.owner(k) in (before[k], "new")


def test_ring_is_stable_across_processes() -> None:
    """blake2b, not hash(): the mapping must not change with PYTHONHASHSEED or a restart
    (a change of this pinned mapping would move every prefix away from its KV cache)."""
    keys = ("alpha", "beta", "gamma", "delta")
    assert [make(4, "prefix-affinity", seed=s).owner(k) for s in (1, 2) for k in keys] == [
        "e3", "e2", "e0", "e0",
    ] * 2  # fmt: skip


# ---- prompt prefix ----------------------------------------------------------------------


def test_prompt_prefix_chat() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
        ],
    }
    key = prompt_prefix(body)
    assert key is not None
    assert "You are a helpful assistant." in key and key.endswith("Hi")
    # role boundaries matter: the same text in another role is another prompt
    other = {"messages": [{"role": "user", "content": "You are a helpful assistant.Hi"}]}
    assert prompt_prefix(other) != key


def test_prompt_prefix_shared_system_prompt_gives_same_key() -> None:
    system = {"role": "system", "content": "x" * 300}
    a = prompt_prefix({"messages": [system, {"role": "user", "content": "question one"}]})
    b = prompt_prefix({"messages": [system, {"role": "user", "content": "question two"}]})
    assert a == b and a is not None and len(a) == 256
    assert prompt_prefix({"messages": [system]}, chars=16) == "\x1esystem\x1fxxxxxxxx"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "Once upon a time"}, "Once upon a time"),
        ({"prompt": ["first", "second"]}, "first"),
        ({"prompt": [1, 2, 3]}, "1,2,3"),
        ({"prompt": [[7, 8], [9]]}, "7,8"),
        ({"prompt": ""}, None),
        ({"prompt": []}, None),
        ({"messages": []}, None),
        ({"messages": [{"role": "user", "content": ""}]}, None),
        ({"messages": "nonsense"}, None),
        ({}, None),
    ],
)
def test_prompt_prefix_shapes(body: dict, expected: str | None) -> None:
    assert prompt_prefix(body) == expected


# ---- active health ----------------------------------------------------------------------


def test_health_failures_in_a_row_take_an_endpoint_out_until_one_passes() -> None:
    b = make(2, health_failures=3, health_probes=True)
    assert b.health("e0", 0.0, False, "no answer") is None
    assert b.health("e0", 1.0, True) is None  # a pass resets the count: failures must be in a row
    assert [b.health("e0", t, False, "no answer to /health within 1s") for t in (2.0, 3.0, 4.0)] == [None, None, "down"]
    assert not b.healthy("e0") and b.healthy("e1")
    assert all(b.pick(5.0).endpoint == "e1" for _ in range(20))  # type: ignore[union-attr]
    assert b.pick(5.0, exclude={"e1"}) is None
    [st0] = [st for st in b.status() if st.endpoint == "e0"]
    assert not st0.healthy and st0.unhealthy_since == 4.0 and "1s" in st0.health_reason
    assert b.health("e0", 5.0, False) is None  # already out
    assert b.health("e0", 6.0, True) == "up"
    assert b.healthy("e0") and {b.pick(7.0, exclude={"e1"}).endpoint} == {"e0"}  # type: ignore[union-attr]
    assert b.health("nope", 7.0, False) is None


def test_an_open_breaker_is_probed_by_health_checks_not_clients() -> None:
    b = make(2, breaker_failures=2, breaker_cooldown=10.0, health_probes=True)
    for _ in range(2):
        p = b.pick(0.0, exclude={"e1"})
        assert p is not None
        b.release(p, 0.0, ok=False, reason="reset")
    assert b.breaker("e0").state is BreakerState.OPEN
    assert b.pick(50.0, exclude={"e1"}) is None  # long past the cool-down: no client probes
    b.health("e0", 50.0, True)
    assert b.breaker("e0").state is BreakerState.CLOSED
    assert b.pick(50.0, exclude={"e1"}).endpoint == "e0"  # type: ignore[union-attr]


def test_turning_active_health_off_puts_every_endpoint_back_and_lets_clients_probe() -> None:
    b = make(1, health_failures=1, breaker_failures=1, breaker_cooldown=1.0, health_probes=True)
    assert b.health("e0", 0.0, False, "no answer") == "down"
    p = b.pick(0.0)
    assert p is None
    b.set_health_policy(3, probes=False)  # a reload with health_interval: 0
    assert b.healthy("e0")
    p = b.pick(0.0)
    assert p is not None
    b.release(p, 0.0, ok=False)
    assert b.breaker("e0").state is BreakerState.OPEN
    assert b.pick(2.0) is not None  # the cool-down is over: a client probes again
