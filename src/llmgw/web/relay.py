"""The one seam between an upstream response and a client: `relay_body` relays an engine's
chunked body to the responder that started the client's answer, and alone chooses how.

- **Spliced by the hub** (llmgw.web.relayhub): plain TCP to an HTTP/1.1 client, where epoll
  exists. The bytes go from the engine socket to the client socket untouched, through one
  task for every stream (the per-token cost is the read, the framing scan and the write).
- **In the request's own task**: a TLS client (the socket carries records, not the stream's
  bytes), an HTTP/1.0 client or a HEAD request (the responder re-frames or drops the body),
  and every stream where there is no epoll. One read, one scan, one write per pass.

Both paths share the framing scanner, the idle timeout (engine silent, or client not taking a
write, for `idle_timeout`), `on_first` (called once the first data byte passes) and the
error vocabulary (RelayError), mapped here once: an engine that breaks, misframes or goes
silent is an UpstreamError; a client that went away or stopped reading is ClientGone. Either
way, and on a cancel, the engine connection is closed; a body relayed to its end hands it back
to the pool. The hub is created before the first request (its task started with
`nursery.start`) and passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio

from llmgw.web.client import Response, UpstreamError
from llmgw.web.http1 import ChunkedScanner, HttpError
from llmgw.web.rawio import ByteStream, Sink
from llmgw.web.relayhub import RelayError, RelayHub
from llmgw.web.server import ClientGone

__all__ = ["ChunkedResponder", "RelayHub", "relay_body"]


class ChunkedResponder(Protocol):
    """A responder whose chunked answer has started (llmgw.web.server.Responder)."""

    def chunked_body_sink(self) -> Sink: ...


async def relay_body(response: Response, responder: ChunkedResponder, hub: RelayHub, idle_timeout: float,
                     on_first: Callable[[], None] | None = None, on_spliced: Callable[[], None] | None = None) -> None:
    """Relay `response`'s chunked body byte for byte to the client, as it arrives (SSE: event by
    event). Raises UpstreamError (engine side) or ClientGone (client side); see the module.
    `on_spliced` is called when the hub takes the stream: the hub watches the client's hang-up
    from then on (llmgw.web.relayhub), so the caller needs no watcher task of its own."""
    sink = responder.chunked_body_sink()
    upstream, initial = response.take_body()
    client_fd = sink.fd
    try:
        if client_fd is not None and hub.splices:
            if on_spliced is not None:
                on_spliced()
            chunks, leftover = await hub.relay(upstream.fd, client_fd, initial, idle_timeout, on_first)
        else:
            chunks, leftover = await relay_in_task(upstream, sink, initial, idle_timeout, on_first)
    except RelayError as exc:
        await response.aclose()
        if exc.kind == "client":
            raise ClientGone(str(exc)) from None
        raise UpstreamError("timeout" if exc.timeout else "protocol", str(exc)) from None
    except BaseException:
        await response.aclose()
        raise
    response.relayed(chunks, leftover)


async def relay_in_task(upstream: ByteStream, sink: Sink, data: bytes, idle_timeout: float,
                        on_first: Callable[[], None] | None = None) -> tuple[int, bytes]:
    """Relay a chunked body from `upstream` (after `data`, already read) to `sink` in the calling
    task; returns (chunks, bytes read past the end) as RelayHub.relay does, and raises RelayError.

    Hot loop (one pass per token): one read, a scan of the chunk framing, one write. The idle
    timeout is one cancel scope whose deadline moves only when it fires too early, not a new
    scope per read (a scope costs ~5 µs). The scope also covers the write: if it fires there,
    the client sat on one chunk for the whole idle timeout (the write starts just after the read
    that set the deadline), and as the write's progress is lost with it the response is cut,
    never resumed."""
    scanner = ChunkedScanner()
    first = on_first is not None
    recv, send = upstream.recv, sink.send_all
    leftover = b""
    last = trio.current_time()
    sending = False
    while True:
        with trio.CancelScope(deadline=last + idle_timeout) as scope:
            while True:
                if data:
                    try:
                        used = scanner.scan(data)
                    except HttpError as exc:
                        raise RelayError("upstream", f"bad chunked stream from engine: {exc}") from None
                    if used < len(data):
                        leftover = data[used:]
                        data = data[:used]
                    if first and scanner.first_data:
                        on_first()  # type: ignore[misc]
                        first = False
                    sending = True
                    try:
                        await send(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone) as exc:
                        raise RelayError("client", f"client went away: {exc}") from None
                    sending = False
                    if scanner.done:
                        return scanner.chunks, leftover
                data = await recv()
                if not data:
                    raise RelayError("upstream", "engine closed the connection mid-stream")
                last = trio.current_time()
        if sending:
            raise RelayError("client", f"client read nothing for {idle_timeout:g}s mid-stream", timeout=True)
        if scope.cancelled_caught and trio.current_time() - last >= idle_timeout:
            raise RelayError("upstream", f"engine sent nothing for {idle_timeout:g}s mid-stream", timeout=True)
        data = b""
