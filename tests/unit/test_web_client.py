"""llmgw.web.client.Upstream against scripted engines on real loopback sockets."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel

from llmgw.web import http1
from llmgw.web.client import Upstream, UpstreamError, Watch
from tests.unit.loopback import DEADLINE, closed_port, serve_tcp


async def read_request(stream: trio.SocketStream, buf: bytearray) -> http1.RequestHead | None:
    """One request (head and Content-Length body) from stream; None at EOF."""
    while (end := http1.find_head_end(buf)) < 0:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
    head = http1.parse_request_head(bytes(buf[:end]))
    del buf[:end]
    n = head.content_length or 0
    while len(buf) < n:
        buf += await stream.receive_some(65536)
    del buf[:n]
    return head


def ok(body: bytes) -> bytes:
    return http1.response_head(200, [(b"content-type", b"text/plain")], content_length=len(body)) + body


SSE = [b"data: {\"n\": %d}\n\n" % i for i in range(20)]
CHUNKED_BODY = b"".join(http1.chunk(e) for e in SSE) + b"0\r\nx-trailer: yes\r\n\r\n"
CHUNKED_HEAD = http1.response_head(200, [(b"content-type", b"text/event-stream")], chunked=True)


async def send_chunked_in_pieces(stream: trio.SocketStream) -> None:
    """The head, then each SSE event in its own write, as an engine streams tokens."""
    await stream.send_all(CHUNKED_HEAD)
    for e in SSE:
        await stream.send_all(http1.chunk(e))
        await trio.lowlevel.checkpoint()
    await stream.send_all(b"0\r\nx-trailer: yes\r\n\r\n")


# ---- connections: reuse, stale reuse, failures ------------------------------------------------


async def test_keep_alive_reuses_the_connection() -> None:
    conns: list[trio.SocketStream] = []
    hosts: list[bytes | None] = []

    async def engine(stream: trio.SocketStream) -> None:
        conns.append(stream)
        buf = bytearray()
        while (head := await read_request(stream, buf)) is not None:
            hosts.append(head.get(b"host"))
            await stream.send_all(ok(b"hello " + head.target))

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        for target in (b"/a", b"/b", b"/c"):
            response = await up.request(b"GET", target, [], b"", head_timeout=DEADLINE)
            assert response.status == 200
            assert await response.read(DEADLINE) == b"hello " + target
        assert len(conns) == 1  # the second and third request reused the first connection
        assert len(up._idle) == 1 and up._idle[0].reused
        assert hosts == [f"127.0.0.1:{port}".encode()] * 3
        await up.aclose()
        nursery.cancel_scope.cancel()


async def test_a_reused_connection_the_engine_closed_is_retried_once_on_a_fresh_one() -> None:
    conns = 0
    closed = 0

    async def engine(stream: trio.SocketStream) -> None:
        # answers one request as keep-alive, then closes (an engine's keep-alive timeout)
        nonlocal conns, closed
        conns += 1
        head = await read_request(stream, bytearray())
        if head is not None:
            await stream.send_all(ok(b"one"))
        await stream.aclose()
        closed += 1

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        # three idle connections: hold each response until the next request has its own
        held = [await up.request(b"GET", b"/", [], b"", head_timeout=DEADLINE) for _ in range(3)]
        for response in held:
            assert await response.read(DEADLINE) == b"one"
        assert conns == 3 and len(up._idle) == 3
        with trio.fail_after(DEADLINE):
            while closed < 3:  # noqa: ASYNC110 - a counter the engine task moves
                await trio.sleep(0.001)  # ok: poll interval of a deadline-bounded wait
        # every idle connection is stale now; one request, no error, one new connection
        response = await up.request(b"POST", b"/", [], b"x", head_timeout=DEADLINE)
        assert await response.read(DEADLINE) == b"one"
        assert conns == 4
        await up.aclose()
        nursery.cancel_scope.cancel()


async def test_connect_refused_is_a_connect_error() -> None:
    up = Upstream(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(UpstreamError) as info:
        await up.request(b"GET", b"/", [], b"", head_timeout=DEADLINE)
    assert info.value.kind == "connect"


@pytest.mark.parametrize("read_first", [True, False])
async def test_closing_before_answering_is_a_reset_and_not_retried_on_a_new_connection(read_first: bool) -> None:
    conns = 0

    async def engine(stream: trio.SocketStream) -> None:
        nonlocal conns
        conns += 1
        if read_first:
            await read_request(stream, bytearray())
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        with pytest.raises(UpstreamError) as info:
            await up.request(b"POST", b"/v1/chat/completions", [], b"{}", head_timeout=DEADLINE)
        assert info.value.kind == "reset"
        assert conns == 1
        assert up._idle == []
        nursery.cancel_scope.cancel()


async def test_closing_inside_the_head_is_a_protocol_error() -> None:
    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-le")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        with pytest.raises(UpstreamError) as info:
            await Upstream(f"http://127.0.0.1:{port}").request(b"GET", b"/", [], b"", head_timeout=DEADLINE)
        assert info.value.kind == "protocol"
        nursery.cancel_scope.cancel()


async def test_no_head_in_time_is_a_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await trio.sleep_forever()  # a hung engine: reads, never answers

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        start = trio.current_time()
        with pytest.raises(UpstreamError) as info:
            await up.request(b"GET", b"/", [], b"", head_timeout=30)
        assert info.value.kind == "timeout"
        assert trio.current_time() - start == pytest.approx(30, abs=0.1)
        assert up._idle == []
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("why", ["timeout", "evicted"])
async def test_a_fired_watch_ends_the_wait_for_the_head_and_the_connection(
    why: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The gateway's way (no cancel scope): whoever owns the watch fires it, the task blocked on
    the engine socket wakes at once, and the connection is closed, never pooled."""
    engine_saw_close = trio.Event()

    async def engine(stream: trio.SocketStream) -> None:
        buf = bytearray()
        await read_request(stream, buf)
        assert await stream.receive_some(65536) == b""  # the gateway closed its side
        engine_saw_close.set()

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        watch = Watch()

        async def owner() -> None:
            await trio.sleep(7)  # ok: MockClock (autojump): the owner fires at virtual t=7, what the test measures
            watch.fire(why)

        nursery.start_soon(owner)
        start = trio.current_time()
        with pytest.raises(UpstreamError) as info, trio.fail_after(60):  # a wait the fire missed fails here
            await up.request(b"POST", b"/", [], b"{}", head_timeout=7, watch=watch)
        assert info.value.kind == why
        assert trio.current_time() - start == pytest.approx(7, abs=0.1)  # no scope of its own: the owner's time
        assert up._idle == [] and watch.fd == -1
        with trio.fail_after(DEADLINE):
            await engine_saw_close.wait()
        # fired before the exchange (while connecting, say): it ends before sending anything
        with pytest.raises(UpstreamError) as info:
            await up.request(b"POST", b"/", [], b"{}", head_timeout=7, watch=watch)
        assert info.value.kind == why and up._idle == []
        nursery.cancel_scope.cancel()


async def test_a_watch_that_never_fires_leaves_the_connection_pooled() -> None:
    async def engine(stream: trio.SocketStream) -> None:
        buf = bytearray()
        while await read_request(stream, buf) is not None:
            await stream.send_all(ok(b"fine"))

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        for _ in range(2):
            watch = Watch()
            response = await up.request(b"POST", b"/", [], b"{}", head_timeout=DEADLINE, watch=watch)
            assert response.complete_body() == b"fine" and watch.fd == -1
            watch.fire("evicted")  # after the exchange: touches nothing
            assert len(up._idle) == 1
        await up.aclose()
        nursery.cancel_scope.cancel()


async def test_interim_responses_are_skipped() -> None:
    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(http1.CONTINUE + b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + ok(b"final"))

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        response = await Upstream(f"http://127.0.0.1:{port}").request(b"GET", b"/", [], b"", head_timeout=DEADLINE)
        assert response.status == 200 and await response.read(DEADLINE) == b"final"
        nursery.cancel_scope.cancel()


# ---- bodies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["length", "chunked", "close", "no-body"])
async def test_bodies_of_every_framing_are_read_and_the_connection_pooled_when_it_can_be(framing: str) -> None:
    body = b"x" * 100_000 + b"end"

    async def engine(stream: trio.SocketStream) -> None:
        buf = bytearray()
        while await read_request(stream, buf) is not None:
            if framing == "length":
                await stream.send_all(ok(body))
            elif framing == "chunked":
                await stream.send_all(http1.response_head(200, chunked=True))
                for i in range(0, len(body), 7000):
                    await stream.send_all(http1.chunk(body[i : i + 7000]))
                await stream.send_all(http1.LAST_CHUNK)
            elif framing == "no-body":
                await stream.send_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            else:  # HTTP/1.0: the body ends when the connection does
                await stream.send_all(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\n")
                for i in range(0, len(body), 7000):
                    await stream.send_all(body[i : i + 7000])
                await stream.aclose()
                return

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        response = await up.request(b"GET", b"/", [], b"", head_timeout=DEADLINE)
        got = await response.read(DEADLINE)
        assert got == (b"" if framing == "no-body" else body)
        assert len(up._idle) == (0 if framing == "close" else 1)
        nursery.cancel_scope.cancel()


async def test_a_bad_chunked_body_is_a_protocol_error_and_the_connection_is_dropped() -> None:
    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(http1.response_head(200, chunked=True) + b"5\r\nhelloXX0\r\n\r\n")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        response = await up.request(b"GET", b"/", [], b"", head_timeout=DEADLINE)
        with pytest.raises(UpstreamError) as info:
            await response.read(DEADLINE)
        assert info.value.kind == "protocol"
        assert up._idle == []
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_a_body_over_the_limit_is_too_large_and_no_more_than_the_limit_is_held(framing: str) -> None:
    """The engine offers 64 MiB (of which it declares all, or nothing); a 1 MiB limit stops
    the read at once (declared) or within one read past the limit, and drops the connection."""
    limit = 1 << 20
    piece = b"x" * 65536
    total = 64 << 20

    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        if framing == "length":
            await stream.send_all(http1.response_head(200, content_length=total))
        elif framing == "chunked":
            await stream.send_all(http1.response_head(200, chunked=True))
        else:
            await stream.send_all(b"HTTP/1.0 200 OK\r\n\r\n")
        try:
            for _ in range(total // len(piece)):
                await stream.send_all(http1.chunk(piece) if framing == "chunked" else piece)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        response = await up.request(b"GET", b"/", [], b"", head_timeout=DEADLINE)
        conn = response._conn
        raw = conn.raw

        class CountingRaw:
            """The socket as the response reads it, counting what it took in."""

            async def recv(self) -> bytes:
                nonlocal received
                data = await raw.recv()
                received += len(data)
                return data

        conn.raw = CountingRaw()  # type: ignore[assignment]
        received = len(conn.buf)  # what came in with the head
        with pytest.raises(UpstreamError) as info:
            await response.read(DEADLINE, limit=limit)
        assert info.value.kind == "too_large"
        assert str(limit) in str(info.value)
        if framing == "length":
            assert received < 65536  # the declared length alone was enough: no read of the body
            assert "declared 67108864" in str(info.value)
        else:
            # What was read from the socket: the limit, one read past it, chunk size lines.
            assert limit < received <= limit + 2 * 65536 + 1024, received
        assert up._idle == []  # the connection is dropped, not reused
        nursery.cancel_scope.cancel()


async def test_a_body_within_the_limit_is_read_whole() -> None:
    body = b"y" * 5000

    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(http1.response_head(200, chunked=True) + http1.chunk(body) + http1.LAST_CHUNK)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        response = await up.request(b"GET", b"/", [], b"", head_timeout=DEADLINE)
        assert await response.read(DEADLINE, limit=len(body)) == body
        nursery.cancel_scope.cancel()


def test_the_fast_lane_post_is_byte_for_byte_the_request_the_task_path_sends() -> None:
    up = Upstream("http://127.0.0.1:9")
    for key in ("", "sk-engine"):
        up.set_api_key(key)
        for accept in (None, b"application/json"):
            headers = [(b"content-type", b"application/json"), (b"x-request-id", b"rid-1")]
            if accept:
                headers.append((b"accept", accept))
            for _ in range(2):  # built, then from the cache
                assert up.post_bytes(b"/v1/chat/completions", b"rid-1", accept, b"{}") == up.request_bytes(
                    b"POST", b"/v1/chat/completions", headers, b"{}")
    for i in range(40):  # targets the client chose: the cache stays small
        up.post_bytes(b"/v1/completions?x=%d" % i, b"r", None, b"")
    assert len(up._post_prefix) <= 16
