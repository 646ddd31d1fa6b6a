"""`llmgw ctl logs`, the server's side: relay an engine's log from its node to an HTTP reader.

`GET /api/v1/replicas/{replica}/logs?shard=&tail=&follow=` asks each shard's agent with
`LogTail` and streams what comes back as text/plain, one line per line (with `[rank N] ` in
front when a replica has several shards and no `shard=` was given). Memory stays bounded end
to end: each request has a channel of CREDIT chunks; a credit goes back to the agent only after
a chunk was written to the reader, so a slow terminal slows the agent's reading instead of
filling the server (at most CREDIT × 16 KiB per shard in flight).
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from llmgw.server.answers import send_error
from llmgw.server.links import Link, Links
from llmgw.wire import messages as m

log = logging.getLogger("llmgw.server.logs")

CREDIT = 4  # chunks in flight per shard and reader
TAIL_MAX = 10_000  # lines `tail=` may ask for


@dataclass(frozen=True)
class LogQuery:
    """What a logs request asks (`shard=`, `tail=`, `follow=`, `replica=`), for both log routes."""

    shard: int | None
    tail: int
    follow: bool
    replica: str


def log_query(query: str) -> LogQuery:
    """The query string read; ValueError when shard= or tail= is not a whole number."""
    from urllib.parse import parse_qs

    args = {k: v[-1] for k, v in parse_qs(query).items()}
    try:
        shard = int(args["shard"]) if args.get("shard") else None
        tail = max(0, min(int(args.get("tail") or 200), TAIL_MAX))
    except ValueError:
        raise ValueError("shard= and tail= take whole numbers") from None
    return LogQuery(shard=shard, tail=tail, follow=args.get("follow", "") in ("1", "true", "yes"),
                    replica=args.get("replica", ""))


@dataclass
class _Route:
    node_id: str
    channel: trio.MemorySendChannel[m.LogChunk]


class LogProblem(Exception):
    """Why no log can be streamed (one line for the reader), with an HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Target:
    shard_id: str
    node_id: str
    rank: int


class LogHub:
    """Routes `LogChunk`s from the fleet streams to the readers that asked for them."""

    def __init__(self, links: Links) -> None:
        self.links = links  # node id → its live fleet stream (read only: server/links.py)
        self.routes: dict[str, _Route] = {}
        self._ids = itertools.count(1)
        self._overrun_logged: set[str] = set()

    def deliver(self, node_id: str, msg: m.LogChunk) -> None:
        """A chunk from a node's stream (never blocks the stream's reader)."""
        route = self.routes.get(msg.request_id)
        if route is None or route.node_id != node_id:
            return  # a request that ended (or another node's): nothing waits for it
        try:
            route.channel.send_nowait(msg)
        except trio.WouldBlock:
            # More chunks than credits given: the agent ignores flow control. Its reader cannot
            # fall behind unboundedly, so the request ends here.
            if node_id not in self._overrun_logged:
                self._overrun_logged.add(node_id)
                log.warning("node %s sent log chunks beyond its credit; ending that log request", node_id)
            route.channel.close()
            del self.routes[msg.request_id]
        except trio.BrokenResourceError:
            self.routes.pop(msg.request_id, None)

    def node_gone(self, node_id: str) -> None:
        """The node's stream ended: its readers get the end of their logs."""
        for request_id, route in list(self.routes.items()):
            if route.node_id == node_id:
                route.channel.close()
                del self.routes[request_id]

    async def stream(self, targets: list[Target], *, tail: int, follow: bool,
                     write: Callable[[bytes], Any] | None = None, prefix: bool = False, emit: Emit | None = None,
                     note: Note | None = None) -> None:
        """Ask every target's node for its log and hand the lines on as they come, until every
        log ends (or, with `follow`, until the reader goes away and the caller is cancelled):
        to `emit(target, lines)` and `note(target, words)`, or as text to `write` (with
        `[rank N] ` in front when `prefix`, llmgw's own words as `-- llmgw: ` lines)."""
        if emit is None or note is None:
            assert write is not None
            emit, note = _as_text(write, prefix)
        sessions = self.check(targets)
        lock = trio.Lock()
        async with trio.open_nursery() as nursery:
            for t in targets:
                nursery.start_soon(self._one, t, sessions[t.node_id], tail, follow, emit, note, lock)

    def check(self, targets: list[Target]) -> dict[str, Link]:
        """The live streams by node, when every target's node can send its log now; else LogProblem."""
        sessions: dict[str, Link] = {}
        for t in targets:
            session = self.links.get(t.node_id)
            if session is None:
                raise LogProblem(503, f"node {t.node_id} is not connected, so the log of {t.shard_id} cannot be "
                                      "read now")
            if not session.supports(m.FEATURE_LOGS):
                raise LogProblem(409, f"the agent on {t.node_id} is too old to send engine logs; upgrade it")
            sessions[t.node_id] = session
        return sessions

    async def _one(self, target: Target, session: Any, tail: int, follow: bool, emit: Emit, note: Note,
                   lock: trio.Lock) -> None:
        request_id = f"logs-{next(self._ids)}-{secrets.token_hex(4)}"
        send, receive = trio.open_memory_channel[m.LogChunk](CREDIT)
        self.routes[request_id] = _Route(target.node_id, send)
        session.send(m.LogTail(request_id=request_id, shard_id=target.shard_id, tail=tail, follow=follow,
                               credit=CREDIT))
        ended = False
        try:
            async with receive:
                async for chunk in receive:
                    if chunk.lines:
                        async with lock:
                            await emit(target, chunk.lines)
                        session.send(m.LogCredit(request_id=request_id, credit=1))
                    if chunk.eof:
                        ended = True
                        if chunk.error:
                            async with lock:
                                await note(target, f"{target.shard_id} on {target.node_id}: {chunk.error}")
                        break
                else:
                    if follow:
                        async with lock:
                            await note(target, f"the stream to {target.node_id} ended")
        finally:
            self.routes.pop(request_id, None)
            if not ended:
                session.send(m.LogCancel(request_id=request_id))


Emit = Callable[[Target, list[str]], Awaitable[None]]  # engine lines of one target
Note = Callable[[Target, str], Awaitable[None]]  # llmgw's own words about one target


def _as_text(write: Callable[[bytes], Any], prefix: bool) -> tuple[Emit, Note]:
    """text/plain: `[rank N] ` in front of each line when asked, llmgw's words as `-- llmgw: ` lines."""

    async def emit(target: Target, lines: list[str]) -> None:
        front = f"[rank {target.rank}] " if prefix else ""
        await write("".join(f"{front}{line}\n" for line in lines).encode("utf-8", "replace"))

    async def note(target: Target, words: str) -> None:
        front = f"[rank {target.rank}] " if prefix else ""
        await write(f"{front}-- llmgw: {words}\n".encode("utf-8", "replace"))

    return emit, note


def targets_of(replica: Any, shard: int | None) -> list[Target]:
    """The shards of `replica` whose logs are asked for: all, or the one of rank `shard`."""
    shards = sorted(replica.shards, key=lambda s: s.rank)
    if shard is not None:
        shards = [s for s in shards if s.rank == shard]
        if not shards:
            ranks = ", ".join(str(s.rank) for s in replica.shards) or "none"
            raise LogProblem(404, f"replica {replica.id} has no shard of rank {shard} (ranks: {ranks})")
    if not shards:
        raise LogProblem(409, f"replica {replica.id} runs nowhere yet ({replica.state}); no engine log to read")
    return [Target(shard_id=s.shard_id, node_id=s.node, rank=s.rank) for s in shards]


class EngineLogs:
    """`GET /api/v1/replicas/{replica}/logs?shard=&tail=&follow=` over the hub: finds the
    replica's shards, streams their lines as text/plain, ends when every log has (or, with
    follow, when the reader hangs up: the request is cancelled and each node told)."""

    def __init__(self, hub: LogHub, replica: Callable[[str], Any]) -> None:
        self.hub = hub
        self.replica = replica  # replica id → the reconciler's replica, or None

    async def serve(self, replica_id: str, query: str, responder: Any) -> None:
        replica = self.replica(replica_id)
        if replica is None:
            await send_error(responder, 404, f"no replica {replica_id!r}", "not_found")
            return
        try:
            asked = log_query(query)
        except ValueError as exc:
            await send_error(responder, 400, str(exc), "bad_request")
            return
        shard, tail, follow = asked.shard, asked.tail, asked.follow
        try:
            targets = targets_of(replica, shard)
        except LogProblem as exc:
            await send_error(responder, exc.status, str(exc), "not_found" if exc.status == 404 else "conflict")
            return
        started = False
        head = [(b"content-type", b"text/plain; charset=utf-8")]

        async def write(data: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                await responder.start(200, head, data)
            else:
                await responder.send(data)

        responder.watch_disconnect()  # a reader that hangs up ends the request (and the node's reading)
        try:
            await self.hub.stream(targets, tail=tail, follow=follow, write=write,
                                  prefix=len(replica.shards) > 1 and shard is None)
        except LogProblem as exc:
            if not started:
                await send_error(responder, exc.status, str(exc), "unavailable" if exc.status == 503 else "conflict")
                return
        if not started:
            await responder.start(200, head)
        await responder.end()
