"""The public port's HTTP/1.1 server on trio: keep-alive, streaming responses, TLS with client certificates, and a
cancel when the client goes away mid-stream.

One task per connection reads requests and runs the handler; a streaming handler may ask for a watcher that notices the
client hanging up and cancels the handler, so an engine request whose client left is cancelled at once instead of
running to the end.

The simulated engine (llmgw.sim.engine) runs on this server too, through small hooks: `render_error` (how a protocol
error is answered: vLLM's error shape there), `drain`, `respond_prepared` (a canned response) and the first and last
bytes of a stream sent with its head and its end."""

from __future__ import annotations

import errno
import functools
import logging
import math
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import trio

from llmgw.netaddr import peer_name
from llmgw.tls.explain import explain_tls_error, is_plain_http
from llmgw.tls.identity import HasPeerCert
from llmgw.tls.net import handshake
from llmgw.web.backlog import accept_queued
from llmgw.web.http1 import (
    CONTINUE,
    LAST_CHUNK,
    ChunkedDecoder,
    Headers,
    HeadScanner,
    HttpError,
    RequestHead,
    chunk,
    parse_request_head,
    response_head,
)
from llmgw.web.linger import answer_plain_on_tls, drop_unread
from llmgw.web.logthrottle import LogThrottle
from llmgw.web.rawio import ByteStream, RawSocket, Sink, TlsSocket

if TYPE_CHECKING:
    from llmgw.web.fastserve import FastPath

log = logging.getLogger("llmgw.http")


# accept() errors that mean "no resources for another connection right now" (trio's own accept
# loop logs each with a traceback, 10 a second: 1,778 lines in 20 s at the fd limit, issue 9).
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY = 0.1  # seconds between accept attempts while out of file descriptors


class Limits(msgspec.Struct, kw_only=True):
    # Open connections at most (0: no cap). At the cap accept pauses (new clients wait in the
    # kernel's listen backlog) until one closes, as at EMFILE; either is logged once a second.
    max_connections: int = 0
    max_body: int = 1024 * 1024
    header_timeout: float = 30.0  # a new connection must send its first request head in time
    keepalive_timeout: float = 75.0
    body_timeout: float = 30.0  # the whole request body, however slowly it drips
    tls_handshake_timeout: float = 10.0
    # Once draining, a keep-alive connection may bring one more request this long after it fell
    # idle (answered with `connection: close`): closing it at once lost the request a client was
    # sending on it just then (a reset to a client without retries as a gateway worker retired).
    drain_idle: float = 1.0


class DropConnection(Exception):
    """Raised by a handler to close the connection without (more of) an answer."""


class ClientGone(DropConnection):
    """The client closed the connection; nothing more can be sent."""


class Request:
    __slots__ = ("body", "head", "peer", "tls")

    # `tls`: the verified client certificate's holder (the connection's TLS stream; on the control
    # plane's api socket, the one a gateway worker verified: server/gateway/forwarded.py).
    def __init__(self, head: RequestHead, body: bytes, peer: str, tls: HasPeerCert | None) -> None:
        self.head = head
        self.body = body
        self.peer = peer
        self.tls = tls

    # Text on demand: the gateway's fast lane reads the bytes (three decodes were ~1 µs a request).
    @property
    def method(self) -> str:
        return self.head.method.decode("latin-1")

    @property
    def path(self) -> str:
        return self.head.path.decode("latin-1")

    @property
    def query(self) -> str:
        return self.head.query.decode("latin-1")

    def header(self, name: bytes) -> str | None:
        value = self.head.get(name)
        return None if value is None else value.decode("latin-1")


class Responder:
    """How a handler answers one request on an HTTP/1.1 connection.

    Streamed answers use chunked coding; an HTTP/1.0 client gets the body undelimited instead (it cannot read chunked
    coding) and the connection closes at its end. A HEAD request gets the head alone."""

    __slots__ = ("_conn", "_dechunk", "_framed", "close", "head_only", "http10", "started", "status", "streaming")

    def __init__(self, conn: ClientConnection, close: bool, *, http10: bool = False, head_only: bool = False) -> None:
        self._conn = conn
        self.close = close
        self.http10 = http10
        self.head_only = head_only
        self.started = False
        self.streaming = False
        self.status = 0
        self._dechunk: ChunkedDecoder | None = None
        self._framed = bytearray()  # chunked bytes not decoded yet (a chunk split across reads)

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = True
        self.status = status
        data = response_head(status, headers, content_length=len(body), close=self.close)
        await self._conn.send(data if self.head_only else data + body)

    async def respond_prepared(self, status: int, data: bytes) -> None:
        """A whole response already framed, head and body (a canned answer). Only for a keep-alive HTTP/1.1 exchange
        that is not HEAD: the caller checks `close`, `http10` and `head_only` first."""
        self.started = True
        self.status = status
        await self._conn.send(data)

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        """Begin a streamed (chunked) response; then `send`/`send_raw_chunked`, then `end`.
        `first` is the body's first bytes, sent in the same write as the head."""
        self.started = True
        self.streaming = True
        self.status = status
        if self.http10 or self.head_only:
            self.close = True
            self._dechunk = ChunkedDecoder()
            head = response_head(status, headers, close=True)
            await self._conn.send(head if self.head_only else head + first)
            return
        head = response_head(status, headers, chunked=True, close=self.close)
        await self._conn.send(head + chunk(first) if first else head)

    async def send(self, data: bytes) -> None:
        if not data or self.head_only:
            return
        await self._conn.send(data if self._dechunk is not None else chunk(data))

    async def send_raw_chunked(self, data: bytes) -> None:
        """Bytes already in chunked coding (relayed from an engine as they came)."""
        if self._dechunk is None:
            await self._conn.send(data)
            return
        decoder = self._dechunk
        self._framed += data
        decoder.feed(self._framed)
        body = bytes(decoder.body)
        decoder.body.clear()
        if body and not self.head_only:
            await self._conn.send(body)

    def chunked_body_sink(self) -> Sink:
        """Where a body already in chunked coding goes after `start` (see llmgw.web.relay): the
        client connection itself when the bytes go untouched (HTTP/1.1; its `fd` is set on
        plain TCP, None over TLS), else `send_raw_chunked`, which re-frames them (fd None)."""
        return self._conn.io if self._dechunk is None else _Reframe(self)

    async def end(self, last: bytes = b"") -> None:
        """End a streamed response; `last` is sent in the same write as the end of the body."""
        if self._dechunk is None:
            await self._conn.send(chunk(last) + LAST_CHUNK)
        elif last and not self.head_only:
            await self._conn.send(last)

    def watch_disconnect(self) -> None:
        """Cancel this request's handler if the client hangs up before it is done."""
        self._conn.start_watch()


class _Reframe:
    """A Sink for an HTTP/1.0 client or a HEAD request: chunked bytes unframed by the responder."""

    __slots__ = ("send_all",)
    fd: None = None

    def __init__(self, responder: Responder) -> None:
        self.send_all = responder.send_raw_chunked


Handler = Callable[[Request, Responder], Awaitable[None]]


HEAD_LATE = HttpError(408, "request head not received in time")


class ClientConnection:
    __slots__ = ("buf", "deadline", "eof", "expired", "handler_scope", "head_scan", "idle", "io", "late", "nursery",
                 "peer", "stream", "tls", "watch_done", "watch_scope")

    def __init__(self, tcp: trio.SocketStream, peer: str, tls: trio.SSLStream | None, nursery: trio.Nursery) -> None:
        self.stream: trio.abc.Stream = tcp if tls is None else tls
        self.peer = peer
        self.tls = tls
        # Plain TCP goes through the fd directly (see llmgw.web.rawio); TLS through SSLStream.
        self.io: ByteStream = RawSocket(tcp.socket) if tls is None else TlsSocket(tls)
        self.buf = bytearray()
        self.head_scan = HeadScanner()
        self.eof = False
        self.idle = False  # between requests, nothing read of the next: drain() gives it drain_idle (a new one: not)
        # While a head or body is awaited: when it is due (trio time), and the answer if it is late.
        self.deadline = math.inf
        self.late = HEAD_LATE
        self.expired = False
        self.nursery = nursery
        self.handler_scope: trio.CancelScope | None = None
        self.watch_scope: trio.CancelScope | None = None
        self.watch_done = trio.Event()

    async def send(self, data: bytes) -> None:
        try:
            await self.io.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ClientGone(f"client {self.peer} went away") from None

    async def receive(self) -> bool:
        """Read more into buf; False at EOF."""
        data = await self.io.recv()
        if not data:
            self.eof = True
            return False
        self.buf += data
        self.idle = False
        return True

    def await_until(self, timeout: float, late: HttpError) -> None:
        """A head or body must arrive within `timeout` seconds, or the connection ends (answering
        `late` if a head was begun or a body is awaited); `deadline = inf` disarms it."""
        self.deadline = trio.current_time() + timeout
        self.late = late

    def expire(self) -> None:
        self.expired = True
        self.nursery.cancel_scope.cancel()

    def start_watch(self) -> None:
        if self.watch_scope is not None or self.eof:
            return
        self.watch_scope = trio.CancelScope()
        self.watch_done = trio.Event()
        self.nursery.start_soon(self._watch, self.watch_scope, self.watch_done)

    async def _watch(self, scope: trio.CancelScope, done: trio.Event) -> None:
        try:
            with scope:
                while await self.receive():
                    pass  # pipelined bytes stay in buf for the next request
                if self.handler_scope is not None:
                    log.debug("client %s hung up; cancelling its request", self.peer)
                    self.handler_scope.cancel()
        finally:
            done.set()

    async def stop_watch(self) -> None:
        """Stop the watcher and wait until it has: a cancelled watcher that was already woken still reads once more, and
        two tasks waiting on one fd is an error in trio (BusyResourceError, which closed pipelined connections)."""
        if self.watch_scope is not None:
            self.watch_scope.cancel()
            self.watch_scope = None
            await self.watch_done.wait()


ErrorRenderer = Callable[[HttpError], tuple[Headers, bytes]]


def json_error(exc: HttpError) -> tuple[Headers, bytes]:
    """The public port's answer to a protocol error: the OpenAI error shape."""
    body = msgspec.json.encode({"error": {"message": str(exc), "type": "invalid_request_error" if exc.status < 500
                                          else "server_error", "code": exc.status}})
    return [(b"content-type", b"application/json")], body


class HttpServer:
    def __init__(self, handler: Handler, *, limits: Limits | None = None, ssl_context: ssl.SSLContext | None = None,
                 render_error: ErrorRenderer = json_error, lane: FastPath | None = None) -> None:
        self.handler = handler
        self.limits = limits or Limits()
        self.ssl_context = ssl_context
        self.render_error = render_error
        self.connections = 0
        self._conns: set[ClientConnection] = set()  # past the TLS handshake: the expiry task watches them
        self.body_late = HttpError(408, f"request body not received within {self.limits.body_timeout:g}s")
        self.head_bytes_scanned = 0  # work spent finding request heads (bounded by bytes received)
        self.draining = False
        self._room = trio.Event()  # set when a connection closes (accept may go on)
        self._accepting: trio.CancelScope | None = None
        self._expiry_nap: trio.CancelScope | None = None  # the expiry task's sleep: drain() cuts it short
        self._active: set[Responder] = set()  # requests in a handler
        self._throttle_cap = LogThrottle(log)
        self._throttle_accept = LogThrottle(log)
        # Plain-TCP requests a lane can take are served by reactor callbacks (llmgw.web.fastserve's
        # FastPath: taken as an object, so that this module does not import the one that imports it).
        self.lane = lane if lane is not None and lane.reactor.available else None
        self.fast_active = 0  # requests in the lane's hands

    def head_timeout(self, first: bool) -> float:
        """How long the next request head may take (a keep-alive one: drain_idle at most once draining)."""
        lim = self.limits
        return lim.header_timeout if first else min(lim.keepalive_timeout,
                                                    lim.drain_idle if self.draining else math.inf)

    @property
    def active_requests(self) -> int:
        return len(self._active) + self.fast_active

    async def serve(self, listeners: list[trio.SocketListener], *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept on every listener until `drain` (or a cancel); returns when the connections
        it accepted have ended too."""
        async with trio.open_nursery() as connections:
            expiry = trio.CancelScope()
            connections.start_soon(self._expire_loop, expiry)
            try:
                async with trio.open_nursery() as accepting:
                    self._accepting = accepting.cancel_scope
                    if self.draining:
                        accepting.cancel_scope.cancel()
                    for listener in listeners:
                        accepting.start_soon(self._accept_loop, listener, connections)
                    task_status.started()
            finally:
                with trio.CancelScope(shield=True):
                    for listener in listeners:
                        for queued in accept_queued(listener) if self.draining else ():  # served, not reset by aclose
                            self.connections += 1
                            connections.start_soon(self._serve_one, trio.SocketStream(queued))
                        await listener.aclose()
            while self.connections:
                self._room = self._room if not self._room.is_set() else trio.Event()  # drain() waits on it too
                await self._room.wait()
            expiry.cancel()

    async def _expire_loop(self, scope: trio.CancelScope) -> None:
        """End the connections whose head or body is late. One task for all of them instead of a
        timer per request: a CancelScope with a deadline per request cost the fixed-answer
        engine ~30% more CPU per request (bench/bench_sim_engine.py)."""
        lim = self.limits
        longest = min(lim.header_timeout, lim.keepalive_timeout, lim.body_timeout)
        with scope:
            while True:
                now = trio.current_time()
                # A deadline set from now on is at least this far off (drain() wakes this loop).
                wake = now + (max(min(longest, lim.drain_idle), 0.05) if self.draining and lim.drain_idle > 0
                              else longest)
                for conn in list(self._conns):
                    if conn.deadline <= now:
                        conn.expire()
                    elif conn.deadline < wake:
                        wake = conn.deadline
                with trio.CancelScope(deadline=wake) as self._expiry_nap:
                    await trio.sleep_forever()
                self._expiry_nap = None

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            cap = self.limits.max_connections
            while cap and self.connections >= cap:
                self._throttle_cap(logging.WARNING, "public port at its cap of %d connections (max_connections): "
                                   "not accepting until one closes", cap)
                self._room = trio.Event()
                await self._room.wait()
            try:
                tcp = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                self._throttle_accept(logging.WARNING, "public port: accept failed with %s (%d connections open): "
                                      "pausing accepts; raise the file descriptor limit (LimitNOFILE) or lower "
                                      "max_connections", errno.errorcode.get(exc.errno or 0, str(exc)),
                                      self.connections)
                await trio.sleep(ACCEPT_RETRY)
                continue
            self.connections += 1
            connections.start_soon(self._serve_one, tcp)

    async def drain(self, grace: float) -> None:
        """Graceful stop: accept no more (what is queued is served), let requests in flight and new connections'
        first ones finish (`connection: close`) for up to `grace` s; then cancel `serve`. A keep-alive connection
        that falls idle (or is) may bring one more request within `drain_idle`, answered with `connection: close`;
        then it is closed."""
        self.draining = True
        if self._accepting is not None:
            self._accepting.cancel()
        for responder in self._active:
            if not responder.started:
                responder.close = True
        until = trio.current_time() + self.limits.drain_idle
        for conn in self._conns:
            if conn.idle and conn.deadline > until:
                conn.deadline = until
        if self._expiry_nap is not None:
            self._expiry_nap.cancel()  # it slept towards a later deadline
        with trio.move_on_after(grace):
            while self.connections:  # requests in flight, and new connections' first requests
                self._room = self._room if not self._room.is_set() else trio.Event()  # serve() waits on it too
                await self._room.wait()

    async def _serve_one(self, tcp: trio.SocketStream) -> None:
        peer = peer_name(tcp)
        try:
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        stream: trio.abc.Stream = tcp
        tls: trio.SSLStream | None = None
        try:
            if self.ssl_context is not None:
                tls = trio.SSLStream(tcp, self.ssl_context, server_side=True)
                try:
                    with trio.fail_after(self.limits.tls_handshake_timeout):
                        # Sends the alert on failure, so a client whose certificate we refuse
                        # hears "unknown CA" or "expired", not a bare EOF.
                        await handshake(tls)
                except (trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError) as exc:
                    log.info("TLS handshake with %s failed: %s", peer, explain_tls_error(exc, peer, side="server"))
                    if is_plain_http(exc):
                        await self._plain_on_tls(tcp)
                    return
                stream = tls
            async with trio.open_nursery() as nursery:
                conn = ClientConnection(tcp, peer, tls, nursery)
                self._conns.add(conn)
                try:
                    await self._serve_http1(conn)
                finally:
                    self._conns.discard(conn)
                nursery.cancel_scope.cancel()
            if conn.expired and (conn.buf or conn.late is not HEAD_LATE):
                await self._error(conn, conn.late)  # else an idle keep-alive connection: close quietly
        except Exception:
            log.exception("connection from %s failed", peer)
        finally:
            self.connections -= 1
            self._room.set()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()

    async def _read_head(self, conn: ClientConnection, first: bool) -> RequestHead | None:
        if not first and self.draining and self.limits.drain_idle <= 0:
            return None  # drain_idle 0: a keep-alive connection ends once its answer is out
        scanned = conn.head_scan.scanned
        conn.await_until(self.head_timeout(first), HEAD_LATE)
        try:
            while True:
                if first and conn.buf[:1] == b"\x16" and conn.tls is None:
                    # A TLS ClientHello (record type 22) on a plain port: answer at once in plain
                    # text (the client reports "wrong version number") instead of waiting out
                    # header_timeout for a request head that never comes.
                    raise HttpError(400, "TLS handshake on a plain-HTTP port; use an http:// URL")
                end = conn.head_scan.find(conn.buf)
                if end >= 0:
                    raw = bytes(conn.buf[:end])
                    del conn.buf[:end]
                    return parse_request_head(raw)
                if not await conn.receive():
                    if conn.buf.strip():
                        raise HttpError(400, "connection closed inside a request head")
                    return None
        finally:
            conn.deadline = math.inf
            self.head_bytes_scanned += conn.head_scan.scanned - scanned

    async def _read_body(self, conn: ClientConnection, head: RequestHead) -> bytes:
        max_body = self.limits.max_body
        if head.content_length is not None and head.content_length > max_body:
            raise HttpError(413, f"request body of {head.content_length} bytes is over the limit of {max_body} bytes")
        if head.expect_continue:
            await conn.send(CONTINUE)
        conn.await_until(self.limits.body_timeout, self.body_late)
        try:
            if head.chunked:
                decoder = ChunkedDecoder(limit=max_body)
                while True:
                    decoder.feed(conn.buf)
                    if decoder.done:
                        return bytes(decoder.body)
                    if not await conn.receive():
                        raise HttpError(400, "connection closed inside a request body")
            need = head.content_length or 0
            while len(conn.buf) < need:
                if not await conn.receive():
                    raise HttpError(400, "connection closed inside a request body")
            body = bytes(conn.buf[:need])
            del conn.buf[:need]
            return body
        finally:
            conn.deadline = math.inf

    async def _serve_http1(self, conn: ClientConnection) -> None:
        first = True
        lane = self.lane
        while True:
            if lane is not None and conn.tls is None and lane.reactor.running:
                handoff = await lane.serve(self, conn, first)  # llmgw.web.fastserve, which imports this module
                if handoff is None:
                    return
                first = handoff.first
                if handoff.continuation is not None:
                    responder = Responder(conn, close=handoff.close or self.draining)
                    if not await self._run(conn, None, responder, functools.partial(handoff.continuation, responder)):
                        return
                    continue
            conn.idle = not first and not conn.buf
            try:
                head = await self._read_head(conn, first)
                if head is None:
                    return
                need = head.content_length or 0  # the whole body came with the head: no wait to set up
                if (len(conn.buf) >= need and not head.chunked and not head.expect_continue
                        and need <= self.limits.max_body):
                    body = bytes(conn.buf[:need])
                    del conn.buf[:need]
                else:
                    body = await self._read_body(conn, head)
            except HttpError as exc:
                await self._error(conn, exc)
                return
            first = False
            request = Request(head, body, conn.peer, conn.tls)
            responder = Responder(conn, close=head.close or self.draining, http10=head.http10,
                                  head_only=head.method == b"HEAD")
            if not await self._run(conn, request, responder, functools.partial(self.handler, request, responder)):
                return

    async def _run(self, conn: ClientConnection, request: Request | None, responder: Responder,
                   call: Callable[[], Awaitable[None]]) -> bool:
        """Run a handler (or the rest of a request the fast lane began: `request` None); False
        when the connection ends after it."""
        self._active.add(responder)
        try:
            # A client that hangs up mid-request ends the connection, handler and all: the
            # connection's own scope serves (no scope per request, see _expire_loop).
            conn.handler_scope = conn.nursery.cancel_scope
            await call()
        except DropConnection:
            return False
        except Exception:
            # A bug in a handler costs this connection, not the server: answer 500 if
            # nothing went out yet (a started response is cut by the close instead).
            what = f"{request.method} {request.path}" if request is not None else "a request the fast lane handed over"
            log.exception("handler failed on %s from %s", what, conn.peer)
            await conn.stop_watch()
            if not responder.started:
                await self._error(conn, HttpError(500, "internal error; see the server log"))
            return False
        finally:
            self._active.discard(responder)
            conn.handler_scope = None
            if conn.watch_scope is not None:
                await conn.stop_watch()
        if conn.eof:
            return False
        if not responder.started:
            await self._error(conn, HttpError(500, "no response"))
            return False
        return not responder.close

    async def _plain_on_tls(self, tcp: trio.SocketStream) -> None:
        headers, body = self.render_error(HttpError(400, "plain HTTP request on a TLS port; use an https:// URL"))
        await answer_plain_on_tls(tcp, response_head(400, headers, content_length=len(body), close=True) + body)

    async def _error(self, conn: ClientConnection, exc: HttpError) -> None:
        headers, body = self.render_error(exc)
        await _answer_and_linger(conn, response_head(exc.status, headers, content_length=len(body), close=True) + body)


async def _answer_and_linger(conn: ClientConnection, data: bytes) -> None:
    """Send `data` (a whole error response) and prepare to close (a lingering close on plain TCP: drop_unread)."""
    try:
        with trio.move_on_after(5):
            await conn.send(data)
    except ClientGone:
        return
    stream, raw = conn.stream, conn.io
    if isinstance(raw, RawSocket) and not conn.eof and isinstance(stream, trio.SocketStream):
        await drop_unread(stream.socket, raw)
