"""A stand-in `ray` for simulated nodes: `ray start … --block` and `ray stop`, as a Ray-mode shard
uses them (agent/rayrank.py), with what makes two Ray clusters on one node collide.

    python -m llmgw.sim.ray NODE_DIR start --head --port P --node-ip-address A … --block
    python -m llmgw.sim.ray NODE_DIR start --address A:P --node-ip-address B … --block
    python -m llmgw.sim.ray NODE_DIR stop [--force]

`llmgw sim node` writes NODE_DIR/bin/ray, which runs this with its node directory. Like Ray 2.x:

- The head listens on its GCS port (`--port`) for the other nodes to join; a worker joins it and
  exits 1 when it goes away (a raylet that lost its GCS). The simulated engine's Ray mode
  (`--distributed-executor-backend ray`) connects to RAY_ADDRESS as the driver and is ready once
  the cluster has the nodes its pipeline spans.
- Every node binds its dashboard agent's port (`--dashboard-agent-listen-port`, Ray's default
  52365) and the ports it is given (node manager, object manager, metrics export, dashboard agent
  gRPC, runtime env agent; 0 or unset: a free one); the head also binds the Ray client server
  (`--ray-client-server-port`, default 10001) and the dashboard (`--dashboard-port`, default
  8265) unless `--include-dashboard=false`. A port already taken fails the start, as it does
  Ray's: two heads on one node with the defaults collide.
- `ray stop` stops every Ray process of the node, whichever cluster it belongs to, as the real
  one does (it matches every Ray process of the machine by name): what a shard must never run
  to stop its own Ray.
- SIGTERM stops it (exit 1, as `ray start --block`'s handler exits after its cleanup).

Only `--block` is simulated: without it Ray leaves daemons behind, which is what rayrank avoids.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from pathlib import Path

import trio

LAUNCH_PREFIX = "llmgw-sim-ray launch:"
JOIN_RETRY = 0.2  # seconds between a worker's tries to reach a head that is still starting
JOIN_DEADLINE = 30.0  # Ray's own worker gives up on an unreachable GCS after about as long

# The ports `ray start` binds on every node / on the head, with Ray's defaults (None: a free one).
NODE_PORTS = {"dashboard_agent_listen_port": 52365, "node_manager_port": None, "object_manager_port": None,
              "metrics_export_port": None, "dashboard_agent_grpc_port": None, "runtime_env_agent_port": None}
HEAD_PORTS = {"ray_client_server_port": 10001}


def say(line: str) -> None:
    print(f"llmgw-sim-ray: {line}", flush=True)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="ray")
    commands = top.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start")
    start.add_argument("--head", action="store_true")
    start.add_argument("--address", default="")
    start.add_argument("--port", type=int, default=6379)
    start.add_argument("--node-ip-address", default="127.0.0.1")
    start.add_argument("--block", action="store_true")
    start.add_argument("--temp-dir", default="")
    start.add_argument("--include-dashboard", default="true")
    start.add_argument("--dashboard-port", type=int, default=8265)
    for name in [*NODE_PORTS, *HEAD_PORTS]:
        start.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    start.add_argument("--min-worker-port", type=int, default=10002)
    start.add_argument("--max-worker-port", type=int, default=19999)
    start.add_argument("--num-gpus", type=int, default=None)
    start.add_argument("--num-cpus", type=int, default=None)
    start.add_argument("--disable-usage-stats", action="store_true")
    stop = commands.add_parser("stop")
    stop.add_argument("--force", action="store_true")
    return top


# ---- the node's Ray processes (what `ray stop` finds) ----------------------------------------------


def _pid_dir(node: Path) -> Path:
    return node / "ray-processes"


def stop_all(node: Path, force: bool) -> int:
    sig = signal.SIGKILL if force else signal.SIGTERM
    stopped = 0
    for path in sorted(_pid_dir(node).glob("*.pid")):
        try:
            os.kill(int(path.stem), sig)
            stopped += 1
        except (ValueError, ProcessLookupError, PermissionError):
            pass
        path.unlink(missing_ok=True)
    say(f"stopped {stopped} Ray process(es) on this node")
    return 0


# ---- start -----------------------------------------------------------------------------------------


def _bind(host: str, port: int, what: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError as exc:
        sock.close()
        raise SystemExit(f"llmgw-sim-ray: failed to start the {what} on {host}:{port}: {exc.strerror or exc} "
                         "(another Ray on this node holds the port)") from None
    return sock


def bind_ports(opts: argparse.Namespace) -> list[socket.socket]:
    wanted = dict(NODE_PORTS)
    if opts.head:
        wanted.update(HEAD_PORTS)
        if opts.include_dashboard.lower() not in ("false", "0", "no"):
            wanted["dashboard_port"] = opts.dashboard_port
    held = []
    for name, default in wanted.items():
        given = getattr(opts, name, None)
        port = given if given is not None else default
        held.append(_bind(opts.node_ip_address, port or 0, name.replace("_", " ")))
    return held


class Head:
    """The GCS side: nodes join (`node ADDR`), drivers watch the count (`driver` → `nodes N`)."""

    def __init__(self) -> None:
        self.nodes = 1  # the head itself
        self.changed = trio.Event()

    def _bump(self, by: int) -> None:
        self.nodes += by
        self.changed.set()
        self.changed = trio.Event()

    async def serve(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                hello = (await stream.receive_some(256)).decode(errors="replace").strip()
                if hello.startswith("node "):
                    await self._node(stream, hello[5:])
                elif hello == "driver":
                    while True:
                        changed = self.changed
                        await stream.send_all(f"nodes {self.nodes}\n".encode())
                        await changed.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the other end went away (a probe that only connects, a stopped node or driver)

    async def _node(self, stream: trio.SocketStream, address: str) -> None:
        self._bump(1)
        say(f"node {address} joined ({self.nodes} in the cluster)")
        try:
            while await stream.receive_some(256):
                pass
        finally:
            self._bump(-1)
            say(f"node {address} left ({self.nodes} in the cluster)")


async def run_head(opts: argparse.Namespace, gcs: socket.socket) -> int:
    head = Head()
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(gcs))
    say(f"Ray head started: GCS at {opts.node_ip_address}:{opts.port}")
    await trio.serve_listeners(head.serve, [listener])
    return 0


async def run_worker(opts: argparse.Namespace) -> int:
    host, _, port = opts.address.rpartition(":")
    stream: trio.SocketStream | None = None
    with trio.move_on_after(JOIN_DEADLINE):
        while stream is None:
            try:
                stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
            except OSError:
                await trio.sleep(JOIN_RETRY)
    if stream is None:
        say(f"cannot reach the GCS at {opts.address}")
        return 1
    async with stream:
        await stream.send_all(f"node {opts.node_ip_address}\n".encode())
        say(f"joined the Ray cluster at {opts.address}")
        try:
            while await stream.receive_some(256):
                pass
        except trio.BrokenResourceError:
            pass
    say(f"the GCS at {opts.address} went away; this node's raylet exits")
    return 1


async def run_start(opts: argparse.Namespace, held: list[socket.socket], gcs: socket.socket | None) -> int:
    code = [0]
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def main() -> None:
                code[0] = await (run_head(opts, gcs) if gcs is not None else run_worker(opts))
                nursery.cancel_scope.cancel()

            nursery.start_soon(main)
            async for signum in signals:
                say(f"received {signal.Signals(signum).name}; stopping this node's Ray processes")
                code[0] = 1
                nursery.cancel_scope.cancel()
                break
    for sock in held:
        sock.close()
    return code[0]


def start(node: Path, opts: argparse.Namespace) -> int:
    print(LAUNCH_PREFIX, json.dumps({"argv": sys.argv[2:], "env": {k: v for k, v in sorted(os.environ.items())
                                                                    if k.startswith(("CUDA_", "RAY_", "VLLM_"))}}),
          flush=True)
    if not opts.block:
        raise SystemExit("llmgw-sim-ray: only `ray start ... --block` is simulated")
    if opts.head == bool(opts.address):
        raise SystemExit("llmgw-sim-ray: give either --head or --address")
    gcs = _bind(opts.node_ip_address, opts.port, "GCS server") if opts.head else None
    held = bind_ports(opts)
    pid_file = _pid_dir(node) / f"{os.getpid()}.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(json.dumps({"head": opts.head, "port": opts.port, "address": opts.address}))
    try:
        return trio.run(run_start, opts, held + ([gcs] if gcs else []), gcs)
    finally:
        pid_file.unlink(missing_ok=True)


STANDIN = """#!/bin/sh
# Written by `llmgw sim node`: a stand-in ray (`ray start ... --block`, `ray stop`) for this node's
# Ray-mode shards (llmgw/sim/ray.py). An agent finds it with NODE/bin first on its PATH.
exec {python} -m llmgw.sim.ray {node} "$@"
"""


def write_standin(root: str) -> None:
    """NODE/bin/ray, running this module with the node directory (`llmgw sim node` calls it)."""
    import shlex

    from llmgw.fsutil import atomic_write

    bin_dir = os.path.join(root, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    script = STANDIN.format(python=shlex.quote(sys.executable), node=shlex.quote(root))
    atomic_write(os.path.join(bin_dir, "ray"), script.encode(), mode=0o755)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m llmgw.sim.ray NODE_DIR start|stop ...")
    node = Path(args[0])
    opts = parser().parse_args(args[1:])
    if opts.command == "stop":
        return stop_all(node, opts.force)
    return start(node, opts)


if __name__ == "__main__":
    sys.exit(main())
