"""The server's end of each node's stream: Register first, then heartbeats and reports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn, Protocol

import msgspec
import trio

from llmgw import __version__
from llmgw.fleet import ChannelClosed, FleetChannel, StreamRefused
from llmgw.fleet.limits import (
    Caps,
    HeartbeatRate,
    RefusalLog,
    fabrics_problem,
    heartbeat_problem,
)
from llmgw.fleet.outbox import CAPACITY as OUTBOX_CAPACITY
from llmgw.fleet.outbox import Outbox
from llmgw.server import heap
from llmgw.server.admit import (
    AdmitRules,
    Refusal,
    admit_register,
    peer_host,
    refuse_by_count,
    split_reports,
)
from llmgw.server.links import FleetLinks
from llmgw.server.logs import LogHub
from llmgw.server.metrics import ServerMetrics
from llmgw.server.registry import NodeRegistry, PortChange, Transition, port_changes
from llmgw.wire import messages as m
from llmgw.wire.ids import message_problems, printable, quote

REFUSED_BAD_ID = "bad id"

log = logging.getLogger("llmgw.server.fleet")

# Distinct unknown message types logged (once each); past this a peer is making them up, and
# remembering more would let it grow the server's memory.
MAX_UNKNOWN_LOGGED = 64
# A Register this big is counted (wire/caps.py's census) before it is decoded. Below it the decode
# builds too little to pin memory (the census is there for the 100,000-GPU, 3.5 MB kind), and a
# second reading of every node's first message would be work for nothing.
CENSUS_AFTER = 64 * 1024


class FleetObserver(Protocol):
    """What the control plane hears from the fleet (the reconciler implements it)."""

    def node_registered(self, node_id: str, msg: m.Register) -> None: ...
    def node_disconnected(self, node_id: str) -> None: ...
    def shard_status(self, node_id: str, msg: m.ShardStatus) -> None: ...
    def progress(self, node_id: str, msg: m.Progress) -> None: ...
    def shard_resync(self, node_id: str, shards: list[m.ShardReport]) -> None: ...
    def fabrics_changed(self, node_id: str) -> None: ...
    def transitions(self, items: list[Transition]) -> None: ...


class FabricTestRoutes(Protocol):
    """Where FabricTestResults go (server/fabric_test.py)."""

    def on_result(self, node_id: str, msg: m.FabricTestResult) -> None: ...
    def node_gone(self, node_id: str) -> None: ...


class Session:
    """One live stream to a node: how to send to it and how to end it."""

    def __init__(self, node_id: str, number: int, channel: FleetChannel, features: list[str],
                 outbox_capacity: int = OUTBOX_CAPACITY) -> None:
        self.node_id = node_id
        self.number = number
        self.channel = channel
        self.features = set(features)
        self.heartbeats: HeartbeatRate | None = None  # set by the service when rate-limited
        self.cancel_scope = trio.CancelScope()
        self.replaced_by: str | None = None
        self.closed_error = False  # the stream ended in error (an idle timeout, a GOAWAY), not by a goodbye
        # Nothing the server sends may be dropped (Start, Stop): a full outbox ends the stream as
        # a slow consumer, and the agent's next Register puts both views right (fleet/outbox.py).
        self.outbox = Outbox(outbox_capacity)

    def send(self, msg: msgspec.Struct) -> None:
        """Queue a message; the session's sender task writes it (never blocks the caller)."""
        if not self.outbox.put(msg):
            self.cancel_scope.cancel()

    def supports(self, feature: str) -> bool:
        return feature in self.features

    async def sender(self) -> None:
        await self.outbox.pump(self.channel)


class FleetService:
    def __init__(
        self,
        registry: NodeRegistry,
        metrics: ServerMetrics,
        *,
        register_timeout: float,
        require_identity: bool,
        observer: FleetObserver | None = None,
        clock: Callable[[], float] = trio.current_time,
        endpoint_host: str = "advertised",
        caps: Caps | None = None,
        heartbeat_rate: float = 0.0,
        refusal_log: RefusalLog | None = None,
        outbox_capacity: int = OUTBOX_CAPACITY,
        links: FleetLinks[Session] | None = None,
        on_discover: Callable[[str, m.DiscoverResult], None] | None = None,
        log_hub: LogHub | None = None,
        fabric_tests: FabricTestRoutes | None = None,
        max_message: int = 0,  # the listener's limit (fleet.max_message), told to agents in the Welcome
        on_port_change: Callable[[str, list[PortChange]], None] | None = None,
    ) -> None:
        self.max_message = max_message
        self.on_port_change = on_port_change  # a port's state changed between two heartbeats (the event log)
        self.outbox_capacity = outbox_capacity
        self.log_hub = log_hub  # engine log chunks go to their readers (`ctl logs`)
        self.fabric_tests = fabric_tests  # ib_write_bw results go to the test that asked (`ctl fabric-test`)
        self.caps = caps or Caps()
        # What a Register is admitted by (server/admit.py).
        self.rules = AdmitRules(caps=self.caps, require_identity=require_identity, endpoint_host=endpoint_host)
        self.heartbeat_rate = heartbeat_rate
        self.refusals = refusal_log or RefusalLog(log)
        self.registry = registry
        self.metrics = metrics
        self.register_timeout = register_timeout
        self.observer = observer
        self.clock = clock
        # The live stream of each node, by node id: this service adds and removes them, the
        # controller and others send on them (built before this service, in app.py).
        self.links: FleetLinks[Session] = links if links is not None else FleetLinks()
        self._unknown_types_logged: set[str] = set()
        self._bad_ids_logged: set[str] = set()
        self.changed = trio.Event()  # set on every fleet change; the reconciler waits on it
        # Fabric tool output (server/fabric_service.py); None: nobody asked, results are dropped.
        self.on_discover = on_discover
        self.shutting_down = False
        self._drained = trio.Event()

    async def shutdown(self) -> None:
        """End every stream with a clear reason (agents reconnect to the next server)."""
        self.shutting_down = True
        for session in self.links.all():
            session.cancel_scope.cancel()
        while len(self.links):
            self._drained = trio.Event()
            await self._drained.wait()

    def _notify(self, transitions: list[Transition]) -> None:
        for t in transitions:
            level = logging.INFO if t.new == "ready" else logging.WARNING
            log.log(level, "node %s: %s → %s (%s)", t.node_id, t.old or "new", t.new, t.reason)
        if transitions and self.observer is not None:
            self.observer.transitions(transitions)
        self.changed.set()

    def tick(self) -> None:
        transitions = self.registry.tick(self.clock())
        if transitions:
            self._notify(transitions)

    async def run_ticker(self) -> None:
        """Re-evaluate liveness a few times per heartbeat interval."""
        period = max(min(self.registry.heartbeat_interval / 4, 1.0), 0.02)
        while True:
            await trio.sleep(period)
            self.tick()

    async def handle(self, channel: FleetChannel) -> None:
        peer = channel.peer
        try:
            with trio.fail_after(self.register_timeout):
                payload = await channel.receive()
        except trio.TooSlowError:
            self.refusals.warning(self.clock(), "register_timeout", peer_host(peer),
                                  "fleet stream from %s: no Register within %gs; closing", peer, self.register_timeout)
            raise StreamRefused("register_timeout", f"no Register within {self.register_timeout:g}s") from None
        except ChannelClosed as exc:
            log.warning("fleet stream from %s closed before Register: %s", peer, exc.reason)
            return
        size = len(payload)
        # Only a big one is counted first: a node's ordinary Register (a few KB) is read once.
        counted = refuse_by_count(payload, peer=peer, rules=self.rules) if size >= CENSUS_AFTER else None
        if counted is not None:  # over the GPU, port or shard caps: refused from a census, never built
            del payload
            self._refuse_register(peer, counted, size)
        try:
            first = m.decode_agent_message(payload)
        except m.MessageError as exc:
            self.refusals.warning(self.clock(), "malformed", peer_host(peer), "fleet stream from %s: %s; closing",
                                  peer, exc)
            raise StreamRefused("malformed", str(exc)) from None
        if not isinstance(first, m.Register):
            kind = m.message_type(first)
            log.warning("fleet stream from %s: first message was %s, not Register; closing", peer, kind)
            raise StreamRefused("protocol", f"the first message must be Register, got {kind}")
        identity = channel.tls_identity
        verdict = admit_register(first, peer=peer, identity=identity, rules=self.rules)
        if isinstance(verdict, Refusal):
            # What the peer sent goes before the refusal's bookkeeping is made (wire/caps.py, the
            # census, says why: nothing lasting may be allocated among a big message's objects).
            del first, payload
            self._refuse_register(peer, verdict, size)
        self.metrics.count_message("Register")
        node_id, host = first.node_id, verdict.endpoint_host
        for problems in verdict.dropped:  # shard reports with bad ids: left out, the node is fine
            self._refuse_ids(node_id, "Register", problems)
        first = verdict.register
        if self.shutting_down:
            raise StreamRefused("shutdown", "the server is shutting down")
        number = self.registry.new_session()
        session = Session(node_id, number, channel, first.features, self.outbox_capacity)
        if self.heartbeat_rate > 0:
            session.heartbeats = HeartbeatRate(self.heartbeat_rate, self.clock())
        known = self.registry.get(node_id)
        ports_before = known.ports if known is not None else {}  # a port may have changed while it was away
        transition, _ = self.registry.register(first, self.clock(), number, peer, identity, endpoint_host=host)
        self._ports_changed(node_id, ports_before)
        old = self.links.add(node_id, session)
        if old is not None:
            log.warning(
                "node %s: new stream from %s replaces the one from %s", node_id, peer, old.channel.peer
            )
            old.replaced_by = peer
            old.cancel_scope.cancel()
        log.info(
            "node %s registered from %s (agent %s, %d GPUs, %d ports, %d shards, engines at %s)",
            node_id,
            peer,
            quote(first.version),
            len(first.inventory.gpus),
            len(first.inventory.ports),
            len(first.shards),
            host,
        )
        session.send(m.Welcome(server_version=__version__, heartbeat_interval=self.registry.heartbeat_interval,
                               max_message=self.max_message))
        if self.observer is not None:
            self.observer.node_registered(node_id, first)
        self._notify([transition] if transition else [])
        reason = "stream ended"
        try:
            with session.cancel_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.sender)
                    reason = await self._receive_loop(session)
                    nursery.cancel_scope.cancel()
        except* ChannelClosed as group:
            reason = "; ".join(e.reason for e in group.exceptions if isinstance(e, ChannelClosed)) or "closed"
        finally:
            if session.outbox.overflow.is_set():
                reason = session.outbox.reason
                log.warning("node %s: closing its stream: %s; it re-registers", node_id, reason)
            if self.links.remove(node_id, session):
                self._drained.set()
                if self.log_hub is not None:
                    self.log_hub.node_gone(node_id)
                if self.fabric_tests is not None:
                    self.fabric_tests.node_gone(node_id)
            t = self.registry.disconnect(node_id, number, self.clock(), reason)
            if t is not None:
                if self.observer is not None:
                    self.observer.node_disconnected(node_id)
                self._notify([t])
            elif session.replaced_by is None:
                log.log(logging.WARNING if session.closed_error else logging.INFO, "node %s: stream from %s closed: %s",
                        node_id, peer, reason)
        if self.shutting_down:
            raise StreamRefused("shutdown", "the server is shutting down")
        if session.replaced_by is not None:
            raise StreamRefused("replaced", f"replaced by a newer stream for {node_id} from {session.replaced_by}")
        if session.outbox.overflow.is_set():
            raise StreamRefused("slow_consumer", session.outbox.reason)

    def _refuse_register(self, peer: str, verdict: Refusal, size: int) -> NoReturn:
        heap.give_back(size)  # a big refused Register's buffers, freed: back to the OS (server/heap.py)
        self.metrics.count_message("Register")
        if verdict.throttled:
            self.refusals.warning(self.clock(), verdict.reason, peer_host(peer), verdict.log_fmt, *verdict.log_args)
        else:
            log.warning(verdict.log_fmt, *verdict.log_args)
        raise StreamRefused(verdict.reason, verdict.message)

    def _heartbeat_allowed(self, session: Session, msg: m.Heartbeat, now: float) -> bool:
        """Over-sized heartbeats end the stream; over-frequent ones are dropped and counted,
        and a flood ends the stream (one node at 6,169/s took 60 % of a core, issue 9)."""
        problem = heartbeat_problem(msg, self.caps)
        if problem is not None:
            self.refusals.warning(now, "too_big", peer_host(session.channel.peer), "node %s: %s; closing the stream",
                                  session.node_id, problem)
            raise StreamRefused("too_big", problem)
        limiter = session.heartbeats
        if limiter is None:
            return True
        verdict = limiter.offer(now)
        if verdict.accept:
            return True
        self.metrics.count_dropped("heartbeat_rate")
        if verdict.flood:
            detail = (f"heartbeats far over the limit of {limiter.rate:g}/s (fleet.max_heartbeat_rate): "
                      f"{limiter.dropped} in a row dropped")
            self.refusals.warning(now, "heartbeat_rate", peer_host(session.channel.peer),
                                  "node %s: %s; closing the stream", session.node_id, detail)
            raise StreamRefused("heartbeat_rate", detail)
        self.refusals.warning(now, "heartbeat_dropped", peer_host(session.channel.peer),
                              "node %s: heartbeats over the limit of %g/s (fleet.max_heartbeat_rate) are dropped",
                              session.node_id, limiter.rate)
        return False

    async def _receive_loop(self, session: Session) -> str:
        channel = session.channel
        node_id = session.node_id
        registry = self.registry
        while True:
            try:
                payload = await channel.receive()
            except ChannelClosed as exc:
                # Said once, where the stream's end is handled: with the node's transition when
                # there is one ("ready → unreachable (no data from peer for 22s …)"), else there
                # on its own (issue 41: each idle timeout was logged twice).
                session.closed_error = exc.error
                return exc.reason
            try:
                msg = m.decode_agent_message(payload)
            except m.MessageError as exc:
                log.warning("node %s: %s; closing the stream", node_id, exc)
                raise StreamRefused("malformed", str(exc)) from None
            kind = m.message_type(msg)
            self.metrics.count_message(kind)
            now = self.clock()
            if isinstance(msg, m.Heartbeat):
                if not self._heartbeat_allowed(session, msg, now):
                    continue
                shards = msg.shards
                if shards is not None:
                    msg = msgspec.structs.replace(msg, shards=None)  # the registry keeps the readings only
                node = registry.get(node_id)
                ports_before = node.ports if node is not None and node.session == session.number else {}
                t = registry.heartbeat(node_id, session.number, msg, now, wall=time.time())
                if t is not None:
                    self._notify([t])
                if msg.ports:
                    self._ports_changed(node_id, ports_before)
                if shards is not None and self.observer is not None:
                    self.observer.shard_resync(node_id, self._good_reports(node_id, "Heartbeat", shards))
            elif isinstance(msg, m.ShardStatus):
                registry.seen(node_id, session.number, now)
                if self._bad_ids(node_id, msg):
                    continue
                if self.observer is not None:
                    self.observer.shard_status(node_id, msg)
                self.changed.set()
            elif isinstance(msg, m.Progress):
                registry.seen(node_id, session.number, now)
                if self._bad_ids(node_id, msg):
                    continue
                if self.observer is not None:
                    self.observer.progress(node_id, msg)
            elif isinstance(msg, m.Fabrics):
                problem = fabrics_problem(msg.fabrics, msg.fabric_status, self.caps)
                if problem is not None:
                    raise StreamRefused("too_big", problem)
                change = registry.fabrics_changed(node_id, session.number, msg, now)
                if change is not None:
                    before, after = change
                    left = [f"{s.name} ({'; '.join(s.problems)})" for s in msg.fabric_status if not s.usable]
                    log.warning("node %s: usable fabrics now %s (were %s)%s", node_id, ", ".join(after) or "none",
                                ", ".join(before) or "none",
                                f"; not usable: {printable(', '.join(left))}" if left else "")
                    if self.observer is not None:
                        self.observer.fabrics_changed(node_id)  # placement and running replicas, now
                    self.changed.set()
            elif isinstance(msg, m.DiscoverResult):
                registry.seen(node_id, session.number, now)
                if self.on_discover is not None:
                    self.on_discover(node_id, msg)
            elif isinstance(msg, m.FabricTestResult):
                registry.seen(node_id, session.number, now)
                if self.fabric_tests is not None:
                    self.fabric_tests.on_result(node_id, msg)
            elif isinstance(msg, m.LogChunk):
                registry.seen(node_id, session.number, now)
                if self.log_hub is not None:
                    self.log_hub.deliver(node_id, msg)
            elif isinstance(msg, m.Register):
                log.warning("node %s: Register on an open stream; closing it", node_id)
                raise StreamRefused("protocol", "Register sent twice on one stream")
            elif isinstance(msg, m.Unknown):
                registry.seen(node_id, session.number, now)
                if msg.type not in self._unknown_types_logged and len(self._unknown_types_logged) <= MAX_UNKNOWN_LOGGED:
                    self._unknown_types_logged.add(msg.type)
                    if len(self._unknown_types_logged) > MAX_UNKNOWN_LOGGED:
                        log.warning("node %s: over %d unknown message types seen; no longer logging new ones",
                                    node_id, MAX_UNKNOWN_LOGGED)
                    else:
                        log.info("node %s sent a message of unknown type %r (newer agent?); skipping",
                                 node_id, msg.type)


    def _bad_ids(self, node_id: str, msg: msgspec.Struct) -> bool:
        """Refuse a message whose ids fail the one pattern (wire/ids.py): counted, logged once per node."""
        problems = message_problems(msg)
        if problems:
            self._refuse_ids(node_id, m.message_type(msg), problems)
        return bool(problems)

    def _refuse_ids(self, node_id: str, kind: str, problems: list[str]) -> None:
        self.metrics.count_refused(REFUSED_BAD_ID)
        if node_id not in self._bad_ids_logged:
            self._bad_ids_logged.add(node_id)
            log.warning("node %s sent %s with %s; refused (further ones are only counted: llmgw_fleet_refused_total)",
                        node_id, kind, "; ".join(problems))

    def _ports_changed(self, node_id: str, before: dict[str, m.PortCounters]) -> None:
        node = self.registry.get(node_id)
        if before and node is not None and self.on_port_change is not None:
            changes = port_changes(before, node.ports)
            if changes:
                self.on_port_change(node_id, changes)

    def _good_reports(self, node_id: str, kind: str, reports: list[m.ShardReport]) -> list[m.ShardReport]:
        good, dropped = split_reports(reports)
        for problems in dropped:
            self._refuse_ids(node_id, kind, problems)
        return good
