"""The gateway's fast lane (llmgw.server.gateway.fastlane) through the real gateway: Gateway behind a
real HttpServer with the lane and its reactor, scripted engines on real loopback sockets, the
gateway's timer task running as the server runs it. Each engine answers a first request at once,
so the gateway holds an idle connection to it and the request under test is the lane's (a first
request to an engine goes to the task path, which dials). What the lane cannot finish it hands
to the task path where it stands: these check the client gets what the task path would give."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint
from llmgw.catalog.units import Duration
from llmgw.server.gateway import fastlane
from llmgw.server.gateway.attempt import AttemptLoop
from llmgw.server.gateway.fastlane import GatewayLane
from llmgw.server.gateway.metrics import GatewayMetrics
from llmgw.server.gateway.phases import Phase
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.metrics import ServerMetrics
from llmgw.web import http1
from llmgw.web.fastserve import FastPath
from llmgw.web.reactor import Reactor
from llmgw.web.relay import RelayHub
from llmgw.web.server import HttpServer
from tests.unit.loopback import serve_tcp, wait_for
from tests.unit.test_gateway_attempts import REQUEST, exchange
from tests.unit.test_web_client import ok, read_request

pytestmark = pytest.mark.skipif(not Reactor().available, reason="the fast lane needs epoll")

Engine = Callable[[trio.SocketStream], Awaitable[None]]


def engine(*then: str, seen: list[str] | None = None) -> Engine:
    """Answers the first request on each connection with 200; then, request by request:
    ok | hang | reset | 503 | chunked | close-after (200, then closes the idle connection)."""
    async def serve(stream: trio.SocketStream) -> None:
        buf = bytearray()
        if await read_request(stream, buf) is None:
            return
        await stream.send_all(ok(b'{"first":true}'))
        for what in then:
            if await read_request(stream, buf) is None:
                if seen is not None:
                    seen.append("eof")
                return
            if seen is not None:
                seen.append(what)
            if what == "ok":
                await stream.send_all(ok(b'{"n":2}'))
            elif what == "hang":
                await trio.sleep_forever()
            elif what == "reset":
                return  # closes with the request unanswered
            elif what == "503":
                await stream.send_all(http1.response_head(503, [], content_length=0))
            elif what == "chunked":
                await stream.send_all(http1.response_head(200, [(b"content-type", b"application/json")], chunked=True)
                                      + http1.chunk(b'{"chunked":') + http1.chunk(b"true}") + http1.LAST_CHUNK)
        await trio.sleep_forever()
    return serve


@asynccontextmanager
async def gateway(engines: list[Engine], *, upstream_timeout: float = 600, max_attempts: int = 2,
                  ) -> AsyncIterator[tuple[Gateway, list[str], int]]:
    async with trio.open_nursery() as nursery:
        urls = [f"http://127.0.0.1:{await serve_tcp(nursery, e)}" for e in engines]
        hub = RelayHub()
        await nursery.start(hub.run)
        reactor = Reactor()
        await nursery.start(reactor.run)
        gw = Gateway(GatewaySettings(upstream_timeout=Duration(upstream_timeout), max_attempts=max_attempts),
                     GatewayMetrics(ServerMetrics(lambda: {}).registry), relay_hub=hub,
                     client_door=lambda request: True)
        gw.configure([Model(name="chat")], [StaticEndpoint(model="chat", url=url) for url in urls])
        nursery.start_soon(gw.run_disconnect_watchdog)
        await trio.testing.wait_all_tasks_blocked()
        server = HttpServer(gw.handle, lane=FastPath(GatewayLane(gw, reactor)))
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(server.serve, listeners)
        port = listeners[0].socket.getsockname()[1]
        # one request to each engine on a connection its pool keeps: the lane's from now on
        for url in urls:
            response = await gw.upstream(url).request(b"POST", b"/v1/chat/completions", [], b"{}", head_timeout=10)
            assert response.status == 200 and await response.read(10) == b'{"first":true}'
            assert len(gw.upstream(url)._idle) == 1
        yield gw, urls, port
        nursery.cancel_scope.cancel()
    await gw.aclose()


def lane(gw: Gateway, outcome: str) -> float:
    return gw.metrics.fast_lane.values.get(("chat", outcome), 0.0)


async def test_a_plain_request_is_answered_in_the_lane_and_counted_as_the_task_path_counts() -> None:
    async with gateway([engine("ok")]) as (gw, _, port):
        before = gw.metrics.requests.values.get(("chat", "200"), 0.0)
        assert await exchange(port) == (200, b'{"n":2}')
        assert lane(gw, "answered") == 1
        assert gw.metrics.requests.values[("chat", "200")] == before + 1
        assert gw.routes["chat"].gate.in_flight == 0 and gw._attempts == {}


async def test_no_head_within_upstream_timeout_is_a_504_from_the_lane(autojump_clock: trio.testing.MockClock) -> None:
    async with gateway([engine("hang")], upstream_timeout=5, max_attempts=1) as (gw, _, port):
        start = trio.current_time()
        with trio.fail_after(60):
            assert (await exchange(port))[0] == 504
        assert 5 <= trio.current_time() - start <= 6
        assert lane(gw, "resumed") >= 1 and gw._attempts == {} and gw.routes["chat"].gate.in_flight == 0


async def test_an_engine_evicted_while_the_lane_waits_moves_the_request(autojump_clock: trio.testing.MockClock) -> None:
    async with gateway([engine("hang"), engine(*["ok"] * 50)]) as (gw, urls, port):
        status: list[int] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                while urls[0] not in gw._attempts:  # until a request waits on the hung engine
                    nursery.start_soon(lambda: _append(status, port))
                    await trio.testing.wait_all_tasks_blocked()
                for _ in range(GatewaySettings().health_failures):
                    gw.routes["chat"].balancer.health(urls[0], trio.current_time(), ok=False)
                assert gw._evict(urls[0], "failing its health checks") == 1
        assert status and set(status) == {200}
        assert gw.metrics.retries.values.get(("chat", "unhealthy")) == 1


async def _append(status: list[int], port: int) -> None:
    status.append((await exchange(port))[0])


async def test_a_503_is_retried_on_another_engine() -> None:
    async with gateway([engine(*["503"] * 20), engine(*["ok"] * 20)]) as (gw, _, port):
        retries, resumed = gw.metrics.retries.values.get(("chat", "503"), 0), lane(gw, "resumed")
        for _ in range(20):  # until the balancer sends one to the engine that answers 503
            status, _ = await exchange(port)
            assert status == 200
            if gw.metrics.retries.values.get(("chat", "503"), 0) > retries:
                break
        assert gw.metrics.retries.values[("chat", "503")] == retries + 1 and lane(gw, "resumed") == resumed + 1


async def test_a_stale_idle_connection_is_retried_on_a_new_one() -> None:
    seen: list[str] = []
    async with gateway([engine("reset", seen=seen)], max_attempts=1) as (gw, _, port):
        assert (await exchange(port))[0] == 200  # a new connection: the engine answers it as a first
        assert seen == ["reset"] and lane(gw, "resumed") >= 1


async def test_a_chunked_answer_to_a_plain_request_is_relayed_by_the_task() -> None:
    async with gateway([engine("chunked")]) as (gw, _, port):
        assert await exchange(port) == (200, b'{"chunked":true}')
        assert lane(gw, "answered") == 0 and lane(gw, "resumed") >= 1


async def test_a_client_that_hangs_up_frees_its_slot_and_the_engine_connection() -> None:
    seen: list[str] = []
    async with gateway([engine("hang", seen=seen)]) as (gw, _, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        await wait_for(lambda: seen == ["hang"], "the request at the engine")
        assert gw.routes["chat"].gate.in_flight == 1
        await client.aclose()
        await wait_for(lambda: gw.routes["chat"].gate.in_flight == 0, "the admission slot freed")
        assert lane(gw, "gone") == 1 and gw.metrics.requests.values.get(("chat", "499")) == 1 and gw._attempts == {}


async def test_a_bug_in_the_lane_costs_the_request_nothing(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the lane")

    async with gateway([engine("ok", "ok")]) as (gw, _, port):
        monkeypatch.setattr(fastlane, "relay_headers", broken)
        with caplog.at_level(logging.ERROR):
            status, _ = await exchange(port)
        assert status == 200 and "fast lane failed" in caplog.text
        assert gw.routes["chat"].gate.in_flight == 0


async def test_an_engine_that_answers_before_taking_the_whole_body_is_not_reused() -> None:
    """An early answer (a 413 on the head alone) leaves part of our request unsent: the connection
    must not carry that leftover into the next request."""
    conns: list[int] = []

    async def early(stream: trio.SocketStream) -> None:
        conns.append(1)
        buf = bytearray()
        if await read_request(stream, buf) is None:  # the warm-up request, read whole
            return
        await stream.send_all(ok(b'{"first":true}'))
        while http1.find_head_end(buf) < 0:
            buf += await stream.receive_some(65536)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # so that our write stops part way
        await stream.send_all(http1.response_head(413, [(b"content-type", b"application/json")],
                                                  content_length=2) + b"{}")
        await trio.sleep_forever()  # never reads the body

    async with gateway([early]) as (gw, _, port):
        body = b'{"model":"chat","pad":"' + b"x" * (900 * 1024) + b'"}'
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(body), body))
        buf = bytearray()
        while http1.find_head_end(buf) < 0:
            buf += await client.receive_some(65536)
        assert http1.parse_response_head(bytes(buf[:http1.find_head_end(buf)])).status == 413
        await client.aclose()
        assert gw.upstream(gw.routes["chat"].balancer.endpoints[0])._idle == []
        assert lane(gw, "answered") == 1  # the 413, from the lane (the engine's answer, passed on)
        assert (await exchange(port))[0] == 200 and len(conns) == 2  # a new connection


async def test_one_attempt_loop_carries_a_request_from_the_lane_into_the_task_path() -> None:
    """A 503 the lane met is retried by the task path on the very loop the lane began (issue 42:
    one state machine for both paths, not a second loop that starts over)."""
    async with gateway([engine(*["503"] * 20), engine(*["ok"] * 20)]) as (gw, urls, port):
        made: list[AttemptLoop] = []
        attempts = gw.attempts

        def recorded(*args: Any) -> AttemptLoop:
            made.append(attempts(*args))
            return made[-1]

        gw.attempts = recorded  # type: ignore[method-assign]
        for _ in range(20):  # until the balancer sends one to the engine that answers 503
            made.clear()
            assert (await exchange(port))[0] == 200
            if made[0].attempt > 1:
                break
        assert len(made) == 1, "the task path began a loop of its own"
        loop = made[0]
        assert loop.phase is Phase.DONE and loop.attempt == 2 and loop.tried == set(urls)
        assert lane(gw, "resumed") >= 1


async def test_a_bug_after_the_answer_gives_the_slot_back_once(caplog: pytest.LogCaptureFixture) -> None:
    """The answer went out, then the lane failed: nothing is redone, nothing given back twice."""
    async with gateway([engine("ok")]) as (gw, _, port):
        before = dict(gw.metrics.requests.values)
        settle = gw.settle

        def broken(*args: Any) -> None:  # the Gateway is never compiled: its methods can be wrapped
            settle(*args)
            raise RuntimeError("a bug after the answer")

        gw.settle = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR):
            assert await exchange(port) == (200, b'{"n":2}')
        assert "fast lane failed" in caplog.text
        gate = gw.routes["chat"].gate
        assert gate.in_flight == 0 and gate.core.in_flight == 0
        after = {k: v - before.get(k, 0) for k, v in gw.metrics.requests.values.items() if v != before.get(k, 0)}
        assert after == {("chat", "200"): 1}
        assert all(s.outstanding == 0 for s in gw.routes["chat"].balancer.status())
