"""`ctl logs MODEL`: a model's engine log, following the model across moves, as `kubectl logs -f
deploy/X` follows a deployment's pod.

`GET /api/v1/logs/{name}?replica=&shard=&tail=&follow=` takes a model name or a replica id.
A model's replica is picked (`replica=` one of its ids; else its first ready replica, oldest
first; else its first); a replica id is that replica. The answer is NDJSON, one object a line:
`{"line": …, "replica": …, "rank": …}` for an engine's line (`rank` only where a replica has
several shards and no `shard=` was given) and `{"note": …}` for llmgw's own words: which
replica was picked, and, with follow, each switch. The reader prints lines on stdout and notes
on stderr, so `ctl logs MODEL -f | grep` sees the engine's lines alone and an engine cannot
forge a note (its lines are JSON strings).

With follow, a model is followed across moves: the replica's log ends when its engine exits
(a drain's, a rollout's or a restart's retirement: the old one drains first, so its last lines
are read), then its move's successor is followed from the start of its log (up to
SUCCESSOR_TAIL lines: what it printed while surging is new to the reader). A replica whose
engine failed and was placed again is followed on its new attempt; one gone without a move
gives way to the model's pick. The reconciler's book is looked at every POLL seconds while
waiting (nothing waits on it otherwise); the reader hanging up ends it all.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import trio

from llmgw.server.answers import send_error
from llmgw.server.logs import LogHub, LogProblem, Target, log_query, targets_of
from llmgw.server.states import LEAVING, ReplicaState

log = logging.getLogger("llmgw.server.logs")

POLL = 0.25  # seconds between two looks at the book while waiting for a successor
SUCCESSOR_TAIL = 1_000  # lines of a successor's log to start with (its startup, printed while it surged)


class Picked(msgspec.Struct, frozen=True):
    replica: Any  # the reconciler's Replica
    note: str  # what was picked, and why, for the reader


def pick(book: Any, name: str, replica_id: str = "") -> Picked | LogProblem:
    """The replica `name` (a model or a replica id) stands for; or why there is none."""
    if name in book.replicas and name not in book.models:
        if replica_id and replica_id != name:
            return LogProblem(400, f"{name} is a replica; replica= picks one of a model's")
        return Picked(book.replicas[name], "")
    of_model = book.of_model(name)
    if not of_model and name not in book.models:
        models = ", ".join(sorted(book.models)[:8]) or "none"
        return LogProblem(404, f"no model or replica {name!r} (models: {models})")
    if replica_id:
        chosen = next((r for r in of_model if r.id == replica_id), None)
        if chosen is None:
            ids = ", ".join(r.id for r in of_model) or "none"
            return LogProblem(404, f"model {name} has no replica {replica_id!r} (its replicas: {ids})")
        return Picked(chosen, f"{name}: replica {chosen.id} ({_where(chosen)})")
    serving = [r for r in of_model if r.state not in LEAVING]
    ready = [r for r in serving if r.state == ReplicaState.READY]
    chosen = (ready or serving or of_model or [None])[0]
    if chosen is None:
        return LogProblem(409, f"model {name} has no replica now (wanted: {book.models[name].replicas})")
    others = f"; {len(of_model)} replicas, --replica picks another" if len(of_model) > 1 else ""
    first = "first ready replica" if ready else "replica"
    return Picked(chosen, f"{name}: {first} {chosen.id} ({_where(chosen)}){others}")


def _where(replica: Any) -> str:
    nodes = ", ".join(dict.fromkeys(s.node for s in sorted(replica.shards, key=lambda s: s.rank)))
    return f"{replica.state}" + (f" on {nodes}" if nodes else "")


def successor_of(book: Any, replica_id: str) -> tuple[Any, Any] | None:
    """The newest move that replaced `replica_id`, and its successor if that still exists."""
    for move in sorted(book.moves.values(), key=lambda mv: mv.id, reverse=True):
        if move.replica == replica_id and move.successor:
            return move, book.replicas.get(move.successor)
    return None


class ModelLogs:
    """`GET /api/v1/logs/{name}` over the hub and the reconciler's book."""

    def __init__(self, hub: LogHub, book: Any) -> None:
        self.hub = hub
        self.book = book  # the reconciler: replicas, of_model(), models, moves

    async def serve(self, name: str, query: str, responder: Any) -> None:
        try:
            asked = log_query(query)
        except ValueError as exc:
            await send_error(responder, 400, str(exc), "bad_request")
            return
        shard, tail, follow = asked.shard, asked.tail, asked.follow
        picked = pick(self.book, name, asked.replica)
        if isinstance(picked, LogProblem):
            await send_error(responder, picked.status, str(picked), _code(picked.status))
            return
        replica = picked.replica
        try:
            targets = targets_of(replica, shard)
            self.hub.check(targets)  # before the first note: a node that cannot send is an error, not a note
        except LogProblem as exc:
            await send_error(responder, exc.status, str(exc), _code(exc.status))
            return
        model_mode = name != replica.id
        out = _Out(responder)
        responder.watch_disconnect()  # a reader that hangs up ends the request (and the node's reading)
        if picked.note:
            await out.note(picked.note)
        while True:
            try:
                await self._stream(out, replica, targets, shard, tail, follow)
            except LogProblem as exc:
                if not out.started:
                    await send_error(responder, exc.status, str(exc), _code(exc.status))
                    return
                await out.note(str(exc))
            if not follow or not model_mode:
                break
            replica, targets = await self._next(out, replica, targets, shard)
            tail = SUCCESSOR_TAIL
        await out.end()

    async def _stream(self, out: _Out, replica: Any, targets: list[Target], shard: int | None, tail: int,
                      follow: bool) -> None:
        multi = len(replica.shards) > 1 and shard is None

        async def emit(target: Target, lines: list[str]) -> None:
            extra = {"rank": target.rank} if multi else {}
            await out.send(b"".join(_enc({"line": line, "replica": replica.id, **extra}) for line in lines))

        async def note(target: Target, words: str) -> None:
            await out.note(f"[rank {target.rank}] {words}" if multi else words)

        await self.hub.stream(targets, tail=tail, follow=follow, emit=emit, note=note)

    async def _next(self, out: _Out, old: Any, targets: list[Target], shard: int | None) -> tuple[Any, list[Target]]:
        """Wait until there is a log to follow after `old`'s ended; say which, and why."""
        said = ""
        shard_ids = {t.shard_id for t in targets}
        while True:
            book = self.book
            current = book.replicas.get(old.id)
            found = successor_of(book, old.id)
            nxt, why = None, ""
            if current is not None and current.state not in LEAVING:
                if current.shards and {s.shard_id for s in current.shards} != shard_ids:
                    nxt, why = current, f"{old.id} was placed again ({_where(current)}); following it"
            elif found is not None:
                move, successor = found
                if successor is not None and successor.shards:
                    nxt, why = successor, (f"{old.id} retired by a {move.kind} ({move.reason}); following its "
                                           f"successor {successor.id} ({_where(successor)})")
                elif not said.startswith("waiting for"):
                    said = f"waiting for {move.successor}, the successor of {old.id} ({move.kind}), to be placed"
                    await out.note(said)
            else:
                picked = pick(book, old.model)
                if not isinstance(picked, LogProblem) and picked.replica.id != old.id and picked.replica.shards:
                    nxt, why = picked.replica, f"{old.id} is gone; {picked.note}"
            if nxt is not None:
                try:
                    new_targets = targets_of(nxt, shard)
                except LogProblem:
                    new_targets = []
                if new_targets:
                    await out.note(why)
                    return nxt, new_targets
            elif not said and current is not None:
                said = f"the log of {old.id} ended ({_where(current)}); waiting for it to be placed again or replaced"
                await out.note(said)
            await trio.sleep(POLL)  # ok: nothing signals a change of the book; cancelled when the reader goes


class _Out:
    """The NDJSON answer: started by the first line or note."""

    def __init__(self, responder: Any) -> None:
        self.responder = responder
        self.started = False

    async def send(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            await self.responder.start(200, [(b"content-type", b"application/x-ndjson")], data)
        else:
            await self.responder.send(data)

    async def note(self, words: str) -> None:
        await self.send(_enc({"note": words}))

    async def end(self) -> None:
        if not self.started:
            self.started = True
            await self.responder.start(200, [(b"content-type", b"application/x-ndjson")])
        await self.responder.end()


def _enc(obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


def _code(status: int) -> str:
    return {400: "bad_request", 404: "not_found", 503: "unavailable"}.get(status, "conflict")
