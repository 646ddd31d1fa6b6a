"""The OpenAI-compatible gateway: pick an engine, forward the body untouched, relay the answer.

Per model: a Balancer (which endpoint), a RetryBudget (how many retries the model may spend)
and an AdmissionGate (how many requests in flight, then a bounded queue). A streamed answer
is relayed chunk by chunk as the engine sends it (the engine's chunked coding is passed on
byte for byte), and never retried once a byte went to the client.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import trio

from llmgw.gwsettings import GatewaySettings, StaticEndpoint
from llmgw.server.gateway.admission import Ticket
from llmgw.server.gateway.admission_gate import AdmissionRejected
from llmgw.server.gateway.attempt import AttemptLoop
from llmgw.server.gateway.balance import Pick
from llmgw.server.gateway.inflight import AttemptGuard, Resumed
from llmgw.server.gateway.metrics import GatewayMetrics
from llmgw.server.gateway.openai_api import is_models_path, models_answer, openai_error
from llmgw.server.gateway.phases import Phase
from llmgw.server.gateway.probes import EngineProbes
from llmgw.server.gateway.reqbody import JSON_REFUSED, ROUTES, affinity_key, peek, request_id
from llmgw.server.gateway.routes import Route, RouteTable, log_breaker
from llmgw.web.client import Response, Upstream, UpstreamError
from llmgw.web.relay import RelayHub, relay_body
from llmgw.web.server import ClientGone, Request, Responder
from llmgw.wire.gateway import Routed, RouteModel, route_model

log = logging.getLogger("llmgw.gateway")

WATCH_AFTER = 0.1  # seconds a plain request runs before a client hang-up is watched for
JSON = (b"content-type", b"application/json")
PASS_RESPONSE_HEADERS = {b"content-type", b"cache-control", b"x-accel-buffering"}


class Followers(Protocol):
    """Where the gateway's configuration goes on to (llmgw.server.gwfeed.GatewayFeedService)."""

    def publish_config(self, models: Sequence[RouteModel], static: Sequence[StaticEndpoint],
                       settings: GatewaySettings) -> None: ...

    def publish_endpoints(self, ready: Mapping[str, Iterable[str]], keys: Mapping[str, str], *,
                          settling: bool = False) -> None: ...


class Gateway:
    """Requests: admission, balancing, retries and the outcome of each attempt. The routing table
    (llmgw.server.gateway.routes) and the engine probes (.probes) are its parts; the relay hub is
    passed in, its task already running (llmgw.web.relay)."""

    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        *,
        relay_hub: RelayHub,
        client_door: Callable[[Request], bool],
        not_ready_reason: Callable[[str], str] = lambda model: "",
        rng: random.Random | None = None,
        followers: Followers | None = None,
    ) -> None:
        self.metrics = metrics
        # Gateway workers and gateways on other machines are told what this gateway is told.
        self.followers = followers
        self.not_ready_reason = not_ready_reason
        self.rng = rng or random.Random()
        self.table = RouteTable(settings, metrics, self.rng)
        self.routes = self.table.routes
        self.engine_up = self.table.engine_up
        self.probes = EngineProbes(self.table, evict=self._evict)
        self.hub = relay_hub
        # The API key check (llmgw.server.gateway.apikeys): counts and logs its refusals itself.
        self.authorized = client_door
        self._attempts: dict[str, set[AttemptGuard]] = {}  # upstream attempts in flight, by endpoint
        self._unwatched: dict[Responder, float] = {}  # plain requests in flight with no hang-up watcher yet
        # Head timeouts of the attempts waiting on a Watch (see AttemptGuard): run_disconnect_watchdog
        # fires those past due. `_next_due` is at most the earliest due time (attempts that ended
        # leave it early, which costs one scan), so the table is scanned only when one may be due.
        self._ticking = False  # run_disconnect_watchdog is running: attempts may use a Watch
        self._next_due = math.inf

    # -- what the control plane tells us (llmgw.server.gateway.routes) -------------------------------

    @property
    def watching(self) -> bool:
        """Whether run_disconnect_watchdog runs: attempts may wait on a Watch (the fast lane's do)."""
        return self._ticking

    @property
    def settings(self) -> GatewaySettings:
        return self.table.settings

    def configure(self, models: Sequence[Routed | RouteModel], static: Sequence[StaticEndpoint],
                  settings: GatewaySettings | None = None) -> None:
        """Models kept, and passed on, as their routing view only (issue 40, finding 2)."""
        routing = [route_model(m) for m in models]
        self.table.configure(routing, static, settings)
        if self.followers is not None:
            self.followers.publish_config(routing, static, self.table.settings)

    def set_endpoints(self, ready: Mapping[str, Iterable[str]], keys: Mapping[str, str] | None = None, *,
                      settling: bool = False) -> None:
        """`settling` (server/settling.py): what a restarted control plane names joins the set in
        rotation (health checks drop the dead) until the settled set replaces it (issue 41)."""
        merged = ({name: set(ready.get(name, ())) | route.dynamic for name, route in self.routes.items()}
                  if settling else ready)
        self.table.set_endpoints(merged, keys)
        if self.followers is not None:
            self.followers.publish_endpoints(ready, keys or {}, settling=settling)

    def upstream(self, url: str) -> Upstream:
        return self.table.upstream(url)

    def models_ready(self) -> list[str]:
        return self.table.models_ready()

    # -- what we ask the engines ourselves (llmgw.server.gateway.probes) -------------------------------

    async def run_health_checks(self) -> None:
        await self.probes.run_health_checks()

    async def run_scraper(self) -> None:
        await self.probes.run_scraper()

    def _evict(self, endpoint: str, reason: str) -> int:
        attempts = list(self._attempts.get(endpoint, ()))
        for attempt in attempts:
            attempt.evict(reason)
        return len(attempts)

    # -- requests ------------------------------------------------------------------------------------

    async def handle(self, request: Request, responder: Responder) -> None:
        started = trio.current_time()
        path = request.head.path
        rid = request.head.get(b"x-request-id") or request_id()
        extra = [(b"x-request-id", rid)]
        if is_models_path(path):
            if request.method != "GET":
                await responder.respond(405, [JSON, *extra],
                                        openai_error(f"use GET {request.path}", "invalid_request_error"))
                return
            if not self.authorized(request):
                await self._unauthorized(responder, extra)
                return
            status, body = models_answer(path, self.models_ready(), self.routes, int(time.time()))
            await responder.respond(status, [JSON, *extra], body)
            return
        if path not in ROUTES:
            await responder.respond(404, [JSON, *extra],
                                    openai_error(f"unknown route {request.path}", "invalid_request_error", "not_found"))
            return
        if request.method != "POST":
            await responder.respond(405, [JSON, *extra],
                                    openai_error(f"use POST {request.path}", "invalid_request_error"))
            return
        if not self.authorized(request):
            await self._unauthorized(responder, extra)
            return
        try:
            peeked = peek(request.body)
        except JSON_REFUSED as exc:
            # RecursionError: nesting deeper than the decoder goes (100,000 `[` inside a valid
            # object was a 500 and a logged traceback per request, issue 9).
            why = "nested too deeply" if isinstance(exc, RecursionError) else "not valid JSON"
            await responder.respond(400, [JSON, *extra], openai_error(
                f"the request body is {why} (a JSON object with a `model` field is expected)",
                "invalid_request_error", "invalid_json"))
            self.metrics.finished("", 400, trio.current_time() - started)
            return
        model = peeked.model
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
        streaming = peeked.stream is True
        code = 500
        # A client that hangs up, streaming or not, cancels its upstream request and frees its
        # admission slot at once (a non-streamed one used to keep both for upstream_timeout).
        # A request gets a watcher task once it has taken WATCH_AFTER (run_disconnect_watchdog):
        # most plain ones are over before that, and a stream the relay hub takes is watched by
        # the hub from then on (on_spliced below). Streams used to get a watcher at once, started
        # and cancelled per stream: ~9 % of the gateway's samples in a 200-stream burst.
        self._unwatched[responder] = started
        gate = route.gate
        try:
            ticket = gate.admit_now(started) or await gate.acquire()
            try:
                code = await self._forward(route, request, responder, rid, streaming, started)
            finally:
                gate.release(ticket)
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

    async def resume(self, route: Route, model: str, request: Request, rid: bytes, started: float, ticket: Ticket,
                     resumed: Resumed, responder: Responder) -> None:
        """The rest of a plain request the fast lane began (llmgw.server.gateway.fastlane)."""
        self._unwatched[responder] = started
        code = 500
        try:
            code = await self._forward(route, request, responder, rid, False, started, resumed)
        except (ClientGone, trio.Cancelled):
            code = 499
            raise
        finally:
            route.gate.release(ticket)
            self._unwatched.pop(responder, None)
            self.metrics.finished(model, code, trio.current_time() - started)

    def attempts(self, route: Route, body: bytes, now: float, streaming: bool) -> AttemptLoop:
        """A request's attempt loop (llmgw.server.gateway.attempt), both paths' one."""
        balancer = route.balancer
        key = affinity_key(body) if balancer.policy == "prefix-affinity" else None
        return AttemptLoop(balancer, route.budget, self.settings.max_attempts, now, key=key, streaming=streaming)

    def settle(self, route: Route, loop: AttemptLoop, now: float | None = None) -> None:
        """What the loop's last step ended, given back: the attempt's hold to the balancer and its
        breaker, its retry to the metrics."""
        released = loop.take_release()
        if released is not None:
            self.release_pick(route, released[0], released[1], loop.last_error, now)
        if loop.retried is not None:
            self.metrics.retried(route.name, loop.retried)
            loop.retried = None

    async def _forward(self, route: Route, request: Request, responder: Responder, rid: bytes, streaming: bool,
                       started: float, resumed: Resumed | None = None) -> int:
        """The task path's driver of the attempt loop: each attempt's I/O, and its end told to the loop."""
        settings = self.settings
        replay: Response | UpstreamError | None = None
        now = trio.current_time()  # for the first attempt (a clock read is ~0.15 µs; 9 a request)
        if resumed is None:
            loop = self.attempts(route, request.body, now, streaming)
            loop.pick(now)
        else:
            loop, replay = resumed.loop, resumed.replay
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
        while True:
            if loop.phase is Phase.PICK:  # a retry, or an eviction's move
                now = trio.current_time()
                loop.pick(now)
            pick = loop.pick_
            if pick is None:
                return await self._unavailable(route, responder, rid, loop.last_error)
            endpoint = pick.endpoint
            response = None
            guard = AttemptGuard()
            self.track(endpoint, guard)
            try:
                try:
                    if replay is not None:  # the fast lane's attempt: handled as if made here
                        if isinstance(replay, Response):
                            response, replay = replay, None
                        elif replay.kind != "evicted":
                            raise replay
                        else:
                            guard.reason, replay = str(replay), None  # response stays None: moves on below
                    elif self._ticking:
                        guard.due = due = now + head_timeout
                        if due < self._next_due:
                            self._next_due = due
                        try:
                            response = await self.upstream(endpoint).request(
                                b"POST", target, headers, request.body, head_timeout=head_timeout, watch=guard)
                        except UpstreamError as exc:
                            if exc.kind != "evicted":
                                raise
                            # response stays None: moves on below, as a cancelled guard scope does
                        finally:
                            guard.due = math.inf
                    else:
                        with guard.scope():
                            response = await self.upstream(endpoint).request(
                                b"POST", target, headers, request.body, head_timeout=head_timeout)
                except UpstreamError as exc:
                    replay = None
                    if loop.failed(exc.kind, str(exc), trio.current_time()) is Phase.PICK:
                        log.info("model %s: %s; retrying elsewhere", route.name, loop.last_error)
                        continue
                    return await _engine_failed(responder, rid, loop.status, route.name, loop.detail)
                if response is not None and loop.head(response.status, trio.current_time()) is Phase.PICK:
                    await response.aclose()  # a 502/503, retried elsewhere
                    continue
                answered = (None if response is None
                            else await self._answer(route, endpoint, response, responder, rid, guard, started))
                if answered is None:
                    # Its endpoint failed its health checks while we waited (for the head, or for a
                    # plain answer's body): nothing went to the client, so another endpoint.
                    loop.evicted(guard.reason)
                    continue
                status, engine_ok = answered
                loop.finish(engine_ok)
                return status
            except UpstreamError as exc:
                # An answer too large to hold is the request's problem, not the engine's health.
                loop.finish(None if exc.kind == "too_large" else False)
                if not responder.started:
                    if exc.kind == "too_large":
                        return await _too_large(responder, rid, route.name, int(settings.max_response),
                                                f"{endpoint}: {exc}")
                    return await _engine_failed(responder, rid, 502, route.name, f"{endpoint}: {exc}")
                responder.close = True
                return 502
            except (ClientGone, trio.Cancelled):
                loop.gone()
                raise
            finally:
                self.untrack(endpoint, guard)
                if response is not None and not response.released:
                    await response.aclose()
                self.settle(route, loop)

    def track(self, endpoint: str, guard: AttemptGuard) -> None:
        """An attempt in flight: its head timeout and its endpoint's eviction reach it."""
        self._attempts.setdefault(endpoint, set()).add(guard)
        if guard.due < self._next_due:
            self._next_due = guard.due

    def untrack(self, endpoint: str, guard: AttemptGuard) -> None:
        waiting = self._attempts.get(endpoint)
        if waiting is not None:
            waiting.discard(guard)
            if not waiting:
                del self._attempts[endpoint]

    def release_pick(self, route: Route, pick: Pick, outcome: bool | None, reason: str,
                     now: float | None = None) -> None:
        """An attempt's outcome, to the balancer and its endpoint's breaker (a change is logged)."""
        balancer = route.balancer
        breaker = pick.breaker if pick.endpoint in balancer else None
        before = breaker.state if breaker is not None else None
        balancer.release(pick, trio.current_time() if now is None else now, ok=outcome, reason=reason)
        if breaker is not None and before is not None and breaker.state != before:
            log_breaker(route.name, pick.endpoint, before, breaker)

    async def _answer(self, route: Route, endpoint: str, response: Response, responder: Responder, rid: bytes,
                      guard: AttemptGuard, started: float) -> tuple[int, bool] | None:
        """Pass the engine's answer on: a stream relayed as it comes (llmgw.web.relay chooses how),
        a plain answer read whole, then sent. Returns (status, whether the engine did its part), or
        None when the endpoint went out of rotation while a plain answer was generated (nothing was
        sent: the request moves on). A plain answer that fails raises UpstreamError."""
        settings = self.settings
        status = response.status
        relay = relay_headers(response, rid)
        if not response.head.chunked:
            body = response.complete_body(int(settings.max_response))
            if body is None:
                with guard.scope() as scope:
                    body = await response.read(float(settings.upstream_timeout), limit=int(settings.max_response))
                if scope.cancelled_caught or body is None:
                    return None
            await responder.respond(status, relay, body)
            return status, True
        await responder.start(status, relay)
        try:
            with guard.scope():
                await relay_body(response, responder, self.hub, float(settings.upstream_timeout),
                                 functools.partial(self._first_token, route.name, started),
                                 functools.partial(self._spliced, responder))
        except UpstreamError as exc:
            # Bytes already went out: no retry. Cut the response so the client sees it broke.
            log.warning("model %s: %s broke mid-stream: %s", route.name, endpoint, exc)
            responder.close = True
            return status, False
        if guard.evicted:
            log.warning("model %s: %s went out of rotation mid-stream (%s): stream cut", route.name, endpoint,
                        guard.reason)
            responder.close = True
            return status, False
        return status, True

    def _spliced(self, responder: Responder) -> None:
        """The relay hub took the stream, and watches its client's hang-up from now on."""
        self._unwatched.pop(responder, None)

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

    async def _unauthorized(self, responder: Responder, extra: list[tuple[bytes, bytes]]) -> None:
        await responder.respond(401, *unauthorized(extra))

    # -- hang-ups ----------------------------------------------------------------------------------

    async def run_disconnect_watchdog(self) -> None:
        """Give every plain request that has been in flight WATCH_AFTER a watcher that cancels
        it when its client hangs up. Not at once for all: a watcher (a task reading the client
        socket, then cancelled) cost 117-148 µs per request on the loaded 2-core machine where
        the bare relay measured 106 µs per chunk (24-30 µs quiet), a sixth of the gateway's
        per-request budget, for requests most of which (an embedding, a short answer, a 429)
        are over before it could matter. Here a fast request costs a dict insert and delete.

        It also fires the head timeouts of attempts waiting on a Watch (see AttemptGuard), so they
        end within WATCH_AFTER of being due; while it does not run, attempts use cancel scopes."""
        self._ticking = True
        try:
            while True:
                await trio.sleep(WATCH_AFTER)
                now = trio.current_time()
                if now >= self._next_due:
                    self._fire_due(now)
                if not self._unwatched:
                    continue
                due = now - WATCH_AFTER
                for responder, since in list(self._unwatched.items()):
                    if since <= due:
                        del self._unwatched[responder]
                        responder.watch_disconnect()
        finally:
            self._ticking = False

    def _fire_due(self, now: float) -> None:
        earliest = math.inf
        for attempts in list(self._attempts.values()):
            for attempt in list(attempts):
                if attempt.due <= now:
                    attempt.fire("timeout")
                elif attempt.due < earliest:
                    earliest = attempt.due
        self._next_due = earliest

    async def aclose(self) -> None:
        await self.table.aclose()


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


def relay_headers(response: Response, rid: bytes) -> list[tuple[bytes, bytes]]:
    """The engine's headers a client gets, and the request id."""
    relay = [(k, v) for k, v in response.head.headers if k in PASS_RESPONSE_HEADERS]
    relay.append((b"x-request-id", rid))
    return relay


def unauthorized(extra: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], bytes]:
    return [JSON, (b"www-authenticate", b'Bearer realm="llmgw"'), *extra], openai_error(
        "Incorrect or missing API key: send `Authorization: Bearer <key>`", "invalid_request_error", "invalid_api_key")
