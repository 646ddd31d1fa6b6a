"""Requests and responses of the simulated engine's OpenAI API, in vLLM's shapes."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.sim import openai_api as api
from llmgw.sim.embeddings import embeddings_response


def _chat(body: dict[str, object], **kw: object) -> api.GenerationPlan:
    args: dict[str, object] = {
        "served_model": "m",
        "max_model_len": 1000,
        "natural_tokens": 16,
        "engine_seed": 0,
    }
    args.update(kw)
    return api.plan_chat(api.decode(json.dumps(body).encode(), api.ChatRequest), **args)  # type: ignore[arg-type]


MSG = [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"", "empty"),
        (b"{not json", "JSON decode error"),
        (b'{"messages": "hi"}', "Expected `array`"),
        (b'{"model": "m"}', "missing required field `messages`"),
        (b"[]", "Expected `object`"),
    ],
)
def test_bodies_that_do_not_parse_are_400_in_the_error_envelope(body: bytes, needle: str) -> None:
    with pytest.raises(api.ApiError) as info:
        api.decode(body, api.ChatRequest)
    err = info.value
    assert err.status == 400
    doc = json.loads(err.body())
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == 400
    assert needle in doc["error"]["message"]


def test_a_wrong_model_is_404_as_vllm_says_it() -> None:
    with pytest.raises(api.ApiError) as info:
        _chat({"model": "other", "messages": MSG})
    doc = json.loads(info.value.body())["error"]
    assert info.value.status == 404
    assert doc == {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_a_missing_model_means_the_served_one() -> None:
    assert _chat({"messages": MSG}).model == "m"


def test_max_tokens_bounds_the_answer_and_sets_the_finish_reason() -> None:
    short = _chat({"messages": MSG, "max_tokens": 3})
    assert (short.output_tokens, short.finish_reason) == (3, "length")
    natural = _chat({"messages": MSG, "max_tokens": 100})
    assert (natural.output_tokens, natural.finish_reason) == (16, "stop")
    newer_field = _chat({"messages": MSG, "max_completion_tokens": 2, "max_tokens": 50})
    assert newer_field.output_tokens == 2
    forced = _chat({"messages": MSG, "max_tokens": 40, "ignore_eos": True})
    assert (forced.output_tokens, forced.finish_reason) == (40, "length")
    unbounded = _chat({"messages": MSG})
    assert unbounded.max_tokens == 1000 - unbounded.prompt_tokens


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "max_tokens": 5000}, "max_tokens"),
        ({"messages": MSG, "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x" * 8000}]}, "messages"),
    ],
)
def test_out_of_range_requests_are_400(body: dict[str, object], param: str) -> None:
    with pytest.raises(api.ApiError) as info:
        _chat(body)
    assert info.value.status == 400
    assert info.value.param == param


def test_completion_prompts_strings_lists_and_token_ids() -> None:
    assert api.completion_prompts("abcd efgh") == [("abcd efgh", 3)]
    assert [t for _, t in api.completion_prompts(["a", "bb"])] == [1, 1]
    assert api.completion_prompts([1, 2, 3])[0][1] == 3
    assert [t for _, t in api.completion_prompts([[1, 2], [3]])] == [2, 1]
    plan = api.plan_completion(
        api.decode(b'{"prompt": ["a", "b"], "n": 2, "max_tokens": 4}', api.CompletionRequest),
        served_model="m",
        max_model_len=100,
        natural_tokens=16,
        engine_seed=0,
    )
    assert plan.choices == 4 and plan.output_tokens == 4 and plan.prompt_tokens == 2


def test_full_chat_response_has_openais_fields_and_consistent_usage() -> None:
    plan = _chat({"messages": MSG, "max_tokens": 5, "n": 2})
    doc = json.loads(api.full_response(plan, request_id="chatcmpl-1", created=7))
    assert doc["object"] == "chat.completion" and doc["id"] == "chatcmpl-1" and doc["model"] == "m"
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    for c in doc["choices"]:
        assert c["message"]["role"] == "assistant"
        assert len(c["message"]["content"].split()) == 5
        assert c["finish_reason"] == "length"
    u = doc["usage"]
    assert u["completion_tokens"] == 10 and u["total_tokens"] == u["prompt_tokens"] + 10


def _events(stream: bytes) -> list[str]:
    assert stream.endswith(b"\n\n")
    events = stream.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_is_one_chunk_per_token_then_usage_then_done(
    kind: str, include_usage: bool
) -> None:
    plan = _chat({"messages": MSG, "max_tokens": 4})
    plan.kind = kind  # type: ignore[assignment]
    plan.include_usage = include_usage
    events = _events(api.whole_stream(plan, request_id="x-1", created=1))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if include_usage:
        last = chunks.pop()
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert all("usage" not in c for c in chunks)
    if kind == "chat":
        first = chunks.pop(0)
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        texts = [c["choices"][0]["delta"]["content"] for c in chunks]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    else:
        texts = [c["choices"][0]["text"] for c in chunks]
        assert all(c["object"] == "text_completion" for c in chunks)
    assert len(texts) == 4
    assert "".join(texts) == api.output_text(plan.seed, 0, 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_continuous_usage_stats_put_usage_on_every_chunk() -> None:
    plan = _chat({"messages": MSG, "max_tokens": 3, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    chunks = [
        json.loads(e) for e in _events(api.whole_stream(plan, request_id="x", created=1))[:-1]
    ]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]


@given(text=st.text(max_size=200), seed=st.integers(0, 2**63))
def test_answers_are_deterministic_and_token_counted(text: str, seed: int) -> None:
    s = api.text_seed(text, seed, None)
    assert s == api.text_seed(text, seed, None)
    out = api.output_text(s, 0, 7)
    assert out == api.output_text(s, 0, 7)
    assert len(out.split(" ")) == 7
    chunk = api.ChunkWriter(_chat({"messages": MSG}), request_id="i", created=1).token_chunk(
        0, text, 1
    )
    assert json.loads(chunk[len(b"data: ") :])["choices"][0]["delta"]["content"] == text


def test_embeddings_are_deterministic_unit_vectors_in_float_and_base64() -> None:
    req = api.decode(b'{"input": ["a", "b", "a"], "model": "m"}', api.EmbeddingRequest)
    body, tokens = embeddings_response(
        req, served_model="m", dim=8, max_model_len=100, request_id="e", created=1
    )
    doc = json.loads(body)
    vecs = [d["embedding"] for d in doc["data"]]
    assert tokens == 3 and doc["usage"]["prompt_tokens"] == 3 and doc["object"] == "list"
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert all(abs(sum(v * v for v in vec) - 1.0) < 1e-9 for vec in vecs)
    req64 = api.decode(b'{"input": "a", "encoding_format": "base64"}', api.EmbeddingRequest)
    body64, _ = embeddings_response(
        req64, served_model="m", dim=8, max_model_len=100, request_id="e", created=1
    )
    raw = base64.b64decode(json.loads(body64)["data"][0]["embedding"])
    assert struct.unpack("<8f", raw) == pytest.approx(vecs[0], abs=1e-6)
    short = api.decode(b'{"input": "a", "dimensions": 3}', api.EmbeddingRequest)
    body3, _ = embeddings_response(
        short, served_model="m", dim=8, max_model_len=100, request_id="e", created=1
    )
    assert len(json.loads(body3)["data"][0]["embedding"]) == 3


def test_models_list_is_openais_list_shape() -> None:
    doc = json.loads(
        api.models_response(served_model="m", root="org/m", max_model_len=10, created=1)
    )
    assert doc["object"] == "list"
    (card,) = doc["data"]
    assert (
        card["id"] == "m"
        and card["object"] == "model"
        and card["owned_by"] == "vllm"
        and card["root"] == "org/m"
    )
