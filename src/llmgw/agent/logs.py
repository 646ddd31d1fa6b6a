"""`llmgw ctl logs`, the node's side: an engine's log file read and sent over the fleet stream.

No SSH and no inbound port: the server asks with `LogTail`, the agent answers with `LogChunk`s.
Backpressure is by credit (as HTTP/2 and gRPC flow control): a request starts with a few
credits, each chunk spends one, and the server returns one for every chunk its reader has
taken. A reader that stops reading stops the agent reading the file; at most
`credit × CHUNK_BYTES` of a request is ever in flight, whatever the engine writes.

Engines log to a file per shard (the supervisor's design: they keep logging while the agent
restarts), so adopted engines are followed the same way as launched ones. The file is polled
(FOLLOW_POLL): inotify is not in the standard library, and a tenth of a second is well within
"new lines within a second".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import trio

from llmgw.wire import messages as m

log = logging.getLogger("llmgw.agent.logs")

CHUNK_BYTES = 16 * 1024  # of line text per LogChunk; JSON escaping can make it up to 6× that
LINE_MAX = 8 * 1024  # a longer line is cut (an engine printing a whole tensor)
MAX_CREDIT = 16  # credits a request may hold (a server asking for more gets this many)
MAX_STREAMS = 32  # log requests served at once per node
FOLLOW_POLL = 0.1  # seconds between two looks at a followed file
TAIL_MAX_BYTES = 4 * 1024 * 1024  # read from the end of the file for --tail at most

Send = Callable[[msgspec.Struct], None]


@dataclass(frozen=True)
class LogSource:
    """Where a shard's engine writes, and what to keep out of what is sent."""

    path: str
    redact: Callable[[str], str]
    alive: Callable[[], bool]


class _Credit:
    def __init__(self, initial: int) -> None:
        self.value = max(1, min(initial, MAX_CREDIT))
        self.changed = trio.Event()

    def add(self, n: int) -> None:
        self.value = min(self.value + max(n, 0), MAX_CREDIT)
        self.changed.set()

    async def take(self) -> None:
        while self.value <= 0:
            self.changed = trio.Event()
            await self.changed.wait()
        self.value -= 1


class _Stream:
    def __init__(self, req: m.LogTail) -> None:
        self.req = req
        self.credit = _Credit(req.credit)
        self.scope = trio.CancelScope()


def read_tail(path: str, lines: int) -> tuple[list[str], int]:
    """The last `lines` complete lines of `path` and the offset just after them (where following
    starts). A line still being written is left to the follower."""
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        start = max(0, end - TAIL_MAX_BYTES)
        fh.seek(start)
        data = fh.read(end - start)
    cut = data.rfind(b"\n") + 1  # complete lines only
    body = data[:cut]
    out = body.decode("utf-8", "replace").splitlines()
    if start > 0 and out:
        out = out[1:]  # the first line is probably cut
    return (out[-lines:] if lines > 0 else []), start + cut


def read_new(path: str, offset: int, limit: int = CHUNK_BYTES * 4) -> tuple[list[str], int]:
    """Complete lines written after `offset` (up to about `limit` bytes) and the new offset. A
    file that shrank (replaced, truncated) is read again from its start."""
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        if end < offset:
            offset = 0
        if end == offset:
            return [], offset
        fh.seek(offset)
        data = fh.read(min(end - offset, limit))
    cut = data.rfind(b"\n") + 1
    if cut == 0:
        if len(data) < LINE_MAX:
            return [], offset  # half a line: wait for its end
        cut = len(data)  # a line longer than LINE_MAX arrives in pieces
    return data[:cut].decode("utf-8", "replace").splitlines(), offset + cut


def chunks(lines: list[str]) -> list[list[str]]:
    """Lines grouped into chunks of at most CHUNK_BYTES (long lines cut at LINE_MAX)."""
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for line in lines:
        if len(line) > LINE_MAX:
            line = line[:LINE_MAX] + " …(cut)"
        if current and size + len(line) > CHUNK_BYTES:
            out.append(current)
            current, size = [], 0
        current.append(line)
        size += len(line) + 1
    if current:
        out.append(current)
    return out


class LogStreams:
    """The agent's log requests. `handle` is called from the link's dispatcher (never blocks);
    each request runs as a task in `nursery`; `cancel_all` when the stream to the server ends."""

    def __init__(self, source: Callable[[str], LogSource | None]) -> None:
        self.source = source
        self.streams: dict[str, _Stream] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def handle(self, msg: m.LogTail | m.LogCredit | m.LogCancel, send: Send) -> None:
        if isinstance(msg, m.LogCredit):
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                stream.credit.add(msg.credit)
        elif isinstance(msg, m.LogCancel):
            stream = self.streams.pop(msg.request_id, None)
            if stream is not None:
                stream.scope.cancel()
        else:
            self._start(msg, send)

    def _start(self, req: m.LogTail, send: Send) -> None:
        def refuse(why: str) -> None:
            send(m.LogChunk(request_id=req.request_id, eof=True, error=why))

        if req.request_id in self.streams:
            return refuse(f"log request {req.request_id} is already being served")
        if len(self.streams) >= MAX_STREAMS:
            return refuse(f"this node already serves {MAX_STREAMS} log requests; try again when one ends")
        source = self.source(req.shard_id)
        if source is None:
            return refuse(f"shard {req.shard_id} does not run on this node")
        if self._nursery is None:
            return refuse("the agent is starting; try again")
        stream = _Stream(req)
        self.streams[req.request_id] = stream
        self._nursery.start_soon(self._serve, stream, source, send)

    def cancel_all(self) -> None:
        """The stream to the server ended: nobody reads what these would send."""
        for stream in self.streams.values():
            stream.scope.cancel()
        self.streams.clear()

    async def _serve(self, stream: _Stream, source: LogSource, send: Send) -> None:
        req = stream.req
        error = ""
        with stream.scope:
            try:
                lines, offset = await trio.to_thread.run_sync(read_tail, source.path, req.tail)
                await self._send(stream, send, lines, source)
                while req.follow:
                    new, offset = await trio.to_thread.run_sync(read_new, source.path, offset)
                    if new:
                        await self._send(stream, send, new, source)
                        continue
                    if not source.alive():
                        error = "the engine is no longer running"
                        break
                    await trio.sleep(FOLLOW_POLL)
            except OSError as exc:
                error = f"cannot read {source.path}: {exc.strerror or exc}"
        if self.streams.get(req.request_id) is stream:
            del self.streams[req.request_id]
            if not stream.scope.cancelled_caught:
                send(m.LogChunk(request_id=req.request_id, eof=True, error=error))

    async def _send(self, stream: _Stream, send: Send, lines: list[str], source: LogSource) -> None:
        for part in chunks([source.redact(line) for line in lines]):
            await stream.credit.take()
            send(m.LogChunk(request_id=stream.req.request_id, lines=part))
