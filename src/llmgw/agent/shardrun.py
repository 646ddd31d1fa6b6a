"""One engine process as the agent's supervisor knows it: its spec, state and exit, and how it
is reported to the server (a Register's ShardReport, a ShardStatus)."""

from __future__ import annotations

import time

import trio

from llmgw.wire import messages as m

TERMINAL = frozenset({"failed", "exited", "stopped"})
HEALTHY_OR_NOT = frozenset({"ready", "unhealthy"})  # answered its health check once


class ShardRun:
    def __init__(self, spec: m.ShardSpec, log_path: str, endpoint: str) -> None:
        self.spec = spec
        self.log_path = log_path
        self.endpoint = endpoint
        self.state = "starting"
        self.pid = 0
        self.pgid = 0
        self.start_ticks = 0
        self.started_at = time.time()
        self.process: trio.Process | None = None
        self.adopted = False
        self.exit_code: int | None = None
        self.reason = ""
        self.tail: list[str] = []
        self.stop_requested = False
        self.stop_reason = ""
        self.failed_reason = ""  # set when we kill it ourselves for a reason (start timeout)
        self.launch_env: list[m.EnvSetting] = []  # NCCL_* / GLOO_* it was given (launch_env.py)
        self.exited = trio.Event()
        self.fetching: trio.CancelScope | None = None  # while it waits on its weights

    def report(self) -> m.ShardReport:
        return m.ShardReport(
            spec=self.spec,
            state=self.state,
            pid=self.pid,
            started_at=self.started_at,
            endpoint=self.endpoint,
            exit_code=self.exit_code,
            reason=self.reason,
            tail=self.tail,
            launch_env=self.launch_env,
        )

    def status(self) -> m.ShardStatus:
        return m.ShardStatus(
            shard_id=self.spec.shard_id,
            replica_id=self.spec.replica_id,
            state=self.state,
            pid=self.pid,
            exit_code=self.exit_code,
            reason=self.reason,
            tail=self.tail if self.state in ("failed", "exited") else [],
            endpoint=self.endpoint,
            launch_env=self.launch_env,
        )
