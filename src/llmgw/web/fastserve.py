"""The public port's fast lane: a plain-TCP connection's requests read, handed to the handler's
lane and answered in reactor callbacks, while its task waits (one wake-up per connection, not
two per request: llmgw.web.reactor says why that matters).

The lane (the gateway's, llmgw.server.gateway.fastlane) takes what it can answer without
awaiting anything and says no to the rest; a request it refuses, or one this module does not
frame here (chunked or incomplete body, Expect, HTTP/1.0, HEAD, a head too large or broken, a
TLS hello on the plain port), goes to the connection's task untouched, which serves it as
before (llmgw.web.server) and then hands the connection back. A request the lane took may
still go to the task halfway (`Exchange.resume`: an engine that failed, a body to relay).
Deadlines are the task path's: the server's expiry task ends a connection whose head is late,
which cancels its task and ends its time here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import trio

from llmgw.netaddr import READ_SIZE
from llmgw.web.http1 import Headers, HttpError, RequestHead, parse_request_head, response_head
from llmgw.web.reactor import GONE, READ, STOPPED, WRITE, Reactor, read_into, write_out
from llmgw.web.server import HEAD_LATE, Request, Responder

if TYPE_CHECKING:
    from llmgw.web.server import ClientConnection, HttpServer

log = logging.getLogger("llmgw.http")
Continuation = Callable[[Responder], Awaitable[None]]
_IN = READ & ~GONE


class Exchange:
    """A request the lane took: answer it with `respond`, or hand the rest to the connection's
    task with `resume`. The lane sets `on_gone`: called if the client hangs up (or the
    connection ends) first, to let go of what the lane holds."""

    __slots__ = ("_fast", "close", "on_gone")

    def __init__(self, fast: FastConnection, close: bool) -> None:
        self._fast = fast
        self.close = close
        self.on_gone: Callable[[], None] | None = None

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self._fast.answer(self, status, headers, body)

    def resume(self, continuation: Continuation) -> None:
        self._fast.hand_over(self, continuation)


class FastLane(Protocol):
    reactor: Reactor

    def offer(self, request: Request, exchange: Exchange) -> bool:
        """True: taken (answered, or to be, through `exchange`); False: nothing was done, the
        task path serves it."""
        ...


class FastPath:
    """The fast lane as HttpServer takes it: a handler's lane and the way a connection is served
    through it. An object handed in, so that llmgw.web.server, which this module builds on, never
    imports this module back (issue 42)."""

    __slots__ = ("lane", "reactor")

    def __init__(self, lane: FastLane) -> None:
        self.lane = lane
        self.reactor = lane.reactor

    def serve(self, server: HttpServer, conn: ClientConnection, first: bool) -> Awaitable[Handoff | None]:
        """Serve `conn` in reactor callbacks until its task must take over (llmgw.web.server)."""
        return FastConnection(server, conn, self.lane, first).serve()


class Handoff:
    """Why `FastConnection.serve` returned: the task serves the request in conn.buf
    (`continuation` None), or finishes one the lane began."""

    __slots__ = ("close", "continuation", "first")

    def __init__(self, first: bool, continuation: Continuation | None = None, close: bool = False) -> None:
        self.first = first
        self.continuation = continuation
        self.close = close


class FastConnection:
    __slots__ = ("_done", "_ended", "_head", "_head_end", "_out", "_paused", "close_after", "conn", "exchange", "fd",
                 "first", "lane", "reactor", "result", "server")

    def __init__(self, server: HttpServer, conn: ClientConnection, lane: FastLane, first: bool) -> None:
        self.server = server
        self.conn = conn
        self.lane = lane
        self.reactor = lane.reactor
        fd = conn.io.fd
        assert fd is not None
        self.fd = fd
        self.first = first
        self.exchange: Exchange | None = None
        self.result: Handoff | None = None
        self.close_after = False
        self._done = trio.Event()
        self._ended = False  # _done is set (a flag: read on every event)
        self._out = b""
        self._paused = False  # stopped reading: a client that floods bytes behind its request
        self._head: RequestHead | None = None  # parsed, its body still coming (`_head_end` bytes in)
        self._head_end = 0

    async def serve(self) -> Handoff | None:
        """Serve requests here until one needs the task (a Handoff) or the connection ends (None)."""
        self._await_head()
        self.reactor.add(self.fd, READ, self._on_event)
        self.reactor.soon(self._serve_next)  # bytes may be buffered already (a request behind one the task served)
        try:
            await self._done.wait()
            return self.result
        finally:
            self.reactor.remove(self.fd)
            if self.exchange is not None:  # cancelled mid-exchange: the server stops, or the reactor did
                self._drop()

    # -- reading ------------------------------------------------------------------------------------

    def _on_event(self, mask: int) -> None:
        try:
            if self._ended:
                return
            if mask & STOPPED:
                self._drop()
                self._finish(None)
                return
            if self._out and mask & WRITE:
                self._flush()
                if self._ended:
                    return
            if mask & (_IN | GONE) and not self._paused:
                self._read(mask)
        except Exception:
            self._fail()

    def _serve_next(self) -> None:
        try:
            self._next()
        except Exception:
            self._fail()

    def _fail(self) -> None:
        """A bug here or in the lane costs this connection, not the reactor (nor a hung client)."""
        log.exception("fast lane failed on a connection from %s; closing it", self.conn.peer)
        self._drop()
        self._finish(None)

    def _read(self, mask: int) -> None:
        conn = self.conn
        busy = self.exchange is not None
        limit = self.server.limits.max_body + READ_SIZE if busy else 0
        had = len(conn.buf)
        if read_into(self.fd, conn.buf, mask, limit=limit):
            conn.eof = True
        elif busy and len(conn.buf) > limit:
            self._paused = True  # read the rest once this request is answered
        if len(conn.buf) > had:
            conn.idle = False
        if conn.eof and self.exchange is not None:
            self._drop()  # the client hung up mid-request: nothing more can be sent
            self._finish(None)
        elif self.exchange is None and not self._out:
            self._next()

    # -- a request ----------------------------------------------------------------------------------

    def _next(self) -> None:
        """Take the next request off the buffer, if it is whole."""
        if self._ended or self.exchange is not None or self._out:
            return
        if self._paused:
            self._paused = False
            self._read(GONE)  # what arrived meanwhile (no new edge will say so)
            return
        conn, server = self.conn, self.server
        if server.draining and not self.first and server.limits.drain_idle <= 0:
            self._finish(None)
            return
        buf = conn.buf
        if not buf:
            if conn.eof:
                self._finish(None)
            return
        if self.first and buf[:1] == b"\x16":
            self._to_task()  # a TLS hello on the plain port: the task answers it
            return
        head, end = self._head, self._head_end
        if head is None:
            scan = conn.head_scan
            scanned = scan.scanned
            try:
                end = scan.find(buf)
            except HttpError:
                self._to_task()
                return
            finally:
                server.head_bytes_scanned += scan.scanned - scanned
            if end < 0:
                if conn.eof:
                    self._to_task()  # it answers "closed inside a request head"
                return
            try:
                head = parse_request_head(bytes(buf[:end]))
            except HttpError:
                self._to_task()
                return
            if (head.chunked or head.expect_continue or head.http10 or head.method == b"HEAD"
                    or (head.content_length or 0) > server.limits.max_body):
                self._to_task()
                return
        need = head.content_length or 0
        if len(buf) - end < need:
            # The body follows the head in writes of its own (the OpenAI SDK's httpx sends two).
            if conn.eof:
                self._to_task()  # it answers "closed inside a request body"
            elif self._head is None:
                self._head, self._head_end = head, end
                conn.await_until(server.limits.body_timeout, server.body_late)
            return
        self._head = None
        request = Request(head, bytes(buf[end:end + need]), conn.peer, None)
        exchange = self.exchange = Exchange(self, close=head.close or server.draining)
        conn.deadline = math.inf
        server.fast_active += 1
        taken = False
        try:
            taken = self.lane.offer(request, exchange)
        except Exception:
            log.exception("fast lane failed on %s %s from %s; the task serves it", request.method, request.path,
                          conn.peer)
        if not taken:
            self._release(exchange)
            self._to_task()
            return
        del buf[:end + need]
        self.first = False

    def answer(self, exchange: Exchange, status: int, headers: Headers, body: bytes) -> None:
        if exchange is not self.exchange:
            return  # the client went away first
        self._release(exchange)
        close = self.close_after = exchange.close or self.server.draining
        self._write(response_head(status, headers, content_length=len(body), close=close) + body)

    def hand_over(self, exchange: Exchange, continuation: Continuation) -> None:
        if exchange is not self.exchange:
            return
        self._release(exchange)
        self._finish(Handoff(False, continuation, close=exchange.close))

    # -- writing ------------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Send `data` (what is not taken now goes when the socket says it is writable)."""
        try:
            self._out = write_out(self.reactor, self.fd, data, self._out)
        except OSError:
            self._finish(None)  # the client went away
            return
        if not self._out:
            self._answered()

    def _flush(self) -> None:
        self._write(self._out)

    def _answered(self) -> None:
        if self.close_after:
            self._finish(None)
            return
        self._await_head()
        if self.conn.buf or self._paused:  # else the next request's bytes will say so themselves
            self.reactor.soon(self._serve_next)  # never from inside the answer: a pipelining client is served in steps

    # -- state --------------------------------------------------------------------------------------

    def _await_head(self) -> None:
        conn = self.conn
        conn.idle = not self.first and not conn.buf
        conn.await_until(self.server.head_timeout(self.first), HEAD_LATE)

    def _release(self, exchange: Exchange) -> None:
        if self.exchange is exchange:
            self.exchange = None
            self.server.fast_active -= 1

    def _drop(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            self._release(exchange)
            if exchange.on_gone is not None:
                exchange.on_gone()

    def _to_task(self) -> None:
        self._finish(Handoff(self.first))

    def _finish(self, result: Handoff | None) -> None:
        if self._ended:
            return
        self._ended = True
        self.result = result
        self.reactor.remove(self.fd)  # no callback reads from it once the task may
        self._done.set()
