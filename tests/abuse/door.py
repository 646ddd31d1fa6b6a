"""What the control-plane abuse tests share: a well-behaved client that measures its latency
while the abuse runs, a real CA for the fleet port, and a scripted agent on a real stream.

Every abuse test says its outcome in one line (`report`), with the figures the "What survives what"
table of docs/operations.md is built from.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import msgspec
import trio

from llmgw import __version__
from llmgw.fleet import ChannelClosed, dial
from llmgw.tls import ca, client_context
from llmgw.wire import messages as m

# A /healthz answer slower than this while abuse runs is a stall. The fixes keep it in
# milliseconds; before them the stalls were 0.8 s to minutes. Generous, for a loaded 2-core box.
LATENCY_BAR = 0.5


class Probe:
    """GET `path` on one keep-alive connection, back to back with a short pause, recording each
    round trip: the well-behaved client that must stay served while the abuse runs."""

    def __init__(self, port: int, path: str = "/healthz", pause: float = 0.02) -> None:
        self.port = port
        self.path = path
        self.pause = pause
        self.latencies: list[float] = []
        self.failures: list[str] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        request = f"GET {self.path} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode()
        stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        started = False
        async with stream:
            while True:
                t0 = time.perf_counter()
                status = await _exchange(stream, request)
                self.latencies.append(time.perf_counter() - t0)
                if status != 200:
                    self.failures.append(f"HTTP {status}")
                if not started:
                    started = True
                    task_status.started()
                await trio.sleep(self.pause)  # ok: a client's think time, not a wait for a condition

    def mark(self) -> int:
        return len(self.latencies)

    def since(self, mark: int) -> list[float]:
        return self.latencies[mark:]


async def _exchange(stream: trio.SocketStream, request: bytes) -> int:
    await stream.send_all(request)
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("the server closed the probe's connection")
        buf += data
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("the server closed the probe's connection mid-body")
        body += data
    return status


def summary(latencies: Sequence[float]) -> str:
    if not latencies:
        return "no requests"
    ordered = sorted(latencies)
    p50 = ordered[len(ordered) // 2]
    return f"{len(ordered)} requests, p50 {p50 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"


def assert_served(probe: Probe, mark: int, what: str) -> str:
    """The well-behaved client was answered, every time, within the bar, while `what` ran."""
    during = probe.since(mark)
    assert during, f"the probe got no answer while {what}"
    assert not probe.failures, probe.failures
    worst = max(during)
    line = f"/healthz during {what}: {summary(during)} (bar {LATENCY_BAR * 1000:.0f} ms)"
    assert worst < LATENCY_BAR, line
    return line


def report(case: str, outcome: str, served: str) -> None:
    """One line per case for the table in docs/operations.md (pytest -s, or -rA, shows it)."""
    print(f"\nABUSE {case}: {outcome}; {served}")


class Certs(msgspec.Struct):
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    def server_tls_yaml(self) -> str:
        d = self.directory
        return f"tls:\n  ca: {d / 'ca.crt'}\n  cert: {d / 'server.crt'}\n  key: {d / 'server.key'}\n"

    def node(self, node_id: str) -> tuple[Path, Path]:
        crt, key = self.directory / f"node-{node_id}.crt", self.directory / f"node-{node_id}.key"
        if not crt.exists():
            ca.issue_client(self.directory, "node", node_id, now=time.time())
        return crt, key

    def gateway(self, name: str) -> tuple[Path, Path]:
        crt, key = self.directory / f"gateway-{name}.crt", self.directory / f"gateway-{name}.key"
        if not crt.exists():
            ca.issue_client(self.directory, "gateway", name, now=time.time())
        return crt, key


def make_ca(directory: Path) -> Certs:
    now = time.time()
    ca.init_ca(directory, now=now, name="abuse test CA")
    ca.issue_server(directory, hosts=["localhost"], ips=["127.0.0.1"], now=now)
    return Certs(directory)


class Agent:
    """A scripted agent on a real mutual-TLS fleet stream: registers what the test says, then
    heartbeats and records what the server sends (Start, Stop) until told to stop."""

    def __init__(self, fleet_url: str, certs: Certs, node_id: str, register: m.Register | None = None,
                 max_message: int = 8 << 20) -> None:
        self.fleet_url = fleet_url
        self.certs = certs
        self.node_id = node_id
        self.register = register or m.Register(node_id=node_id, version=__version__)
        self.max_message = max_message
        self.received: list[msgspec.Struct] = []
        self.closed: str | None = None
        self.ack_starts = False  # answer each Start with a ShardStatus "starting", as an agent does
        # For each message the server sends, an async generator of what this agent answers (run in its
        # own task, so an answer that never ends, "progress" forever, does not stop the reader).
        self.answer: Callable[[msgspec.Struct], AsyncIterator[msgspec.Struct]] | None = None
        self._send_lock = trio.Lock()

    def context(self):  # type: ignore[no-untyped-def]
        crt, key = self.certs.node(self.node_id)
        return client_context(str(self.certs.ca), str(crt), str(key))

    async def run(self, stop: trio.Event, heartbeat: float = 0.2) -> None:
        try:
            async with dial(self.fleet_url, ssl_context=self.context(), max_message=self.max_message) as ch:
                await ch.send(m.encode(self.register))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._receive, ch, nursery)
                    seq = 0
                    while not stop.is_set():
                        seq += 1
                        async with self._send_lock:
                            await ch.send(m.encode(m.Heartbeat(seq=seq)))
                        with trio.move_on_after(heartbeat):
                            await stop.wait()
                    nursery.cancel_scope.cancel()
        except* ChannelClosed as group:
            self.closed = "; ".join(e.reason for e in group.exceptions if isinstance(e, ChannelClosed))

    async def _receive(self, ch, nursery: trio.Nursery) -> None:  # type: ignore[no-untyped-def]
        scope = nursery.cancel_scope
        try:
            while True:
                msg = m.decode_server_message(await ch.receive())
                self.received.append(msg)
                if self.answer is not None:
                    nursery.start_soon(self._answer, ch, msg)
                if self.ack_starts and isinstance(msg, m.Start):
                    async with self._send_lock:
                        await ch.send(m.encode(m.ShardStatus(shard_id=msg.spec.shard_id, replica_id=msg.spec.replica_id,
                                                             state="starting", pid=1)))
        except ChannelClosed as exc:
            self.closed = exc.reason
            scope.cancel()

    async def _answer(self, ch, msg: msgspec.Struct) -> None:  # type: ignore[no-untyped-def]
        assert self.answer is not None
        async for reply in self.answer(msg):
            async with self._send_lock:
                await ch.send(m.encode(reply))

    def starts(self) -> list[m.Start]:
        return [x for x in self.received if isinstance(x, m.Start)]


def clique(n: int, links: int = 18) -> list[m.Gpu]:
    """n GPUs, every one NVLinked to every other (an NVSwitch box)."""
    return [m.Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_mib=81559,
                  nvlink={j: links for j in range(n) if j != i}) for i in range(n)]


def metric(server_url: str, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics (0 when absent)."""
    import httpx

    prefix = f"{name}{{{labels}}}" if labels else name
    for line in httpx.get(f"{server_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    return 0.0


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS in /proc/PID/status), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no VmRSS for process {pid}")
