"""A simulated vLLM: its OpenAI-compatible HTTP server, latency, metrics and failures, on trio.

What a gateway and an agent touch behaves like vLLM's server: `/v1/chat/completions` and
`/v1/completions` (JSON and SSE streaming), `/v1/embeddings`, `/v1/models`, `/health` (503
until the simulated weights are loaded), `/metrics` with vLLM's metric names, `/version`.
Requests beyond `max_concurrency` wait (`vllm:num_requests_waiting`); a client that goes
away aborts its request, as vLLM does. Failures are injected by option: error answers, a
crash after N requests, a hang, a failed start.

Use it as a process (`llmgw sim engine`, see `run_until_signalled`) or in a nursery:

    handle = await nursery.start(serve_engine, EngineOptions(port=0))
    ... handle.url ...
    handle.stop()   # graceful: stop accepting, let requests finish for shutdown_grace_s

With `port=0` the engine prints `llmgw-sim-engine listening on HOST:PORT` on stdout as
soon as it is bound (before the startup delay), so a parent process can read the port.

The parts: this module is the lifecycle (bind, load, serve, stop, crash); HTTP is
llmgw.web.server, the same server as the public port's, with its head and body timeouts;
the routes are llmgw.sim.routes, the batch and its timing llmgw.sim.scheduler, the log
lines llmgw.sim.vllm_log, the request and response bodies llmgw.sim.openai_api.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

import trio

from llmgw.netaddr import url_host
from llmgw.sim.multinode import RayClusterLost, WorkerGroup, ray_driver
from llmgw.sim.options import (
    LISTENING_PREFIX,
    VLLM_VERSION,
    EngineBindFailed,
    EngineOptions,
    EngineStartupFailed,
    SimulatedCrash,
)
from llmgw.sim.routes import EngineApp
from llmgw.sim.scheduler import SimEngine
from llmgw.sim.vllm_log import LogFn, VllmLog, default_log, stamp
from llmgw.web.server import HttpServer, Limits

__all__ = [
    "LISTENING_PREFIX",
    "VLLM_VERSION",
    "EngineBindFailed",
    "EngineHandle",
    "EngineOptions",
    "EngineStartupFailed",
    "SimEngine",
    "SimulatedCrash",
    "run_until_signalled",
    "serve_engine",
]

MAX_BODY = 64 * 1024 * 1024


class EngineHandle:
    """What `serve_engine` hands its starter: where it listens, its state, and a stop button."""

    def __init__(self, engine: SimEngine, stop: trio.Event, host: str, port: int) -> None:
        self.engine = engine
        self._stop = stop
        self.host = host
        self.port = port
        self.ready = trio.Event()  # set once the startup delay is over and /health answers 200

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def stop(self) -> None:
        """Graceful stop: close the listener, end idle connections, give requests shutdown_grace_s."""
        self._stop.set()


class _Lifecycle:
    """One engine's run: bind, load (the startup delay), serve, stop gracefully or crash."""

    def __init__(self, options: EngineOptions, log: LogFn | None, on_crash: Callable[[], None] | None) -> None:
        self.options = options
        self.log = VllmLog(log)
        self.engine = SimEngine(options)
        self.app = EngineApp(options, self.engine, self.log, crash=self._crash)
        # drain_idle 0: an engine's clients are gateways, which resend a request that meets the
        # close of an idle pooled connection on a new one; its stop is not held for them.
        self.http = HttpServer(self.app, limits=Limits(max_body=MAX_BODY, drain_idle=0.0),
                               render_error=self.app.render_error)
        self.stop = trio.Event()
        self._on_crash = on_crash
        self.crashed = False
        self.failure: str | None = None
        self._outer = trio.CancelScope()

    async def run(self, task_status: trio.TaskStatus[EngineHandle]) -> None:
        o = self.options
        self.log.banner(o)
        listeners = await self._bind()
        host, port = listeners[0].socket.getsockname()[:2]
        handle = EngineHandle(self.engine, self.stop, host, port)
        self.log.raw(f"{LISTENING_PREFIX} {handle.url.removeprefix('http://')}")
        try:
            with self._outer:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._startup, handle)
                    if o.log_stats_interval_s > 0:
                        nursery.start_soon(self._stats_loop)
                    async with trio.open_nursery() as serving:
                        if o.hang:
                            await serving.start(trio.serve_listeners, _hold, listeners)
                        else:
                            await serving.start(self.http.serve, listeners)
                        task_status.started(handle)
                        await self.stop.wait()
                        self.log.info("launcher.py:101", "Shutting down FastAPI HTTP server.")
                        if not o.hang:  # a hung engine has no request to finish
                            await self.http.drain(o.shutdown_grace_s)
                        serving.cancel_scope.cancel()  # cut what outlived the grace
                    nursery.cancel_scope.cancel()
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)
        if self.crashed:
            raise SimulatedCrash(
                f"simulated crash after {self.app.answered} requests (crash_after={o.crash_after})"
            )
        if self.failure is not None:
            raise EngineStartupFailed(self.failure)

    async def _bind(self) -> list[trio.SocketListener]:
        o = self.options
        try:
            listeners = await trio.open_tcp_listeners(o.port, host=o.host)
        except OSError as exc:
            raise EngineBindFailed(
                f"cannot listen on {o.host}:{o.port}: {exc.strerror or exc}; pick another --port or --host"
            ) from None
        if o.port == 0 and len(listeners) > 1:
            # Each address family got its own free port; keep one so the printed port is the port.
            for extra in listeners[1:]:
                await extra.aclose()
            listeners = listeners[:1]
        return listeners

    async def _startup(self, handle: EngineHandle) -> None:
        o = self.options
        self.log.info("gpu_model_runner.py:2602", f"Starting to load model {o.model}...")
        if o.startup_delay_s > 0:
            await trio.sleep(o.startup_delay_s)
        if o.fail_startup:
            self.log.load_failure(o)
            self.failure = f"simulated engine failed to load the weights of {o.model} (--fail-startup)"
            self._outer.cancel()
            return
        if o.ray_address:
            try:
                await ray_driver(o.ray_address, o.ray_nodes, lambda line: self.log.info("ray_utils.py:290", line),
                                 lambda: self._ready(handle))
            except RayClusterLost as exc:
                self.failure = str(exc)
                self._outer.cancel()
        elif o.nnodes > 1:
            group = WorkerGroup(o.nnodes - 1, lambda line: self.log.info("multiproc_executor.py:140", line))
            async with trio.open_nursery() as nursery:
                await nursery.start(group.serve, o.master_addr, o.master_port)
                self.log.info("multiproc_executor.py:120", f"waiting for {o.nnodes - 1} worker rank(s) on "
                              f"{o.master_addr}:{o.master_port}")
                await group.all_joined.wait()
                self._ready(handle)
                await trio.sleep_forever()  # the group keeps listening (a worker's loss is logged)
        else:
            self._ready(handle)

    def _ready(self, handle: EngineHandle) -> None:
        self.log.loaded(self.options, handle.url)
        self.app.ready = True
        handle.ready.set()

    def _crash(self, answered: int) -> None:
        self.log.crash(answered)
        if self._on_crash is not None:
            self._on_crash()
        self.crashed = True
        self._outer.cancel()

    async def _stats_loop(self) -> None:
        interval = self.options.log_stats_interval_s
        while True:
            await trio.sleep(interval)
            self.log.stats(self.engine, interval)


async def _hold(stream: trio.SocketStream) -> None:
    """--hang: accept a connection and never read or answer, as a hung engine's kernel does."""
    async with stream:
        await trio.sleep_forever()


async def serve_engine(
    options: EngineOptions,
    *,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
    log: LogFn | None = None,
    on_crash: Callable[[], None] | None = None,
) -> None:
    """Serve until `handle.stop()` (graceful) or cancellation; `nursery.start` gets the handle.

    `log(line, is_error)` receives the vLLM-like log lines (default: stdout, errors to
    stderr). `on_crash` runs when `crash_after` is reached; the process runner passes one
    that exits the process on the spot, otherwise `SimulatedCrash` is raised. After a
    `fail_startup` start, `EngineStartupFailed` is raised.
    """
    await _Lifecycle(options, log, on_crash).run(task_status)


def _exit_now() -> None:
    """A crash as a supervisor sees one: no cleanup, no flush of sockets, a non-zero status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


async def run_until_signalled(options: EngineOptions) -> None:
    """The process: serve; SIGTERM or SIGINT stops gracefully, a second one stops at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        failure: list[Exception] = []
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[EngineHandle | None]) -> None:
                try:
                    await serve_engine(options, task_status=task_status, on_crash=_exit_now)
                except EngineBindFailed as exc:  # before it started
                    failure.append(exc)
                    task_status.started(None)
                except EngineStartupFailed as exc:
                    failure.append(exc)
                nursery.cancel_scope.cancel()

            handle: EngineHandle | None = await nursery.start(serve)
            if handle is not None:
                stopping = False
                async for signum in signals:
                    if stopping:
                        nursery.cancel_scope.cancel()
                        break
                    stopping = True
                    default_log(
                        f"(APIServer pid={os.getpid()}) INFO {stamp()} [launcher.py:99] "
                        f"Received {signal.Signals(signum).name}; shutting down.",
                        False,
                    )
                    handle.stop()
        if failure:
            raise failure[0]
