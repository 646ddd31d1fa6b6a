"""The gateway's fast lane: a plain (non-streamed) request answered in reactor callbacks.

Why: with a task per connection, a proxied request cost ~140 µs of gateway CPU against nginx's
~10 µs, and most of the difference was not our work but trio's: two task switches and two epoll
registration changes a request (llmgw.web.reactor has the figures). Here the request that can be
answered without awaiting anything is: admitted at once, its engine picked, written to an idle
engine connection, its answer read whole and passed on, all in callbacks. The policies are the
gateway's own, called as the task path calls them (admission, retry budget, balancer and breaker,
metrics, head timeouts and evictions through the Gateway's attempt table).

What this lane does not finish goes to the task path at the point it reached, never redone:
  - refused before anything happened (a stream, a body that is not JSON, an unknown model, a
    full admission gate, no disconnect watchdog running): `offer` says False;
  - past admission (no engine to pick, no idle connection to it, the engine failed, answered
    502/503, sent a body to relay or too large to hold, timed out or was evicted):
    `Gateway.resume` carries on with what the lane did (`Resumed`), retries and all.
A client that hangs up mid-request frees its slot and engine connection at once (499).
"""

from __future__ import annotations

import logging
import math

import trio

from llmgw.server.gateway.admission import Ticket
from llmgw.server.gateway.attempt import AttemptLoop
from llmgw.server.gateway.inflight import AttemptGuard, Resumed
from llmgw.server.gateway.phases import Phase
from llmgw.server.gateway.proxy import Gateway, relay_headers, unauthorized
from llmgw.server.gateway.reqbody import JSON_REFUSED, ROUTES, peek, request_id
from llmgw.server.gateway.routes import Route
from llmgw.web.client import Response, Upstream, UpstreamError
from llmgw.web.fastclient import FastCall, StaleConnection
from llmgw.web.fastserve import Exchange
from llmgw.web.reactor import Reactor
from llmgw.web.server import Request

log = logging.getLogger("llmgw.gateway")


class GatewayLane:
    """What the public port's server offers requests to (llmgw.web.fastserve.FastLane)."""

    def __init__(self, gateway: Gateway, reactor: Reactor) -> None:
        self.gateway = gateway
        self.reactor = reactor

    def offer(self, request: Request, exchange: Exchange) -> bool:
        gw = self.gateway
        head = request.head
        if head.method != b"POST" or not gw.watching or head.path not in ROUTES:
            return False
        try:
            peeked = peek(request.body)
        except JSON_REFUSED:
            return False
        model = peeked.model
        if peeked.stream is True or not isinstance(model, str):
            return False
        route = gw.routes.get(model)
        if route is None:
            return False
        rid = head.get(b"x-request-id") or request_id()
        if not gw.authorized(request):  # counted and logged by the door, as on the task path
            headers, body = unauthorized([(b"x-request-id", rid)])
            exchange.respond(401, headers, body)
            return True
        started = trio.current_time()
        ticket = route.gate.admit_now(started)
        if ticket is None:
            return False  # the task queues it
        _Request(self, gw, route, model, request, exchange, rid, started, ticket).start()
        return True


class _Request:
    """A plain request driving its attempt loop (llmgw.server.gateway.attempt) in callbacks, as
    far as it can without awaiting; the loop goes on in the task path where it stops."""

    __slots__ = ("call", "endpoint", "exchange", "guard", "gw", "lane", "loop", "model", "over", "request", "rid",
                 "route", "started", "ticket", "upstream")

    def __init__(self, lane: GatewayLane, gw: Gateway, route: Route, model: str, request: Request, exchange: Exchange,
                 rid: bytes, started: float, ticket: Ticket) -> None:
        self.lane = lane
        self.gw = gw
        self.route = route
        self.model = model
        self.request = request
        self.exchange = exchange
        self.rid = rid
        self.started = started
        self.ticket = ticket
        self.loop: AttemptLoop | None = None
        self.over = False  # _end ran: slot, engine and count given back
        self.endpoint = ""
        self.upstream: Upstream | None = None
        self.call: FastCall | None = None
        self.guard: AttemptGuard | None = None

    def _rescue(self) -> None:
        """A bug in the lane must not strand the request (its slot, its pick, a waiting client):
        the task path takes it where the loop is, an attempt in ATTEMPT made again."""
        log.exception("fast lane failed on a request for %s; the task path finishes it", self.model)
        self._untrack()
        if self.call is not None:
            self.call.abandon()
        loop = self.loop
        if loop is None:
            loop = self.loop = self.gw.attempts(self.route, self.request.body, trio.current_time(), False)
        if loop.phase in (Phase.PICK, Phase.ATTEMPT, Phase.UNAVAILABLE):
            self._resume(None)
            return
        # Past the answer (the lane tells the loop only once the answer is out): nothing for the
        # task path to add; what `_end` has not given back yet is given back now, once.
        if loop.phase is Phase.ANSWER:
            loop.finish(True)
        self._end(500)

    def start(self) -> None:
        try:
            self._start()
        except Exception:
            self._rescue()

    def _start(self) -> None:
        gw, request, now = self.gw, self.request, self.started
        loop = self.loop = gw.attempts(self.route, request.body, now, False)
        pick = loop.pick(now)
        if pick is None:
            self._resume(None)  # UNAVAILABLE: the task answers 503 with the reasons
            return
        endpoint = self.endpoint = pick.endpoint
        upstream = self.upstream = gw.upstream(endpoint)
        conn = upstream.take_idle()
        if conn is None:
            self._resume(None)  # the task dials the engine (then its connection is pooled for us)
            return
        settings = gw.settings
        accept = request.head.get(b"accept")
        guard = self.guard = AttemptGuard()
        guard.due = now + float(settings.upstream_timeout)
        guard.wake = self._fired
        gw.track(endpoint, guard)
        self.exchange.on_gone = self._gone
        call = self.call = FastCall(upstream, conn, self.lane.reactor, int(settings.max_response), self.done)
        call.start(upstream.post_bytes(request.head.target, self.rid, accept, request.body))

    def done(self, result: Response | UpstreamError) -> None:
        """FastCall's end: the engine's answer (head, and a whole body when it had one to give) or an error."""
        try:
            self._untrack()
            if isinstance(result, StaleConnection):
                assert self.upstream is not None
                self.upstream.drop_idle()
                self._resume(None)  # a new connection, as Upstream.request does on the task path
                return
            if isinstance(result, UpstreamError):
                self._resume(result)  # the loop's `failed`, told by the task path (it retries)
                return
            response = result
            body = None if response.status in (502, 503) else response.complete_body(int(self.gw.settings.max_response))
            if body is None:
                assert self.call is not None
                self.call.to_task()
                self._resume(response)
                return
            loop = self.loop
            assert loop is not None
            status = response.status
            self.exchange.on_gone = None
            self.exchange.respond(status, relay_headers(response, self.rid), body)
            now = trio.current_time()
            loop.head(status, now)  # told once the answer is out: a failure before it leaves the loop in ATTEMPT
            loop.finish(True)
            self._end(status, now)
            self.gw.metrics.left_fast_lane(self.model, "answered")
        except Exception:
            self._rescue()

    def _fired(self) -> None:
        """The head timeout passed, or the endpoint went out of rotation (its guard fired)."""
        guard, call, upstream = self.guard, self.call, self.upstream
        assert guard is not None and call is not None and upstream is not None
        self._untrack()
        call.abandon()
        timeout = float(self.gw.settings.upstream_timeout)
        self._resume(upstream.fired_error(guard, timeout) if guard.why == "timeout"
                     else UpstreamError("evicted", guard.reason))

    def _gone(self) -> None:
        """The client hung up (or the server stops) before the answer."""
        self._untrack()
        if self.call is not None:
            self.call.abandon()
        if self.loop is not None:
            self.loop.gone()
        self._end(499)
        self.gw.metrics.left_fast_lane(self.model, "gone")

    def _resume(self, replay: Response | UpstreamError | None) -> None:
        self.exchange.on_gone = None
        self.gw.metrics.left_fast_lane(self.model, "resumed")
        assert self.loop is not None
        resumed = Resumed(self.loop, replay)
        self.exchange.resume(lambda responder: self.gw.resume(self.route, self.model, self.request, self.rid,
                                                              self.started, self.ticket, resumed, responder))

    def _untrack(self) -> None:
        guard = self.guard
        if guard is not None:
            self.guard = None
            guard.wake = None
            guard.due = math.inf
            self.gw.untrack(self.endpoint, guard)

    def _end(self, status: int, now: float | None = None) -> None:
        """The request is over in the lane: its slot, its engine and its count given back, once."""
        if self.over:
            return
        self.over = True
        gw, route = self.gw, self.route
        if now is None:
            now = trio.current_time()
        try:
            if self.loop is not None:
                gw.settle(route, self.loop, now)
        finally:  # the slot and the count whatever became of the engine's hold
            route.gate.release(self.ticket, now)
            gw.metrics.finished(self.model, status, now - self.started)
