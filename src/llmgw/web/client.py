"""Keep-alive HTTP/1.1 connections to engines, one small pool per endpoint, on trio streams.

Why not httpx: its connection pool is a known hot spot under concurrency (the gateway issue
measured a hypercorn + httpx proxy at ~900 µs of CPU per request against a 300 µs budget).
This pool does only what the gateway needs: reuse idle connections LIFO, frame requests
and responses with llmgw.web.http1, hand a chunked body to llmgw.web.relay (which relays it
untouched), and tell a failure to connect from a connection reset before any response byte
(both retryable elsewhere).
"""

from __future__ import annotations

import errno
import math
import os
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import trio

from llmgw.netaddr import hostport
from llmgw.web.http1 import (
    ChunkedDecoder,
    Headers,
    HttpError,
    ResponseHead,
    find_head_end,
    parse_response_head,
    request_head,
)
from llmgw.web.rawio import RawSocket

JSON_TYPE = (b"content-type", b"application/json")


class UpstreamError(Exception):
    """`kind`: connect | reset (closed before any response byte) | timeout | protocol |
    too_large (a buffered body over its limit)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Watch:
    """A request's wait on its engine connection, ended by its owner without a cancel scope.

    Two cancel scopes per proxied request (the head timeout's move_on_after and the eviction
    guard) were ~11 % of the gateway's samples (py-spy, wrk -c32, issue 17); without them, same-run
    A/B of 3 rounds: 119 -> 100 µs of CPU per request, 6,550 -> 8,300 requests/s. With a Watch the
    owner keeps the due time in a table that one task checks (llmgw.server.gateway.proxy), and
    `fire` wakes the waiting task through trio.lowlevel.notify_closing on the connection's fd: its
    wait_readable (or wait_writable) raises ClosedResourceError at once and the request fails with
    UpstreamError(`why`). The connection is closed then, which is right after a timeout or an
    eviction anyway.

    `why` is checked before every wait too, so a fire while the task was not waiting (runnable,
    or still connecting: a new connection is bounded by connect_timeout) is seen at its next
    step; a fire during an exchange fails it even if the head came in the same instant.

    An exchange no task waits on (the fast lane's, llmgw.web.fastclient) sets `wake` instead:
    `fire` calls it."""

    __slots__ = ("due", "fd", "wake", "why")

    def __init__(self) -> None:
        self.due = math.inf  # when the owner fires it with "timeout" (its table, not ours)
        self.fd = -1  # the engine connection being waited on, while an exchange runs
        self.why = ""  # "" until fired: "timeout" or "evicted"
        self.wake: Callable[[], None] | None = None

    def fire(self, why: str) -> None:
        if self.why:
            return
        self.why = why
        if self.wake is not None:
            self.wake()
        elif self.fd >= 0:
            trio.lowlevel.notify_closing(self.fd)


class EngineConn:
    __slots__ = ("buf", "detach", "raw", "reused", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.raw = RawSocket(stream.socket)
        self.buf = bytearray()
        self.reused = False
        # Set while the fast lane's reactor has this socket registered (llmgw.web.fastclient):
        # called before a task waits on it through trio, and before it is closed.
        self.detach: Callable[[], None] | None = None

    def forget(self) -> None:
        if self.detach is not None:
            self.detach()
            self.detach = None

    async def receive(self) -> bool:
        data = await self.raw.recv()
        if not data:
            return False
        self.buf += data
        return True

    async def send_all(self, data: bytes) -> None:
        await self.raw.send_all(data)

    async def close(self) -> None:
        self.forget()
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class Response:
    """An upstream response whose head has arrived: read or relay the body (which hands the
    connection back to the pool, or closes it on an error), or `aclose` to give it up."""

    __slots__ = ("_conn", "_pool", "_released", "chunks", "head")

    def __init__(self, pool: Upstream, conn: EngineConn, head: ResponseHead) -> None:
        self._pool = pool
        self._conn = conn
        self.head = head
        self._released = False
        self.chunks = 0

    @property
    def status(self) -> int:
        return self.head.status

    @property
    def released(self) -> bool:
        """Its connection went back to the pool or was closed: nothing left to `aclose`."""
        return self._released

    def complete_body(self, limit: int | None = None) -> bytes | None:
        """The body, when it came whole with the head (Content-Length, all of it read): most
        plain answers do. No wait, so no cancel scope: two scopes (the read's timeout and the
        caller's eviction guard) were ~5 % of the gateway's CPU per request (py-spy, issue 17).
        None when it must be read (`read`)."""
        conn, head = self._conn, self.head
        need = head.content_length
        if (need is None or head.chunked or not head.has_body or len(conn.buf) < need
                or (limit is not None and need > limit)):
            return None
        body = bytes(conn.buf[:need])
        del conn.buf[:need]
        self._finish(reusable=not head.close and not conn.buf)
        return body

    async def read(self, within: float, limit: int | None = None) -> bytes:
        """The whole body (Content-Length, chunked, or until close). A body over `limit`
        bytes raises UpstreamError("too_large") as soon as that is known (a declared length
        before any of it is read; otherwise once the decoded body passes the limit), so no
        more than about `limit` + one read is ever held. On an error the connection is
        closed (it is in an unknown state)."""
        try:
            return await self._read(within, limit)
        except BaseException:
            await self.aclose()
            raise

    async def _read(self, within: float, limit: int | None) -> bytes:
        conn, head = self._conn, self.head
        if not head.has_body:  # 204, 304: nothing follows the head, whatever it says
            self._finish(reusable=not head.close and not conn.buf)
            return b""
        with trio.move_on_after(within):
            if head.chunked:
                decoder = ChunkedDecoder(limit, status=502)
                while True:
                    try:
                        decoder.feed(conn.buf)
                    except HttpError as exc:
                        if exc.status == 413:
                            raise _too_large(limit) from None
                        raise UpstreamError("protocol", f"bad chunked body from engine: {exc}") from None
                    if decoder.done:
                        self._finish(reusable=not head.close and not conn.buf)
                        return bytes(decoder.body)
                    if not await conn.receive():
                        raise UpstreamError("protocol", "engine closed the connection inside a chunked body")
            if head.content_length is not None:
                need = head.content_length
                if limit is not None and need > limit:
                    raise _too_large(limit, need)
                while len(conn.buf) < need:
                    if not await conn.receive():
                        raise UpstreamError("protocol", "engine closed the connection inside a body")
                body = bytes(conn.buf[:need])
                del conn.buf[:need]
                self._finish(reusable=not head.close and not conn.buf)
                return body
            while await conn.receive():
                if limit is not None and len(conn.buf) > limit:
                    raise _too_large(limit)
            body = bytes(conn.buf)
            self._finish(reusable=False)
            return body
        raise UpstreamError("timeout", f"engine sent no body within {within:g}s")

    def take_body(self) -> tuple[RawSocket, bytes]:
        """For a relay (llmgw.web.relay.relay_body, the only caller): the engine connection and
        the body bytes already read with the head. Then `relayed`, or `aclose` on an error."""
        conn = self._conn
        initial = bytes(conn.buf)
        conn.buf.clear()
        return conn.raw, initial

    def relayed(self, chunks: int, leftover: bytes) -> None:
        """The body went through to its end; bytes past it (a misbehaving engine) cost the connection."""
        self.chunks = chunks
        self._finish(reusable=not self.head.close and not leftover)

    def _finish(self, reusable: bool) -> None:
        if not self._released:
            self._released = True
            self._pool.put(self._conn, reusable)

    def disown(self) -> None:
        """The exchange failed after all (see Watch): the caller closes the connection."""
        self._released = True

    async def aclose(self) -> None:
        """Give up on the body (client gone, error): the connection is closed, not reused."""
        if not self._released:
            self._released = True
            await self._conn.close()


class Upstream:
    """Connections to one engine endpoint (base URL `http://host:port`)."""

    def __init__(self, url: str, *, connect_timeout: float = 2.0, max_idle: int = 256, unix_path: str = "") -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"engine endpoint {url!r} must be http://host:port")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.authority = hostport(self.host, self.port).encode()
        self.connect_timeout = connect_timeout
        # Idle connections kept: as many as a burst used. With 64, each 200-stream burst of the
        # bench dialled 136 new engine connections: CPU per stream 770 -> 670 µs with 256 (same-run
        # A/B, 20 tokens a stream, issue 17). One an engine closed meanwhile (its keep-alive
        # timeout) costs the next request one reset, retried on a fresh connection (`request`).
        self.max_idle = max_idle
        self._idle: list[EngineConn] = []
        self.closed = False
        self._auth: list[tuple[bytes, bytes]] = []
        self._post_prefix: dict[bytes, bytes] = {}
        # A local peer on a Unix socket (a gateway worker's way to the control plane's API).
        self.unix_path = unix_path
        self._family = _literal_family(self.host)  # an IP literal is dialled without trio's resolver

    def set_api_key(self, key: str) -> None:
        """The engine's API key, sent as `Authorization: Bearer` with every request ("" = none)."""
        self._auth = [(b"authorization", b"Bearer " + key.encode())] if key else []
        self._post_prefix.clear()

    def put(self, conn: EngineConn, reusable: bool) -> None:
        if reusable and not self.closed and len(self._idle) < self.max_idle and not conn.buf:
            conn.reused = True
            self._idle.append(conn)
        else:
            close_soon(conn)

    async def _connect(self) -> EngineConn:
        stream: trio.SocketStream | None = None
        try:
            # move_on_after, not fail_after: trio's fail_after is a generator context manager
            # around it, ~1.5 % of the CPU of a 200-stream burst (py-spy, issue 17).
            with trio.move_on_after(self.connect_timeout):
                if self.unix_path:
                    stream = await trio.open_unix_socket(self.unix_path)
                elif self._family is not None:
                    stream = await _connect_literal(self._family, self.host, self.port)
                else:
                    stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise UpstreamError("connect",
                                f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        if stream is None:
            raise UpstreamError("connect", f"connect to {self.host}:{self.port} timed out")
        if self._family is None:  # trio.SocketStream sets TCP_NODELAY itself; a Unix socket has none
            try:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return EngineConn(stream)

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: bytes,
        *,
        head_timeout: float,
        watch: Watch | None = None,
    ) -> Response:
        """Send a request and wait for the response head. A reused connection the engine had
        closed meanwhile is retried once on a new one (it never saw the request): a new
        connection, not the next idle one, which is likely as stale (the engine restarted).

        With a `watch` the caller times the wait itself (it fires the watch with "timeout"
        when `head_timeout` is up, see Watch) and this sets no cancel scope."""
        data = self.request_bytes(method, target, headers, body)
        conn = self._idle.pop() if self._idle else await self._connect()
        conn.forget()
        try:
            return await self._exchange(conn, data, head_timeout, watch)
        except UpstreamError as exc:
            await conn.close()
            if exc.kind != "reset" or not conn.reused:
                raise
        except BaseException:
            await conn.close()
            raise
        self.drop_idle()
        conn = await self._connect()
        try:
            return await self._exchange(conn, data, head_timeout, watch)
        except BaseException:
            await conn.close()
            raise

    def request_bytes(self, method: bytes, target: bytes, headers: Headers, body: bytes) -> bytes:
        return request_head(method, target, [(b"host", self.authority), *self._auth, *headers], len(body)) + body

    def post_bytes(self, target: bytes, rid: bytes, accept: bytes | None, body: bytes) -> bytes:
        """`request_bytes` for the gateway's JSON POST, its constant lines built once per target
        (`headers` the same: content-type, x-request-id, accept when the client sent one)."""
        prefix = self._post_prefix.get(target)
        if prefix is None:
            prefix = request_head(b"POST", target, [(b"host", self.authority), *self._auth, JSON_TYPE], None)[:-2]
            if len(self._post_prefix) < 16:  # the query string is the client's: a few targets are kept, not any
                self._post_prefix[target] = prefix
        accept_line = b"accept: " + accept + b"\r\n" if accept else b""
        return b"%sx-request-id: %s\r\n%scontent-length: %d\r\n\r\n%s" % (prefix, rid, accept_line, len(body), body)

    def take_idle(self) -> EngineConn | None:
        """An idle connection for an exchange that is not `request`'s (the fast lane's), or None."""
        return self._idle.pop() if self._idle else None

    def drop_idle(self) -> None:
        """A reused connection turned out stale: the other idle ones have been idle longer
        (LIFO), so they are as stale (an engine restart, its keep-alive timeout)."""
        stale, self._idle = self._idle, []
        for old in stale:
            close_soon(old)

    async def _exchange(self, conn: EngineConn, data: bytes, head_timeout: float, watch: Watch | None) -> Response:
        if watch is None:
            await self._send(conn, data)
            with trio.move_on_after(head_timeout):
                return await self._read_head(conn, None)
            raise UpstreamError("timeout", f"{self.host}:{self.port} sent no response within {head_timeout:g}s")
        if watch.why:
            raise self.fired_error(watch, head_timeout)
        watch.fd = conn.raw.fd
        try:
            await self._send(conn, data)
            response = await self._read_head(conn, watch)
        except (UpstreamError, trio.ClosedResourceError):
            if watch.why:
                raise self.fired_error(watch, head_timeout) from None
            raise
        finally:
            watch.fd = -1
        if watch.why:
            response.disown()
            raise self.fired_error(watch, head_timeout)
        return response

    def fired_error(self, watch: Watch, head_timeout: float) -> UpstreamError:
        """What an exchange ends with when its Watch fired."""
        if watch.why == "timeout":
            return UpstreamError("timeout", f"{self.host}:{self.port} sent no response within {head_timeout:g}s")
        return UpstreamError(watch.why, f"{self.host}:{self.port}: request ended ({watch.why})")

    async def _send(self, conn: EngineConn, data: bytes) -> None:
        try:
            await conn.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise UpstreamError("reset", f"{self.host}:{self.port} closed the connection") from None

    async def _read_head(self, conn: EngineConn, watch: Watch | None) -> Response:
        scanned = 0
        while True:
            try:
                end = find_head_end(conn.buf, scanned)
            except HttpError as exc:
                raise UpstreamError("protocol", f"bad response from engine: {exc}") from None
            if end >= 0:
                raw = bytes(conn.buf[:end])
                del conn.buf[:end]
                try:
                    head = parse_response_head(raw)
                except HttpError as exc:
                    raise UpstreamError("protocol", f"bad response from engine: {exc}") from None
                if head.status < 200:
                    scanned = 0
                    continue  # 100 Continue and friends: the real head follows
                return Response(self, conn, head)
            scanned = len(conn.buf)
            if watch is not None and watch.why:
                raise trio.ClosedResourceError("watch fired")  # see Watch: fired while we ran
            if not await conn.receive():
                kind = "reset" if not conn.buf else "protocol"
                raise UpstreamError(kind, f"{self.host}:{self.port} closed the connection before answering")

    async def aclose(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


def _literal_family(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 for an IP literal, None for a name (resolved by trio.open_tcp_stream)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    return None


async def _connect_literal(family: socket.AddressFamily, host: str, port: int) -> trio.SocketStream:
    """A TCP connection to an IP literal: one non-blocking connect and a wait for writability.
    trio.open_tcp_stream resolves even a literal through getaddrinfo in a worker thread and runs
    a happy-eyeballs nursery; under a burst of 200 new streams each needs a new engine
    connection, and that machinery was ~7 % of the gateway's CPU (py-spy, issue 17)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        err = sock.connect_ex((host, port))
        if err == errno.EINPROGRESS:
            await trio.lowlevel.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


def _too_large(limit: int | None, declared: int | None = None) -> UpstreamError:
    said = f" (it declared {declared} bytes)" if declared is not None else ""
    return UpstreamError("too_large", f"engine response body over the limit of {limit} bytes{said}")


def close_soon(conn: EngineConn) -> None:
    """Close without awaiting (called from sync code): a plain socket close is immediate."""
    conn.forget()
    try:
        conn.stream.socket.close()
    except OSError:
        pass
