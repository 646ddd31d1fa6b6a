"""One engine process as the agent's supervisor knows it: its spec, state and exit, and the trio
objects that follow it (its process, its exit, its weights' wait). What it means and how it is
reported to the server (a Register's ShardReport, a ShardStatus) is decided in decide.py."""

from __future__ import annotations

import time

import trio

from llmgw.agent import decide
from llmgw.agent.decide import HEALTHY_OR_NOT, TERMINAL
from llmgw.wire import messages as m
from llmgw.wire.shardstate import ShardState

__all__ = ["HEALTHY_OR_NOT", "TERMINAL", "ShardRun"]


class ShardRun:
    def __init__(self, spec: m.ShardSpec, log_path: str, endpoint: str) -> None:
        self.spec = spec
        self.log_path = log_path
        self.endpoint = endpoint
        self.state: ShardState = ShardState.STARTING
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
        return decide.report(self)

    def status(self) -> m.ShardStatus:
        return decide.status(self)
