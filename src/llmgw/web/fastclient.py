"""One request to an engine on a pooled connection, driven by the reactor (no task waits on it).

The fast lane's half of llmgw.web.client: the same pool, framing and errors, but the request
is written and the answer read in reactor callbacks (llmgw.web.reactor says why). It ends by
calling `done` once with either a Response (its head here; with Content-Length, its whole
body too when it fits `limit`, so `complete_body` returns it) or an UpstreamError. A Response
whose body must still be read or relayed is handed to a task with `to_task` first.

A pooled connection stays registered with the reactor while it is idle in the pool (no epoll
change per request); `EngineConn.detach` takes it out before a task waits on it or it is closed.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.web.client import EngineConn, Response, Upstream, UpstreamError, close_soon
from llmgw.web.http1 import HttpError, find_head_end, parse_response_head
from llmgw.web.reactor import GONE, READ, STOPPED, WRITE, Reactor, read_into, write_out

Done = Callable[[Response | UpstreamError], None]


class StaleConnection(UpstreamError):
    """A reused connection closed before any byte of the answer: the engine closed it while
    idle (keep-alive timeout, restart). Not the engine's failure: retried on a new connection."""


def _ignore(mask: int) -> None:
    """An idle pooled connection's events: nothing to do (an engine that closed it is found out
    by the next request, as on the task path)."""


class FastCall:
    __slots__ = ("_fd", "_out", "_scanned", "conn", "done", "limit", "pool", "reactor", "response")

    def __init__(self, pool: Upstream, conn: EngineConn, reactor: Reactor, limit: int, done: Done) -> None:
        self.pool = pool
        self.conn = conn
        self.reactor = reactor
        self.limit = limit  # a body up to this is read whole here; a larger one is the task's
        self.done: Done | None = done
        self.response: Response | None = None
        self._fd = conn.raw.fd
        self._out = b""
        self._scanned = 0

    def start(self, data: bytes) -> None:
        conn, fd, reactor = self.conn, self._fd, self.reactor
        if conn.detach is None:
            reactor.add(fd, READ, self._on_event)
            conn.detach = lambda: reactor.remove(fd)
        else:
            reactor.set(fd, self._on_event)
        self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            self._out = write_out(self.reactor, self._fd, data, self._out)
        except OSError as exc:
            self._fail(exc, before_answer=True)

    def to_task(self) -> None:
        """The Response goes to a task (which reads through trio): the reactor lets go of it."""
        self.conn.forget()

    def abandon(self) -> None:
        """Nobody wants the answer any more (client gone, timed out, engine evicted): the
        connection is in an unknown state, so it is closed."""
        if self.done is None and self.response is not None:
            return  # it ended already; the Response owns the connection
        self.done = None
        self.response = None
        close_soon(self.conn)

    def _on_event(self, mask: int) -> None:
        if self.done is None or mask & STOPPED:
            return  # stopped: the client's side lets go of this call
        if self._out and mask & WRITE:
            self._write(self._out)
            if self.done is None:
                return  # the write failed: the call ended
        if not mask & (READ | GONE):
            return
        self._parse(read_into(self._fd, self.conn.buf, mask))

    def _parse(self, eof: bool) -> None:
        conn = self.conn
        response = self.response
        while response is None:
            try:
                end = find_head_end(conn.buf, self._scanned)
                if end < 0:
                    self._scanned = len(conn.buf)
                    if eof:
                        kind = "reset" if not conn.buf else "protocol"
                        self._fail(None, before_answer=kind == "reset", kind=kind)
                    return
                raw = bytes(conn.buf[:end])
                del conn.buf[:end]
                self._scanned = 0
                head = parse_response_head(raw)
            except HttpError as exc:
                self._end(UpstreamError("protocol", f"bad response from engine: {exc}"))
                return
            if head.status >= 200:  # 100 Continue and friends: the real head follows
                if self._out:
                    # It answered before taking the whole request (an early 413, say): the rest is
                    # not sent, and the connection is not reused (it would carry our leftover).
                    self._out = b""
                    self.reactor.want(self._fd, READ)
                    head.close = True
                response = self.response = Response(self.pool, conn, head)
        head = response.head
        need = head.content_length
        if need is not None and not head.chunked and head.has_body and need <= self.limit and len(conn.buf) < need:
            if eof:
                self._end(UpstreamError("protocol", "engine closed the connection inside a body"))
            return  # the rest of the body is on its way
        self._end(response)

    def _fail(self, exc: OSError | None, *, before_answer: bool, kind: str = "reset") -> None:
        pool = self.pool
        why = f"{pool.host}:{pool.port} closed the connection" + (f" ({exc.strerror or exc})" if exc else "")
        if before_answer and self.conn.reused:
            self._end(StaleConnection("reset", why))
        else:
            self._end(UpstreamError(kind, why + ("" if kind == "reset" else " before answering")))

    def _end(self, result: Response | UpstreamError) -> None:
        done, self.done = self.done, None
        self.reactor.set(self._fd, _ignore)
        if isinstance(result, UpstreamError):
            self.response = None
            close_soon(self.conn)
        if done is not None:
            done(result)
