"""llmgw.web.relay.relay_body, the one seam between an engine's chunked answer and a client,
against scripted engines on real loopback sockets. Every behaviour runs on each path the seam
can choose: spliced by the relay hub (plain socket, epoll), in the request's own task (a sink
with no fd: TLS, HTTP/1.0), and in its own task because there is no epoll (the hub built as
on a platform without it), so the two relay loops cannot drift apart unnoticed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from llmgw.web import http1, relayhub
from llmgw.web.client import Upstream, UpstreamError
from llmgw.web.rawio import RawSocket, Sink
from llmgw.web.relay import RelayHub, relay_body
from llmgw.web.server import ClientGone
from tests.unit.loopback import DEADLINE, recv_exactly, serve_tcp, tcp_pair
from tests.unit.test_web_client import (
    CHUNKED_BODY,
    CHUNKED_HEAD,
    SSE,
    read_request,
    send_chunked_in_pieces,
)

PATHS = ["splice", "task", "no-epoll"]


class SinkResponder:
    """The part of a Responder the seam uses: where the chunked body goes."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def chunked_body_sink(self) -> Sink:
        return self.sink


class SendSink:
    """A sink with no fd (as TLS or a re-framing responder): the seam relays in the task."""

    fd = None

    def __init__(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        self.send_all = send


@asynccontextmanager
async def running_hub(path: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RelayHub]:
    if path == "no-epoll":
        monkeypatch.setattr(relayhub, "_epoll", None)  # as imported where select has no epoll
    hub = RelayHub()
    assert hub.splices == (path != "no-epoll")
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        yield hub
        nursery.cancel_scope.cancel()


def responder_for(path: str, sock: trio.socket.SocketType) -> SinkResponder:
    raw = RawSocket(sock)
    return SinkResponder(SendSink(raw.send_all) if path == "task" else raw)


@pytest.mark.parametrize("path", PATHS)
async def test_the_body_is_relayed_byte_for_byte_and_the_connection_reused(path: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async def engine(stream: trio.SocketStream) -> None:
        buf = bytearray()
        while await read_request(stream, buf) is not None:
            await send_chunked_in_pieces(stream)

    async with running_hub(path, monkeypatch) as hub, trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        hub_side, client = await tcp_pair()
        for _ in range(2):  # the second stream on the same, reused connection
            response = await up.request(b"POST", b"/v1/chat/completions", [], b"{}", head_timeout=DEADLINE)
            firsts: list[int] = []
            got: list[bytes] = []

            async def read_client(got: list[bytes] = got) -> None:
                got.append(await recv_exactly(client, len(CHUNKED_BODY)))

            async with trio.open_nursery() as inner:
                inner.start_soon(read_client)
                await relay_body(response, responder_for(path, hub_side), hub, DEADLINE,
                                 on_first=lambda firsts=firsts: firsts.append(1))
            assert got == [CHUNKED_BODY]
            assert firsts == [1] and response.chunks == len(SSE)
            assert len(up._idle) == 1
        assert hub.streams == (2 if path == "splice" else 0)
        assert hub._by_fd == {}
        hub_side.close()
        client.close()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("path", PATHS)
async def test_a_broken_engine_is_told_from_a_silent_one(path: str, monkeypatch: pytest.MonkeyPatch,
                                                         autojump_clock: trio.testing.MockClock) -> None:
    async def engine(stream: trio.SocketStream) -> None:
        head = await read_request(stream, bytearray())
        assert head is not None
        await stream.send_all(CHUNKED_HEAD + http1.chunk(b"data: 1\n\n"))
        if head.target == b"/silent":
            await trio.sleep_forever()
        if head.target == b"/bad":
            await stream.send_all(b"0x5\r\nhello\r\n")
            await trio.sleep_forever()
        await stream.aclose()

    async with running_hub(path, monkeypatch) as hub, trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        hub_side, _client = await tcp_pair()
        for target, kind in ((b"/broken", "protocol"), (b"/bad", "protocol"), (b"/silent", "timeout")):
            response = await up.request(b"POST", target, [], b"{}", head_timeout=DEADLINE)
            with pytest.raises(UpstreamError) as info:
                await relay_body(response, responder_for(path, hub_side), hub, 20.0)
            assert info.value.kind == kind, info.value
            assert up._idle == [] and hub._by_fd == {}
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("path", PATHS)
async def test_a_client_that_went_away_is_client_gone_and_the_engine_connection_closed(
    path: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(CHUNKED_HEAD)
        while True:
            await stream.send_all(http1.chunk(b"data: %s\n\n" % (b"x" * 1000)))
            await trio.sleep(0.001)  # ok: paces the engine; the client is gone, the relay must notice

    async with running_hub(path, monkeypatch) as hub, trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        hub_side, client = await tcp_pair()
        client.close()
        response = await up.request(b"POST", b"/", [], b"{}", head_timeout=DEADLINE)
        with trio.fail_after(DEADLINE), pytest.raises(ClientGone):
            await relay_body(response, responder_for(path, hub_side), hub, DEADLINE)
        assert up._idle == [] and hub._by_fd == {}
        nursery.cancel_scope.cancel()


async def test_a_client_that_takes_no_chunk_for_the_idle_timeout_is_cut(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock,
) -> None:
    """The idle timeout firing inside a write used to restart the loop with the same data:
    the chunk was scanned and written a second time after a partial first write. (The hub's
    side of this, a parked client, is in test_web_relayhub.)"""

    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(CHUNKED_HEAD)
        for e in SSE:
            await stream.send_all(http1.chunk(e))
            await trio.sleep(1)  # ok: virtual time (autojump_clock), paces the engine
        await stream.send_all(http1.LAST_CHUNK)

    async with running_hub("task", monkeypatch) as hub, trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        response = await up.request(b"POST", b"/", [], b"{}", head_timeout=DEADLINE)
        writes: list[bytes] = []

        async def send(data: bytes) -> None:
            writes.append(data)
            if len(writes) == 3:
                await trio.sleep(1000)  # ok: virtual time; a client that stopped reading

        with pytest.raises(ClientGone, match="read nothing for 20s"):
            await relay_body(response, SinkResponder(SendSink(send)), hub, 20.0)
        assert writes == [http1.chunk(e) for e in SSE[:3]]
        assert up._idle == []
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("path", PATHS)
async def test_bytes_past_the_end_of_the_body_cost_the_connection(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def engine(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(CHUNKED_HEAD + http1.chunk(b"data: 1\n\n") + http1.LAST_CHUNK + b"HTTP/1.1 200 OK\r\n")
        await trio.sleep_forever()

    async with running_hub(path, monkeypatch) as hub, trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        up = Upstream(f"http://127.0.0.1:{port}")
        hub_side, client = await tcp_pair()
        response = await up.request(b"POST", b"/", [], b"{}", head_timeout=DEADLINE)
        with trio.fail_after(DEADLINE):
            await relay_body(response, responder_for(path, hub_side), hub, DEADLINE)
        assert await recv_exactly(client, len(http1.chunk(b"data: 1\n\n") + http1.LAST_CHUNK)) == \
            http1.chunk(b"data: 1\n\n") + http1.LAST_CHUNK
        assert up._idle == []
        nursery.cancel_scope.cancel()
