"""The node agent's link to the server: dial out, Register, heartbeat, obey; reconnect forever."""

from __future__ import annotations

import logging
import random
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import msgspec
import trio

from llmgw import __version__
from llmgw.agent.backoff import Backoff
from llmgw.agent.fabric_test import FabricTester
from llmgw.agent.fabric_tools import MAX_QUEUED, FabricTools
from llmgw.catalog.schema import AgentConfig
from llmgw.errors import first_leaf
from llmgw.fabric import declared
from llmgw.fleet import ChannelClosed, DialError, FleetChannel, dial
from llmgw.fleet.outbox import CAPACITY as OUTBOX_CAPACITY
from llmgw.fleet.outbox import Outbox
from llmgw.wire import messages as m
from llmgw.wire.envelope import DEFAULT_MAX_MESSAGE
from llmgw.wire.ids import quote

log = logging.getLogger("llmgw.agent")

Dialer = Callable[[], AbstractAsyncContextManager[FleetChannel]]


class NodeHardware(Protocol):
    """Where the agent's inventory and heartbeat readings come from (discovery, or a fake)."""

    def inventory(self) -> m.Inventory: ...
    def port_counters(self) -> list[m.PortCounters]: ...
    def gpu_health(self) -> list[m.GpuHealth]: ...


class Engines(Protocol):
    """The supervisor, as the link sees it (issue: engines and replicas)."""

    @property
    def features(self) -> Sequence[str]:
        """The requests these engines answer (Register.features)."""
        ...

    def reports(self) -> list[m.ShardReport]: ...
    def snapshot(self) -> list[m.ShardReport]:
        """Every shard as it stands, forgetting nothing (a heartbeat's resync; `reports` is the Register's)."""
        ...

    async def handle(self, msg: Any, send: Callable[[msgspec.Struct], None]) -> None: ...
    def attach(self, send: Callable[[msgspec.Struct], None] | None) -> None: ...


class NoEngines:
    @property
    def features(self) -> list[str]:
        return []

    def reports(self) -> list[m.ShardReport]:
        return []

    def snapshot(self) -> list[m.ShardReport]:
        return []

    async def handle(self, msg: Any, send: Callable[[msgspec.Struct], None]) -> None:
        log.warning("no supervisor: ignoring %s", m.message_type(msg))

    def attach(self, send: Callable[[msgspec.Struct], None] | None) -> None:
        pass


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        *,
        hardware: NodeHardware,
        dialer: Dialer,
        engines: Engines | None = None,
        rng: random.Random | None = None,
        cert_not_after: float = 0.0,
        outbox_capacity: int = OUTBOX_CAPACITY,
        tools: FabricTools | None = None,
        tester: FabricTester | None = None,
    ) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id or socket.gethostname()
        self.hardware = hardware
        self.dialer = dialer
        self.engines = engines or NoEngines()
        self.tools = tools  # ibnetdiscover / saquery for the server; None: not offered
        self.tester = tester  # ib_write_bw for `ctl fabric-test`; None: not offered
        self.backoff = Backoff(cfg.backoff.initial, cfg.backoff.max, rng)
        self.heartbeat_interval = float(cfg.heartbeat_interval)
        self.cert_not_after = cert_not_after
        self.connected = trio.Event()  # set while a registered stream is up (tests watch it)
        self.sessions = 0
        self._seq = 0
        self._last_error: str | None = None
        self._registered_at: float | None = None  # when the current stream registered
        self._unknown_logged: set[str] = set()
        self.outbox_capacity = outbox_capacity
        self._fabric_key: list[tuple[Any, ...]] | None = None
        self.fabrics_version = 0  # bumped when the declared fabrics' verdicts change
        self.fabric_status: list[m.FabricStatus] = []  # the latest verdicts (the supervisor's launch env reads them)

    async def run(self) -> None:
        """Connect, serve the stream, and on any end reconnect after a jittered backoff."""
        while True:
            self._registered_at = None
            try:
                async with self.dialer() as channel:
                    await self._session(channel)
            except* DialError as group:
                self._note_error(str(first_leaf(group, DialError)))
            except* ChannelClosed as group:
                exc = first_leaf(group, ChannelClosed)
                self._note_error(f"stream closed: {exc.reason}", warn=exc.error)
            except* Exception as group:
                # A bug must not end the agent: engines depend on it. Log it and reconnect.
                log.error("link to the server failed", exc_info=group)
            finally:
                if self.connected.is_set():
                    self.connected = trio.Event()
                self.engines.attach(None)
            # Start over small only after a stream that registered and then stayed up a while;
            # time spent dialing (a connect timeout against a dead server) is no sign of health.
            up_since = self._registered_at
            if (up_since is not None
                    and trio.current_time() - up_since > 4 * self.heartbeat_interval + self.cfg.backoff.max):
                self.backoff.reset()
            delay = self.backoff.next()
            log.info("reconnecting in %.1fs", delay)
            await trio.sleep(delay)

    def _note_error(self, text: str, warn: bool = True) -> None:
        if text != self._last_error:
            log.log(logging.WARNING if warn else logging.INFO, "%s", text)
        else:
            log.debug("%s", text)
        self._last_error = text

    async def _session(self, channel: FleetChannel) -> None:
        inventory = await trio.to_thread.run_sync(self.hardware.inventory)
        # Heartbeats and progress are dropped when the queue is full (the next one replaces
        # them); a shard status that finds it full ends the stream (see fleet/outbox.py).
        outbox = Outbox(self.outbox_capacity, replaceable=(m.Heartbeat, m.Progress))

        def send(msg: msgspec.Struct) -> None:
            if not outbox.put(msg) and not outbox.overflow.is_set() and outbox.dropped == 1:
                log.warning("the server is not reading this node's messages; dropping heartbeats until it does")

        statuses = self._check_fabrics(inventory.ports)
        self.fabric_status = statuses
        register = m.Register(
            node_id=self.node_id,
            version=__version__,
            features=(list(self.engines.features) + (self.tools.features if self.tools else [])
                      + (self.tester.features if self.tester and inventory.ports else [])),
            inventory=inventory,
            fabrics=declared.advertised(statuses),
            fabric_status=statuses,
            shards=self.engines.reports(),
            cert_not_after=self.cert_not_after,
            advertise_host=self.cfg.advertise_host,
        )
        # Attach right after the snapshot: a state change from here on is queued (and sent
        # after the Register), never dropped between the snapshot and the Welcome.
        self.engines.attach(send)
        await channel.send(m.encode(register))

        async def overflowed() -> None:
            await outbox.overflow.wait()
            raise ChannelClosed(outbox.reason, error=True)

        discover_send, discover_receive = trio.open_memory_channel[m.Discover](MAX_QUEUED)
        async with trio.open_nursery() as nursery:
            first = await self._receive(channel)
            if isinstance(first, m.Welcome):
                self.heartbeat_interval = first.heartbeat_interval
                if self.tools is not None:
                    # What one message may carry: the server's limit (a bigger one ends the
                    # stream there) and this end's own (a bigger one is refused here).
                    own = getattr(channel.connection, "max_message", 0)
                    self.tools.fit(first.max_message, own)
                log.info(
                    "registered as %s with server %s (heartbeat every %gs)",
                    self.node_id,
                    quote(first.server_version),
                    self.heartbeat_interval,
                )
            else:
                log.info("registered as %s", self.node_id)
            self._last_error = None
            self._registered_at = trio.current_time()
            self.sessions += 1
            self.connected.set()
            nursery.start_soon(outbox.pump, channel)
            nursery.start_soon(overflowed)
            nursery.start_soon(self._heartbeats, channel, send, inventory)
            if self.tools is not None:
                nursery.start_soon(self.tools.serve, discover_receive, send)
            if self.tester is not None:
                nursery.start_soon(self.tester.serve, send)
            if not isinstance(first, m.Welcome):
                await self._dispatch(first, send)
            while True:
                msg = await self._receive(channel)
                if isinstance(msg, m.Discover):
                    self._discover(msg, discover_send, send)
                elif isinstance(msg, m.FabricTest | m.FabricTestCancel):
                    self._fabric_test(msg, send, bool(inventory.ports))
                else:
                    await self._dispatch(msg, send)

    async def _receive(self, channel: FleetChannel) -> Any:
        payload = await channel.receive()
        try:
            return m.decode_server_message(payload)
        except m.MessageError as exc:
            raise ChannelClosed(f"bad message from server: {exc}", error=True) from None

    async def _dispatch(self, msg: Any, send: Callable[[msgspec.Struct], None]) -> None:
        if isinstance(msg, m.Welcome):
            self.heartbeat_interval = msg.heartbeat_interval
        elif isinstance(msg, m.Unknown):
            if msg.type not in self._unknown_logged:
                self._unknown_logged.add(msg.type)
                log.info("server sent a message of unknown type %r (newer server?); skipping", msg.type)
        else:
            await self.engines.handle(msg, send)

    def _discover(self, msg: m.Discover, queue: trio.MemorySendChannel[m.Discover],
                  send: Callable[[msgspec.Struct], None]) -> None:
        """Queue a fabric tool run; answered at once when this agent has no tools or is busy."""
        answer = m.DiscoverResult(request_id=msg.request_id, tool=msg.tool, device=msg.device, port=msg.port)
        if self.tools is None or not self.tools.features:
            answer.error = "this agent runs no fabric tools (ibnetdiscover and saquery not found)"
            send(answer)
            return
        try:
            queue.send_nowait(msg)
        except trio.WouldBlock:
            answer.error = f"busy: {MAX_QUEUED} fabric tool runs already queued"
            send(answer)

    def _fabric_test(self, msg: m.FabricTest | m.FabricTestCancel, send: Callable[[msgspec.Struct], None],
                     has_ports: bool) -> None:
        if self.tester is not None and self.tester.features and has_ports:
            self.tester.accept(msg, send)
        elif isinstance(msg, m.FabricTest):
            send(m.FabricTestResult(request_id=msg.request_id, error="this agent runs no fabric tests (no RDMA port, "
                                    "or no ib_write_bw and no way to install perftest)"))

    def _check_fabrics(self, ports: list[m.Port]) -> list[m.FabricStatus]:
        """The declared fabrics against these ports; a change from the last check is logged
        once (a fabric left out says why: the node's log is where an operator looks first)."""
        statuses = declared.check_fabrics(declared.from_config(self.cfg.fabrics), ports)
        key = [msgspec.structs.astuple(s) for s in statuses]
        if key != self._fabric_key:
            first = self._fabric_key is None
            self._fabric_key = key
            for status in statuses:
                if not status.usable:
                    log.warning("fabric %s", declared.describe(status))
                elif status.problems or not first:
                    log.info("fabric %s", declared.describe(status))
            self.fabrics_version += 1
        return statuses

    async def _heartbeats(self, channel: FleetChannel, send: Callable[[msgspec.Struct], None],
                          inventory: m.Inventory) -> None:
        conn = channel.connection
        conn.last_received = trio.current_time()
        resync_every = int(self.cfg.resync_every)
        beats = 0
        while True:
            await trio.sleep(self.heartbeat_interval)
            ports, gpus, host = await trio.to_thread.run_sync(self._readings)
            self._seq += 1
            beats += 1
            # The shard list is taken here, in the task that queues the heartbeat: every status
            # the supervisor queued before it is ahead of it on the stream, so the list never
            # contradicts what the server has already been told.
            shards = self.engines.snapshot() if resync_every and beats % resync_every == 0 else None
            send(m.Heartbeat(seq=self._seq, sent_at=time.time(), ports=ports, gpus=gpus, shards=shards, host=host))
            seen = self.fabrics_version
            statuses = self._check_fabrics(declared.with_live(inventory.ports, ports))
            if self.fabrics_version != seen:
                # The usable set changed (a cable pulled, a subnet manager gone): said once.
                send(m.Fabrics(fabrics=declared.advertised(statuses), fabric_status=statuses))
            self.fabric_status = statuses
            silent = trio.current_time() - conn.last_received
            if silent > 6 * self.heartbeat_interval:
                raise ChannelClosed(f"no answer from the server for {silent:.0f}s (half-open connection?)", error=True)
            if silent > 3 * self.heartbeat_interval:
                conn.ping()  # the server is quiet; an HTTP/2 PING tells us it is still there

    def _readings(self) -> tuple[list[m.PortCounters], list[m.GpuHealth], m.HostFacts | None]:
        # Host facts are optional to a NodeHardware (a test's fake may have none): doctor then
        # reports them unknown, as for an older agent.
        host = getattr(self.hardware, "host_facts", None)
        return self.hardware.port_counters(), self.hardware.gpu_health(), host() if host is not None else None


def make_dialer(
    cfg: AgentConfig,
    *,
    insecure: bool,
    ssl_context: ssl.SSLContext | None,
    max_message: int = DEFAULT_MAX_MESSAGE,
) -> Dialer:
    def dialer() -> AbstractAsyncContextManager[FleetChannel]:
        return dial(
            cfg.server,
            ssl_context=ssl_context,
            insecure=insecure,
            max_message=max_message,
            headers=[("user-agent", f"llmgw-agent/{__version__}")],
        )

    return dialer
