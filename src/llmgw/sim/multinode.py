"""The simulated engine's ranks of a multi-node replica, as vLLM's multiprocessing runs them.

Rank 0 (`--nnodes N --node-rank 0 --master-addr A --master-port P`) listens on the master port
and does not answer /health with 200 until all N-1 other ranks have connected (vLLM's API
server is not up before its workers have joined). A rank above 0 (`--headless`) serves no
HTTP: it connects to the master (retrying while rank 0 starts) and runs until it is stopped,
exiting 1 if the master goes away. A worker that goes away after the start is only logged by
rank 0, which keeps answering /health: the half-alive replica the control plane must not
leave in rotation.

In Ray mode (`--distributed-executor-backend ray`, only rank 0 runs an engine) the engine is the
Ray driver: it connects to the cluster at RAY_ADDRESS (the stand-in `ray`, sim/ray.py), is ready
once the cluster has as many nodes as its pipeline spans, and fails when the cluster goes away.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

CONNECT_RETRY = 0.2  # seconds between a worker's tries to reach a master that is still starting


class WorkerGroup:
    """Rank 0's side: accept the other ranks; `all_joined` once N-1 have."""

    def __init__(self, workers: int, log: Callable[[str], None]) -> None:
        self.workers = workers
        self.joined = 0
        self.all_joined = trio.Event()
        self.log = log
        if workers <= 0:
            self.all_joined.set()

    async def serve(self, host: str, port: int, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started()
        await trio.serve_listeners(self._worker, listeners)

    async def _worker(self, stream: trio.SocketStream) -> None:
        async with stream:
            hello = (await stream.receive_some(64)).decode(errors="replace").strip()
            self.joined += 1
            self.log(f"worker {hello or '?'} joined ({self.joined} of {self.workers})")
            if self.joined >= self.workers:
                self.all_joined.set()
            while await stream.receive_some(64):
                pass
            self.joined -= 1
            self.log(f"worker {hello or '?'} went away; still serving (a collective would hang now)")


async def run_headless(master_addr: str, master_port: int, rank: int, log: Callable[[str], None]) -> int:
    """A rank above 0: join the master, then hold until stopped; 1 if the master goes away."""
    while True:
        try:
            stream = await trio.open_tcp_stream(master_addr, master_port)
            break
        except OSError:
            await trio.sleep(CONNECT_RETRY)
    async with stream:
        await stream.send_all(f"rank {rank}\n".encode())
        log(f"headless rank {rank} joined the master at {master_addr}:{master_port}")
        while await stream.receive_some(64):
            pass
    log(f"headless rank {rank}: the master at {master_addr}:{master_port} went away")
    return 1


class RayClusterLost(Exception):
    """The Ray cluster the simulated driver was attached to went away."""


async def ray_driver(address: str, nodes: int, log: Callable[[str], None], ready: Callable[[], None]) -> None:
    """Attach to the (simulated) Ray cluster at `address` ("host:port"); call `ready` once it has
    `nodes` nodes; raise RayClusterLost when it goes away."""
    host, _, port = address.rpartition(":")
    try:
        stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
    except (OSError, ValueError) as exc:
        raise RayClusterLost(f"cannot connect to the Ray cluster at {address}: {exc}") from None
    async with stream:
        await stream.send_all(b"driver\n")
        log(f"connected to the Ray cluster at {address}; waiting for {nodes} node(s)")
        buffer, started = b"", False
        while True:
            try:
                data = await stream.receive_some(256)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                raise RayClusterLost(f"the Ray cluster at {address} went away")
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                count = int(line.split()[1]) if line.startswith(b"nodes ") else 0
                if count >= nodes and not started:
                    started = True
                    log(f"the Ray cluster has {count} node(s); placement group ready")
                    ready()
