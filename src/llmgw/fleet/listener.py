"""The server's fleet listener: TLS (or h2c with --insecure), one Connect stream per connection."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable

import h2.errors
import h2.exceptions
import trio

from llmgw.errors import first_leaf
from llmgw.fleet.h2conn import ChannelClosed, FleetChannel, H2Connection
from llmgw.fleet.limits import RefusalLog
from llmgw.netaddr import peer_name
from llmgw.tls import explain_tls_error, peer_common_name
from llmgw.tls.net import handshake as tls_handshake
from llmgw.wire.gateway import GATEWAY_PATH
from llmgw.wire.messages import CONNECT_PATH, CONTENT_TYPE

log = logging.getLogger("llmgw.fleet")


class StreamRefused(Exception):
    """Raised by a stream handler to end the stream with an error the agent will show."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


StreamHandler = Callable[[FleetChannel], Awaitable[None]]
RefusalHook = Callable[[str], None]
# Whether a verified peer certificate may use the fleet port: None, or (metric reason, message).
PeerCheck = Callable[[trio.SSLStream[trio.SocketStream]], "tuple[str, str] | None"]


class FleetListener:
    """Accepts agent connections and runs `handler(channel)` for each Connect stream."""

    def __init__(
        self,
        handler: StreamHandler,
        *,
        ssl_context: ssl.SSLContext | None,
        max_message: int,
        handshake_timeout: float = 10.0,
        idle_timeout: float | None = None,
        on_refused: RefusalHook | None = None,
        peer_check: PeerCheck | None = None,
        refusal_log: RefusalLog | None = None,
        gateway_handler: StreamHandler | None = None,
        gateway_check: PeerCheck | None = None,
    ) -> None:
        self.handler = handler
        # The gateway feed (llmgw.wire.gateway) on the same port: its own path, its own check
        # of who may follow (a gateway certificate), none of the node's.
        self.gateway_handler = gateway_handler
        self.gateway_check = gateway_check or (lambda peer: None)
        # One line per reason and peer host every 10 s: a stalled, unauthenticated TLS
        # handshake is free to repeat, and wrote one WARNING each (issue 9).
        self.refusal_log = refusal_log or RefusalLog(log)
        self.ssl_context = ssl_context
        self.max_message = max_message
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.on_refused = on_refused or (lambda reason: None)
        self.peer_check = peer_check or (lambda peer: None)
        self.connections = 0
        # Live TLS connections, so that a certificate revoked meanwhile can be cut off (recheck).
        # With each, the check that applies to it (a node's or a gateway's, once its path is known).
        self._live: dict[trio.SSLStream[trio.SocketStream], tuple[trio.CancelScope, list[PeerCheck]]] = {}
        self._idle = trio.Event()

    async def wait_idle(self) -> None:
        """Until every connection has finished (its GOAWAY sent, its socket closed)."""
        while self.connections:
            self._idle = trio.Event()
            await self._idle.wait()

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await trio.serve_listeners(self._serve_one, listeners, task_status=task_status)

    def recheck(self) -> int:
        """Apply `peer_check` again to every live connection (the deny list was reloaded) and end
        those it now refuses; the agent's reconnect is then refused at the handshake with the
        reason. Returns how many were ended."""
        ended = 0
        for ssl_stream, (scope, check) in list(self._live.items()):
            refusal = check[0](ssl_stream)
            if refusal is not None:
                log.warning("fleet connection from %s ended: %s", peer_name(ssl_stream.transport_stream), refusal[1])
                scope.cancel()
                ended += 1
        return ended

    def _refuse(self, peer: str, reason: str, detail: str) -> None:
        host = peer.rsplit(":", 1)[0]
        self.refusal_log.warning(trio.current_time(), reason, host, "fleet connection from %s refused: %s",
                                 peer, detail)
        self.on_refused(reason)

    async def _serve_one(self, tcp: trio.SocketStream) -> None:
        peer = peer_name(tcp)
        stream: trio.abc.Stream = tcp
        identity: str | None = None
        self.connections += 1
        try:
            if self.ssl_context is not None:
                ssl_stream = trio.SSLStream(tcp, self.ssl_context, server_side=True)
                try:
                    with trio.fail_after(self.handshake_timeout):
                        await tls_handshake(ssl_stream)  # tells a refused agent why
                except trio.TooSlowError:
                    self._refuse(peer, "tls_timeout", f"no TLS handshake within {self.handshake_timeout:g}s")
                    return
                except (trio.BrokenResourceError, ssl.SSLError) as exc:
                    detail = explain_tls_error(exc, peer.rsplit(":", 1)[0], side="server")
                    self._refuse(peer, "tls_handshake", f"TLS handshake failed: {detail}")
                    return
                alpn = ssl_stream.selected_alpn_protocol()
                if alpn not in (None, "h2"):
                    self._refuse(peer, "alpn", f"client negotiated {alpn!r}, the fleet port speaks only h2")
                    return
                identity = peer_common_name(ssl_stream)
                stream = ssl_stream
                check: list[PeerCheck] = [self.peer_check]
                with trio.CancelScope() as scope:
                    self._live[ssl_stream] = (scope, check)
                    try:
                        await self._serve_h2(stream, peer, identity, ssl_stream, check)
                    finally:
                        del self._live[ssl_stream]
            else:
                await self._serve_h2(stream, peer, identity)
        except Exception as exc:
            # A bug in one stream's handling must never take down the listener.
            log.exception("fleet connection from %s failed: %s", peer, exc)
            self.on_refused("internal")
        finally:
            self.connections -= 1
            if not self.connections:
                self._idle.set()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()

    async def _serve_h2(
        self, stream: trio.abc.Stream, peer: str, identity: str | None,
        ssl_stream: trio.SSLStream[trio.SocketStream] | None = None, check: list[PeerCheck] | None = None,
    ) -> None:
        conn = H2Connection(
            stream,
            client_side=False,
            max_message=self.max_message,
            peer=peer,
            tls_identity=identity,
            idle_timeout=self.idle_timeout,
        )
        conn.start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.reader)
            nursery.start_soon(conn.writer)
            try:
                with trio.fail_after(self.handshake_timeout):
                    channel, headers = await conn.accept()
            except trio.TooSlowError:
                self._refuse(peer, "timeout",
                             f"no Connect request within {self.handshake_timeout:g}s (half-open connection?)")
                conn.fail("no request in time", h2.errors.ErrorCodes.CANCEL)
                with trio.move_on_after(2):  # a peer that reads nothing must not hold us here
                    await conn.flushed()
                nursery.cancel_scope.cancel()
                return
            except ChannelClosed as exc:
                self._refuse(peer, "protocol", exc.reason)
                nursery.cancel_scope.cancel()
                return
            gateway = headers.get(":path", "") == GATEWAY_PATH and self.gateway_handler is not None
            handler = self.gateway_handler if gateway and self.gateway_handler is not None else self.handler
            refusal = None
            if ssl_stream is not None and check is not None:
                if gateway:
                    check[0] = self.gateway_check  # a later recheck applies the gateway's rule
                refusal = check[0](ssl_stream)
            problem = _check_request(headers, gateway=gateway)
            if problem is not None:
                status, detail = problem
                self._refuse(peer, "bad_request", detail)
                try:
                    conn.respond(channel, status, [("content-type", "text/plain")], end=False)
                    await channel.send_raw(detail.encode() + b"\n", end_stream=True)
                except (ChannelClosed, h2.exceptions.H2Error):
                    pass  # the peer is already gone; it was refused either way
                await conn.goaway(detail)
                nursery.cancel_scope.cancel()
                return
            try:
                conn.respond(channel, 200, [("content-type", CONTENT_TYPE)])
            except h2.exceptions.H2Error as exc:
                self._refuse(peer, "protocol", f"stream gone before the answer: {exc}")
                nursery.cancel_scope.cancel()
                return
            error: tuple[str, str] | None = None  # (code, message)
            if refusal is not None:
                # Refused on the stream rather than in the handshake, so the agent can say why.
                error = refusal
                self._refuse(peer, *refusal)
            else:
                try:
                    await handler(channel)
                except* StreamRefused as group:
                    # The code and message only, never the exception: its traceback holds this
                    # frame and the handler's, with what the peer sent (a refused 3.5 MB Register,
                    # 100,000 GPUs decoded), in a cycle only a full gc collection frees (issue 41).
                    leaf = first_leaf(group, StreamRefused)
                    error = (leaf.code, leaf.message)
                    del leaf
                    self.on_refused(error[0])
            if error is not None:
                await conn.end_channel(channel, error[1], error[0])
            else:
                await conn.end_channel(channel)
            await conn.goaway()
            nursery.cancel_scope.cancel()


def _check_request(headers: dict[str, str], *, gateway: bool = False) -> tuple[int, str] | None:
    method = headers.get(":method", "")
    path = headers.get(":path", "")
    if path != CONNECT_PATH and not gateway:
        return 404, f"unknown path {path!r}; the fleet port serves only {CONNECT_PATH}"
    if method != "POST":
        return 405, f"method {method} not allowed on {path}"
    ctype = headers.get("content-type", "").split(";")[0].strip()
    if ctype != CONTENT_TYPE:
        return 415, f"content-type {ctype!r} not supported; expected {CONTENT_TYPE}"
    return None
