"""A simulated vLLM: its OpenAI-compatible HTTP server, latency, metrics and failures, on trio.

What a gateway and an agent touch behaves like vLLM's server: `/v1/chat/completions` and
`/v1/completions` (JSON and SSE streaming), `/v1/embeddings`, `/v1/models`, `/health` (503
until the simulated weights are loaded), `/metrics` with vLLM's metric names, `/version`.
Requests beyond `max_concurrency` wait (`vllm:num_requests_waiting`); a client that goes
away aborts its request, as vLLM does. Failures are injected by option: error answers, a
crash after N requests, a hang, a failed start.

Use it as a process (`llmgw sim engine`, see `run_until_signalled`) or in a nursery:

    handle = await nursery.start(serve_engine, EngineOptions(port=0))
    ... handle.url ...
    handle.stop()   # graceful: stop accepting, let requests finish for shutdown_grace_s

With `port=0` the engine prints `llmgw-sim-engine listening on HOST:PORT` on stdout as
soon as it is bound (before the startup delay), so a parent process can read the port.
"""

from __future__ import annotations

import errno
import hmac
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import datetime

import msgspec
import trio

from llmgw import __version__
from llmgw.sim import openai_api as api
from llmgw.sim.latency import LatencyModel, LatencyParams, kv_blocks, kv_cache_usage
from llmgw.sim.metrics import EngineMetrics, render_metrics
from llmgw.web import http1

LISTENING_PREFIX = "llmgw-sim-engine listening on"
VLLM_VERSION = "0.11.0"  # the vLLM release whose server this one imitates
MAX_BODY = 64 * 1024 * 1024
RECV_SIZE = 65536
FIXED_PROMPT_TOKENS = 8

LogFn = Callable[[str, bool], None]  # (line, is_error)


class EngineOptions(msgspec.Struct, kw_only=True, frozen=True):
    """Everything `llmgw sim engine` takes; times are in seconds."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port, printed in the listening line
    model: str = "llmgw/sim-model"
    served_model_name: str | None = None  # the name clients use; defaults to `model`
    max_model_len: int = 32768
    max_concurrency: int = 256
    ttft_s: float = 0.020
    itl_s: float = 0.005
    prefill_s_per_token: float = 0.00001
    jitter: float = 0.2
    load_slowdown: float = 1.0
    kv_cache_tokens: int = 39232
    output_tokens: int = 16  # the answer's length when max_tokens does not cut it short
    embedding_dim: int = 256
    seed: int = 0
    startup_delay_s: float = 0.0
    error_rate: float = 0.0  # fraction of inference requests answered 500 or 503
    crash_after: int = 0  # exit abruptly once this many inference requests were answered
    hang: bool = False  # accept connections and never answer
    fail_startup: bool = False  # print a load failure and exit non-zero after the startup delay
    fixed: bool = False  # answer every POST at once with a fixed small completion
    fixed_chunks: int = 4  # tokens (stream chunks) of the fixed completion
    access_log: bool = False
    log_stats_interval_s: float = 10.0  # 0: never
    shutdown_grace_s: float = 2.0
    # Like vLLM's --api-key (or VLLM_API_KEY): /v1/* answers 401 without
    # `Authorization: Bearer <key>`; /health, /metrics, /version and /ping stay open.
    api_key: str = ""

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    def latency_params(self) -> LatencyParams:
        return LatencyParams(
            ttft_s=self.ttft_s,
            itl_s=self.itl_s,
            prefill_s_per_token=self.prefill_s_per_token,
            jitter=self.jitter,
            max_concurrency=self.max_concurrency,
            load_slowdown=self.load_slowdown,
            kv_cache_tokens=self.kv_cache_tokens,
        )


class SimulatedCrash(Exception):
    """Raised by `serve_engine` when `crash_after` requests were answered (in-process use)."""


class EngineStartupFailed(Exception):
    """Raised by `serve_engine` when `fail_startup` is set, after the startup delay."""


class EngineBindFailed(Exception):
    """The listening address cannot be bound (in use, not local, not permitted)."""


# ---- the engine proper: admission, latency, metrics (no sockets) ---------------------------


async def _no_emit(_k: int) -> None:
    return None


class SimEngine:
    """The scheduler side: waits for a batch slot, sleeps the model's delays, counts metrics."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.served_model = options.served_name
        self.latency = LatencyModel(options.latency_params(), options.seed)
        self.metrics = EngineMetrics(max_model_len=options.max_model_len, created=time.time())
        self.running = 0
        self.waiting = 0
        self.kv_blocks_used = 0
        self._slots = trio.Semaphore(options.max_concurrency)
        self._ids = random.Random(options.seed ^ 0x5EED)
        self.rng = random.Random(options.seed ^ 0xFA11)

    def kv_usage(self) -> float:
        return kv_cache_usage(self.kv_blocks_used, self.options.kv_cache_tokens)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{self._ids.getrandbits(64):016x}"

    def render_metrics(self) -> str:
        return render_metrics(
            self.metrics,
            model_name=self.served_model,
            running=self.running,
            waiting=self.waiting,
            kv_cache_usage=self.kv_usage(),
            cache_config={
                "block_size": "16",
                "cache_dtype": "auto",
                "enable_prefix_caching": "True",
                "gpu_memory_utilization": "0.9",
                "num_gpu_blocks": str(self.options.kv_cache_tokens // 16),
            },
        )

    async def generate(
        self, plan: api.GenerationPlan, emit: Callable[[int], Awaitable[None]] = _no_emit
    ) -> None:
        """Run one request through the simulated batch; `emit(k)` is awaited as token k is ready.

        Cancellation (the client went away, the engine stops) aborts the request: it leaves
        the batch and is counted with finished_reason="abort", as vLLM counts it.
        """
        arrival = trio.current_time()
        admitted: float | None = None
        first: float | None = None
        generated = 0
        held = 0
        finish = "abort"
        self.waiting += 1
        try:
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            admitted = trio.current_time()
            self.running += 1
            held = kv_blocks(plan.prompt_tokens)
            self.kv_blocks_used += held
            try:
                await trio.sleep(self.latency.ttft(self.running, plan.longest_prompt))
                last = 0.0
                for k in range(plan.output_tokens):
                    if k:
                        await trio.sleep(self.latency.itl(self.running))
                    now = trio.current_time()
                    if k == 0:
                        first = now
                    else:
                        self.metrics.record_token_gap(now - last)
                    last = now
                    generated = k + 1
                    want = kv_blocks(plan.prompt_tokens + generated * plan.choices)
                    self.kv_blocks_used += want - held
                    held = want
                    await emit(k)
                finish = plan.finish_reason
            finally:
                self.running -= 1
                self.kv_blocks_used -= held
                self._slots.release()
        finally:
            end = trio.current_time()
            start = admitted if admitted is not None else end
            self.metrics.record_finished(
                finish_reason=finish,
                prompt_tokens=plan.prompt_tokens,
                generation_tokens=generated * plan.choices,
                max_tokens=plan.max_tokens,
                n=plan.n,
                queue_s=start - arrival,
                ttft_s=None if first is None else first - arrival,
                e2e_s=end - arrival,
                prefill_s=(first if first is not None else end) - start,
                decode_s=0.0 if first is None else end - first,
            )

    async def pool(self, prompt_tokens: int) -> None:
        """An embeddings request: a batch slot for one prefill, no decode."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        held = kv_blocks(prompt_tokens)
        self.kv_blocks_used += held
        try:
            await trio.sleep(self.latency.ttft(self.running, prompt_tokens))
        finally:
            self.running -= 1
            self.kv_blocks_used -= held
            self._slots.release()
        self.metrics.prompt_tokens += prompt_tokens

    def record_fixed(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Fixed-response mode: counters only, to keep the hot path cheap."""
        m = self.metrics
        m.request_success["stop"] += 1
        m.prompt_tokens += prompt_tokens
        m.generation_tokens += generation_tokens


# ---- HTTP ----------------------------------------------------------------------------------


JSON = b"application/json"
SSE = b"text/event-stream; charset=utf-8"
PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"
INFERENCE_PATHS = (b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings")
GET_PATHS = (b"/health", b"/metrics", b"/v1/models", b"/version", b"/ping")
NOT_FOUND = b'{"detail":"Not Found"}'
NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
UNAUTHORIZED = b'{"error":"Unauthorized"}'  # vLLM's answer to a missing or wrong key


class _Connection:
    __slots__ = ("buf", "close", "http10", "idle", "peer", "peer_gone", "scope", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()  # received and not yet consumed (a pipelined request, too)
        self.idle = True  # between requests: a graceful stop may close it at once
        self.peer_gone = False
        self.close = False  # close after the current response
        self.http10 = False
        self.scope = trio.CancelScope()
        self.peer = ""


class EngineHandle:
    """What `serve_engine` hands its starter: where it listens, its state, and a stop button."""

    def __init__(self, server: _Server, host: str, port: int) -> None:
        self._server = server
        self.host = host
        self.port = port
        self.ready = trio.Event()  # set once the startup delay is over and /health answers 200

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def engine(self) -> SimEngine:
        return self._server.engine

    def stop(self) -> None:
        """Graceful stop: close the listener, end idle connections, give requests shutdown_grace_s."""
        self._server.stop.set()


def _default_log(line: str, is_error: bool) -> None:
    stream = sys.stderr if is_error else sys.stdout
    stream.write(line + "\n")
    stream.flush()


def _stamp() -> str:
    return datetime.now().strftime("%m-%d %H:%M:%S")


class _Server:
    def __init__(
        self, options: EngineOptions, log: LogFn | None, on_crash: Callable[[], None] | None
    ) -> None:
        self.options = options
        self.engine = SimEngine(options)
        self._log_fn = log or _default_log
        self._on_crash = on_crash
        self.stop = trio.Event()
        self.ready = False
        self.draining = False
        self.crashed = False
        self.failure: str | None = None
        self.answered = 0  # inference requests answered, for crash_after
        self._conns: set[_Connection] = set()
        self._drained = trio.Event()
        self._outer: trio.Nursery | None = None
        self._date_at = -1
        self._date = b""
        self._pid = os.getpid()
        self._fixed = self._build_fixed() if options.fixed else {}
        self._fixed_wire: dict[tuple[bytes, bool, bool], bytes] = {}
        self._fixed_date = b""
        self._last_stats = (0, 0)
        self._expected_auth = b"Bearer " + options.api_key.encode() if options.api_key else b""
        self.handle: EngineHandle  # set by run() once bound

    # -- logging --------------------------------------------------------------------------

    def info(self, where: str, message: str) -> None:
        self._log_fn(f"(APIServer pid={self._pid}) INFO {_stamp()} [{where}] {message}", False)

    def error(self, where: str, message: str) -> None:
        self._log_fn(f"(EngineCore_DP0 pid={self._pid}) ERROR {_stamp()} [{where}] {message}", True)

    def raw(self, line: str, is_error: bool = False) -> None:
        self._log_fn(line, is_error)

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[EngineHandle]) -> None:
        o = self.options
        self.info(
            "api_server.py:1839",
            f"vLLM API server version {VLLM_VERSION} (llmgw sim engine {__version__})",
        )
        self.info(
            "utils.py:233",
            f"non-default args: {{'model': {o.model!r}, 'host': {o.host!r}, 'port': {o.port}}}",
        )
        self.info("model.py:547", "Resolved architecture: SimulatedForCausalLM")
        self.info("model.py:1510", f"Using max model len {o.max_model_len}")
        try:
            listeners = await trio.open_tcp_listeners(o.port, host=o.host)
        except OSError as exc:
            raise EngineBindFailed(
                f"cannot listen on {o.host}:{o.port}: {exc.strerror or exc}; pick another --port or --host"
            ) from None
        if o.port == 0 and len(listeners) > 1:
            # Each address family got its own free port; keep one so the printed port is the port.
            for extra in listeners[1:]:
                await extra.aclose()
            listeners = listeners[:1]
        host, port = listeners[0].socket.getsockname()[:2]
        handle = EngineHandle(self, host, port)
        self.handle = handle
        self.raw(f"{LISTENING_PREFIX} {handle.url.removeprefix('http://')}")
        try:
            async with trio.open_nursery() as outer:
                self._outer = outer
                async with trio.open_nursery() as conns:
                    accept_scope = trio.CancelScope()
                    outer.start_soon(self._accept_all, listeners, conns, accept_scope)
                    outer.start_soon(self._startup)
                    if o.log_stats_interval_s > 0:
                        outer.start_soon(self._stats_loop)
                    task_status.started(handle)
                    await self.stop.wait()
                    self.info("launcher.py:101", "Shutting down FastAPI HTTP server.")
                    self.draining = True
                    accept_scope.cancel()
                    for c in list(self._conns):
                        if c.idle:
                            c.scope.cancel()
                    if self._conns:
                        with trio.move_on_after(o.shutdown_grace_s):
                            await self._drained.wait()
                    conns.cancel_scope.cancel()
                outer.cancel_scope.cancel()
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)
        if self.crashed:
            raise SimulatedCrash(
                f"simulated crash after {self.answered} requests (crash_after={o.crash_after})"
            )
        if self.failure is not None:
            raise EngineStartupFailed(self.failure)

    async def _startup(self) -> None:
        o = self.options
        self.info("gpu_model_runner.py:2602", f"Starting to load model {o.model}...")
        if o.startup_delay_s > 0:
            await trio.sleep(o.startup_delay_s)
        if o.fail_startup:
            self._print_load_failure()
            self.failure = (
                f"simulated engine failed to load the weights of {o.model} (--fail-startup)"
            )
            assert self._outer is not None
            self._outer.cancel_scope.cancel()
            return
        self.info("default_loader.py:267", f"Loading weights took {o.startup_delay_s:.2f} seconds")
        self.info(
            "gpu_model_runner.py:2653",
            f"Model loading took 0.0 GiB and {o.startup_delay_s:.6f} seconds",
        )
        self.info("kv_cache_utils.py:1087", f"GPU KV cache size: {o.kv_cache_tokens:,} tokens")
        self.info(
            "kv_cache_utils.py:1091",
            f"Maximum concurrency for {o.max_model_len:,} tokens per request: "
            f"{o.kv_cache_tokens / o.max_model_len:.2f}x",
        )
        self.info("api_server.py:1880", f"Starting vLLM API server 0 on {self.handle.url}")
        self.raw(
            f"(APIServer pid={self._pid}) INFO:     Started server process [{self._pid}]", True
        )
        self.raw(f"(APIServer pid={self._pid}) INFO:     Waiting for application startup.", True)
        self.raw(f"(APIServer pid={self._pid}) INFO:     Application startup complete.", True)
        self.ready = True
        self.handle.ready.set()

    def _print_load_failure(self) -> None:
        o = self.options
        self.error("core.py:708", "EngineCore failed to start.")
        self.error("core.py:708", "Traceback (most recent call last):")
        lines = [
            '  File "vllm/v1/engine/core.py", line 699, in run_engine_core',
            '  File "vllm/model_executor/model_loader/default_loader.py", line 262, in load_weights',
            f"OSError: Error no file named model.safetensors or pytorch_model.bin found in directory "
            f"/models/{o.model} (simulated by llmgw sim engine --fail-startup)",
        ]
        for line in lines:
            self.error("core.py:708", line)
        self.raw(
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore_DP0': 1}",
            True,
        )

    def _crash(self) -> None:
        self.error(
            "core.py:775",
            f"EngineCore encountered a fatal error (simulated crash after {self.answered} requests).",
        )
        if self._on_crash is not None:
            self._on_crash()
        self.crashed = True
        assert self._outer is not None
        self._outer.cancel_scope.cancel()

    async def _stats_loop(self) -> None:
        e = self.engine
        interval = self.options.log_stats_interval_s
        while True:
            await trio.sleep(interval)
            prompt, gen = e.metrics.prompt_tokens, e.metrics.generation_tokens
            d_prompt, d_gen = prompt - self._last_stats[0], gen - self._last_stats[1]
            self._last_stats = (prompt, gen)
            if d_prompt or d_gen or e.running or e.waiting:
                self.info(
                    "loggers.py:123",
                    f"Engine 000: Avg prompt throughput: {d_prompt / interval:.1f} tokens/s, "
                    f"Avg generation throughput: {d_gen / interval:.1f} tokens/s, "
                    f"Running: {e.running} reqs, Waiting: {e.waiting} reqs, "
                    f"GPU KV cache usage: {e.kv_usage() * 100:.1f}%, Prefix cache hit rate: 0.0%",
                )

    async def _accept_all(
        self, listeners: list[trio.SocketListener], conns: trio.Nursery, scope: trio.CancelScope
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept_loop, listener, conns)

    async def _accept_loop(self, listener: trio.SocketListener, conns: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                    self.error(
                        "api_server.py:1", f"accept failed: {exc.strerror}; retrying in 100 ms"
                    )
                    await trio.sleep(0.1)
                    continue
                raise
            conns.start_soon(self._serve_connection, stream)

    # -- connections ----------------------------------------------------------------------

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        c = _Connection(stream)
        if self.options.access_log:
            try:
                peer = stream.socket.getpeername()
                c.peer = f"{peer[0]}:{peer[1]}"
            except OSError:
                c.peer = "?"
        self._conns.add(c)
        try:
            with c.scope:
                if self.options.hang:
                    await trio.sleep_forever()
                await self._connection_loop(c)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except (
            Exception
        ) as exc:  # a bug here: lose this connection, not the engine (as uvicorn does)
            self.error("httptools_impl.py:414", f"Exception in ASGI application: {exc!r}")
            for line in traceback.format_exc().rstrip().splitlines():
                self.error("httptools_impl.py:414", line)
        finally:
            self._conns.discard(c)
            if self.draining and not self._conns:
                self._drained.set()
            await trio.aclose_forcefully(stream)

    async def _connection_loop(self, c: _Connection) -> None:
        stream = c.stream
        buf = c.buf
        while True:
            c.idle = not buf
            if self.draining:
                return
            try:
                scanned = 0
                while (end := http1.find_head_end(buf, scanned)) < 0:
                    scanned = len(buf)
                    data = await stream.receive_some(RECV_SIZE)
                    if not data:
                        return
                    buf += data
                    c.idle = False
                c.idle = False
                head = http1.parse_request_head(bytes(buf[:end]))
                del buf[:end]
                c.http10 = head.http10
                c.close = head.close
                body = await self._read_body(c, head)
                if body is None:
                    return
            except http1.HttpError as exc:
                c.close = True
                err = api.error_body(exc.status, f"Invalid HTTP request: {exc}", "Bad Request")
                await self._respond(c, None, exc.status, err)
                return
            await self._dispatch(c, head, body)
            if c.peer_gone or c.close or self.draining:
                return

    async def _read_body(self, c: _Connection, head: http1.RequestHead) -> bytes | None:
        """The request body, or None if the client went away first."""
        buf = c.buf
        if head.chunked:
            if head.expect_continue and not buf:
                await c.stream.send_all(http1.CONTINUE)
            decoder = http1.ChunkedDecoder(limit=MAX_BODY)
            decoder.feed(buf)
            while not decoder.done:
                data = await c.stream.receive_some(RECV_SIZE)
                if not data:
                    return None
                buf += data
                decoder.feed(buf)
            return bytes(decoder.body)
        n = head.content_length or 0
        if n > MAX_BODY:
            raise http1.HttpError(413, "request body too large")
        if n == 0:
            return b""
        if head.expect_continue and len(buf) < n:
            await c.stream.send_all(http1.CONTINUE)
        while len(buf) < n:
            data = await c.stream.receive_some(RECV_SIZE)
            if not data:
                return None
            buf += data
        body = bytes(buf[:n])
        del buf[:n]
        return body

    def _date_header(self) -> bytes:
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode()
        return self._date

    def _access(self, c: _Connection, head: http1.RequestHead | None, status: int) -> None:
        if self.options.access_log and head is not None:
            version = "1.0" if head.http10 else "1.1"
            self.raw(
                f'(APIServer pid={self._pid}) INFO:     {c.peer} - "{head.method.decode()} '
                f'{head.target.decode(errors="replace")} HTTP/{version}" '
                f"{status} {http1.REASONS.get(status, b'').decode()}",
                True,
            )

    async def _respond(
        self,
        c: _Connection,
        head: http1.RequestHead | None,
        status: int,
        body: bytes,
        content_type: bytes = JSON,
    ) -> None:
        c.close = c.close or self.draining
        out = self._head(status, content_type, len(body), close=c.close)
        await c.stream.send_all(out + body)
        self._access(c, head, status)

    def _stream_head(self, c: _Connection) -> bytes:
        """Head of an SSE response: chunked on HTTP/1.1, close-delimited on HTTP/1.0."""
        c.close = c.close or c.http10 or self.draining
        return self._head(200, SSE, None, close=c.close, http10=c.http10)

    def _head(
        self,
        status: int,
        content_type: bytes,
        content_length: int | None,
        *,
        close: bool = False,
        http10: bool = False,
    ) -> bytes:
        """A response head as uvicorn writes it for vLLM; `content_length=None` is a
        streamed body: chunked, or close-delimited on HTTP/1.0."""
        headers = (
            (b"date", self._date_header()),
            (b"server", b"uvicorn"),
            (b"content-type", content_type),
        )
        return http1.response_head(
            status,
            headers,
            content_length=content_length,
            chunked=content_length is None and not http10,
            close=close,
        )

    def _frame(self, c: _Connection, data: bytes) -> bytes:
        return data if c.http10 else http1.chunk(data)

    def _last_frame(self, c: _Connection) -> bytes:
        return b"" if c.http10 else http1.LAST_CHUNK

    # -- routing --------------------------------------------------------------------------

    async def _dispatch(self, c: _Connection, head: http1.RequestHead, body: bytes) -> None:
        path = head.path
        method = head.method
        if self._expected_auth and path.startswith(b"/v1") and method != b"OPTIONS" and not hmac.compare_digest(
            head.get(b"authorization") or b"", self._expected_auth
        ):
            await self._respond(c, head, 401, UNAUTHORIZED)
            return
        if path in INFERENCE_PATHS:
            if method != b"POST":
                await self._respond(c, head, 405, NOT_ALLOWED)
                return
            await self._inference(c, head, path, body)
            self.answered += 1
            if self.options.crash_after and self.answered >= self.options.crash_after:
                self._crash()
            return
        if path not in GET_PATHS:
            await self._respond(c, head, 404, NOT_FOUND)
            return
        if method != b"GET":
            await self._respond(c, head, 405, NOT_ALLOWED)
            return
        if path == b"/metrics":
            await self._respond(c, head, 200, self.engine.render_metrics().encode(), PROMETHEUS)
        elif path == b"/version":
            await self._respond(c, head, 200, msgspec.json.encode({"version": VLLM_VERSION}))
        elif not self.ready:
            await self._respond(c, head, 503, self._starting_body())
        elif path in (b"/health", b"/ping"):
            await self._respond(c, head, 200, b"")
        else:  # /v1/models
            o = self.options
            models = api.models_response(
                served_model=o.served_name,
                root=o.model,
                max_model_len=o.max_model_len,
                created=int(time.time()),
            )
            await self._respond(c, head, 200, models)

    def _starting_body(self) -> bytes:
        return api.error_body(
            503, "The engine is starting: the model is still loading.", "ServiceUnavailableError"
        )

    async def _inference(
        self, c: _Connection, head: http1.RequestHead, path: bytes, body: bytes
    ) -> None:
        o = self.options
        if not self.ready:
            await self._respond(c, head, 503, self._starting_body())
            return
        e = self.engine
        if o.error_rate > 0 and e.rng.random() < o.error_rate:
            if e.rng.random() < 0.5:
                err = api.error_body(
                    500, "Simulated engine error (--error-rate).", "InternalServerError"
                )
                await self._respond(c, head, 500, err)
            else:
                err = api.error_body(
                    503, "Simulated engine overload (--error-rate).", "ServiceUnavailableError"
                )
                await self._respond(c, head, 503, err)
            return
        try:
            if path == b"/v1/embeddings":
                await self._embeddings(c, head, body)
                return
            if o.fixed:
                await self._fixed_answer(c, head, path, body)
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
            await self._respond(c, head, exc.status, exc.body())
            return
        await self._watching_disconnect(c, lambda: self._generate(c, head, plan))

    async def _watching_disconnect(
        self, c: _Connection, work: Callable[[], Awaitable[None]]
    ) -> None:
        """Run `work`; if the client closes the connection meanwhile, cancel it (vLLM aborts)."""
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                try:
                    while True:
                        data = await c.stream.receive_some(RECV_SIZE)
                        if not data:
                            break
                        c.buf += data  # a pipelined next request: kept for the next cycle
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                c.peer_gone = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                await work()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                c.peer_gone = True
            nursery.cancel_scope.cancel()

    async def _generate(
        self, c: _Connection, head: http1.RequestHead, plan: api.GenerationPlan
    ) -> None:
        e = self.engine
        request_id = e.next_id("chatcmpl" if plan.kind == "chat" else "cmpl")
        created = int(time.time())
        if not plan.stream:
            await e.generate(plan)
            await self._respond(
                c, head, 200, api.full_response(plan, request_id=request_id, created=created)
            )
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
            out = self._frame(c, b"".join(parts))
            if k == 0:
                # vLLM sends the headers and the role chunk with the first token, not before.
                out = self._stream_head(c) + out
            await c.stream.send_all(out)

        await e.generate(plan, emit)
        tail = (
            writer.usage_chunk(plan.output_tokens * plan.choices) if plan.include_usage else b""
        ) + api.DONE
        await c.stream.send_all(self._frame(c, tail) + self._last_frame(c))
        self._access(c, head, 200)

    async def _embeddings(self, c: _Connection, head: http1.RequestHead, body: bytes) -> None:
        e = self.engine
        o = self.options
        req = api.decode(body, api.EmbeddingRequest)
        out, prompt_tokens = api.embeddings_response(
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
            await self._watching_disconnect(c, lambda: e.pool(prompt_tokens))
            if c.peer_gone:
                return
        await self._respond(c, head, 200, out)

    # -- fixed-response mode ----------------------------------------------------------------

    def _build_fixed(self) -> dict[tuple[bytes, bool, bool], bytes]:
        """Bodies of every fixed answer: (path, stream, include_usage) -> bytes."""
        o = self.options
        created = int(time.time())
        out: dict[tuple[bytes, bool, bool], bytes] = {}
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
                        out[(path, True, usage)] = api.whole_stream(
                            plan, request_id=rid, created=created
                        )
                    else:
                        out[(path, False, usage)] = api.full_response(
                            plan, request_id=rid, created=created
                        )
        return out

    def _fixed_bytes(self, key: tuple[bytes, bool, bool]) -> bytes:
        """A whole keep-alive response, head and body, rebuilt only when the Date second changes."""
        date = self._date_header()
        if date is not self._fixed_date:
            self._fixed_date = date
            wire = {}
            for k, payload in self._fixed.items():
                if k[1]:
                    head = self._head(200, SSE, None)
                    wire[k] = head + http1.chunk(payload) + http1.LAST_CHUNK
                else:
                    head = self._head(200, JSON, len(payload))
                    wire[k] = head + payload
            self._fixed_wire = wire
        return self._fixed_wire[key]

    async def _fixed_answer(
        self, c: _Connection, head: http1.RequestHead, path: bytes, body: bytes
    ) -> None:
        probe = api.decode(body, api.Probe)
        if probe.model is not None and probe.model != self.engine.served_model:
            raise api.model_not_found(probe.model)
        stream = bool(probe.stream)
        key = (path, stream, stream and api.usage_flags(probe.stream_options)[0])
        self.engine.record_fixed(FIXED_PROMPT_TOKENS, self.options.fixed_chunks)
        if not (c.close or c.http10 or self.draining):
            await c.stream.send_all(self._fixed_bytes(key))
            self._access(c, head, 200)
        elif stream:
            await c.stream.send_all(
                self._stream_head(c) + self._frame(c, self._fixed[key]) + self._last_frame(c)
            )
            self._access(c, head, 200)
        else:
            await self._respond(c, head, 200, self._fixed[key])


async def serve_engine(
    options: EngineOptions,
    *,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
    log: LogFn | None = None,
    on_crash: Callable[[], None] | None = None,
) -> None:
    """Serve until `handle.stop()` (graceful) or cancellation; `nursery.start` gets the handle.

    `log(line, is_error)` receives the vLLM-like log lines (default: stdout, errors to
    stderr). `on_crash` runs when `crash_after` is reached; the process runner passes one
    that exits the process on the spot, otherwise `SimulatedCrash` is raised. After a
    `fail_startup` start, `EngineStartupFailed` is raised.
    """
    server = _Server(options, log, on_crash)
    await server.run(task_status)


def _exit_now() -> None:
    """A crash as a supervisor sees one: no cleanup, no flush of sockets, a non-zero status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


async def run_until_signalled(options: EngineOptions) -> None:
    """The process: serve; SIGTERM or SIGINT stops gracefully, a second one stops at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        failure: list[Exception] = []
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[EngineHandle | None]) -> None:
                try:
                    await serve_engine(options, task_status=task_status, on_crash=_exit_now)
                except EngineBindFailed as exc:  # before it started
                    failure.append(exc)
                    task_status.started(None)
                except EngineStartupFailed as exc:
                    failure.append(exc)
                nursery.cancel_scope.cancel()

            handle: EngineHandle | None = await nursery.start(serve)
            if handle is not None:
                stopping = False
                async for signum in signals:
                    if stopping:
                        nursery.cancel_scope.cancel()
                        break
                    stopping = True
                    _default_log(
                        f"(APIServer pid={os.getpid()}) INFO {_stamp()} [launcher.py:99] "
                        f"Received {signal.Signals(signum).name}; shutting down.",
                        False,
                    )
                    handle.stop()
        if failure:
            raise failure[0]
