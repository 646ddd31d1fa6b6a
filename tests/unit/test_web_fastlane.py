"""The public port's fast lane (llmgw.web.fastserve on llmgw.web.reactor), on real loopback sockets.

Two parts. Every test of the task path (tests/unit/test_web_server.py) runs again here with a
lane in front that declines every request, so each one goes reactor -> task -> reactor: what
the server promised before (pipelining, timeouts, slow clients, a TLS hello on the plain port,
draining) must hold with the lane there. Then the lane's own behaviour, with a toy lane that
answers /fast at once, holds /later until the test answers, and hands /resume to the task.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio

import tests.unit.test_web_server as base
from llmgw.web.fastserve import Exchange, FastPath
from llmgw.web.reactor import Reactor
from llmgw.web.server import HttpServer, Limits, Request, Responder
from tests.unit.loopback import DEADLINE, wait_for
from tests.unit.test_web_server import *  # noqa: F403  (the task path's tests, collected again here)
from tests.unit.test_web_server import App, Client, get, post


class ToyLane:
    def __init__(self, reactor: Reactor, *, decline_all: bool = False) -> None:
        self.reactor = reactor
        self.decline_all = decline_all
        self.offered: list[str] = []
        self.held: list[Exchange] = []
        self.gone: list[str] = []
        self.big: Exchange | None = None

    def offer(self, request: Request, exchange: Exchange) -> bool:
        self.offered.append(request.path)
        if self.decline_all or not request.path.startswith(("/fast", "/later", "/resume", "/big")):
            return False
        exchange.on_gone = lambda: self.gone.append(request.path)
        if request.path == "/fast":
            exchange.respond(200, [(b"x-lane", b"fast")], b"fast:" + request.body)
        elif request.path == "/big":
            self.big = exchange
            exchange.respond(200, [], b"x" * (4 * 1024 * 1024))
        elif request.path == "/later":
            self.held.append(exchange)
        else:
            async def rest(responder: Responder) -> None:
                await trio.lowlevel.checkpoint()
                await responder.respond(200, [(b"x-lane", b"resumed")], b"resumed")
            exchange.resume(rest)
        return True


@asynccontextmanager
async def lane_serving(app: App, limits: Limits | None = None, *, decline_all: bool = False,
                       ) -> AsyncIterator[tuple[HttpServer, int, ToyLane]]:
    reactor = Reactor()
    lane = ToyLane(reactor, decline_all=decline_all)
    server = HttpServer(app, limits=limits, lane=FastPath(lane))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)
        await nursery.start(server.serve, listeners)
        yield server, port, lane
        nursery.cancel_scope.cancel()


@pytest.fixture(autouse=True)
def _declining_lane_in_front(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The task path's tests, collected into this module, get a server with a lane."""
    @asynccontextmanager
    async def serving(app: App, limits: Limits | None = None) -> AsyncIterator[tuple[HttpServer, int]]:
        async with lane_serving(app, limits, decline_all=True) as (server, port, _):
            yield server, port
    monkeypatch.setattr(base, "serving", serving)
    yield


async def test_the_declined_requests_were_offered_to_the_lane_first() -> None:
    app = App()
    async with lane_serving(app, decline_all=True) as (_, port, lane):
        client = await Client.open(port)
        await client.send(get("/a") + post("/b", b"x"))
        for _ in range(2):
            head, _ = await client.response()
            assert head.status == 200
        await client.aclose()
    assert lane.offered == ["/a", "/b"] and app.calls == ["/a", "/b"]


async def test_drain_lets_a_connection_idle_in_the_reactor_bring_one_more_request_to_the_lane() -> None:
    """The lane's side of drain: a keep-alive connection waiting in the reactor when drain begins
    may still bring a request within drain_idle; the lane answers it with `connection: close`."""
    app = App()
    async with lane_serving(app) as (server, port, lane):
        client = await Client.open(port)
        await client.send(post("/fast", b"1"))
        head, _ = await client.response()
        assert head.get(b"x-lane") == b"fast" and not head.close
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.drain, DEADLINE)
            await wait_for(lambda: server.draining, "drain begun")
            await client.send(post("/fast", b"2"))
            head, body = await client.response()
            assert head.get(b"x-lane") == b"fast" and body == b"fast:2" and head.close
            assert await client.closed()
    assert lane.offered == ["/fast", "/fast"] and app.calls == []


async def test_pipelined_requests_are_answered_in_order_across_lane_task_and_resume() -> None:
    app = App()
    async with lane_serving(app) as (_, port, _lane):
        client = await Client.open(port)
        await client.send(post("/fast", b"1") + get("/task") + post("/resume", b"") + post("/fast", b"2"))
        answers = [await client.response() for _ in range(4)]
        await client.aclose()
    assert [body for _, body in answers[:1]] == [b"fast:1"]
    assert base.echoed(answers[1][1])["path"] == "/task"
    assert answers[2][0].get(b"x-lane") == b"resumed" and answers[2][1] == b"resumed"
    assert answers[3][1] == b"fast:2"
    assert app.calls == ["/task"]  # the lane's requests never reached the handler


async def test_a_body_sent_after_its_head_is_waited_for_in_the_lane() -> None:
    """The OpenAI SDK (httpx) writes the head and the body separately: the lane must not hand
    every SDK request to the task path for that."""
    app = App()
    async with lane_serving(app, Limits(body_timeout=5.0)) as (server, port, lane):
        client = await Client.open(port)
        request = post("/fast", b"the body")
        await client.send(request[:-8])
        await wait_for(lambda: server.head_bytes_scanned > 0, "the head seen")
        await client.send(request[-8:-4])
        await client.send(request[-4:])
        head, body = await client.response()
        assert head.get(b"x-lane") == b"fast" and body == b"fast:the body"
        await client.aclose()
    assert app.calls == [] and lane.offered == ["/fast"]


async def test_a_body_that_never_comes_is_answered_408_after_body_timeout() -> None:
    async with lane_serving(App(), Limits(body_timeout=0.5)) as (_, port, lane):
        client = await Client.open(port)
        await client.send(post("/fast", b"0123456789")[:-5])
        head, _ = await client.response()
        assert head.status == 408 and await client.closed()
    assert lane.offered == []


async def test_a_held_request_is_answered_when_the_lane_answers_and_the_connection_goes_on() -> None:
    async with lane_serving(App()) as (server, port, lane):
        client = await Client.open(port)
        await client.send(post("/later", b""))
        await wait_for(lambda: len(lane.held) == 1, "len(lane.held) == 1")
        assert server.active_requests == 1
        lane.held[0].respond(201, [], b"late")
        head, body = await client.response()
        assert (head.status, body) == (201, b"late") and server.active_requests == 0
        await client.send(post("/fast", b"again"))
        assert (await client.response())[1] == b"fast:again"
        await client.aclose()


async def test_a_client_that_hangs_up_mid_request_is_told_to_the_lane() -> None:
    async with lane_serving(App()) as (server, port, lane):
        client = await Client.open(port)
        await client.send(post("/later", b""))
        await wait_for(lambda: len(lane.held) == 1, "len(lane.held) == 1")
        await client.aclose()
        await wait_for(lambda: lane.gone == ["/later"], "lane.gone == ['/later']")
        await wait_for(lambda: server.connections == 0 and server.active_requests == 0,
                       "server.connections == 0 and server.active_requests == 0")
        lane.held[0].respond(200, [], b"too late")  # goes nowhere, breaks nothing


async def test_the_server_stopping_mid_request_lets_the_lane_go_and_ends_the_connection() -> None:
    with trio.fail_after(DEADLINE):
        async with lane_serving(App()) as (_, port, lane):
            client = await Client.open(port)
            await client.send(post("/later", b""))
            await wait_for(lambda: len(lane.held) == 1, "len(lane.held) == 1")
        # the nursery was cancelled with the request held: serve() returned, the lane heard
    assert lane.gone == ["/later"]


async def test_a_client_flooding_bytes_behind_a_held_request_is_not_read_without_bound() -> None:
    limits = Limits(max_body=64 * 1024)
    async with lane_serving(App(), limits) as (_, port, lane):
        client = await Client.open(port)
        await client.send(post("/later", b""))
        await wait_for(lambda: len(lane.held) == 1, "len(lane.held) == 1")
        flood = post("/fast", b"y" * 60_000) * 40  # 2.4 MB behind the held one
        fast = lane.held[0]._fast
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send, flood)
            await wait_for(lambda: fast._paused, "fast._paused")  # it stopped reading, the rest waits in the kernel
            assert len(fast.conn.buf) <= limits.max_body + 2 * 65536
            lane.held[0].respond(200, [], b"held")
            assert (await client.response())[1] == b"held"
            for _ in range(40):
                head, body = await client.response()
                assert head.status == 200 and body == b"fast:" + b"y" * 60_000
        await client.aclose()


async def test_an_answer_larger_than_the_socket_buffer_is_written_as_the_client_reads() -> None:
    async with lane_serving(App()) as (_, port, _lane):
        client = await Client.open(port)
        await client.send(post("/big", b"") + post("/fast", b"after"))
        await wait_for(lambda: _lane.big is not None and bool(_lane.big._fast._out),
                       "_lane.big is not None and bool(_lane.big._fast._out)")  # the socket took only part
        head, body = await client.response()
        assert head.status == 200 and len(body) == 4 * 1024 * 1024
        assert (await client.response())[1] == b"fast:after"
        await client.aclose()


async def test_the_reactor_stopping_ends_the_connections_it_served() -> None:
    reactor = Reactor()
    lane = ToyLane(reactor)
    server = HttpServer(App(), lane=FastPath(lane))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        reactor_scope = trio.CancelScope()

        async def run_reactor(task_status: trio.TaskStatus[None]) -> None:
            with reactor_scope:
                await reactor.run(task_status=task_status)

        await nursery.start(run_reactor)
        await nursery.start(server.serve, listeners)
        client = await Client.open(port)
        await client.send(post("/later", b""))
        await wait_for(lambda: len(lane.held) == 1, "len(lane.held) == 1")
        reactor_scope.cancel()
        assert await client.closed()
        await wait_for(lambda: server.connections == 0, "server.connections == 0")
        assert lane.gone == ["/later"]
        nursery.cancel_scope.cancel()
