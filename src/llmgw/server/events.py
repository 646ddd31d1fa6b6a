"""The event log: what an SRE asks about afterwards ("what happened to gpu-02 last night?").

Node state changes, placements and replica transitions (with the engine's last lines on a
failure), breaker openings and closings, refused certificates, config reloads, drains. Kept in
an embedded SQLite file in the server's state directory (`events.db`, WAL), so it survives a
restart; DESIGN.md puts cordon marks and subnet-manager history in the same kind of file.

The event loop never touches the database: `record()` only appends to a bounded queue
(MAX_PENDING events; past that the oldest are dropped and counted, as a log handler would), a
writer task flushes it in batches in a worker thread (`trio.to_thread`), and queries run there
too. A disk that is full or read-only degrades the log to memory (the last MEMORY_EVENTS
events) with one warning, never a crash; a database that is not one (corrupt, truncated) is
moved aside as `events.db.corrupt-<time>` with a warning and a new one started.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import trio

from llmgw.server.sqlitefile import connect_checked, move_aside
from llmgw.wire.ids import printable

log = logging.getLogger("llmgw.server.events")

MAX_PENDING = 10_000  # events waiting for the writer; a burst past this drops the oldest
MEMORY_EVENTS = 10_000  # kept when the database cannot be written (a full or read-only disk)
BATCH = 500  # events per write transaction
QUERY_LIMIT = 1_000  # events one query answers at most (the newest of those that match)
TAIL_LINES = 20  # engine output lines kept with a failure event
PRUNE_EVERY = 3600.0  # seconds between two retention sweeps
DEFAULT_RETENTION = 14 * 86400.0


class Event(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One thing that happened, as `GET /api/v1/events` shows it."""

    id: int = 0
    time: float  # wall clock, seconds since the epoch
    kind: str  # node | port | placement | replica | breaker | cert | reload | drain | rollout | restart
    message: str
    node: str = ""  # the node it is about (a replica on several: its rank 0's; a move: the node left)
    nodes: list[str] = []  # every node it is about, when more than one (a multi-node replica's)
    model: str = ""
    replica: str = ""
    detail: list[str] = []  # the engine's last lines, for a failure


class EventQuery(msgspec.Struct, kw_only=True, frozen=True):
    since: float = 0.0  # wall clock; events at or after it
    after: int = 0  # events with a larger id (`ctl events --watch` asks for what is new)
    node: str = ""
    model: str = ""
    limit: int = QUERY_LIMIT

    def matches(self, e: Event) -> bool:
        return (e.time >= self.since and e.id > self.after
                and (not self.node or e.node == self.node or self.node in e.nodes)
                and (not self.model or e.model == self.model))


_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    node TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    replica TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    nodes TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_time ON events(time);
CREATE INDEX IF NOT EXISTS events_node ON events(node, id);
CREATE INDEX IF NOT EXISTS events_model ON events(model, id);
"""


class EventLog:
    """The server's event log. `record()` from anywhere in the event loop; `run()` is the writer."""

    def __init__(self, state_dir: str | Path, *, retention: float = DEFAULT_RETENTION,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(state_dir) / "events.db"
        self.retention = retention
        self.clock = clock
        self.db: sqlite3.Connection | None = None
        self.degraded = ""  # why events are kept in memory only ("" while the database works)
        self.memory: deque[Event] = deque(maxlen=MEMORY_EVENTS)
        self.dropped = 0
        self._pending: deque[Event] = deque()
        self._wake = trio.Event()
        self._lock = trio.Lock()  # one worker thread at a time uses the connection
        self._next_memory_id = 1
        self.written = trio.Event()  # set after each flush; replaced (tests and --watch wait on it)

    # -- recording (event loop, never blocks) -------------------------------------------------------

    def record(self, kind: str, message: str, *, node: str = "", model: str = "", replica: str = "",
               detail: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        lines = [printable(line) for line in list(detail)[-TAIL_LINES:]]
        every = sorted({*nodes, *([node] if node else [])})
        event = Event(time=self.clock(), kind=kind, message=printable(message),
                      node=node or (every[0] if every else ""),
                      nodes=every if len(every) > 1 else [], model=model, replica=replica, detail=lines)
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                log.warning("event log: %d events dropped (the writer cannot keep up)", self.dropped)
        self._pending.append(event)
        self._wake.set()

    # -- the writer ----------------------------------------------------------------------------

    async def open(self) -> None:
        """Open (or create) the database in a worker thread; degrade to memory if that fails."""
        async with self._lock:
            await trio.to_thread.run_sync(self._open_sync)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.db is None and not self.degraded:
            await self.open()
        task_status.started()
        next_prune = 0.0
        try:
            while True:
                if trio.current_time() >= next_prune:
                    await self.prune()
                    next_prune = trio.current_time() + PRUNE_EVERY
                await self.flush()
                with trio.move_on_after(max(next_prune - trio.current_time(), 0.0)):
                    await self._wake.wait()
                self._wake = trio.Event()
        finally:
            with trio.CancelScope(shield=True):
                await self.flush()
                async with self._lock:
                    if self.db is not None:
                        db, self.db = self.db, None
                        await trio.to_thread.run_sync(db.close)

    async def flush(self) -> None:
        """Write what is pending, in batches, in a worker thread."""
        while self._pending:
            batch = [self._pending.popleft() for _ in range(min(BATCH, len(self._pending)))]
            async with self._lock:
                if self.db is not None:
                    await trio.to_thread.run_sync(self._write_sync, batch)
                if self.db is None:
                    self._to_memory(batch)
        written, self.written = self.written, trio.Event()
        written.set()

    async def prune(self) -> int:
        """Delete events older than the retention; returns how many."""
        cutoff = self.clock() - self.retention
        while self.memory and self.memory[0].time < cutoff:
            self.memory.popleft()
        async with self._lock:
            if self.db is None:
                return 0
            return await trio.to_thread.run_sync(self._prune_sync, cutoff)

    async def query(self, q: EventQuery) -> list[Event]:
        await self.flush()
        async with self._lock:
            if self.db is not None:
                return await trio.to_thread.run_sync(self._query_sync, q)
        found = [e for e in self.memory if q.matches(e)]
        return found[-q.limit:] if q.limit else found

    # -- worker-thread side -------------------------------------------------------------------------

    def _open_sync(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = self._connect()
        except sqlite3.DatabaseError as exc:
            if not _is_corrupt(exc):
                self._degrade(f"cannot open {self.path}: {exc}")
                return
            try:
                aside = move_aside(self.path)
                log.warning("event log: %s is not a readable database (%s); moved it aside to %s and started a new one",
                            self.path, exc, aside)
                self.db = self._connect()
            except (OSError, sqlite3.Error) as again:
                self._degrade(f"cannot start a new {self.path}: {again}")
        except OSError as exc:
            self._degrade(f"cannot create {self.path.parent}: {exc.strerror or exc}")

    def _connect(self) -> sqlite3.Connection:
        db = connect_checked(self.path, _SCHEMA)
        if "nodes" not in {row[1] for row in db.execute("PRAGMA table_info(events)")}:
            db.execute("ALTER TABLE events ADD COLUMN nodes TEXT NOT NULL DEFAULT ''")  # a file from before issue 46
        return db

    def _write_sync(self, batch: list[Event]) -> None:
        assert self.db is not None
        try:
            with self.db:
                self.db.execute("BEGIN")
                self.db.executemany(
                    "INSERT INTO events (time, kind, node, model, replica, message, detail, nodes) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(e.time, e.kind, e.node, e.model, e.replica, e.message, "\n".join(e.detail),
                      f",{','.join(e.nodes)}," if e.nodes else "") for e in batch],
                )
        except sqlite3.Error as exc:
            self._degrade(f"cannot write {self.path}: {exc}")

    def _prune_sync(self, cutoff: float) -> int:
        assert self.db is not None
        try:
            return self.db.execute("DELETE FROM events WHERE time < ?", (cutoff,)).rowcount
        except sqlite3.Error as exc:
            log.warning("event log: pruning %s failed: %s", self.path, exc)
            return 0

    def _query_sync(self, q: EventQuery) -> list[Event]:
        assert self.db is not None
        where = ["time >= ?", "id > ?"]
        args: list[float | str] = [q.since, q.after]
        if q.node:  # node ids have no comma (ids.py), so ",gpu-02," finds it in ",gpu-01,gpu-02,"
            where.append("(node = ? OR instr(nodes, ?) > 0)")
            args.extend((q.node, f",{q.node},"))
        if q.model:
            where.append("model = ?")
            args.append(q.model)
        sql = ("SELECT id, time, kind, node, model, replica, message, detail, nodes FROM events "
               f"WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?")
        try:
            rows = self.db.execute(sql, (*args, q.limit or -1)).fetchall()
        except sqlite3.Error as exc:
            log.warning("event log: reading %s failed: %s", self.path, exc)
            return []
        return [Event(id=r[0], time=r[1], kind=r[2], node=r[3], model=r[4], replica=r[5], message=r[6],
                      detail=r[7].split("\n") if r[7] else [], nodes=[n for n in r[8].split(",") if n])
                for r in reversed(rows)]

    def _degrade(self, why: str) -> None:
        """Keep events in memory from now on; the database stays as it was."""
        if self.db is not None:
            try:
                self.db.close()
            except sqlite3.Error:
                pass
            self.db = None
        if not self.degraded:
            log.warning("event log: %s; keeping the last %d events in memory only (they are lost on restart)",
                        why, MEMORY_EVENTS)
        self.degraded = why

    def _to_memory(self, batch: list[Event]) -> None:
        for e in batch:
            e.id = self._next_memory_id
            self._next_memory_id += 1
            self.memory.append(e)


def _is_corrupt(exc: sqlite3.DatabaseError) -> bool:
    text = str(exc).lower()
    return ("not a database" in text or "malformed" in text or "quick_check" in text or "corrupt" in text
            or "file is encrypted" in text)


# -- what changed: replica transitions and breakers, by comparing what the server holds ----------


class _ReplicaSeen(msgspec.Struct):
    state: str
    model: str
    nodes: tuple[str, ...]
    shards: tuple[str, ...]


def replica_events(seen: dict[str, _ReplicaSeen], replicas: Iterable[Any], events: EventLog) -> None:
    """Record every replica whose state or placement changed since the last call (`seen` is the
    caller's memory of the last call, updated in place). Comparing what the reconciler holds
    after each pass sees every transition a pass makes without touching the reconciler."""
    now_ids = set()
    for r in replicas:
        now_ids.add(r.id)
        shards = tuple(s.shard_id for s in r.shards)
        nodes = tuple(dict.fromkeys(s.node for s in sorted(r.shards, key=lambda s: s.rank)))  # rank 0's first
        state = str(getattr(r.state, "value", r.state))
        before = seen.get(r.id)
        seen[r.id] = _ReplicaSeen(state, r.model, nodes, shards)
        node = nodes[0] if nodes else ""  # and `nodes`: a 2-node replica's events are found by either node
        if before is not None and before.state == state and before.shards == shards:
            continue
        where = "; ".join(f"{s.node} GPUs {list(s.gpus)} port {s.port}" for s in r.shards)
        if before is None and r.adopted:
            events.record("replica", f"adopted {r.id} ({r.model}, {state}) running on {where}", node=node, nodes=nodes,
                          model=r.model, replica=r.id)
            continue
        if state == "starting" and (before is None or before.shards != shards):
            why = ("new replica" if before is None or not before.shards
                   else f"replacing {', '.join(before.shards)} ({before.state})")
            why += "".join(f"; {note}" for note in getattr(r, "placement", ()))  # the fabric map's say
            events.record("placement", f"placed {r.id} ({r.model}/{r.profile}) on {where}: {why}",
                          node=node, nodes=nodes, model=r.model, replica=r.id)
            continue
        reason = f": {r.reason}" if r.reason else ""
        if state == "pending" and before is not None and before.state == "pending":
            continue
        events.record("replica", f"replica {r.id} {state}{reason}", node=node, nodes=nodes, model=r.model, replica=r.id,
                      detail=r.tail if state == "failed" else ())
    for gone in set(seen) - now_ids:
        before = seen.pop(gone)
        events.record("replica", f"replica {gone} stopped and removed", node=before.nodes[0] if before.nodes else "",
                      nodes=before.nodes, model=before.model, replica=gone)


def port_events(events: EventLog, node_id: str, changes: Iterable[Any]) -> None:
    """A port whose state changed between two heartbeats (registry.PortChange): INIT after a
    subnet manager went away, ACTIVE again after it came back. A rail of a 2-node replica going
    INIT is what an SRE asks about afterwards, and it made no event at all (issue 46)."""
    for c in changes:
        phys = f" ({c.phys_state})" if c.phys_state else ""
        events.record("port", f"port {c.port} on {node_id}: {c.old} → {c.new}{phys}", node=node_id)


def breaker_events(seen: dict[tuple[str, str], str], endpoints: Iterable[dict[str, Any]], events: EventLog) -> None:
    """Record each breaker opening and closing (rows of `gateway_endpoints()`)."""
    current = set()
    for e in endpoints:
        key = (e["model"], e["endpoint"])
        current.add(key)
        state = "closed" if e["breaker"] == "closed" else "open"  # half-open is still out of rotation
        before = seen.get(key, "closed")
        seen[key] = state
        if state != before:
            why = f": {e['breaker_reason']}" if e.get("breaker_reason") and state == "open" else ""
            events.record("breaker", f"breaker of {e['endpoint']} ({e['model']}) "
                          f"{'opened' if state == 'open' else 'closed'}{why}", model=e["model"])
    for key in set(seen) - current:
        del seen[key]


class RecordingObserver:
    """The fleet's observer (FleetObserver) in front of the controller: node state changes go
    to the event log, everything goes on to the controller."""

    def __init__(self, inner: Any, events: EventLog) -> None:
        self.inner = inner
        self.events = events

    def node_registered(self, node_id: str, msg: Any) -> None:
        self.inner.node_registered(node_id, msg)

    def node_disconnected(self, node_id: str) -> None:
        self.inner.node_disconnected(node_id)

    def shard_status(self, node_id: str, msg: Any) -> None:
        self.inner.shard_status(node_id, msg)

    def progress(self, node_id: str, msg: Any) -> None:
        self.inner.progress(node_id, msg)

    def shard_resync(self, node_id: str, shards: list[Any]) -> None:
        self.inner.shard_resync(node_id, shards)

    def fabrics_changed(self, node_id: str) -> None:
        self.inner.fabrics_changed(node_id)

    def transitions(self, items: list[Any]) -> None:
        for t in items:
            self.events.record("node", f"node {t.node_id}: {t.old or 'new'} → {t.new}"
                               + (f" ({t.reason})" if t.reason else ""), node=t.node_id)
        self.inner.transitions(items)


class EventFeeds:
    """What the event log hears from the rest of the server, in one place (app.py composes, it
    does not decide): replica transitions after each reconcile pass, refused fleet certificates,
    breakers looked at once a second (a breaker's cooldown is 10 s by default)."""

    def __init__(self, events: EventLog, replicas: Callable[[], Iterable[Any]],
                 endpoints: Callable[[], Iterable[Any]], notes: Callable[[], Iterable[Any]] = tuple) -> None:
        self.events = events
        self.replicas = replicas
        self.notes = notes  # the reconciler's moves.Note lines (drains, rollouts, moves)
        self.endpoints = endpoints
        self._replicas_seen: dict[str, _ReplicaSeen] = {}
        self._breakers_seen: dict[tuple[str, str], str] = {}

    def after_pass(self) -> None:
        for n in self.notes():
            self.events.record(n.kind, n.message, node=n.node, nodes=n.nodes, model=n.model, replica=n.replica,
                               detail=n.detail)
        replica_events(self._replicas_seen, self.replicas(), self.events)

    def fleet_refusal(self, refusal: tuple[str, str] | None) -> tuple[str, str] | None:
        if refusal is not None:
            self.events.record("cert", f"fleet connection refused ({refusal[0]}): {refusal[1]}")
        return refusal

    async def watch_breakers(self) -> None:
        while True:
            rows = [msgspec.structs.asdict(e) if isinstance(e, msgspec.Struct) else e for e in self.endpoints()]
            breaker_events(self._breakers_seen, rows, self.events)
            await trio.sleep(1.0)


def chain(*calls: Callable[[], None]) -> Callable[[], None]:
    """One callback that makes each of `calls` in turn (a pass feeds the gateway, then the log)."""

    def run() -> None:
        for call in calls:
            call()

    return run
