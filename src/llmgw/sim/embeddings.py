"""OpenAI embeddings as vLLM answers them. Pure: values in, bytes out (see llmgw.sim.openai_api).

A vector is derived from the input text alone (a hash, normalised), so equal inputs embed
equally and different inputs differ, which is all a gateway or a test can observe.
"""

from __future__ import annotations

import base64
import hashlib
import struct

import msgspec

from llmgw.sim.openai_api import (
    EmbeddingRequest,
    bad_request,
    check_model,
    count_text_tokens,
    usage_counts,
)


def embedding_vector(text: str, dim: int, model: str = "") -> list[float]:
    """A unit vector derived from the input alone: equal inputs embed equally, others differ."""
    raw = hashlib.shake_256(f"{model}\x00{text}".encode()).digest(2 * dim)
    values = [v / 32768.0 for v in struct.unpack(f"<{dim}h", raw)]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return [v / norm for v in values]


def embedding_inputs(value: str | list[str | int | list[int]]) -> list[tuple[str, int]]:
    """(text, tokens) per input: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [(value, max(count_text_tokens(value), 1))]
    if not value:
        raise bad_request("Input cannot be empty.", "input")
    if all(isinstance(v, int) for v in value):
        return [(" ".join(map(str, value)), len(value))]
    out: list[tuple[str, int]] = []
    for v in value:
        if isinstance(v, str):
            out.append((v, max(count_text_tokens(v), 1)))
        elif isinstance(v, list):
            out.append((" ".join(map(str, v)), len(v)))
        else:
            raise bad_request("input must be a string, a list of strings, or token ids.", "input")
    return out


def embeddings_response(
    req: EmbeddingRequest,
    *,
    served_model: str,
    dim: int,
    max_model_len: int,
    request_id: str,
    created: int,
) -> tuple[bytes, int]:
    """(body, prompt tokens) of an embeddings request."""
    model = check_model(req.model, served_model)
    inputs = embedding_inputs(req.input)
    out_dim = dim
    if req.dimensions is not None:
        if not 1 <= req.dimensions <= dim:
            raise bad_request(
                f"dimensions must be between 1 and {dim}, got {req.dimensions}.", "dimensions"
            )
        out_dim = req.dimensions
    for _, tokens in inputs:
        if tokens > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{tokens} tokens in the input for embedding generation. Please reduce the length of the input.",
                "input",
            )
    data = []
    for i, (text, _) in enumerate(inputs):
        vec = embedding_vector(text, dim, model)[:out_dim]
        if out_dim != dim:
            norm = sum(v * v for v in vec) ** 0.5 or 1.0
            vec = [v / norm for v in vec]
        emb: list[float] | str
        emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if req.encoding_format == "base64" else vec
        data.append({"index": i, "object": "embedding", "embedding": emb})
    prompt_tokens = sum(t for _, t in inputs)
    body = {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": usage_counts(prompt_tokens, 0),
    }
    return msgspec.json.encode(body), prompt_tokens
