"""The OpenAI-compatible gateway: pick an engine, forward the body untouched, relay the answer.

Per model: a Balancer (which endpoint), a RetryBudget (how many retries the model may spend)
and an AdmissionGate (how many requests in flight, then a bounded queue). A streamed answer
is relayed chunk by chunk as the engine sends it (the engine's chunked coding is passed on
byte for byte), and never retried once a byte went to the client.
"""

from __future__ import annotations

import functools
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec
import trio

from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint
from llmgw.server.gateway.admission_gate import AdmissionGate, AdmissionRejected
from llmgw.server.gateway.balance import Balancer, prompt_prefix
from llmgw.server.gateway.breaker import Breaker, BreakerState
from llmgw.server.gateway.enginemetrics import parse_engine_metrics
from llmgw.server.gateway.retry import FailureKind, RetryBudget, should_retry
from llmgw.server.metrics import GatewayMetrics
from llmgw.web.client import Upstream, UpstreamError
from llmgw.web.relayhub import RelayHub
from llmgw.web.server import ClientGone, Request, Responder

log = logging.getLogger("llmgw.gateway")

ROUTES = {b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"}
WATCH_AFTER = 0.1  # seconds a plain request runs before a client hang-up is watched for
JSON = (b"content-type", b"application/json")
PASS_RESPONSE_HEADERS = {b"content-type", b"cache-control", b"x-accel-buffering"}
# An engine's /metrics page (or /health answer), at most: vLLM v1's whole page is 46 KB idle (tests/fixtures/real/
# vllm-metrics), SGLang's 10 KB; per-adapter or per-request labels multiply that, not by 100.
SCRAPE_MAX = 4 * 1024 * 1024


class _Peek(msgspec.Struct):
    """The only fields the gateway reads from a request body; the rest is forwarded as is."""

    model: Any = None
    stream: Any = False


_peek = msgspec.json.Decoder(_Peek)
# Everything msgspec's decoder raises on a body it refuses.
JSON_REFUSED: tuple[type[Exception], ...] = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
PREFIX_REFUSED: tuple[type[Exception], ...] = (*JSON_REFUSED, TypeError, AttributeError)  # a body with no usable prompt


def openai_error(message: str, kind: str, code: str | int | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": None, "code": code}})


class _Attempt:
    """One upstream attempt in flight, so that the health check that takes its endpoint out of
    rotation can cancel what it is waiting on (`scope()` guards each wait; an attempt evicted
    between two waits finds the next one cancelled at once)."""

    __slots__ = ("_scope", "evicted", "reason")

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None
        self.evicted = False
        self.reason = ""

    def scope(self) -> trio.CancelScope:
        self._scope = trio.CancelScope()
        if self.evicted:
            self._scope.cancel()
        return self._scope

    def evict(self, reason: str) -> None:
        self.evicted = True
        self.reason = reason
        if self._scope is not None:
            self._scope.cancel()


class Route:
    """One model's balancing, retry budget and admission."""

    def __init__(self, name: str, settings: GatewaySettings, policy: str, rng: random.Random, metrics: GatewayMetrics) -> None:
        self.name = name
        self.balancer = Balancer(
            policy,  # type: ignore[arg-type]
            rng=rng,
            load_factor=settings.affinity_load_factor,
            breaker_failures=settings.breaker_failures,
            breaker_cooldown=float(settings.breaker_cooldown),
            kv_cache_limit=settings.kv_cache_limit,
            max_waiting=settings.max_waiting,
            health_failures=settings.health_failures,
            health_probes=settings.health_interval > 0,
        )
        self.budget = RetryBudget(settings.retry_budget)
        self.gate = AdmissionGate(
            on_admit=lambda wait: metrics.admitted(name, wait),
            on_reject=lambda reason: metrics.rejected_for(name, reason),
        )
        self.static: set[str] = set()
        self.dynamic: set[str] = set()


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        *,
        client_door: Callable[[Request], bool],
        not_ready_reason: Callable[[str], str] = lambda model: "",
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.not_ready_reason = not_ready_reason
        self.rng = rng or random.Random()
        self.routes: dict[str, Route] = {}
        self.upstreams: dict[str, Upstream] = {}
        self.engine_up: dict[str, bool] = {}
        # The API key check (llmgw.server.auth): counts and logs its refusals itself.
        self._authorized = client_door
        self._changed = trio.Event()
        self.hub: RelayHub | None = None  # set while run_relay_hub runs
        self._bad_endpoints: set[str] = set()
        self._attempts: dict[str, set[_Attempt]] = {}  # upstream attempts in flight, by endpoint
        self._checking: set[str] = set()  # endpoints whose health check is in flight
        self._unwatched: dict[Responder, float] = {}  # plain requests in flight with no hang-up watcher yet

    async def run_relay_hub(self) -> None:
        """The task that relays every streamed answer (see llmgw.web.relayhub)."""
        hub = RelayHub(coalesce=float(self.settings.stream_coalesce))
        self.hub = hub
        try:
            await hub.run()
        finally:
            self.hub = None
            hub.close()

    # -- what the control plane tells us ---------------------------------------------------------

    def configure(self, models: Sequence[Model], static: Sequence[StaticEndpoint], settings: GatewaySettings | None = None) -> None:
        if settings is not None:
            self.settings = settings
        wanted: dict[str, str] = {m.name: m.balancer for m in models}
        by_name = {m.name: m for m in models}  # dicts, not scans: 3,000 models took 1.5 s scanned
        static_of: dict[str, set[str]] = {}
        for ep in static:
            wanted.setdefault(ep.model, "least-outstanding")
            static_of.setdefault(ep.model, set()).add(ep.url.rstrip("/"))
        for name in list(self.routes):
            if name not in wanted:
                del self.routes[name]
        for name, policy in wanted.items():
            route = self.routes.get(name)
            if route is None:
                route = self.routes[name] = Route(name, self.settings, policy, self.rng, self.metrics)
            route.balancer.policy = policy  # type: ignore[assignment]
            route.balancer.set_health_policy(self.settings.health_failures, self.settings.health_interval > 0)
            model = by_name.get(name)
            if model is not None:
                adm = model.admission
                route.gate.set_limits(limit=adm.max_in_flight, max_queue=adm.max_queue, max_wait=float(adm.max_wait))
            route.static = static_of.get(name, set())
            route.balancer.set_endpoints(route.static | route.dynamic)
        self._prune_upstreams()

    def set_endpoints(self, ready: Mapping[str, Iterable[str]], keys: Mapping[str, str] | None = None) -> None:
        """Endpoints of ready replicas, per model (rank 0 of each), as the control plane sees them,
        and the engine API key of each (sent on every request, health check and scrape)."""
        for endpoint, key in (keys or {}).items():
            if self._usable(endpoint):
                self.upstream(endpoint.rstrip("/")).set_api_key(key)
        changed = False
        for name, route in self.routes.items():
            dynamic = {e.rstrip("/") for e in ready.get(name, ()) if self._usable(e)}
            if dynamic != route.dynamic:
                added, gone = dynamic - route.dynamic, route.dynamic - dynamic
                route.dynamic = dynamic
                route.balancer.set_endpoints(route.static | dynamic)
                for ep in sorted(added):
                    log.info("model %s: endpoint %s in rotation", name, ep)
                for ep in sorted(gone):
                    log.info("model %s: endpoint %s out of rotation", name, ep)
                changed = True
        if changed:
            self._prune_upstreams()
            self._changed.set()

    def _usable(self, endpoint: str) -> bool:
        """An endpoint an agent reported is not trusted blindly: one that is not a valid
        http://host:port URL is left out of rotation (logged once) instead of failing requests."""
        try:
            self.upstream(endpoint.rstrip("/"))
        except ValueError as exc:
            if endpoint not in self._bad_endpoints:
                self._bad_endpoints.add(endpoint)
                log.warning("engine endpoint %r left out of rotation: %s", endpoint, exc)
            return False
        return True

    def _prune_upstreams(self) -> None:
        live = {ep for route in self.routes.values() for ep in route.balancer.endpoints}
        for url in list(self.upstreams):
            if url not in live:
                upstream = self.upstreams.pop(url)
                upstream.closed = True
                self.engine_up.pop(url, None)

    def upstream(self, url: str) -> Upstream:
        upstream = self.upstreams.get(url)
        if upstream is None:
            upstream = self.upstreams[url] = Upstream(url, connect_timeout=float(self.settings.connect_timeout))
        return upstream

    def models_ready(self) -> list[str]:
        return sorted(name for name, route in self.routes.items() if route.balancer.endpoints)

    # -- requests ------------------------------------------------------------------------------------

    async def handle(self, request: Request, responder: Responder) -> None:
        started = trio.current_time()
        path = request.head.path
        rid = request.head.get(b"x-request-id") or uuid.uuid4().hex.encode()
        extra = [(b"x-request-id", rid)]
        if path == b"/v1/models":
            if request.method != "GET":
                await responder.respond(405, [JSON, *extra], openai_error("use GET /v1/models", "invalid_request_error"))
                return
            if not self._authorized(request):
                await self._unauthorized(responder, extra)
                return
            await responder.respond(200, [JSON, *extra], self._models_body())
            return
        if path not in ROUTES:
            await responder.respond(404, [JSON, *extra], openai_error(f"unknown route {request.path}", "invalid_request_error", "not_found"))
            return
        if request.method != "POST":
            await responder.respond(405, [JSON, *extra], openai_error(f"use POST {request.path}", "invalid_request_error"))
            return
        if not self._authorized(request):
            await self._unauthorized(responder, extra)
            return
        try:
            peek = _peek.decode(request.body)
        except JSON_REFUSED as exc:
            # RecursionError: nesting deeper than the decoder goes (100,000 `[` inside a valid
            # object was a 500 and a logged traceback per request, issue 9).
            why = "nested too deeply" if isinstance(exc, RecursionError) else "not valid JSON"
            await responder.respond(400, [JSON, *extra], openai_error(
                f"the request body is {why} (a JSON object with a `model` field is expected)",
                "invalid_request_error", "invalid_json"))
            self.metrics.finished("", 400, trio.current_time() - started)
            return
        model = peek.model
        if not isinstance(model, str) or not model:
            await responder.respond(400, [JSON, *extra], openai_error(
                "you must provide a model parameter", "invalid_request_error", "missing_model"))
            self.metrics.finished("", 400, trio.current_time() - started)
            return
        route = self.routes.get(model)
        if route is None:
            await responder.respond(404, [JSON, *extra], openai_error(
                f"The model `{model}` does not exist (known: {', '.join(sorted(self.routes)) or 'none'})",
                "invalid_request_error", "model_not_found"))
            self.metrics.finished("", 404, trio.current_time() - started)
            return
        streaming = peek.stream is True
        code = 500
        # A client that hangs up, streaming or not, cancels its upstream request and frees its
        # admission slot at once (a non-streamed one used to keep both for upstream_timeout).
        # Streams are watched from the start; a plain request only once it has taken
        # WATCH_AFTER (see run_disconnect_watchdog): most are over before that.
        if streaming:
            responder.watch_disconnect()
        else:
            self._unwatched[responder] = started
        try:
            async with route.gate.admit():
                code = await self._forward(route, request, responder, rid, streaming, started)
        except AdmissionRejected as exc:
            code = 429
            await responder.respond(429, [JSON, (b"retry-after", str(exc.retry_after).encode()), *extra], openai_error(
                f"too many requests for model {model}: {exc.reason}; retry after {exc.retry_after}s",
                "rate_limit_error", "rate_limited"))
        except (ClientGone, trio.Cancelled):
            code = 499  # the client went away (nginx's "client closed request")
            raise
        finally:
            self._unwatched.pop(responder, None)
            self.metrics.finished(model, code, trio.current_time() - started)

    async def _forward(self, route: Route, request: Request, responder: Responder, rid: bytes, streaming: bool, started: float) -> int:
        settings = self.settings
        balancer = route.balancer
        now = trio.current_time()
        route.budget.record_request(now)
        key: str | None = None
        if balancer.policy == "prefix-affinity":
            try:
                key = prompt_prefix(msgspec.json.decode(request.body))
            except PREFIX_REFUSED:
                key = None
        headers = [(b"content-type", b"application/json"), (b"x-request-id", rid)]
        accept = request.head.get(b"accept")
        if accept:
            headers.append((b"accept", accept))
        target = request.head.target
        # A stream's head comes at once or with its first token; a non-streamed answer's head
        # only after the whole generation, so only upstream_timeout bounds it.
        head_timeout = float(settings.upstream_timeout)
        if streaming and settings.stream_head_timeout > 0:
            head_timeout = min(head_timeout, float(settings.stream_head_timeout))
        tried: set[str] = set()
        attempt = 0
        last_error = ""
        while True:
            attempt += 1
            now = trio.current_time()
            pick = balancer.pick(now, key=key, exclude=tried)
            if pick is None:
                return await self._unavailable(route, responder, rid, last_error)
            endpoint = pick.endpoint
            outcome: bool | None = None
            response = None
            guard = _Attempt()
            self._attempts.setdefault(endpoint, set()).add(guard)
            try:
                try:
                    with guard.scope():
                        response = await self.upstream(endpoint).request(
                            b"POST", target, headers, request.body, head_timeout=head_timeout)
                except UpstreamError as exc:
                    outcome = False
                    failure = _failure(exc.kind)
                    if failure == "timeout" and streaming:
                        failure = "no_head"
                        exc = UpstreamError("timeout", f"{exc} (stream_head_timeout)")
                    last_error = f"{endpoint}: {exc}"
                    decision = should_retry(failure=failure, status=None, sent_to_client=False, attempt=attempt,
                                            max_attempts=settings.max_attempts, budget=route.budget, now=trio.current_time())
                    if decision.retry:
                        tried.add(endpoint)
                        self.metrics.retried(route.name, failure if failure == "no_head" else exc.kind)
                        log.info("model %s: %s; retrying elsewhere", route.name, last_error)
                        continue
                    status = 504 if exc.kind == "timeout" else 502
                    return await _engine_failed(responder, rid, status, route.name, f"{last_error} ({decision.reason})")
                if response is None:
                    # Its endpoint failed its health checks while we waited: nothing went to the
                    # client, so move to another endpoint (no retry budget spent: the engine is
                    # known to be out, and this request no longer loads it).
                    outcome = False
                    last_error = f"{endpoint}: {guard.reason}"
                    attempt -= 1
                    tried.add(endpoint)
                    self.metrics.retried(route.name, "unhealthy")
                    continue
                status = response.status
                if status in (502, 503):
                    outcome = False
                    last_error = f"{endpoint}: answered {status}"
                    decision = should_retry(failure="status", status=status, sent_to_client=False, attempt=attempt,
                                            max_attempts=settings.max_attempts, budget=route.budget, now=trio.current_time())
                    if decision.retry:
                        await response.aclose()
                        tried.add(endpoint)
                        self.metrics.retried(route.name, str(status))
                        continue
                if outcome is None:
                    outcome = True  # the engine answered (a 502/503 not retried is already False)
                relay = [(k, v) for k, v in response.head.headers if k in PASS_RESPONSE_HEADERS]
                relay.append((b"x-request-id", rid))
                if response.head.chunked:
                    await responder.start(status, relay)
                    try:
                        on_first = functools.partial(self._first_token, route.name, started)
                        client_fd = responder.client_fd
                        with guard.scope():
                            if client_fd is not None and self.hub is not None:
                                await response.relay_via_hub(self.hub, client_fd, float(settings.upstream_timeout), on_first)
                            else:
                                await response.relay_chunked(responder.raw_chunked_sender(), float(settings.upstream_timeout), on_first)
                    except UpstreamError as exc:
                        # Bytes already went out: no retry. Cut the response so the client sees it broke.
                        outcome = False
                        log.warning("model %s: %s broke mid-stream: %s", route.name, endpoint, exc)
                        responder.close = True
                        return status
                    if guard.evicted:
                        outcome = False
                        log.warning("model %s: %s went out of rotation mid-stream (%s): stream cut", route.name, endpoint,
                                    guard.reason)
                        responder.close = True
                    return status
                with guard.scope() as scope:
                    body = await response.read(float(settings.upstream_timeout), limit=int(settings.max_response))
                if scope.cancelled_caught:  # went out of rotation while generating: as above
                    outcome = False
                    last_error = f"{endpoint}: {guard.reason}"
                    attempt -= 1
                    tried.add(endpoint)
                    self.metrics.retried(route.name, "unhealthy")
                    continue
                await responder.respond(status, relay, body)
                return status
            except UpstreamError as exc:
                # An answer too large to hold is the request's problem, not the engine's health.
                outcome = None if exc.kind == "too_large" else False
                if not responder.started:
                    if exc.kind == "too_large":
                        return await _too_large(responder, rid, route.name, int(settings.max_response), f"{endpoint}: {exc}")
                    return await _engine_failed(responder, rid, 502, route.name, f"{endpoint}: {exc}")
                responder.close = True
                return 502
            except (ClientGone, trio.Cancelled):
                outcome = None
                raise
            except trio.BrokenResourceError:
                outcome = None  # the client went away while we relayed
                raise ClientGone(f"client {request.peer} went away") from None
            finally:
                waiting = self._attempts.get(endpoint)
                if waiting is not None:
                    waiting.discard(guard)
                    if not waiting:
                        del self._attempts[endpoint]
                if response is not None:
                    await response.aclose()
                breaker = balancer.breaker(endpoint) if endpoint in balancer else None
                before = breaker.state if breaker is not None else None
                balancer.release(pick, trio.current_time(), ok=outcome, reason=last_error)
                if breaker is not None and breaker.state != before:
                    self._log_breaker(route.name, endpoint, before, breaker)

    def _log_breaker(self, model: str, endpoint: str, before: BreakerState | None, breaker: Breaker) -> None:
        log.log(logging.INFO if breaker.state.label == "closed" else logging.WARNING,
                "model %s: circuit breaker of %s %s → %s%s", model, endpoint,
                before.label if before is not None else "?", breaker.state.label,
                f" ({breaker.reason})" if breaker.reason else "")

    def _first_token(self, model: str, started: float) -> None:
        self.metrics.first_token(model, trio.current_time() - started)

    async def _unavailable(self, route: Route, responder: Responder, rid: bytes, last_error: str) -> int:
        # The client reads what happened; engine addresses, errors and replica states stay in
        # the server log under the request id (they map the fleet for anyone who may chat).
        if last_error:
            message, detail = f"no engine of {route.name} could answer", f"last error: {last_error}"
        elif not route.balancer.endpoints:
            message, detail = f"no ready replica of {route.name}", self.not_ready_reason(route.name)
        else:
            message = f"every engine of {route.name} is failing"
            detail = "; ".join(f"{st.endpoint} failing its health checks ({st.health_reason})" if not st.healthy
                               else f"{st.endpoint} circuit breaker {st.breaker}"
                               + (f" ({st.breaker_reason})" if st.breaker_reason else "")
                               for st in route.balancer.status())
        log.log(logging.WARNING if last_error else logging.INFO, "request %s: 503 for model %s: %s%s",
                rid.decode("latin-1"), route.name, message, f" ({detail})" if detail else "")
        await responder.respond(503, [JSON, (b"x-request-id", rid), (b"retry-after", b"5")], openai_error(
            f"{message}; retry later (request id {rid.decode('latin-1')})", "server_error", "no_ready_replica"))
        return 503

    def _models_body(self) -> bytes:
        created = int(time.time())
        return msgspec.json.encode({
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "llmgw"} for name in self.models_ready()],
        })

    async def _unauthorized(self, responder: Responder, extra: list[tuple[bytes, bytes]]) -> None:
        await responder.respond(401, [JSON, (b"www-authenticate", b'Bearer realm="llmgw"'), *extra], openai_error(
            "Incorrect or missing API key: send `Authorization: Bearer <key>`", "invalid_request_error", "invalid_api_key"))

    # -- scraping ----------------------------------------------------------------------------------

    async def run_disconnect_watchdog(self) -> None:
        """Give every plain request that has been in flight WATCH_AFTER a watcher that cancels
        it when its client hangs up. Not at once for all: a watcher (a task reading the client
        socket, then cancelled) cost 117-148 µs per request on the loaded 2-core machine where
        the bare relay measured 106 µs per chunk (24-30 µs quiet), a sixth of the gateway's
        per-request budget, for requests most of which (an embedding, a short answer, a 429)
        are over before it could matter. Here a fast request costs a dict insert and delete."""
        while True:
            await trio.sleep(WATCH_AFTER)
            if not self._unwatched:
                continue
            due = trio.current_time() - WATCH_AFTER
            for responder, since in list(self._unwatched.items()):
                if since <= due:
                    del self._unwatched[responder]
                    responder.watch_disconnect()

    async def run_health_checks(self) -> None:
        """Active health (issue 9: a SIGSTOPped engine stayed in rotation ~11 minutes): every
        health_interval, GET health_path on every endpoint in rotation, at most one check in
        flight per endpoint, each bounded by health_timeout. See `_health_result`."""
        async with trio.open_nursery() as nursery:
            next_round = trio.current_time()
            while True:
                interval = float(self.settings.health_interval)
                if interval > 0:
                    for ep in sorted({ep for route in self.routes.values() for ep in route.balancer.endpoints}):
                        if ep not in self._checking:
                            self._checking.add(ep)
                            nursery.start_soon(self._check_health, ep)
                next_round = max(next_round + (interval or 1.0), trio.current_time())
                await trio.sleep_until(next_round)

    async def _check_health(self, endpoint: str) -> None:
        path = self.settings.health_path.encode()
        timeout = float(self.settings.health_timeout)
        ok, reason = False, ""
        try:
            with trio.move_on_after(timeout) as scope:
                try:
                    response = await self.upstream(endpoint).request(b"GET", path, [], b"", head_timeout=timeout)
                    try:
                        await response.read(timeout, limit=SCRAPE_MAX)
                    finally:
                        await response.aclose()
                    ok = response.status < 500  # any answer but a server error: alive
                    reason = "" if ok else f"{path.decode()} answered {response.status}"
                except UpstreamError as exc:
                    reason = f"{path.decode()}: {exc}"
            if scope.cancelled_caught:
                reason = f"no answer to {path.decode()} within {timeout:g}s"
        except ValueError as exc:  # not a usable URL (left out of rotation elsewhere)
            reason = str(exc)
        finally:
            self._checking.discard(endpoint)
        self._health_result(endpoint, ok, reason)

    def _health_result(self, endpoint: str, ok: bool, reason: str) -> None:
        """Feed a health check (or a metrics scrape that got no answer) to every balancer that
        has the endpoint; when it goes out of rotation, the requests waiting on it are moved
        (those that sent nothing to their client) or cut (streams already relaying)."""
        now = trio.current_time()
        for route in self.routes.values():
            if endpoint not in route.balancer:
                continue
            breaker = route.balancer.breaker(endpoint)
            before = breaker.state
            change = route.balancer.health(endpoint, now, ok, reason)
            if breaker.state != before:
                self._log_breaker(route.name, endpoint, before, breaker)
            if change == "down":
                attempts = list(self._attempts.get(endpoint, ()))
                for attempt in attempts:
                    attempt.evict(f"out of rotation: {reason}")
                log.warning("model %s: endpoint %s out of rotation: %d health checks failed in a row, last: %s; "
                            "%d request(s) in flight on it moved or cut", route.name, endpoint,
                            route.balancer.health_failures, reason, len(attempts))
            elif change == "up":
                log.info("model %s: endpoint %s back in rotation (health check passed)", route.name, endpoint)

    async def run_scraper(self) -> None:
        """Every scrape_interval: each engine's /metrics, for load-aware balancing and violations."""
        while True:
            endpoints = sorted({ep for route in self.routes.values() for ep in route.balancer.endpoints})
            if endpoints:
                async with trio.open_nursery() as nursery:
                    for ep in endpoints:
                        nursery.start_soon(self._scrape, ep)
            with trio.move_on_after(float(self.settings.scrape_interval)):
                await self._changed.wait()
                await trio.sleep(0.05)
            self._changed = trio.Event()

    async def _scrape(self, endpoint: str) -> None:
        try:
            await self._scrape_one(endpoint)
        except Exception:
            # One engine's odd answer must not stop scraping (and balancing) for every model.
            log.exception("scraping %s failed", endpoint)

    async def _scrape_one(self, endpoint: str) -> None:
        load = None
        error = ""
        answered = False
        with trio.move_on_after(float(self.settings.scrape_timeout)):
            try:
                response = await self.upstream(endpoint).request(b"GET", b"/metrics", [], b"", head_timeout=float(self.settings.scrape_timeout))
                try:
                    body = await response.read(float(self.settings.scrape_timeout), limit=SCRAPE_MAX)
                finally:
                    await response.aclose()
                answered = True
                if response.status == 200:
                    load = parse_engine_metrics(body.decode("utf-8", "replace"))
                else:
                    error = f"HTTP {response.status}"
            except UpstreamError as exc:
                error = str(exc)
        if load is None and not error:
            error = f"no answer within {float(self.settings.scrape_timeout):g}s"
        up = load is not None
        if self.engine_up.get(endpoint) != up:
            if up:
                log.info("engine %s metrics: up", endpoint)
            elif endpoint in self.engine_up:
                log.warning("engine %s metrics: unreachable (%s)", endpoint, error)
            else:
                log.info("engine %s metrics: not answering yet (%s)", endpoint, error)
        self.engine_up[endpoint] = up
        if not answered and self.settings.health_interval > 0:
            self._health_result(endpoint, False, f"metrics scrape: {error}")
        for route in self.routes.values():
            if endpoint in route.balancer:
                route.balancer.update_load(endpoint, load)

    async def aclose(self) -> None:
        for upstream in list(self.upstreams.values()):
            await upstream.aclose()


async def _engine_failed(responder: Responder, rid: bytes, status: int, model: str, detail: str) -> int:
    """A generic line for the client; the engine's address and error go to the log under the request id."""
    request_id = rid.decode("latin-1")
    log.warning("request %s: %d for model %s: engine failed: %s", request_id, status, model, detail)
    await responder.respond(status, [JSON, (b"x-request-id", rid)], openai_error(
        f"the engine for {model} failed to answer (request id {request_id})", "server_error", "upstream_error"))
    return status


async def _too_large(responder: Responder, rid: bytes, model: str, limit: int, detail: str) -> int:
    """The client may know why (its request asked for too much); not which engine."""
    request_id = rid.decode("latin-1")
    log.warning("request %s: 502 for model %s: %s", request_id, model, detail)
    await responder.respond(502, [JSON, (b"x-request-id", rid)], openai_error(
        f"the answer for {model} is larger than this gateway passes on ({limit} bytes, gateway.max_response; "
        f"request id {request_id})", "server_error", "response_too_large"))
    return 502


_FAILURES: dict[str, FailureKind] = {"connect": "connect", "reset": "reset", "timeout": "timeout"}


def _failure(kind: str) -> FailureKind:
    return _FAILURES.get(kind, "other")

