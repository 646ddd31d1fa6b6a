"""GET /v1/models and /v1/models/{id} as the OpenAI clients read them (llmgw.server.gateway.openai_api)."""

from __future__ import annotations

import msgspec

from llmgw.server.gateway.openai_api import is_models_path, models_answer

READY = ["chat", "meta-llama/Llama-3.1-8B-Instruct"]
KNOWN = {"chat", "meta-llama/Llama-3.1-8B-Instruct", "cold"}


def test_the_list_holds_the_models_in_rotation():
    status, body = models_answer(b"/v1/models", READY, KNOWN, 1700000000)
    doc = msgspec.json.decode(body)
    assert status == 200 and doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == READY
    assert doc["data"][0] == {"id": "chat", "object": "model", "created": 1700000000, "owned_by": "llmgw"}


def test_retrieve_answers_exactly_for_a_listed_model_encoded_or_raw():
    for path in (b"/v1/models/meta-llama%2FLlama-3.1-8B-Instruct", b"/v1/models/meta-llama/Llama-3.1-8B-Instruct"):
        status, body = models_answer(path, READY, KNOWN, 5)
        assert status == 200
        assert msgspec.json.decode(body) == {"id": READY[1], "object": "model", "created": 5, "owned_by": "llmgw"}


def test_retrieve_of_a_model_with_no_replica_or_no_such_model_is_404_model_not_found():
    status, body = models_answer(b"/v1/models/cold", READY, KNOWN, 5)
    error = msgspec.json.decode(body)["error"]
    assert status == 404 and error["code"] == "model_not_found" and "no ready replica" in error["message"]
    status, body = models_answer(b"/v1/models/gpt-4", READY, KNOWN, 5)
    error = msgspec.json.decode(body)["error"]
    assert status == 404 and error["code"] == "model_not_found"
    assert error["message"].startswith("The model `gpt-4` does not exist (known: chat, cold, ")


def test_only_the_models_paths_are_models_paths():
    assert is_models_path(b"/v1/models") and is_models_path(b"/v1/models/x")
    assert not is_models_path(b"/v1/modelsx") and not is_models_path(b"/v1/chat/completions")
