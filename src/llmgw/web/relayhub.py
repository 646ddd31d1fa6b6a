"""One task that relays every streamed response body: engine socket → client socket.

Why: relaying a token stream is a small read and a small write per token, thousands of times
a second. With one trio task per stream, each token also costs a task wake-up and two epoll
registration changes; measured on the gateway benchmark (200 streams × 200 tokens, 2 cores)
a bare trio relay with no parsing at all used ~24 µs of CPU per token, above the gateway's
bar of 20 µs. Here the engine sockets stay registered in an epoll set of our own; the hub
task waits (through trio) for that set to become readable and then serves every stream that
has data in one pass, so the per-token cost is the read, the framing scan and the write.
The figures are in bench/bench_gateway.py's output.

Each stream's own task (the request handler) waits on an event; cancelling it (the server
stops) takes the stream out of the hub at once. A client that reads slowly is handled by
parking the stream until its socket is writable again. The hub also watches each client socket
for its hang-up (EPOLLRDHUP: the client closed its side, as a read of EOF tells) and ends the
stream at once, so the gateway starts no watcher task for a stream the hub relays: that task,
started and cancelled once per stream, was ~9 % of the gateway's samples in a 200-stream burst
(py-spy, issue 17).

epoll is Linux's: elsewhere the hub is created and runs all the same but relays nothing
(`splices` is False), and llmgw.web.relay, which alone chooses the path of each stream, relays
every stream in its own task. Nothing here reads select's epoll names at import.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable

import trio

from llmgw.netaddr import READ_SIZE
from llmgw.web.http1 import ChunkedScanner, HttpError

_epoll = getattr(select, "epoll", None)  # Linux only: see above


class RelayError(Exception):
    """`kind`: upstream (engine broke or went silent), client (client went away or stopped
    reading); `timeout` says it was a timeout rather than a broken connection."""

    def __init__(self, kind: str, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.timeout = timeout


class _Stream:
    __slots__ = (
        "client_fd", "done", "error", "first", "last", "leftover", "on_first", "pending", "scanner", "upstream_fd",
    )

    def __init__(self, upstream_fd: int, client_fd: int, on_first: Callable[[], None] | None, now: float) -> None:
        self.upstream_fd = upstream_fd
        self.client_fd = client_fd
        self.scanner = ChunkedScanner()
        self.done = trio.Event()
        self.error: RelayError | None = None
        self.on_first = on_first
        self.first = on_first is not None
        self.pending = b""  # bytes the client socket did not take yet
        self.leftover = b""  # bytes after the body (a misbehaving engine): the connection is not reused
        self.last = now


class RelayHub:
    _ep: select.epoll  # only where `splices`
    _in: int
    _out: int
    _hup: int  # watched on every client socket: the client closed its side
    _gone: int  # what says so in an event: RDHUP, HUP or ERR

    def __init__(self, coalesce: float = 0.0, busy_rate: float = 2000.0, rate_window: float = 0.05) -> None:
        # Under load (more than `busy_rate` tokens a second through the hub), passes are
        # `coalesce` seconds apart so that one wake-up serves many tokens; below it, every
        # token is relayed the moment it arrives.
        #
        # The rate is a count of events decayed over `rate_window` seconds, divided by the
        # window. (An average of events/gap per pass, as before, is biased upwards: two
        # tokens 50 µs apart read as 20,000/s, so a few hundred tokens a second looked busy
        # and got the coalescing delay meant for load.)
        self.coalesce = coalesce
        self.busy_rate = busy_rate
        self.rate_window = rate_window
        self.rate = 0.0  # tokens per second over about the last rate_window
        self.passes = 0  # passes served (for tests and metrics)
        self.gaps = 0  # coalescing gaps taken
        self.streams = 0  # streams relayed (for tests and metrics)
        self._last_pass = 0.0
        ep = _epoll() if _epoll is not None else None
        self.splices = ep is not None  # False: every stream is relayed in its own task (llmgw.web.relay)
        if ep is not None:
            self._ep = ep
            self._in, self._out = select.EPOLLIN, select.EPOLLOUT
            self._hup = select.EPOLLRDHUP
            self._gone = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
        self._by_fd: dict[int, _Stream] = {}  # upstream fd (readable) or client fd (writable, when parked)
        self._wake = trio.Event()

    def close(self) -> None:
        if self.splices:
            self._ep.close()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The hub's task (`await nursery.start(hub.run)`: ready before the first request);
        closes the hub when it ends."""
        try:
            task_status.started()
            if not self.splices:
                await trio.sleep_forever()
            else:
                await self._serve(self._ep)
        finally:
            self.close()

    async def _serve(self, ep: select.epoll) -> None:
        """Serve ready streams whenever the epoll set is readable.

        The loop body is the per-token hot path, kept flat on purpose (locals, no helper
        calls for the common case of one whole chunk read and written at once)."""
        ep_fd = ep.fileno()
        by_fd = self._by_fd
        read, write = os.read, os.write
        wait_readable = trio.lowlevel.wait_readable
        current_time = trio.current_time
        while True:
            if not by_fd:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            await wait_readable(ep_fd)
            now = current_time()
            events = ep.poll(0, 1024)
            for fd, mask in events:
                stream = by_fd.get(fd)
                if stream is None:
                    continue
                if fd == stream.client_fd:
                    if mask & self._gone:
                        self._finish(stream, RelayError("client", "client went away (closed its connection)"))
                    elif stream.pending:
                        self._flush(stream, now)
                    continue
                try:
                    data = read(fd, READ_SIZE)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    self._finish(stream, RelayError("upstream", f"engine connection failed mid-stream: {exc}"))
                    continue
                if not data:
                    self._finish(stream, RelayError("upstream", "engine closed the connection mid-stream"))
                    continue
                scanner = stream.scanner
                if stream.first or stream.pending:
                    self._consume(stream, data, now)
                    continue
                try:
                    used = scanner.scan(data)
                except HttpError as exc:
                    self._finish(stream, RelayError("upstream", str(exc)))
                    continue
                stream.last = now
                if used < len(data):
                    stream.leftover = data[used:]
                    data = data[:used]
                try:
                    sent = write(stream.client_fd, data)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self._finish(stream, RelayError("client", f"client went away: {exc}"))
                    continue
                if sent < len(data):
                    self._park(stream, data[sent:])
                elif scanner.done:
                    self._finish(stream)
            self.passes += 1
            if self.coalesce:
                # Token rate; under load, leave a gap so the next pass serves many.
                window = self.rate_window
                elapsed = now - self._last_pass
                self._last_pass = now
                keep = 1.0 - elapsed / window if elapsed < window else 0.0
                self.rate = self.rate * keep + len(events) / window
                if self.rate >= self.busy_rate:
                    self.gaps += 1
                    await trio.sleep(self.coalesce)

    async def relay(self, upstream_fd: int, client_fd: int, initial: bytes, idle_timeout: float,
                    on_first: Callable[[], None] | None = None) -> tuple[int, bytes]:
        """Relay a chunked body until its end; returns (chunks, bytes read past the end).
        Raises RelayError; cancellation removes the stream from the hub. The idle timeout
        applies to the engine (nothing read) and to the client (a parked write not taken).
        Only where `splices` (llmgw.web.relay checks)."""
        if not self.splices:
            raise RuntimeError("no epoll on this platform: relay the stream in its own task (llmgw.web.relay)")
        self.streams += 1
        stream = _Stream(upstream_fd, client_fd, on_first, trio.current_time())
        try:
            if initial:
                self._consume(stream, initial, stream.last)
            if not stream.done.is_set():
                if not stream.pending:  # parked on the client already: _flush registers the engine
                    self._register(stream, client_fd, self._hup)
                    if not stream.done.is_set():
                        self._register(stream, upstream_fd, self._in)
                self._wake.set()
            while not stream.done.is_set():
                with trio.move_on_at(stream.last + idle_timeout):
                    await stream.done.wait()
                if not stream.done.is_set() and trio.current_time() - stream.last >= idle_timeout:
                    if stream.pending:
                        raise RelayError("client", f"client read nothing for {idle_timeout:g}s mid-stream",
                                         timeout=True)
                    raise RelayError("upstream", f"engine sent nothing for {idle_timeout:g}s mid-stream", timeout=True)
            if stream.error is not None:
                raise stream.error
            return stream.scanner.chunks, stream.leftover
        finally:
            self._detach(stream)

    def _detach(self, stream: _Stream) -> None:
        for fd in (stream.upstream_fd, stream.client_fd):
            if self._by_fd.get(fd) is stream:
                del self._by_fd[fd]
                try:
                    self._ep.unregister(fd)
                except (OSError, ValueError):
                    pass

    def _finish(self, stream: _Stream, error: RelayError | None = None) -> None:
        stream.error = error
        self._detach(stream)
        stream.done.set()

    def _register(self, stream: _Stream, fd: int, mask: int) -> None:
        """Watch fd for the stream; a failure ends that stream, never the hub's task."""
        try:
            self._ep.register(fd, mask)
        except OSError as exc:
            side = "client" if fd == stream.client_fd else "upstream"
            self._finish(stream, RelayError(side, f"cannot watch the {side} connection: {exc}"))
            return
        self._by_fd[fd] = stream

    def _consume(self, stream: _Stream, data: bytes, now: float) -> None:
        stream.last = now
        scanner = stream.scanner
        try:
            used = scanner.scan(data)
        except HttpError as exc:
            self._finish(stream, RelayError("upstream", str(exc)))
            return
        if used < len(data):
            stream.leftover = data[used:]
            data = data[:used]
        if stream.first and scanner.first_data:
            stream.first = False
            stream.on_first()  # type: ignore[misc]
        self._write(stream, data)
        if scanner.done and not stream.pending and stream.error is None:
            self._finish(stream)

    def _write(self, stream: _Stream, data: bytes) -> None:
        try:
            sent = os.write(stream.client_fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._finish(stream, RelayError("client", f"client went away: {exc}"))
            return
        if sent < len(data):
            self._park(stream, data[sent:])

    def _watch_client(self, stream: _Stream, mask: int) -> None:
        """The client socket's events: its hang-up always, writability while parked."""
        if self._by_fd.get(stream.client_fd) is stream:
            try:
                self._ep.modify(stream.client_fd, mask)
            except OSError as exc:
                self._finish(stream, RelayError("client", f"cannot watch the client connection: {exc}"))
        else:
            self._register(stream, stream.client_fd, mask)

    def _park(self, stream: _Stream, rest: bytes) -> None:
        """The client is slower than the engine: stop reading the engine until it catches up."""
        stream.pending = rest
        if self._by_fd.get(stream.upstream_fd) is stream:
            try:
                self._ep.unregister(stream.upstream_fd)
            except (OSError, ValueError):
                pass
            del self._by_fd[stream.upstream_fd]
        self._watch_client(stream, self._out | self._hup)

    def _flush(self, stream: _Stream, now: float) -> None:
        data, stream.pending = stream.pending, b""
        self._watch_client(stream, self._hup)
        if stream.done.is_set():
            return
        stream.last = now
        self._write(stream, data)
        if stream.pending or stream.done.is_set():
            return
        if stream.scanner.done:
            self._finish(stream)
            return
        self._register(stream, stream.upstream_fd, self._in)
