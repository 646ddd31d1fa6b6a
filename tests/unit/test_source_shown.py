"""What viewers see of a model's source (GET /api/v1/models, `ctl models`): never its credentials.
Through the real port: tests/e2e/test_weights.py, the slow download's test."""

from __future__ import annotations

import pytest

from llmgw.catalog.sources import shown


@pytest.mark.parametrize(("source", "seen"), [
    ("https://fetcher:s3cret@files.example:8443/m/model.safetensors?X-Amz-Signature=sig#x",
     "https://files.example:8443/m/model.safetensors"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
    ("/models/llama", "/models/llama"),
    ("s3://key:secret@bucket/x", "s3://…"),  # refused by the catalog; never echoed whole
])
def test_what_viewers_see_of_a_source_holds_no_credential(source: str, seen: str) -> None:
    assert shown(source) == seen
