"""Which way a streamed answer takes through the real gateway (Gateway.handle behind a real
HttpServer, a scripted engine, real loopback sockets and real TLS): the relay hub splices a
plain HTTP/1.1 client's stream; a TLS client, an HTTP/1.0 client and a gateway without epoll
get theirs relayed in the request's own task. Each gets the engine's events intact, whichever
way, and a relay hub started with nursery.start serves the very first request."""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import trio

from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint
from llmgw.server.gateway.metrics import GatewayMetrics
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.metrics import ServerMetrics
from llmgw.tls import ca as store
from llmgw.tls import client_context, server_context
from llmgw.web import http1, relayhub
from llmgw.web.relay import RelayHub
from llmgw.web.server import HttpServer
from tests.unit.loopback import DEADLINE, serve_tcp
from tests.unit.test_web_client import CHUNKED_HEAD, SSE, read_request

BODY = msgspec.json.encode({"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    store.init_ca(root, now=time.time())
    store.issue_server(root, hosts=["localhost"], ips=["127.0.0.1"], now=time.time())
    return root


async def engine(stream: trio.SocketStream) -> None:
    """Streams SSE events in chunked coding, one write per event, keep-alive."""
    buf = bytearray()
    while await read_request(stream, buf) is not None:
        await stream.send_all(CHUNKED_HEAD)
        for e in SSE:
            await stream.send_all(http1.chunk(e))
            await trio.lowlevel.checkpoint()
        await stream.send_all(http1.LAST_CHUNK)


@asynccontextmanager
async def gateway(tls: ssl.SSLContext | None = None) -> AsyncIterator[tuple[RelayHub, int]]:
    hub = RelayHub()
    async with trio.open_nursery() as nursery:
        engine_port = await serve_tcp(nursery, engine)
        await nursery.start(hub.run)  # as the server does: ready before the public port opens
        gw = Gateway(GatewaySettings(), GatewayMetrics(ServerMetrics(lambda: {}).registry),
                     relay_hub=hub, client_door=lambda request: True)
        gw.configure([Model(name="chat")], [StaticEndpoint(model="chat", url=f"http://127.0.0.1:{engine_port}")])
        server = HttpServer(gw.handle, ssl_context=tls)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(server.serve, listeners)
        yield hub, listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()
    await gw.aclose()


async def exchange(stream: trio.abc.Stream, request: bytes, *, until_close: bool = False) -> tuple[http1.ResponseHead,
                                                                                                   bytes]:
    """Send one request; the response head and its body (chunked coding decoded, or up to EOF)."""
    await stream.send_all(request)
    buf = bytearray()
    with trio.fail_after(DEADLINE):
        while (end := http1.find_head_end(buf)) < 0:
            data = await stream.receive_some(65536)
            assert data, f"closed before a response head: {bytes(buf)!r}"
            buf += data
        head = http1.parse_response_head(bytes(buf[:end]))
        del buf[:end]
        if until_close:
            while data := await stream.receive_some(65536):
                buf += data
            return head, bytes(buf)
        decoder = http1.ChunkedDecoder()
        decoder.feed(buf)
        while not decoder.done:
            data = await stream.receive_some(65536)
            assert data, "closed inside a chunked body"
            buf += data
            decoder.feed(buf)
        return head, bytes(decoder.body)


def post(version: bytes = b"HTTP/1.1") -> bytes:
    return (b"POST /v1/chat/completions %s\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: "
            b"%d\r\n\r\n%s"
            % (version, len(BODY), BODY))


async def test_a_plain_http11_stream_is_spliced_by_the_hub_from_the_first_request() -> None:
    async with gateway() as (hub, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        for n in (1, 2):  # keep-alive: the second stream on the same client connection
            head, body = await exchange(client, post())
            assert head.status == 200 and head.chunked and body == b"".join(SSE)
            assert hub.streams == n
        await client.aclose()


async def test_a_tls_stream_is_relayed_in_its_task(pki: Path) -> None:
    tls = server_context(str(pki / "server.crt"), str(pki / "server.key"), alpn=("http/1.1",))
    async with gateway(tls) as (hub, port):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        client = trio.SSLStream(tcp, client_context(str(pki / "ca.crt"), alpn=("http/1.1",)),
                                server_hostname="127.0.0.1")
        for _ in range(2):
            head, body = await exchange(client, post())
            assert head.status == 200 and head.chunked and body == b"".join(SSE)
        assert hub.streams == 0  # the hub never wrote TLS records' worth of plaintext to the socket
        await client.aclose()


async def test_an_http10_stream_is_unframed_in_its_task_and_ends_with_the_connection() -> None:
    async with gateway() as (hub, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        head, body = await exchange(client, post(b"HTTP/1.0"), until_close=True)
        assert head.status == 200 and not head.chunked and head.close
        assert body == b"".join(SSE)  # no chunk framing: an HTTP/1.0 client cannot read it
        assert hub.streams == 0
        await client.aclose()


async def test_without_epoll_a_plain_stream_is_relayed_in_its_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relayhub, "_epoll", None)  # as imported where select has no epoll
    async with gateway() as (hub, port):
        assert not hub.splices
        client = await trio.open_tcp_stream("127.0.0.1", port)
        for _ in range(2):
            head, body = await exchange(client, post())
            assert head.status == 200 and head.chunked and body == b"".join(SSE)
        assert hub.streams == 0
        await client.aclose()
