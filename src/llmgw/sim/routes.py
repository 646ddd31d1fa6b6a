"""The simulated engine's HTTP API, as vLLM's server answers it, as a handler for llmgw.web.server.

Routing, the OpenAI endpoints (JSON and SSE streaming), injected errors, the fixed-response
mode, vLLM's response heads (`server: uvicorn`, a Date header) and its error shape for bad
HTTP. The bodies come from llmgw.sim.openai_api (pure); the timing from llmgw.sim.scheduler.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

import msgspec

from llmgw.sim import openai_api as api
from llmgw.sim.embeddings import embeddings_response
from llmgw.sim.options import VLLM_VERSION, EngineOptions
from llmgw.sim.scheduler import SimEngine
from llmgw.sim.vllm_log import VllmLog
from llmgw.web import http1
from llmgw.web.server import DropConnection, Request, Responder

JSON = b"application/json"
SSE = b"text/event-stream; charset=utf-8"
PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"
INFERENCE_PATHS = (b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings")
GET_PATHS = (b"/health", b"/metrics", b"/v1/models", b"/version", b"/ping")
NOT_FOUND = b'{"detail":"Not Found"}'
NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
UNAUTHORIZED = b'{"error":"Unauthorized"}'  # vLLM's answer to a missing or wrong key
FIXED_PROMPT_TOKENS = 8

FixedKey = tuple[bytes, bool, bool]  # (path, stream, include_usage)


class EngineApp:
    """The request handler: `await app(request, responder)` answers one request."""

    def __init__(self, options: EngineOptions, engine: SimEngine, log: VllmLog, crash: Callable[[int], None]) -> None:
        self.options = options
        self.engine = engine
        self.log = log
        self._crash = crash  # called with the count once crash_after inference requests were answered
        self.ready = False  # the simulated weights are loaded: /health answers 200
        self.answered = 0  # inference requests answered, for crash_after
        self._date_at = -1
        self._date = b""
        self._fixed = self._build_fixed() if options.fixed else {}
        self._fixed_wire: dict[FixedKey, bytes] = {}
        self._fixed_date = b""
        self._expected_auth = b"Bearer " + options.api_key.encode() if options.api_key else b""

    async def __call__(self, request: Request, responder: Responder) -> None:
        try:
            await self._dispatch(request, responder)
        except DropConnection:
            raise
        except Exception as exc:  # a bug here: lose this connection, not the engine (as uvicorn does)
            self.log.handler_bug(exc)
            raise DropConnection from None

    def render_error(self, exc: http1.HttpError) -> tuple[http1.Headers, bytes]:
        """A request that is not HTTP as it should be: vLLM's error shape (web.server's hook)."""
        body = api.error_body(exc.status, f"Invalid HTTP request: {exc}", "Bad Request")
        return self._headers(JSON), body

    # -- heads ----------------------------------------------------------------------------

    def _date_header(self) -> bytes:
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode()
        return self._date

    def _headers(self, content_type: bytes) -> http1.Headers:
        """The headers uvicorn writes for vLLM."""
        return [(b"date", self._date_header()), (b"server", b"uvicorn"), (b"content-type", content_type)]

    def _access(self, request: Request, status: int) -> None:
        if self.options.access_log:
            head = request.head
            self.log.access(request.peer, request.method, head.target.decode(errors="replace"), head.http10,
                            status, http1.REASONS.get(status, b"").decode())

    async def _respond(self, request: Request, responder: Responder, status: int, body: bytes,
                       content_type: bytes = JSON) -> None:
        await responder.respond(status, self._headers(content_type), body)
        self._access(request, status)

    # -- routing --------------------------------------------------------------------------

    async def _dispatch(self, request: Request, responder: Responder) -> None:
        head = request.head
        path = head.path
        method = head.method
        if self._expected_auth and path.startswith(b"/v1") and method != b"OPTIONS" and not hmac.compare_digest(
            head.get(b"authorization") or b"", self._expected_auth
        ):
            await self._respond(request, responder, 401, UNAUTHORIZED)
            return
        if path in INFERENCE_PATHS:
            if method != b"POST":
                await self._respond(request, responder, 405, NOT_ALLOWED)
                return
            try:
                await self._inference(request, responder, path)
            finally:
                self.answered += 1  # a request whose client left counts too
            if self.options.crash_after and self.answered >= self.options.crash_after:
                self._crash(self.answered)
            return
        if path not in GET_PATHS:
            await self._respond(request, responder, 404, NOT_FOUND)
            return
        if method != b"GET":
            await self._respond(request, responder, 405, NOT_ALLOWED)
            return
        if path == b"/metrics":
            await self._respond(request, responder, 200, self.engine.render_metrics().encode(), PROMETHEUS)
        elif path == b"/version":
            await self._respond(request, responder, 200, msgspec.json.encode({"version": VLLM_VERSION}))
        elif not self.ready:
            await self._respond(request, responder, 503, _starting_body())
        elif path in (b"/health", b"/ping"):
            await self._respond(request, responder, 200, b"")
        else:  # /v1/models
            o = self.options
            models = api.models_response(
                served_model=o.served_name, root=o.model, max_model_len=o.max_model_len, created=int(time.time())
            )
            await self._respond(request, responder, 200, models)

    async def _inference(self, request: Request, responder: Responder, path: bytes) -> None:
        o = self.options
        if not self.ready:
            await self._respond(request, responder, 503, _starting_body())
            return
        e = self.engine
        if o.error_rate > 0 and e.rng.random() < o.error_rate:
            if e.rng.random() < 0.5:
                err = api.error_body(500, "Simulated engine error (--error-rate).", "InternalServerError")
                await self._respond(request, responder, 500, err)
            else:
                err = api.error_body(503, "Simulated engine overload (--error-rate).", "ServiceUnavailableError")
                await self._respond(request, responder, 503, err)
            return
        body = request.body
        try:
            if path == b"/v1/embeddings":
                await self._embeddings(request, responder)
                return
            if o.fixed:
                await self._fixed_answer(request, responder, path)
                return
            if path == b"/v1/chat/completions":
                plan = api.plan_chat(
                    api.decode(body, api.ChatRequest),
                    served_model=e.served_model,
                    max_model_len=o.max_model_len,
                    natural_tokens=o.output_tokens,
                    engine_seed=o.seed,
                )
            else:
                plan = api.plan_completion(
                    api.decode(body, api.CompletionRequest),
                    served_model=e.served_model,
                    max_model_len=o.max_model_len,
                    natural_tokens=o.output_tokens,
                    engine_seed=o.seed,
                )
        except api.ApiError as exc:
            await self._respond(request, responder, exc.status, exc.body())
            return
        responder.watch_disconnect()  # a client that leaves aborts its request, as in vLLM
        await self._generate(request, responder, plan)

    async def _generate(self, request: Request, responder: Responder, plan: api.GenerationPlan) -> None:
        e = self.engine
        request_id = e.next_id("chatcmpl" if plan.kind == "chat" else "cmpl")
        created = int(time.time())
        if not plan.stream:
            await e.generate(plan)
            await self._respond(request, responder, 200,
                                api.full_response(plan, request_id=request_id, created=created))
            return
        writer = api.ChunkWriter(plan, request_id=request_id, created=created)
        last = plan.output_tokens - 1

        async def emit(k: int) -> None:
            parts: list[bytes] = []
            if k == 0 and plan.kind == "chat":
                parts.extend(writer.role_chunk(i) for i in range(plan.choices))
            finish = plan.finish_reason if k == last else None
            for i in range(plan.choices):
                parts.append(writer.token_chunk(i, api.token_text(plan.seed, i, k), k + 1, finish))
            if k == 0:
                # vLLM sends the headers and the role chunk with the first token, not before.
                await responder.start(200, self._headers(SSE), b"".join(parts))
            else:
                await responder.send(b"".join(parts))

        await e.generate(plan, emit)
        usage = writer.usage_chunk(plan.output_tokens * plan.choices) if plan.include_usage else b""
        await responder.end(usage + api.DONE)
        self._access(request, 200)

    async def _embeddings(self, request: Request, responder: Responder) -> None:
        e = self.engine
        o = self.options
        req = api.decode(request.body, api.EmbeddingRequest)
        out, prompt_tokens = embeddings_response(
            req,
            served_model=e.served_model,
            dim=o.embedding_dim,
            max_model_len=o.max_model_len,
            request_id=e.next_id("embd"),
            created=int(time.time()),
        )
        if o.fixed:
            e.metrics.prompt_tokens += prompt_tokens
        else:
            responder.watch_disconnect()
            await e.pool(prompt_tokens)
        await self._respond(request, responder, 200, out)

    # -- fixed-response mode ----------------------------------------------------------------

    def _build_fixed(self) -> dict[FixedKey, bytes]:
        """Bodies of every fixed answer: (path, stream, include_usage) -> bytes."""
        o = self.options
        created = int(time.time())
        out: dict[FixedKey, bytes] = {}
        for path, kind in ((b"/v1/chat/completions", "chat"), (b"/v1/completions", "completion")):
            rid = ("chatcmpl" if kind == "chat" else "cmpl") + "-llmgw-sim-fixed"
            for stream in (False, True):
                for usage in (False, True):
                    plan = api.GenerationPlan(
                        kind=kind,  # type: ignore[arg-type]
                        model=o.served_name,
                        stream=stream,
                        include_usage=usage,
                        continuous_usage=False,
                        prompt_tokens=FIXED_PROMPT_TOKENS,
                        longest_prompt=FIXED_PROMPT_TOKENS,
                        choices=1,
                        n=1,
                        output_tokens=o.fixed_chunks,
                        max_tokens=o.fixed_chunks,
                        finish_reason="stop",
                        seed=o.seed,
                    )
                    if stream:
                        out[(path, True, usage)] = api.whole_stream(plan, request_id=rid, created=created)
                    else:
                        out[(path, False, usage)] = api.full_response(plan, request_id=rid, created=created)
        return out

    def _fixed_bytes(self, key: FixedKey) -> bytes:
        """A whole keep-alive response, head and body, rebuilt only when the Date second changes."""
        date = self._date_header()
        if date is not self._fixed_date:
            self._fixed_date = date
            wire = {}
            for k, payload in self._fixed.items():
                if k[1]:
                    head = http1.response_head(200, self._headers(SSE), chunked=True)
                    wire[k] = head + http1.chunk(payload) + http1.LAST_CHUNK
                else:
                    head = http1.response_head(200, self._headers(JSON), content_length=len(payload))
                    wire[k] = head + payload
            self._fixed_wire = wire
        return self._fixed_wire[key]

    async def _fixed_answer(self, request: Request, responder: Responder, path: bytes) -> None:
        probe = api.decode(request.body, api.Probe)
        if probe.model is not None and probe.model != self.engine.served_model:
            raise api.model_not_found(probe.model)
        stream = bool(probe.stream)
        key = (path, stream, stream and api.usage_flags(probe.stream_options)[0])
        self.engine.record_fixed(FIXED_PROMPT_TOKENS, self.options.fixed_chunks)
        if not (responder.close or responder.http10 or responder.head_only):
            await responder.respond_prepared(200, self._fixed_bytes(key))
            self._access(request, 200)
        elif stream:
            await responder.start(200, self._headers(SSE), self._fixed[key])
            await responder.end()
            self._access(request, 200)
        else:
            await self._respond(request, responder, 200, self._fixed[key])


def _starting_body() -> bytes:
    return api.error_body(503, "The engine is starting: the model is still loading.", "ServiceUnavailableError")
