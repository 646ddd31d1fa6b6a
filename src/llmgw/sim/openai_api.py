"""OpenAI-compatible requests and responses as vLLM writes them. Pure: bytes in, bytes out.

The shapes, field order, error envelope and messages follow vLLM's OpenAI server
(vllm/entrypoints/openai/*): errors are `{"error": {"message", "type", "param", "code"}}`
with `code` the HTTP status, an unknown model is 404 `NotFoundError` "The model `X` does
not exist.", a body that does not parse or validate is 400, streaming sends a first chat
chunk with the role, one chunk per token, the finish reason on the last token's chunk, and
with `stream_options.include_usage` a last chunk with `choices: []` and the usage.

Tokens are simulated: the prompt is counted as one token per four UTF-8 bytes (plus a chat
template's few tokens per message) and the output is words drawn deterministically from
the prompt, so the same request always gets the same answer.
"""

from __future__ import annotations

import zlib
from typing import Any, Literal, TypeVar

import msgspec

MASK64 = (1 << 64) - 1

# ---- errors -----------------------------------------------------------------------------


class ApiError(Exception):
    """A request the engine answers with an error status and vLLM's error body."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


# ---- requests ---------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    # vLLM's StreamOptions defaults include_usage to True once stream_options is given.
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(msgspec.Struct):
    messages: list[ChatMessage]
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None


class CompletionRequest(msgspec.Struct):
    prompt: str | list[str | int | list[int]]
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for /v1/completions
    n: int | None = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None


class EmbeddingRequest(msgspec.Struct):
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class Probe(msgspec.Struct):
    """The few fields the fixed-response fast path reads; everything else is skipped unparsed."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t) for t in (ChatRequest, CompletionRequest, EmbeddingRequest, Probe)
}


T = TypeVar("T")


def decode(body: bytes, kind: type[T]) -> T:
    """Parse a request body or raise the 400 vLLM gives for a body that fails validation."""
    if not body:
        raise ApiError(400, "Request body is empty; expected a JSON object.", "Bad Request")
    try:
        return _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"1 validation error: {exc}", "Bad Request") from None
    except msgspec.DecodeError as exc:
        raise ApiError(
            400, f"1 validation error: JSON decode error: {exc}", "Bad Request"
        ) from None


def usage_flags(stream_options: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as vLLM's should_include_usage decides them."""
    if stream_options is None:
        return False, False
    include = bool(stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


# ---- simulated tokens ---------------------------------------------------------------------


def count_text_tokens(text: str) -> int:
    """A stand-in tokenizer: about four bytes a token, as BPE tokenizers average on English."""
    if not text:
        return 0
    return (len(text.encode()) + 3) // 4


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))


def chat_prompt(messages: list[ChatMessage]) -> tuple[str, int]:
    """(text the answer is derived from, prompt tokens) for a chat: ChatML-like overhead."""
    texts = [_content_text(m.content) for m in messages]
    tokens = sum(count_text_tokens(t) + 4 for t in texts) + 3  # role markers + generation prompt
    return "\n".join(texts), tokens


def completion_prompts(prompt: str | list[str | int | list[int]]) -> list[tuple[str, int]]:
    """One (text, tokens) per prompt: a string, a list of strings, token ids, or lists of ids."""
    if isinstance(prompt, str):
        return [(prompt, count_text_tokens(prompt))]
    if not prompt:
        raise bad_request("Prompt cannot be empty.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(" ".join(map(str, prompt)), len(prompt))]
    out: list[tuple[str, int]] = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, count_text_tokens(p)))
        elif isinstance(p, list):
            out.append((" ".join(map(str, p)), len(p)))
        else:
            raise bad_request("prompt must be a string, a list of strings, or token ids.", "prompt")
    return out


_VOCAB = (
    "the", "engine", "answers", "with", "tokens", "that", "look", "like", "a", "model",
    "on", "GPU", "fleet", "of", "nodes", "and", "each", "request", "gets", "same",
    "words", "for", "prompt", "so", "tests", "can", "compare", "them", "across", "runs",
    "while", "latency", "follows", "load", "cache", "fills", "up", "as", "batch", "grows",
    "in", "simulated", "time", "every", "reply", "is", "deterministic", "given", "seed", "it",
    "streams", "one", "chunk", "per", "token", "until", "stop", "or", "length", "ends",
    "text", "here", "now", "done",
)  # fmt: skip


def text_seed(prompt_text: str, engine_seed: int, request_seed: int | None) -> int:
    return (
        zlib.crc32(prompt_text.encode()) ^ (engine_seed * 0x9E3779B1) ^ ((request_seed or 0) << 32)
    ) & MASK64


def token_text(seed: int, choice: int, k: int) -> str:
    """The k-th output token of one choice: a word, with a space before all but the first."""
    h = (seed + choice * 0x632BE59BD9B4E019 + k * 0x9E3779B97F4A7C15) & MASK64
    h ^= h >> 29
    word = _VOCAB[(h * 0xBF58476D1CE4E5B9 & MASK64) >> 58]
    return word if k == 0 else " " + word


def output_text(seed: int, choice: int, tokens: int) -> str:
    return "".join(token_text(seed, choice, k) for k in range(tokens))


# ---- generation plan ----------------------------------------------------------------------


class GenerationPlan(msgspec.Struct, kw_only=True):
    """What the engine will produce for one chat or completion request, decided up front."""

    kind: Literal["chat", "completion"]
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    prompt_tokens: int  # all prompts together (usage.prompt_tokens)
    longest_prompt: int
    choices: int  # len(prompts) * n
    n: int
    output_tokens: int  # per choice
    max_tokens: int
    finish_reason: Literal["stop", "length"]
    seed: int


def _max_tokens_and_length(
    *,
    requested: int | None,
    longest_prompt: int,
    max_model_len: int,
    natural: int,
    ignore_eos: bool,
    min_tokens: int,
) -> tuple[int, int, Literal["stop", "length"]]:
    if requested is not None and requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}.", "max_tokens")
    if longest_prompt >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {longest_prompt} input tokens. Please reduce the length of the input messages.",
            "messages",
        )
    room = max_model_len - longest_prompt
    if requested is not None and requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest_prompt + requested} tokens ({longest_prompt} in the messages, {requested} in the "
            "completion). Please reduce the length of the messages or completion.",
            "max_tokens",
        )
    max_tokens = room if requested is None else requested
    want = max_tokens if ignore_eos else max(natural, min_tokens, 1)
    if want >= max_tokens:
        return max_tokens, max_tokens, "length"
    return max_tokens, want, "stop"


def check_model(requested: str | None, served: str) -> str:
    # vLLM accepts a missing model and answers as the first served model.
    if requested is not None and requested != served:
        raise model_not_found(requested)
    return served


def _check_n(n: int | None) -> int:
    n = 1 if n is None else n
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}.", "n")
    return n


def plan_chat(
    req: ChatRequest,
    *,
    served_model: str,
    max_model_len: int,
    natural_tokens: int,
    engine_seed: int,
) -> GenerationPlan:
    model = check_model(req.model, served_model)
    n = _check_n(req.n)
    text, prompt_tokens = chat_prompt(req.messages)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens, length, finish = _max_tokens_and_length(
        requested=requested,
        longest_prompt=prompt_tokens,
        max_model_len=max_model_len,
        natural=natural_tokens,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )
    include, continuous = usage_flags(req.stream_options)
    return GenerationPlan(
        kind="chat",
        model=model,
        stream=bool(req.stream),
        include_usage=include,
        continuous_usage=continuous,
        prompt_tokens=prompt_tokens,
        longest_prompt=prompt_tokens,
        choices=n,
        n=n,
        output_tokens=length,
        max_tokens=max_tokens,
        finish_reason=finish,
        seed=text_seed(text, engine_seed, req.seed),
    )


def plan_completion(
    req: CompletionRequest,
    *,
    served_model: str,
    max_model_len: int,
    natural_tokens: int,
    engine_seed: int,
) -> GenerationPlan:
    model = check_model(req.model, served_model)
    n = _check_n(req.n)
    prompts = completion_prompts(req.prompt)
    longest = max(t for _, t in prompts)
    max_tokens, length, finish = _max_tokens_and_length(
        requested=req.max_tokens,
        longest_prompt=longest,
        max_model_len=max_model_len,
        natural=natural_tokens,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )
    include, continuous = usage_flags(req.stream_options)
    return GenerationPlan(
        kind="completion",
        model=model,
        stream=bool(req.stream),
        include_usage=include,
        continuous_usage=continuous,
        prompt_tokens=sum(t for _, t in prompts),
        longest_prompt=longest,
        choices=len(prompts) * n,
        n=n,
        output_tokens=length,
        max_tokens=max_tokens,
        finish_reason=finish,
        seed=text_seed("\x00".join(p for p, _ in prompts), engine_seed, req.seed),
    )


# ---- responses ----------------------------------------------------------------------------


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def full_response(
    plan: GenerationPlan, *, request_id: str, created: int, texts: list[str] | None = None
) -> bytes:
    """The non-streaming body: every choice's whole text and the usage."""
    if texts is None:
        texts = [output_text(plan.seed, i, plan.output_tokens) for i in range(plan.choices)]
    completion_tokens = plan.output_tokens * plan.choices
    if plan.kind == "chat":
        choices: list[dict[str, Any]] = [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": plan.finish_reason,
                "stop_reason": None,
            }
            for i, text in enumerate(texts)
        ]
        body: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": plan.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage_counts(plan.prompt_tokens, completion_tokens),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
    else:
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": plan.model,
            "choices": [
                {
                    "index": i,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": plan.finish_reason,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
                for i, text in enumerate(texts)
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage_counts(plan.prompt_tokens, completion_tokens),
            "kv_transfer_params": None,
        }
    return msgspec.json.encode(body)


class ChunkWriter:
    """SSE events of one streaming response, each `data: {json}\\n\\n`, built from templates.

    The per-token chunk is the hot path of a streaming request, so the constant parts of its
    JSON are encoded once and only the token text is encoded per chunk.
    """

    def __init__(self, plan: GenerationPlan, *, request_id: str, created: int) -> None:
        self.plan = plan
        obj = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
        head = msgspec.json.encode(
            {"id": request_id, "object": obj, "created": created, "model": plan.model}
        )
        self._head = b"data: " + head[:-1] + b',"choices":['
        self._chat = plan.kind == "chat"

    def _usage_suffix(self, completion_tokens: int) -> bytes:
        if not self.plan.continuous_usage:
            return b"}\n\n"
        return (
            b',"usage":'
            + msgspec.json.encode(usage_counts(self.plan.prompt_tokens, completion_tokens))
            + b"}\n\n"
        )

    def role_chunk(self, index: int) -> bytes:
        """Chat only: the first chunk of a choice, with the role and empty content."""
        return (
            self._head
            + b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            % index
            + self._usage_suffix(0)
        )

    def token_chunk(
        self, index: int, text: str, completion_tokens: int, finish_reason: str | None = None
    ) -> bytes:
        fin = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        stop = b"" if finish_reason is None else b',"stop_reason":null'
        enc = msgspec.json.encode(text)
        if self._chat:
            choice = (
                b'{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":%s%s}]'
                % (
                    index,
                    enc,
                    fin,
                    stop,
                )
            )
        else:
            choice = b'{"index":%d,"text":%s,"logprobs":null,"finish_reason":%s%s}]' % (
                index,
                enc,
                fin,
                stop,
            )
        return self._head + choice + self._usage_suffix(completion_tokens)

    def usage_chunk(self, completion_tokens: int) -> bytes:
        """The last event before [DONE] when include_usage is on: no choices, the whole usage."""
        usage = msgspec.json.encode(
            {
                "prompt_tokens": self.plan.prompt_tokens,
                "total_tokens": self.plan.prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
            }
        )
        return self._head + b'],"usage":' + usage + b"}\n\n"


DONE = b"data: [DONE]\n\n"


def stream_error_event(message: str, err_type: str, status: int) -> bytes:
    """An error after the 200 went out: vLLM sends it as one data event, then [DONE]."""
    return b"data: " + error_body(status, message, err_type) + b"\n\n"


def whole_stream(plan: GenerationPlan, *, request_id: str, created: int) -> bytes:
    """Every event of a streaming response at once (the fixed-response mode sends this)."""
    w = ChunkWriter(plan, request_id=request_id, created=created)
    parts: list[bytes] = []
    if plan.kind == "chat":
        parts.extend(w.role_chunk(i) for i in range(plan.choices))
    for k in range(plan.output_tokens):
        last = k == plan.output_tokens - 1
        for i in range(plan.choices):
            parts.append(
                w.token_chunk(
                    i, token_text(plan.seed, i, k), (k + 1), plan.finish_reason if last else None
                )
            )
    if plan.include_usage:
        parts.append(w.usage_chunk(plan.output_tokens * plan.choices))
    parts.append(DONE)
    return b"".join(parts)


def models_response(*, served_model: str, root: str, max_model_len: int, created: int) -> bytes:
    card = {
        "id": served_model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{zlib.crc32(served_model.encode()):08x}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return msgspec.json.encode({"object": "list", "data": [card]})
