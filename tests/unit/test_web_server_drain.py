"""HttpServer.drain: the graceful stop the simulated engine (and a server on SIGTERM) uses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from llmgw.web.server import Handler, HttpServer, Limits, Request, Responder


async def read_all(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


def slow_app(slow: Callable[[], Awaitable[object]]) -> Handler:
    """`/slow` awaits `slow()` before its answer, `/never` never answers, the rest at once."""

    async def app(request: Request, responder: Responder) -> None:
        if request.path == "/slow":
            await slow()
        elif request.path == "/never":
            await trio.sleep_forever()
        await responder.respond(200, [(b"content-type", b"text/plain")], b"done")

    return app


async def serving(server: HttpServer, nursery: trio.Nursery) -> int:
    """Start `server` on a loopback port; returns the port."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return int(listeners[0].socket.getsockname()[1])


async def test_drain_closes_idle_connections_after_drain_idle_lets_a_request_finish_and_cuts_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    release = trio.Event()
    server = HttpServer(slow_app(release.wait))
    async with trio.open_nursery() as nursery:
        port = await serving(server, nursery)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await idle.send_all(b"GET /fast HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await idle.receive_some(65536)).endswith(b"done")  # now an idle keep-alive connection
        fresh = await trio.open_tcp_stream("127.0.0.1", port)  # connected, its request not sent yet
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        never = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
        await never.send_all(b"GET /never HTTP/1.1\r\nhost: t\r\n\r\n")
        await trio.sleep(1)  # ok: autojump MockClock; both requests reach their handler
        started = trio.current_time()
        nursery.start_soon(server.drain, 10.0)
        assert await read_all(idle) == b""  # nothing was in flight, and it brought nothing more:
        assert trio.current_time() == started + server.limits.drain_idle  # closed once drain_idle passed
        # A new connection's first request is served, with connection: close (its client was about to send).
        await fresh.send_all(b"GET /fast HTTP/1.1\r\nhost: t\r\n\r\n")
        answer = await read_all(fresh)
        assert (answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower()
                and answer.endswith(b"done"))
        release.set()
        answer = await read_all(slow)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"done")  # then closed
        with trio.move_on_after(20):
            await read_all(never)  # drain() gave up on it after the grace; it is still open
            raise AssertionError("a request in flight past the grace was closed by drain()")
        nursery.cancel_scope.cancel()  # the caller cuts what outlived the grace
    assert await read_all(never) == b""


async def test_drain_serves_the_connections_still_in_the_accept_queue(autojump_clock: trio.testing.MockClock) -> None:
    """Closing a listening socket resets what the kernel queued on it; drain() accepts those first
    and answers them. Here the server is at its cap of 1 connection, so the second waits in the
    kernel's queue when the drain begins."""
    release = trio.Event()
    server = HttpServer(slow_app(release.wait), limits=Limits(max_connections=1))
    async with trio.open_nursery() as nursery:
        port = await serving(server, nursery)
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
        await trio.sleep(1)  # ok: autojump MockClock; the slow request is in its handler
        queued = await trio.open_tcp_stream("127.0.0.1", port)  # the kernel completes the handshake
        await queued.send_all(b"GET /queued HTTP/1.1\r\nhost: t\r\n\r\n")
        await trio.sleep(1)  # ok: autojump MockClock; the server, at its cap, has not accepted it
        assert server.connections == 1
        nursery.start_soon(server.drain, 10.0)
        answer = await read_all(queued)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"done"), answer
        release.set()
        assert (await read_all(slow)).endswith(b"done")
        nursery.cancel_scope.cancel()


async def test_drain_idle_0_closes_idle_connections_at_once_and_waits_without_spinning(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """drain_idle 0 (the simulated engine's): an idle keep-alive connection is closed as the
    drain begins; a request that takes 5 s more is still answered, the expiry task sleeping
    meanwhile (were it polling a 0 s step, the clock could never jump: this test would hang)."""

    async def five_seconds() -> None:
        await trio.sleep(5)  # ok: autojump MockClock; the request takes 5 s of the fake clock

    server = HttpServer(slow_app(five_seconds), limits=Limits(drain_idle=0.0))
    async with trio.open_nursery() as nursery:
        port = await serving(server, nursery)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await idle.send_all(b"GET /fast HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await idle.receive_some(65536)).endswith(b"done")
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
        await trio.sleep(1)  # ok: autojump MockClock; the slow request is in its handler
        started = trio.current_time()
        nursery.start_soon(server.drain, 10.0)
        assert await read_all(idle) == b""
        assert trio.current_time() == started  # at once
        answer = await read_all(slow)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower()
        assert trio.current_time() - started >= 4
        nursery.cancel_scope.cancel()
