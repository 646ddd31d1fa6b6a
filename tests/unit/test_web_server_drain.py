"""HttpServer.drain: the graceful stop the simulated engine (and a server on SIGTERM) uses."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.web.server import HttpServer, Request, Responder


async def read_all(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


async def test_drain_closes_idle_connections_lets_a_request_finish_and_cuts_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    release = trio.Event()

    async def app(request: Request, responder: Responder) -> None:
        if request.path == "/slow":
            await release.wait()
        elif request.path == "/never":
            await trio.sleep_forever()
        await responder.respond(200, [(b"content-type", b"text/plain")], b"done")

    server = HttpServer(app)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listeners)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        never = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
        await never.send_all(b"GET /never HTTP/1.1\r\nhost: t\r\n\r\n")
        await trio.sleep(1)  # ok: autojump MockClock; both requests reach their handler
        started = trio.current_time()
        nursery.start_soon(server.drain, 10.0)
        assert await read_all(idle) == b""  # closed at once: nothing was in flight
        assert trio.current_time() == started
        release.set()
        answer = await read_all(slow)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"done")  # then closed
        with trio.move_on_after(20):
            await read_all(never)  # drain() gave up on it after the grace; it is still open
            raise AssertionError("a request in flight past the grace was closed by drain()")
        nursery.cancel_scope.cancel()  # the caller cuts what outlived the grace
    assert await read_all(never) == b""
