"""`ctl fabric-test A B`, the server's side: run ib_write_bw rail by rail between two nodes' agents.

`POST /api/v1/fabric-tests {"a": A, "b": B}` (operator door) pairs the rails (fabric/railtest.py:
the Nth usable port of each fabric on A with the Nth on B, as NCCL does) and, one rail at a time
so two runs never share a link:

0. (once) asks both agents to `prepare`: have ib_write_bw, installing perftest if need be;
1. sends B's agent `FabricTest(role=server)` for its port and waits for "ready" with the TCP port
   its ib_write_bw listens on;
2. sends A's agent `FabricTest(role=client)` with B's address and that port, and waits for "done".
   The address is the server's record of B (its registered endpoint host), never anything in B's
   answer, and the port must be 1024-65535 (railtest.client_target): a node cannot send its
   partner's client to a host or a system port of its choosing;
3. grades the client's table against what the rail carries (its link's data rate, capped by either
   HCA's PCIe link: railtest, linkrate); if the client failed, B's run is cancelled (killed there)
   instead of waiting out its timeout.

Each run lasts `duration` seconds (ib_write_bw -D; 5 s by default, as perftest's own DEF_DURATION)
where both agents list FEATURE_FABRIC_TEST_DURATION, else the old 64 KiB × `iterations`, said in
the notes. `gpudirect` runs both sides with `--use_cuda=N`, N the GPU nearest the rail's HCA on
that node's PCIe tree (Port.gpu_affinity: one switch, then one host bridge, then one NUMA node),
or, from an agent that cannot place its GPUs, the rail's position in its fabric modulo the GPU
count; it is refused at once when a node lists no GPU (FEATURE_FABRIC_TEST_GPUDIRECT is offered
only where there is one).

A test is refused at once, before anything is sent, when a node is unknown, not connected, or its
agent does not list `fabric-test` in Register.features (an agent too old to answer would only
time out). Every wait is a phase with a hard deadline fixed when it starts (railtest.Phase: the
rail timeout plus `fabric.test_grace`; prepare, where an agent may install perftest, up to
`fabric.test_install_wait` once it says "progress", and never past it, however often it says so);
a node whose stream ends fails its rail at once. Progress goes to the caller as NDJSON lines while
the test runs (`emit`), then the report.

One test at a time per node, not per server: two tests sharing a node would share its links and
skew both, but a test of C and D has nothing to wait for while A and B run (or hang until their
deadline). A test takes its two nodes' locks in name order, so A→B beside B→A cannot deadlock.

Results are matched by request id and node: an unsolicited FabricTestResult is dropped.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import msgspec
import trio

from llmgw.fabric.gputopo import nearest_gpus
from llmgw.fabric.linkrate import Capacity, capacity
from llmgw.fabric.perftest import parse
from llmgw.fabric.railtest import (
    Phase,
    Rail,
    RailResult,
    client_target,
    grade,
    lock_order,
    overall,
    pair_rails,
    phase,
    split_port,
)
from llmgw.server.alertmetrics import CheckResults
from llmgw.server.links import Links
from llmgw.server.registry import NodeRegistry
from llmgw.wire import messages as m
from llmgw.wire.ids import quote

log = logging.getLogger("llmgw.server.fabric_test")

GRACE = 10.0  # beyond the run's own timeout: the agent's queue, the stream, perftest's start (fabric.test_grace)
INSTALL_WAIT = 660.0  # an agent installing perftest: its fabric_test.install_timeout, 600 s, and GRACE
DEFAULT_TIMEOUT = 60.0
DEFAULT_DURATION = 5  # seconds of ib_write_bw -D: perftest's own DEF_DURATION (perftest_parameters.h)
DURATION_SLACK = 3.0  # what a -D run needs beyond its duration: open the device (~1 s on a real HCA), connect, report
MAX_TIMEOUT = 600.0
QUEUE = 8  # results in flight per request (progress, ready, done)
MAX_NOTES = 32  # per rail: a real run says 1-4 (install, GID index, a retried port); a node inventing new ones is cut


class Refused(Exception):
    """The test cannot start (one line for the operator) with an HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Route(msgspec.Struct):
    node_id: str
    channel: trio.MemorySendChannel[m.FabricTestResult]


class FabricTests:
    def __init__(self, registry: NodeRegistry, links: Links, *,
                 grace: float = GRACE, install_wait: float = INSTALL_WAIT, results: CheckResults | None = None) -> None:
        self.registry = registry
        self.links = links  # node id → its live fleet stream (read only: server/links.py)
        self.routes: dict[str, _Route] = {}
        self.grace = grace
        self.install_wait = install_wait
        self._ids = itertools.count(1)
        self._locks: dict[str, trio.Lock] = {}  # one test at a time per node (kept while anyone holds or waits)
        self._users: dict[str, int] = {}
        self.results = results  # where each test's report goes (llmgw.server.alertmetrics)

    # ---- from the fleet streams -------------------------------------------------------------------

    def on_result(self, node_id: str, msg: m.FabricTestResult) -> None:
        """From a stream's reader: never blocks it."""
        route = self.routes.get(msg.request_id)
        if route is None or route.node_id != node_id:
            log.info("node %s: a FabricTestResult nobody asked for (%s); dropped", node_id, quote(msg.request_id[:40]))
            return
        try:
            route.channel.send_nowait(msg)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            log.warning("node %s: more fabric test results than expected for %s; dropped one", node_id,
                        quote(msg.request_id[:40]))

    def node_gone(self, node_id: str) -> None:
        """The node's stream ended: whatever waits on it ends now, not at its deadline."""
        for request_id, route in list(self.routes.items()):
            if route.node_id == node_id:
                route.channel.close()
                del self.routes[request_id]

    # ---- the test ----------------------------------------------------------------------------------

    def check(self, a: str, b: str, *, gpudirect: bool = False, duration: int | None = None,
              rail_timeout: float = DEFAULT_TIMEOUT) -> list[Rail]:
        """The rails to test, or Refused with the reason (nothing has been sent yet)."""
        if duration and duration + DURATION_SLACK > min(max(float(rail_timeout), 1.0), MAX_TIMEOUT):
            raise Refused(400, f"a {duration:g} s run does not fit in the {rail_timeout:g} s rail timeout: ib_write_bw "
                               f"needs about {DURATION_SLACK:g} s more to open the device and connect; raise "
                               "--rail-timeout or shorten --duration")
        if a == b:
            raise Refused(400, f"fabric-test needs two different nodes (got {a} twice)")
        for node_id in (a, b):
            node = self.registry.get(node_id)
            if node is None:
                raise Refused(404, f"no node {node_id!r} has registered with this server")
            session = self.links.get(node_id)
            if session is None or node.state != "ready":
                raise Refused(503, f"node {node_id} is not connected "
                                   f"({node.state}{': ' + node.reason if node.reason else ''});"
                                   " its agent must be up to run its side of the test")
            if not session.supports(m.FEATURE_FABRIC_TEST):
                raise Refused(409, f"the agent on {node_id} (version {node.version or 'unknown'}) does not run fabric "
                                   "tests: it has no RDMA port, no ib_write_bw and no way to install perftest, or is "
                                   "too old; see its log")
        node_a, node_b = self.registry.get(a), self.registry.get(b)
        assert node_a is not None and node_b is not None
        if gpudirect:
            for node_id, node in ((a, node_a), (b, node_b)):
                if not node.inventory.gpus:
                    raise Refused(409, f"--gpudirect: {node_id} has no GPU (its inventory lists none, "
                                       f"{node.inventory.gpu_note or node.inventory.gpu_source or 'no GPU library'}): "
                                       "GPUDirect RDMA needs GPU memory on both ends; run without --gpudirect to test "
                                       "the link from host memory")
                if not self.links.supports(node_id, m.FEATURE_FABRIC_TEST_GPUDIRECT):
                    raise Refused(409, f"--gpudirect: the agent on {node_id} (version {node.version or 'unknown'}) "
                                       "does not run GPUDirect tests (too old)")
        rails, problems = pair_rails(node_a.fabric_status, node_b.fabric_status, _rates(node_a), _rates(node_b))
        if not rails:
            raise Refused(409, f"no rail to test between {a} and {b}: {'; '.join(problems)}")
        return rails

    async def run(self, a: str, b: str, emit: Callable[[dict[str, Any]], Awaitable[None]], *,
                  rail_timeout: float = DEFAULT_TIMEOUT, size: int = 65536, iterations: int = 5000,
                  duration: int | None = None, gpudirect: bool = False) -> dict[str, Any]:
        """Test every rail between A (client) and B (server); `emit` gets each step as it happens.
        `duration`: seconds of -D (0: `iterations` of `size`; None: default_duration(rail_timeout))."""
        rails = self.check(a, b, gpudirect=gpudirect, duration=duration, rail_timeout=rail_timeout)
        timeout = min(max(float(rail_timeout), 1.0), MAX_TIMEOUT)
        notes: list[str] = []
        if duration is None:
            duration = default_duration(timeout)
            if not duration:
                notes.append(f"a {timeout:g} s rail timeout leaves no room for a duration run (-D needs "
                             f"{DURATION_SLACK:g} s beyond it): ran {iterations} iterations of {size} bytes")
        if duration and not all(self.links.supports(n, m.FEATURE_FABRIC_TEST_DURATION) for n in (a, b)):
            old = [n for n in (a, b) if not self.links.supports(n, m.FEATURE_FABRIC_TEST_DURATION)]
            notes.append(f"{' and '.join(old)}: agent too old for duration runs (-D); ran {iterations} iterations "
                         f"of {size} bytes instead")
            duration = 0
        plan = _Plan(size=size, iterations=iterations, duration=duration,
                     cuda=_cuda_devices(self.registry, a, b, rails) if gpudirect else {})
        async with self._holding((a, b), emit):
            await emit({"event": "start", "a": a, "b": b, "duration": duration, "gpudirect": gpudirect,
                        "rails": [msgspec.to_builtins(r) for r in rails]})
            results: list[RailResult] = []
            unready = await self._prepare((a, b), emit, notes)
            for rail in rails:
                await emit({"event": "rail_start", "rail": rail.index, "fabric": rail.fabric, "a": rail.a, "b": rail.b})
                if unready:
                    result = grade(rail, None, unready)
                else:
                    result = await self._rail(a, b, rail, emit, timeout, plan)
                results.append(result)
                await emit({"event": "rail", **msgspec.to_builtins(result)})
        status, code = overall(results)
        log.info("fabric test %s → %s: %s (%s)", a, b, status,
                 ", ".join(f"{r.fabric}#{r.rail} {r.status}" for r in results))
        done = {"event": "done", "a": a, "b": b, "status": status, "exit_code": code, "notes": notes,
                "duration": duration, "gpudirect": gpudirect, "rails": [msgspec.to_builtins(r) for r in results]}
        if self.results is not None:
            self.results.fabric_test_done(done)  # the pair's last result, on /metrics
        return done

    @asynccontextmanager
    async def _holding(self, nodes: tuple[str, ...],
                       emit: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[None]:
        """Both nodes' locks, taken in name order (lock_order); the caller hears whom it waits for."""
        order = lock_order(*nodes)
        busy = [n for n in order if n in self._locks and self._locks[n].locked()]
        if busy:
            await emit({"event": "waiting", "message": f"{' and '.join(busy)} {'is' if len(busy) == 1 else 'are'} "
                                                       "in another fabric test; this one starts after it"})
        for node_id in order:
            self._users[node_id] = self._users.get(node_id, 0) + 1
            self._locks.setdefault(node_id, trio.Lock())
        try:
            async with AsyncExitStack() as stack:
                for node_id in order:
                    await stack.enter_async_context(self._locks[node_id])
                yield
        finally:
            for node_id in order:
                self._users[node_id] -= 1
                if not self._users[node_id]:
                    del self._users[node_id], self._locks[node_id]

    def busy(self) -> list[str]:
        """The nodes in a fabric test now."""
        return sorted(n for n, lock in self._locks.items() if lock.locked())

    def _phase(self, name: str, within: float, install: float = 0.0) -> Phase:
        return phase(name, trio.current_time(), within, self.grace, install)

    async def _prepare(self, nodes: tuple[str, ...], emit: Callable[[dict[str, Any]], Awaitable[None]],
                       notes: list[str]) -> str:
        """Both agents make sure ib_write_bw is there first (an install takes minutes: it must not
        happen while the other side's server waits). "" when both are ready, else why not."""
        base = f"ft-{next(self._ids)}-{secrets.token_hex(4)}"
        for node_id in nodes:
            async with self._asking(node_id, f"{base}-p-{node_id}") as (request_id, results):
                self._send(node_id, m.FabricTest(request_id=request_id, role="prepare"))
                said: list[str] = []
                step = self._phase("prepare", 0.0, self.install_wait)
                done = await self._wait(node_id, results, step, said, emit, want="done")
                notes.extend(f"{node_id}: {note}" for note in said)
            if done is None or not done.ok:
                return _why(node_id, done, "could not get ib_write_bw ready", step)
        return ""

    async def _rail(self, a: str, b: str, rail: Rail, emit: Callable[[dict[str, Any]], Awaitable[None]],
                    limit: float, plan: _Plan) -> RailResult:
        timeout = limit
        if not rail.a or not rail.b:
            return grade(rail, None)
        base = f"ft-{next(self._ids)}-{secrets.token_hex(4)}"
        notes: list[str] = []
        if plan.cuda:
            notes.append(f"GPUDirect: buffers in GPU {plan.cuda.get((a, rail.index), -1)} of {a} and GPU "
                         f"{plan.cuda.get((b, rail.index), -1)} of {b} (--use_cuda)")
        b_dev, b_port = split_port(rail.b)
        a_dev, a_port = split_port(rail.a)
        async with self._asking(b, base + "-s") as (server_id, server_results):
            self._send(b, m.FabricTest(request_id=server_id, role="server", device=b_dev, port=b_port, size=plan.size,
                                       iterations=plan.iterations, timeout=timeout + GRACE, duration=plan.duration,
                                       cuda_device=plan.cuda.get((b, rail.index), -1)))
            step = self._phase("ready", timeout)
            ready = await self._wait(b, server_results, step, notes, emit, want="ready")
            if ready is None or not ready.ok or ready.phase != "ready":
                why = _why(b, ready, "did not start its ib_write_bw server", step)
                return _with(grade(rail, None, why), notes)
            host, tcp_port, refused = client_target(b, self._host(b), ready.tcp_port)
            if refused:
                log.warning("fabric test %s → %s, rail %s: %s", a, b, rail.name, refused)
                self._send(b, m.FabricTestCancel(request_id=server_id))
                return _with(grade(rail, None, refused), notes)
            async with self._asking(a, base + "-c") as (client_id, client_results):
                self._send(a, m.FabricTest(request_id=client_id, role="client", device=a_dev, port=a_port,
                                           server_host=host, server_port=tcp_port, size=plan.size,
                                           iterations=plan.iterations, timeout=timeout, duration=plan.duration,
                                           cuda_device=plan.cuda.get((a, rail.index), -1)))
                step = self._phase("client", timeout)
                done = await self._wait(a, client_results, step, notes, emit, want="done")
            if done is None or not done.ok:
                self._send(b, m.FabricTestCancel(request_id=server_id))
                why = _why(a, done, "ran no client", step)
                return _with(grade(rail, parse(done.output) if done else None, why), notes)
            server_done = await self._wait(b, server_results, self._phase("server done", 0.0), notes, emit,
                                           want="done")
        table = parse(done.output)
        if table.result is None and server_done is not None:
            table = parse(server_done.output)  # the server side prints the same table
        result = _with(grade(rail, table), notes)
        result.duration = done.duration
        return result

    def _host(self, node_id: str) -> str:
        """Where B is reached: the host the server decided at its Register (fleet.endpoint_host)."""
        node = self.registry.get(node_id)
        return (node.endpoint_host or node.address.rpartition(":")[0].strip("[]")) if node else ""

    def _send(self, node_id: str, msg: msgspec.Struct) -> None:
        session = self.links.get(node_id)
        if session is not None:
            session.send(msg)

    def _asking(self, node_id: str, request_id: str) -> _Asking:
        return _Asking(self, node_id, request_id)

    async def _wait(self, node_id: str, results: trio.MemoryReceiveChannel[m.FabricTestResult], step: Phase,
                    notes: list[str], emit: Callable[[dict[str, Any]], Awaitable[None]], *,
                    want: str) -> m.FabricTestResult | None:
        """The next result of phase `want` (or a failure), None at the phase's deadline or when the
        node is gone. Nothing the node sends moves the deadline past the phase's ceiling."""
        while True:
            with trio.move_on_at(step.deadline):
                try:
                    msg = await results.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return m.FabricTestResult(request_id="", error=f"the stream to {node_id} ended during the test")
                for note in msg.notes:
                    if note not in notes and len(notes) < MAX_NOTES:
                        notes.append(note)
                        await emit({"event": "note", "node": node_id, "message": note})
                if msg.phase == "progress":
                    step.progressed()  # installing perftest: up to the ceiling fixed at the phase start
                    continue
                if msg.phase == want or not msg.ok:
                    return msg
                continue
            return None


class _Asking:
    """A request id routed to this test while the block runs, forgotten after it."""

    def __init__(self, tests: FabricTests, node_id: str, request_id: str) -> None:
        self.tests, self.node_id, self.request_id = tests, node_id, request_id
        self.send, self.receive = trio.open_memory_channel[m.FabricTestResult](QUEUE)

    async def __aenter__(self) -> tuple[str, trio.MemoryReceiveChannel[m.FabricTestResult]]:
        self.tests.routes[self.request_id] = _Route(self.node_id, self.send)
        return self.request_id, self.receive

    async def __aexit__(self, kind: object, value: object, tb: object) -> None:
        self.tests.routes.pop(self.request_id, None)
        self.send.close()
        if kind is not None:  # the test ended early (the caller went away): nothing is left running there
            self.tests._send(self.node_id, m.FabricTestCancel(request_id=self.request_id))


def default_duration(rail_timeout: float) -> int:
    """The -D seconds a test runs when not told: perftest's 5, or what fits in the rail timeout
    beside DURATION_SLACK; 0 (iterations) when not even 1 s does."""
    fits = int(rail_timeout - DURATION_SLACK)
    return max(0, min(DEFAULT_DURATION, fits))


class _Plan(msgspec.Struct, frozen=True, kw_only=True):
    """How every rail of one test runs."""

    size: int
    iterations: int
    duration: int  # -D seconds; 0: -n iterations
    cuda: dict[tuple[str, int], int] = {}  # (node, rail index) → the GPU whose memory it uses


def _cuda_devices(registry: NodeRegistry, a: str, b: str, rails: list[Rail]) -> dict[tuple[str, int], int]:
    """Each rail's GPU on each side: the GPU nearest the rail's HCA on the node's PCIe tree (one
    switch, then one host bridge, then one NUMA node: the path GPUDirect RDMA takes; the agent's
    Port.gpu_affinity, fabric/gputopo.nearest_gpus), else, from an agent that cannot place its GPUs,
    its position in its fabric modulo the node's GPUs (NIC n ↔ GPU n)."""
    out: dict[tuple[str, int], int] = {}
    seen: dict[str, int] = {}
    nearest: dict[str, dict[str, int]] = {}
    for node_id, side in ((a, 0), (b, 1)):
        node = registry.get(node_id)
        if node is not None:
            order = [_device(rail.a if side == 0 else rail.b) for rail in rails]
            affinity = {p.device: p.gpu_affinity for p in node.inventory.ports if p.gpu_affinity}
            nearest[node_id] = nearest_gpus(affinity, [d for d in order if d])
    for rail in rails:
        position = seen.get(rail.fabric, 0)
        seen[rail.fabric] = position + 1
        for node_id, end in ((a, rail.a), (b, rail.b)):
            node = registry.get(node_id)
            gpus = sorted(g.index for g in node.inventory.gpus) if node else []
            near = nearest.get(node_id, {}).get(_device(end))
            if near is not None and near in gpus:
                out[(node_id, rail.index)] = near
            elif gpus:
                out[(node_id, rail.index)] = gpus[position % len(gpus)]
    return out


def _device(end: str) -> str:
    """A rail's end, "mlx5_0:1", → its HCA, "mlx5_0"."""
    return end.rpartition(":")[0] if ":" in end else end


def _rates(node: Any) -> dict[str, float | Capacity]:
    """"mlx5_0/1" → what the port carries: the heartbeat's rate (the Register's inventory before the
    first one) as a data rate, capped by the HCA's PCIe link the inventory reports (linkrate)."""
    out: dict[str, float | Capacity] = {}
    for p in node.inventory.ports:
        key = f"{p.device}/{p.port}"
        reading = node.ports.get(key)
        rate = reading.rate_gbps if reading is not None and reading.rate_gbps else p.rate_gbps
        speed = p.speed
        out[key] = capacity(rate, speed, p.link_layer, pcie_speed=p.pcie_speed_gts, pcie_width=p.pcie_width,
                            pcie_max_speed=p.pcie_max_speed_gts, pcie_max_width=p.pcie_max_width)
    return out


def _why(node_id: str, msg: m.FabricTestResult | None, what: str, step: Phase) -> str:
    if msg is None:
        return (f"{node_id} {what} in time: the {step.name} phase's deadline ({step.seconds:g} s, fixed when it "
                "started) passed")
    return f"{node_id}: {msg.error or what}"


def _with(result: RailResult, notes: list[str]) -> RailResult:
    result.notes = list(notes)
    return result
