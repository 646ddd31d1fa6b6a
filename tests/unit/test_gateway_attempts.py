"""How an upstream attempt's wait for the engine's head ends, through the real gateway
(Gateway.handle behind a real HttpServer, scripted engines on real loopback sockets), with the
gateway's timer task running as the server runs it (the attempts then wait on a Watch, no cancel
scope) and without it (cancel scopes): the head timeout answers 504, and an endpoint taken out
of rotation by its health checks moves the waiting request to another engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing

from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint
from llmgw.catalog.units import Duration
from llmgw.server.gateway.metrics import GatewayMetrics
from llmgw.server.gateway.proxy import WATCH_AFTER, Gateway
from llmgw.server.metrics import ServerMetrics
from llmgw.web import http1
from llmgw.web.relay import RelayHub
from llmgw.web.server import HttpServer
from tests.unit.loopback import serve_tcp
from tests.unit.test_web_client import ok, read_request

BODY = msgspec.json.encode({"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))


async def hung(stream: trio.SocketStream) -> None:
    await read_request(stream, bytearray())
    await trio.sleep_forever()  # reads the request, never answers


async def answers(stream: trio.SocketStream) -> None:
    buf = bytearray()
    while await read_request(stream, buf) is not None:
        await stream.send_all(ok(b"{}"))


@asynccontextmanager
async def gateway(engines: list, *, ticking: bool,
                  upstream_timeout: float = 600) -> AsyncIterator[tuple[Gateway, list[str], int]]:
    async with trio.open_nursery() as nursery:
        urls = [f"http://127.0.0.1:{await serve_tcp(nursery, engine)}" for engine in engines]
        hub = RelayHub()
        await nursery.start(hub.run)
        gw = Gateway(GatewaySettings(upstream_timeout=Duration(upstream_timeout), max_attempts=1),
                     GatewayMetrics(ServerMetrics(lambda: {}).registry),
                     relay_hub=hub, client_door=lambda request: True)
        gw.configure([Model(name="chat")], [StaticEndpoint(model="chat", url=url) for url in urls])
        if ticking:
            nursery.start_soon(gw.run_disconnect_watchdog)
            await trio.testing.wait_all_tasks_blocked()
        server = HttpServer(gw.handle)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(server.serve, listeners)
        yield gw, urls, listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()
    await gw.aclose()


async def exchange(port: int) -> tuple[int, bytes]:
    """One request on a new connection: the answer's status and (de-chunked) body."""
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await client.send_all(REQUEST)
    buf = bytearray()
    while (end := http1.find_head_end(buf)) < 0:
        data = await client.receive_some(65536)
        assert data, "closed before a response head"
        buf += data
    head = http1.parse_response_head(bytes(buf[:end]))
    del buf[:end]
    if head.chunked:
        decoder = http1.ChunkedDecoder()
        decoder.feed(buf)
        while not decoder.done:
            buf += await client.receive_some(65536)
            decoder.feed(buf)
        body = bytes(decoder.body)
    else:
        while len(buf) < (head.content_length or 0):
            buf += await client.receive_some(65536)
        body = bytes(buf)
    await client.aclose()
    return head.status, body


async def ask(port: int) -> int:
    return (await exchange(port))[0]


@pytest.mark.parametrize("ticking", [True, False])
async def test_no_head_within_upstream_timeout_is_a_504(ticking: bool, autojump_clock: trio.testing.MockClock) -> None:
    async with gateway([hung], ticking=ticking, upstream_timeout=5) as (gw, _, port):
        start = trio.current_time()
        with trio.fail_after(60):
            assert await ask(port) == 504
        # Not exact: the mock clock may also jump (to the timer task's next tick) while a byte is
        # in the kernel on its way; never fired would be the 60 s above.
        assert 5 <= trio.current_time() - start <= 5 + 10 * WATCH_AFTER
        assert gw._attempts == {}


@pytest.mark.parametrize("ticking", [True, False])
async def test_an_endpoint_out_of_rotation_moves_its_waiting_request(ticking: bool,
                                                                     autojump_clock: trio.testing.MockClock) -> None:
    async with gateway([hung, answers], ticking=ticking) as (gw, urls, port):
        status: list[int] = []

        async def client() -> None:
            status.append(await ask(port))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                # until the request waits on the hung engine (the balancer may pick either first)
                while True:
                    nursery.start_soon(client)
                    await trio.testing.wait_all_tasks_blocked()
                    if urls[0] in gw._attempts:
                        break
                    await trio.sleep(1)  # ok: MockClock (autojump) time, paces the next client only
                # as the health checks do: out of rotation first (no new request goes there), then
                # the attempts waiting on it are evicted
                for _ in range(GatewaySettings().health_failures):
                    gw.routes["chat"].balancer.health(urls[0], trio.current_time(), ok=False)
                assert gw._evict(urls[0], "failing its health checks") >= 1
        assert status[-1] == 200 and set(status) == {200}
        assert gw._attempts == {}


async def slams(stream: trio.SocketStream) -> None:
    await read_request(stream, bytearray())
    await stream.aclose()  # reads the request and hangs up: the engine died mid-request


async def test_an_engine_that_fails_an_attempt_is_counted_by_its_breaker(
    autojump_clock: trio.testing.MockClock
) -> None:
    """The attempt's outcome reaches the balancer and the endpoint's breaker (issue 22's planted
    bug, caught until issue 37 only by the e2e kill test): a failure counts, a success resets."""
    async with gateway([slams], ticking=True) as (gw, urls, port):
        breaker = gw.routes["chat"].balancer.breaker(urls[0])
        with trio.fail_after(60):
            assert await ask(port) == 502
        assert breaker.consecutive_failures == 1
        assert gw._attempts == {}
