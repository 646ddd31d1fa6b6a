"""The engine supervisor: launch, watch, health-check, stop, and adopt engine processes.

This is the part that does it (spawns, signals, probes, reads and writes files); what each
observation means (adopt, stop or keep an engine found at start, a shard's next state, what is
reported) is decided in decide.py, which is pure and tested table by table.

Each engine runs in its own process group with its output going straight to a per-shard
log file (not through a pipe to the agent), so it keeps running, and keeps logging, while
the agent restarts. A state file per shard (full spec, pid, process start time) lets the
next agent adopt it: a pid alive with the same start time is the same process.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from llmgw.agent import decide, launch_env, procs
from llmgw.agent.decide import HEALTHY_OR_NOT, TERMINAL, Found
from llmgw.agent.engine_version import EngineVersions
from llmgw.agent.engines import LaunchError, adapter_for
from llmgw.agent.engines.policy import check_engine, check_env, check_executable
from llmgw.agent.launch_env import LaunchFacts
from llmgw.agent.logs import LogSource, LogStreams
from llmgw.agent.shardfiles import PathRefused, ShardFiles, connect_host, port_free, redact
from llmgw.agent.shardrun import ShardRun
from llmgw.agent.weights import Weights, WeightsPlan
from llmgw.catalog.schema import EngineAllow, EngineHealth
from llmgw.catalog.units import format_duration
from llmgw.wire import messages as m
from llmgw.wire.ids import message_problems, printable, quote, spec_problems
from llmgw.wire.shardstate import ShardState as S

log = logging.getLogger("llmgw.agent.supervisor")

TAIL_LINES = 200
HEALTH_PERIOD = 0.5
ADOPTED_POLL = 0.5


Send = Callable[[msgspec.Struct], None]


class Supervisor:
    features: tuple[str, ...] = (m.FEATURE_START, m.FEATURE_STOP, m.FEATURE_DRAIN, m.FEATURE_ADOPT, m.FEATURE_LOGS)

    def __init__(
        self,
        work_dir: str,
        *,
        bind_host: str = "127.0.0.1",
        advertise_host: str = "127.0.0.1",
        gpu_indexes: Callable[[], set[int] | None] = lambda: None,
        health: EngineHealth | None = None,
        allow: EngineAllow | None = None,
        launch_facts: Callable[[], LaunchFacts] | None = None,
        weights: Weights | None = None,
        versions: EngineVersions | None = None,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.weights = weights if weights is not None else Weights(self.work_dir)
        self.allow = allow if allow is not None else EngineAllow()
        self.files = ShardFiles(self.work_dir)  # state files and logs, nowhere outside the work dir
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.gpu_indexes = gpu_indexes
        self.health = health or EngineHealth()
        self.launch_facts = launch_facts or LaunchFacts
        self.versions = versions or EngineVersions()
        self.stopping_all = False  # stop_all began: no new engine may start (it would outlive us)
        self.runs: dict[str, ShardRun] = {}
        self._send: Send | None = None
        self._nursery: trio.Nursery | None = None
        self._http: httpx.AsyncClient | None = None
        self.logs = LogStreams(self._log_source)  # `ctl logs`: engine logs over the fleet stream

    # -- the link's view ------------------------------------------------------------------------

    def attach(self, send: Send | None) -> None:
        self._send = send
        if send is None:
            self.logs.cancel_all()

    def _log_source(self, shard_id: str) -> LogSource | None:
        run = self.runs.get(shard_id)
        if run is None:
            return None
        key = run.spec.api_key
        return LogSource(path=run.log_path, redact=lambda line: redact(line, key),
                         alive=lambda: run.state not in TERMINAL)

    def snapshot(self) -> list[m.ShardReport]:
        return [run.report() for run in self.runs.values()]

    def reports(self) -> list[m.ShardReport]:
        out = self.snapshot()
        # Terminal shards are told once, in this Register; then forgotten.
        for shard_id in decide.told_in_register(self._states()):
            del self.runs[shard_id]
        return out

    def _states(self) -> list[tuple[str, S]]:
        return [(sid, run.state) for sid, run in self.runs.items()]

    async def handle(self, msg: Any, send: Send) -> None:
        problems = message_problems(msg)
        if problems:
            # Checked before anything touches the filesystem: a shard id becomes a file name.
            log.warning("refusing %s from the server: %s", m.message_type(msg), "; ".join(problems))
            return
        if isinstance(msg, m.Start):
            self.start(msg.spec)
        elif isinstance(msg, m.Stop):
            self.stop(msg.shard_id, msg.grace, msg.reason)
        elif isinstance(msg, m.LogTail | m.LogCredit | m.LogCancel):
            self.logs.handle(msg, send)
        elif isinstance(msg, m.Drain):
            run = self.runs.get(msg.shard_id)
            if run is None:
                log.warning("refusing Drain for shard %s: it does not run on this node", msg.shard_id)
            else:
                # Out of the gateway's rotation already: what it runs finishes within the grace
                # (the engine's own SIGTERM handling), then the engine is stopped.
                log.info("draining shard %s: its in-flight requests get up to %gs", msg.shard_id, msg.grace)
                self.stop(msg.shard_id, msg.grace, f"drained: {msg.reason}" if msg.reason else "drained by the server")
        else:
            log.info("ignoring %s", m.message_type(msg))

    def _emit(self, run: ShardRun) -> None:
        """Tell the server (if a stream is up). A finished shard stays listed until the next
        Register repeats it, so a status lost with a breaking stream is not lost for good."""
        if self._send is not None:
            self._send(run.status())
        if run.state in TERMINAL:
            for sid in decide.too_many_finished(self._states()):
                del self.runs[sid]  # a long-lived stream: keep only the latest few

    # -- running ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.files.make_private()
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http, trio.open_nursery() as nursery:
            self._http = http
            self._nursery = nursery
            await nursery.start(self.logs.run)
            self._adopt_all()
            task_status.started()
            await trio.sleep_forever()

    def start(self, spec: m.ShardSpec) -> None:
        existing = self.runs.get(spec.shard_id)
        if existing is not None and decide.repeat_start(existing.state):
            self._emit(existing)  # a repeated Start (after a reconnect): say where it stands
            return
        problems = list(spec_problems(spec))
        if problems:
            log.warning("refusing Start: %s", "; ".join(problems))
            return
        try:
            log_path = self.files.log_path(spec.shard_id)
            self.files.state_path(spec.shard_id)
        except PathRefused as exc:
            log.warning("refusing Start of shard %s: %s", spec.shard_id, exc)
            return
        host = spec.host or self.bind_host
        run = ShardRun(spec, str(log_path), decide.endpoint(self.advertise_host, spec.port))
        self.runs[spec.shard_id] = run
        if self.stopping_all:
            # The server replaces the engines we are stopping, here too while we are still
            # connected: an engine started now would be left running after the agent exits.
            self._refuse(run, "the agent is stopping its engines")
            return
        try:
            self._check(spec, host)
            adapter = adapter_for(spec.engine)
            # This node's own allowlist before anything else about the profile.
            check_engine(spec.engine, self.allow)
            check_env(spec.env, self.allow)
            plan = self.weights.plan(spec)  # a missing path or a bad URL fails here, before anything runs
            argv = adapter.argv(plan.for_engine(spec), host, spec.port)
            for exe in adapter.executables(spec, argv):
                check_executable(spec.engine, exe, self.allow)
            adapter.validate(spec)
            env = adapter.env(spec)
            run.launch_env = launch_env.prepare(spec, self.launch_facts(), env)
        except (LaunchError, launch_env.LaunchError) as exc:
            self._refuse(run, str(exc))
            return
        assert self._nursery is not None
        self._nursery.start_soon(self._launch_and_watch, run, argv, env, plan)

    def _refuse(self, run: ShardRun, reason: str) -> None:
        log.warning("shard %s not started: %s", run.spec.shard_id, reason)
        run.state, run.reason = decide.refused(reason)
        self._emit(run)

    def _check(self, spec: m.ShardSpec, host: str) -> None:
        itself = self.runs.get(spec.shard_id)
        busy = decide.busy_gpus(r for r in self.runs.values() if r is not itself)
        problem = decide.launch_problem(spec, self.gpu_indexes(), busy)
        if problem:
            raise LaunchError(problem)
        if not port_free(host, spec.port):
            raise LaunchError(f"port {spec.port} on {host} is in use by another process")

    async def _launch_and_watch(self, run: ShardRun, argv: list[str], env: dict[str, str], plan: WeightsPlan) -> None:
        spec = run.spec
        # The engine's version before anything is fetched: a flag it does not take fails late.
        too_old = await self.versions.refusal(spec.engine, argv) if decide.runs_engine(spec) else ""
        if too_old and not run.stop_requested:
            self._refuse(run, too_old)
            return
        if plan.url and not await self._fetch_weights(run, plan):
            return
        if run.stop_requested:
            self._stopped_before_launch(run)
            return
        out = await trio.to_thread.run_sync(open, run.log_path, "ab")
        if run.stop_requested:  # the Stop came while the log file was being opened
            out.close()
            self._stopped_before_launch(run)
            return
        with out:
            shown = redact(subprocess.list2cmdline(argv), spec.api_key)
            out.write(f"=== llmgw: starting {spec.shard_id} ({spec.model}/{spec.profile}) at "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {shown}\n".encode())
            out.flush()
            try:
                process = await trio.lowlevel.open_process(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True, cwd=str(self.work_dir),
                )
            except OSError as exc:
                self._refuse(run, f"cannot execute {argv[0]}: {exc.strerror or exc}")
                return
        run.process = process
        run.pid = run.pgid = process.pid
        run.start_ticks = procs.start_ticks(process.pid) or 0
        run.started_at = time.time()
        self.files.write(run)
        if run.stop_requested:  # the Stop came while the process was being started
            assert self._nursery is not None
            self._nursery.start_soon(self._terminate, run, spec.stop_grace)
        log.info("shard %s started: pid %d, %s, log %s", spec.shard_id, run.pid,
                 redact(subprocess.list2cmdline(argv[:3]), spec.api_key) + " …", run.log_path)
        self._emit(run)
        await self._watch(run)

    async def _watch(self, run: ShardRun) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._check_health, run)
            code = await self._wait_exit(run)
            nursery.cancel_scope.cancel()
        self._on_exit(run, code)

    async def _wait_exit(self, run: ShardRun) -> int | None:
        if run.process is not None:
            return await run.process.wait()
        # Not our child (adopted): a pidfd becomes readable when it exits; poll where there is none.
        try:
            pidfd = os.pidfd_open(run.pid)
        except (AttributeError, OSError):
            pidfd = -1
        try:
            if pidfd >= 0 and procs.alive(run.pid, run.start_ticks):
                await trio.lowlevel.wait_readable(pidfd)
                return None
            while procs.alive(run.pid, run.start_ticks):  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(ADOPTED_POLL)
            return None
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    async def _fetch_weights(self, run: ShardRun, plan: WeightsPlan) -> bool:
        """Wait for the shard's weights (llmgw.agent.weights); False when it failed (reported).
        A Stop cancels the wait; start_timeout counts from the Start."""
        assert self._nursery is not None
        left = decide.time_left(run.spec, run.started_at, time.time())
        run.fetching = trio.CancelScope()
        try:
            with run.fetching:
                await self.weights.ensure(run.spec.shard_id, plan, trio.current_time() + left, self._nursery,
                                          self._send_progress)
        except LaunchError as exc:
            if not run.stop_requested:
                self._refuse(run, str(exc))
                return False
        finally:
            run.fetching = None
        return True

    def _send_progress(self, msg: msgspec.Struct) -> None:
        if self._send is not None:
            self._send(msg)

    async def _check_health(self, run: ShardRun) -> None:
        await self._until_healthy(run)
        if run.state in HEALTHY_OR_NOT:
            await self._while_ready(run)

    def _health_url(self, run: ShardRun) -> str:
        return f"http://{connect_host(run.spec.host or self.bind_host)}:{run.spec.port}{run.spec.health_path}"

    async def _while_ready(self, run: ShardRun) -> None:
        """Keep checking a ready engine (issue 9: a SIGSTOPped engine stayed `ready`): after
        `failures` checks in a row without an answer it is reported `unhealthy` with since
        when (the first of those failures); the next check that passes reports it ready."""
        if run.spec.rank > 0:
            return  # nothing to check over HTTP; its exit is watched
        url = self._health_url(run)
        health = self.health
        checks = decide.ReadyChecks(health.failures)
        while True:
            await trio.sleep(float(health.interval))
            if run.stop_requested or run.state not in HEALTHY_OR_NOT:
                return
            ok = await self._probe(url, float(health.timeout), api_key=run.spec.api_key)
            if run.stop_requested or run.state not in HEALTHY_OR_NOT:
                return
            change = checks.observe(ok, run.state, time.time())
            if change == S.READY:
                run.state, run.reason = S.READY, ""
                log.info("shard %s healthy again at %s", run.spec.shard_id, run.endpoint)
                self._emit(run)
            elif change == S.UNHEALTHY:
                run.state = S.UNHEALTHY
                since = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(checks.first_failure))
                run.reason = decide.unhealthy_reason(since, checks.failures, url, float(health.timeout))
                log.warning("shard %s %s", run.spec.shard_id, run.reason)
                self._emit(run)

    async def _until_healthy(self, run: ShardRun) -> None:
        if run.state != S.STARTING:
            return
        if run.spec.rank > 0:
            # A rank above 0 serves no HTTP (vLLM --headless): up is ready, and rank 0's health
            # speaks for the replica (the server holds it to every shard being ready).
            run.state = S.READY
            log.info("shard %s (rank %d of %d) is up", run.spec.shard_id, run.spec.rank, run.spec.world)
            self.files.write(run)
            self._emit(run)
            return
        url = self._health_url(run)
        with trio.move_on_after(decide.time_left(run.spec, run.started_at, time.time())):
            while True:
                if run.stop_requested:
                    return  # a Stop came while it started: it is stopping, not ready
                if await self._probe(url, api_key=run.spec.api_key):
                    if run.stop_requested:
                        return
                    run.state = S.READY
                    log.info("shard %s ready at %s", run.spec.shard_id, run.endpoint)
                    self.files.write(run)
                    self._emit(run)
                    return
                await trio.sleep(HEALTH_PERIOD)
        run.failed_reason = decide.start_timed_out(run.spec)
        log.warning("shard %s: %s", run.spec.shard_id, run.failed_reason)
        await self._terminate(run, run.spec.stop_grace)

    async def _probe(self, url: str, within: float | None = None, api_key: str = "") -> bool:
        """One health check. With the shard's key: vLLM leaves /health open, but an engine may
        guard every path (older SGLang guards /metrics), and a key never hurts."""
        assert self._http is not None
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        try:
            response = await (self._http.get(url, headers=headers) if within is None
                              else self._http.get(url, headers=headers, timeout=within))
        except (httpx.HTTPError, httpx.InvalidURL):
            return False
        return response.status_code == 200

    @staticmethod
    def _tail(run: ShardRun) -> list[str]:
        return [redact(line, run.spec.api_key) for line in procs.tail_lines(run.log_path, TAIL_LINES)]

    def _on_exit(self, run: ShardRun, code: int | None) -> None:
        run.exit_code = code
        self.files.remove(run.spec.shard_id)
        outcome = decide.exit_outcome(
            run.state, stop_requested=run.stop_requested, stop_reason=run.stop_reason,
            failed_reason=run.failed_reason, exit_text=procs.describe_exit(code),
        )
        if outcome.tail:
            run.tail = self._tail(run)
        run.state, run.reason = outcome.state, outcome.reason
        if outcome.state == S.STOPPED:
            log.info("shard %s stopped (%s)", run.spec.shard_id, procs.describe_exit(code))
        else:
            log.warning("shard %s %s: %s", run.spec.shard_id, run.state, run.reason)
        run.exited.set()
        self._emit(run)

    def stop(self, shard_id: str, grace: float, reason: str = "") -> None:
        run = self.runs.get(shard_id)
        if run is None:
            # Not a shard of this node: nothing is touched; say it is stopped, so the server can let it go.
            log.warning("refusing Stop for shard %s: it does not run on this node", shard_id)
            if self._send is not None:
                self._send(decide.not_here(shard_id))
            return
        if not decide.should_stop(run.state, run.stop_requested):
            return
        run.stop_requested = True
        if run.fetching is not None:
            run.fetching.cancel()  # waiting on its weights: stop waiting (the launcher sees the stop)
        run.stop_reason = reason or "stopped by the server"
        run.state = S.STOPPING
        log.info("stopping shard %s (grace %gs): %s", shard_id, grace, printable(run.stop_reason))
        self._emit(run)
        assert self._nursery is not None
        self._nursery.start_soon(self._terminate, run, grace)

    def _stopped_before_launch(self, run: ShardRun) -> None:
        run.state = S.STOPPED
        run.reason = run.stop_reason
        log.info("shard %s stopped before it was launched (%s)", run.spec.shard_id, run.stop_reason)
        run.exited.set()
        self._emit(run)

    async def _terminate(self, run: ShardRun, grace: float) -> None:
        """SIGTERM to the group, SIGKILL after the grace; the watcher reports the exit."""
        if run.pgid <= 0:
            return  # not launched yet: the launcher sees stop_requested and launches nothing
        if not procs.signal_group(run.pgid, signal.SIGTERM):
            return
        with trio.move_on_after(grace):
            await run.exited.wait()
            return
        if procs.signal_group(run.pgid, signal.SIGKILL):
            log.warning("shard %s did not stop within %gs: killed its process group", run.spec.shard_id, grace)

    async def stop_all(self, reason: str = "agent stopping") -> None:
        self.stopping_all = True
        for run in list(self.runs.values()):
            if run.state not in TERMINAL:
                self.stop(run.spec.shard_id, run.spec.stop_grace, reason)
        for run in list(self.runs.values()):
            if run.pid:
                with trio.move_on_after(run.spec.stop_grace + 5):
                    await run.exited.wait()

    # -- adoption ----------------------------------------------------------------------------

    def _adopt_all(self) -> None:
        for path in self.files.state_files():
            self._adopt(path)

    def _adopt(self, path: Path) -> None:
        """Observe one state file (read it, check its log path, is its pid alive), let decide.py
        judge it, then act on the verdict."""
        try:
            read = decide.read_state(path.read_bytes())
        except OSError as exc:
            read = decide.read_state(None, str(exc.strerror or exc))
        if read.state is not None and not read.problems:
            try:
                if Path(read.state.log_path).resolve() != self.files.log_path(read.state.spec.shard_id):
                    why = f"log path {quote(read.state.log_path)} is not the shard's own"
                    read = msgspec.structs.replace(read, problems=(why,))
            except PathRefused as exc:
                read = msgspec.structs.replace(read, problems=(str(exc),))
        verdict = decide.adoption(read, alive=procs.alive(read.ids.pid, read.ids.start_ticks),
                                  advertise_host=self.advertise_host)
        if verdict.found == Found.KEEP:
            log.error("state file %s cannot be read: %s; leaving it alone", path, verdict.why)
            return
        if verdict.found == Found.STOP:
            log.warning("state file %s cannot be read (%s); stopping the engine it names (pid %d): "
                        "nobody can describe it", path, verdict.why, read.ids.pid)
            procs.signal_group(read.ids.pgid or read.ids.pid, signal.SIGKILL)
            path.unlink(missing_ok=True)
            return
        if verdict.found == Found.REMOVE:
            log.warning("state file %s cannot be read (%s); removing it", path, verdict.why)
            path.unlink(missing_ok=True)
            return
        state = read.state
        assert state is not None
        run = ShardRun(state.spec, state.log_path, verdict.endpoint)
        run.pid, run.pgid, run.start_ticks = state.pid, state.pgid, state.start_ticks
        run.started_at = state.started_at
        run.adopted = True
        run.state, run.reason = verdict.state, verdict.reason
        self.runs[state.spec.shard_id] = run
        if verdict.found == Found.GONE:
            path.unlink(missing_ok=True)
            run.tail = self._tail(run)
            log.warning("shard %s: %s", state.spec.shard_id, run.reason)
            return
        log.info(
            "adopted shard %s (pid %d, started %s ago); output before this agent started is in %s",
            state.spec.shard_id, state.pid, format_duration(time.time() - state.started_at), state.log_path,
        )
        with open(run.log_path, "ab") as out:
            out.write(f"=== llmgw: agent restarted; adopted this engine (pid {run.pid}) at "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode())
        assert self._nursery is not None
        self._nursery.start_soon(self._watch_adopted, run)

    async def _watch_adopted(self, run: ShardRun) -> None:
        url = self._health_url(run)
        if decide.adopted_needs_probe(run.state) and await self._probe(url, api_key=run.spec.api_key):
            run.state = S.READY
            log.info("adopted shard %s is ready at %s", run.spec.shard_id, run.endpoint)
            self.files.write(run)
            self._emit(run)
        await self._watch(run)
