"""What the agent's supervisor decides about its shards, apart from the processes themselves. Pure.

The supervisor (supervisor.py) spawns, signals and probes engine processes and reads and writes
their files; this module says what those observations mean, the way `Reconciler.reconcile()` does
for the server: values in, a decision out, time passed in as a number (DESIGN.md, "Layout").

- **Adoption**: a state file found when the agent starts is read here (`read_state`), and with
  what the edge saw (is its pid alive with the same start time, is its log path the shard's own)
  becomes one of five verdicts (`adoption`): adopt it, report it gone, stop an engine nobody can
  describe, remove a file that names nothing alive, or keep a file that cannot be read.
- **State changes**: what a Start, a Stop, a health check or an exit does to a shard's state
  (`launch_problem`, `exit_outcome`, `ReadyChecks`).
- **Reports**: what a Register and a ShardStatus carry, and which finished shards are forgotten.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from llmgw.catalog.units import format_duration
from llmgw.netaddr import url_host
from llmgw.wire import messages as m
from llmgw.wire.ids import spec_problems
from llmgw.wire.shardstate import ShardState

S = ShardState

TERMINAL: frozenset[ShardState] = frozenset({S.FAILED, S.EXITED, S.STOPPED})
HEALTHY_OR_NOT: frozenset[ShardState] = frozenset(
    {S.READY, S.UNHEALTHY}
)  # answered its health check once
TAIL_SENT: frozenset[ShardState] = frozenset(
    {S.FAILED, S.EXITED}
)  # a ShardStatus carries the output tail
MAX_FINISHED = 64  # finished shards remembered for the next Register


class StateFile(msgspec.Struct, kw_only=True):
    """What survives the agent: enough to find, identify and describe the engine."""

    spec: m.ShardSpec
    pid: int
    pgid: int
    start_ticks: int
    started_at: float
    log_path: str
    endpoint: str
    # It answered its health check once: an agent that adopts it need not wait for another
    # (a busy engine may be slow to answer) and must not hold it to its start timeout.
    ready: bool = False


class PidOnly(msgspec.Struct):
    pid: int = 0
    pgid: int = 0
    start_ticks: int = 0


def endpoint(advertise_host: str, port: int) -> str:
    """A shard's endpoint as the server derives it (this node's advertise host, the spec's port)."""
    return f"http://{url_host(advertise_host)}:{port}"


# -- adoption ------------------------------------------------------------------------------------


class Found(enum.StrEnum):
    """What to do with an engine whose state file the agent finds at start."""

    ADOPT = "adopt"  # described and alive: watch it as if this agent had launched it
    GONE = "gone"  # described, but it exited while no agent ran: report it exited, remove the file
    STOP = "stop"  # alive, but nobody can describe it: kill its process group, remove the file
    REMOVE = "remove"  # nobody can describe it and nothing it names is alive: remove the file
    KEEP = "keep"  # the file cannot be read: leave it (and whatever it names) alone


class Read(msgspec.Struct, frozen=True):
    """A state file as read: the state when it decodes, the ids it names in any case, and what
    is wrong."""

    state: StateFile | None
    ids: PidOnly
    problems: tuple[str, ...] = ()
    unreadable: str = ""  # the file could not be read at all (its OSError)


def read_state(raw: bytes | None, unreadable: str = "") -> Read:
    """Decode a state file's bytes (None: it could not be read, `unreadable` says why).

    The ids (pid, process group, start time) are taken from whatever decodes, so an engine a
    file describes badly can still be found and stopped.
    """
    if raw is None:
        return Read(state=None, ids=PidOnly(), unreadable=unreadable or "unreadable")
    try:
        state = msgspec.json.decode(raw, type=StateFile)
    except msgspec.DecodeError as exc:
        return Read(state=None, ids=_ids(raw), problems=(str(exc),))
    problems = tuple(spec_problems(state.spec))
    # Written by an agent that took ids unchecked: nobody can describe it safely.
    return Read(
        state=state,
        ids=_ids(raw) if problems else PidOnly(state.pid, state.pgid, state.start_ticks),
        problems=problems,
    )


def _ids(raw: bytes) -> PidOnly:
    try:
        return msgspec.json.decode(raw, type=PidOnly)
    except msgspec.DecodeError:
        return PidOnly()


class Adoption(msgspec.Struct, frozen=True):
    """The verdict on one state file; for ADOPT and GONE, the shard as the agent now knows it."""

    found: Found
    why: str = ""  # for STOP, REMOVE and KEEP: what is wrong with the file
    state: ShardState = S.STARTING
    reason: str = ""
    endpoint: str = ""


GONE_REASON = "the engine exited while the agent was not running"


def adoption(read: Read, *, alive: bool, advertise_host: str) -> Adoption:
    """The verdict on a state file read at start. `alive`: the pid it names (`read.ids`) runs with
    the start time it recorded; `read.problems` includes the edge's own check of the log path."""
    if read.unreadable:
        return Adoption(Found.KEEP, why=read.unreadable)
    if read.state is None or read.problems:
        return Adoption(
            Found.STOP if read.ids.pid and alive else Found.REMOVE, why="; ".join(read.problems)
        )
    # The endpoint as the server derives it now, not as an older state file recorded it: the
    # server refuses any other.
    where = endpoint(advertise_host, read.state.spec.port)
    if not alive:
        return Adoption(Found.GONE, state=S.EXITED, reason=GONE_REASON, endpoint=where)
    return Adoption(Found.ADOPT, state=S.READY if read.state.ready else S.STARTING, endpoint=where)


def adopted_needs_probe(state: ShardState) -> bool:
    """One adopted ready stays ready (as a launched one is never re-checked); one still starting
    is probed once, then held to what is left of its start timeout."""
    return state == S.STARTING


# -- state changes -------------------------------------------------------------------------------


class ShardView(Protocol):
    """What the decisions read of a supervised shard (shardrun.ShardRun is one)."""

    @property
    def spec(self) -> m.ShardSpec: ...
    @property
    def state(self) -> ShardState: ...
    @property
    def pid(self) -> int: ...
    @property
    def started_at(self) -> float: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def reason(self) -> str: ...
    @property
    def tail(self) -> list[str]: ...
    @property
    def launch_env(self) -> list[m.EnvSetting]: ...


def repeat_start(existing: ShardState | None) -> bool:
    """A Start for a shard that still runs (repeated after a reconnect): say where it stands,
    start nothing."""
    return existing is not None and existing not in TERMINAL


def busy_gpus(others: Iterable[ShardView]) -> set[int]:
    """The GPUs the other shards hold: any that has not ended."""
    return {g for run in others if run.state not in TERMINAL for g in run.spec.gpus}


def launch_problem(spec: m.ShardSpec, known_gpus: set[int] | None, busy: set[int]) -> str:
    """Why this node cannot start `spec` on the GPUs and port it names, or "" (the port's being
    free is the edge's to check)."""
    if known_gpus is not None:
        missing = [g for g in spec.gpus if g not in known_gpus]
        if missing:
            return f"GPU(s) {missing} do not exist on this node (it has {sorted(known_gpus)})"
    clash = sorted(busy & set(spec.gpus))
    if clash:
        return f"GPU(s) {clash} are in use by another engine on this node"
    if not 0 < spec.port < 65536:
        return f"bad port {spec.port}"
    return ""


def refused(reason: str) -> tuple[ShardState, str]:
    """A Start the agent will not carry out: failed, and why."""
    return S.FAILED, f"not started: {reason}"


def runs_engine(spec: m.ShardSpec) -> bool:
    """Whether the shard runs the engine itself (its version is checked): a Ray worker rank
    runs only `ray`."""
    return not (spec.engine_mode == "ray" and spec.rank > 0)


def time_left(spec: m.ShardSpec, started_at: float, now: float) -> float:
    """What is left of the start timeout, which counts from the Start (never below 0)."""
    return max(float(spec.start_timeout) - (now - started_at), 0.0)


def start_timed_out(spec: m.ShardSpec) -> str:
    return f"not healthy within {format_duration(spec.start_timeout)} (start_timeout); stopped it"


def should_stop(state: ShardState, stop_requested: bool) -> bool:
    """A Stop acts once, on a shard that has not ended."""
    return state not in TERMINAL and not stop_requested


class Exit(msgspec.Struct, frozen=True):
    state: ShardState
    reason: str
    tail: bool  # its output tail goes with the report (it was not asked to stop)


def exit_outcome(
    was: ShardState, *, stop_requested: bool, stop_reason: str, failed_reason: str, exit_text: str
) -> Exit:
    """The state an engine's exit leaves its shard in. `exit_text`: the exit described
    (procs.describe_exit)."""
    if stop_requested:
        return Exit(S.STOPPED, stop_reason, tail=False)
    if failed_reason:  # the agent killed it for a reason (its start timeout)
        return Exit(S.FAILED, failed_reason, tail=True)
    if was == S.STARTING:
        return Exit(S.FAILED, f"{exit_text} during startup", tail=True)
    return Exit(S.EXITED, exit_text, tail=True)


class ReadyChecks:
    """Health checks of an engine that was ready (issue 9: a SIGSTOPped engine stayed `ready`):
    after `failures` checks in a row without an answer it is `unhealthy`, since the first of those
    failures; the next check that passes makes it ready again. Time is passed in."""

    def __init__(self, failures: int) -> None:
        self.allowed = failures
        self.failures = 0
        self.first_failure = 0.0

    def observe(self, ok: bool, state: ShardState, now: float) -> ShardState | None:
        """One check's result for a shard in `state`: the state it changes to, or None."""
        if ok:
            self.failures = 0
            return S.READY if state == S.UNHEALTHY else None
        self.failures += 1
        if self.failures == 1:
            self.first_failure = now
        if self.failures >= self.allowed and state == S.READY:
            return S.UNHEALTHY
        return None


def unhealthy_reason(since: str, failures: int, url: str, timeout: float) -> str:
    """`since`: the first failure's time as a person reads it (the edge formats the clock)."""
    return (
        f"unhealthy since {since}: {failures} health checks of {url} in a row failed or "
        f"got no answer within {timeout:g}s"
    )


# -- reports -------------------------------------------------------------------------------------


def report(run: ShardView) -> m.ShardReport:
    """The shard in a Register: everything, so that a new server can adopt it."""
    return m.ShardReport(
        spec=run.spec,
        state=run.state,
        pid=run.pid,
        started_at=run.started_at,
        endpoint=run.endpoint,
        exit_code=run.exit_code,
        reason=run.reason,
        tail=run.tail,
        launch_env=run.launch_env,
    )


def status(run: ShardView) -> m.ShardStatus:
    """A change of the shard's state; the output tail only when it failed or exited on its own."""
    return m.ShardStatus(
        shard_id=run.spec.shard_id,
        replica_id=run.spec.replica_id,
        state=run.state,
        pid=run.pid,
        exit_code=run.exit_code,
        reason=run.reason,
        tail=run.tail if run.state in TAIL_SENT else [],
        endpoint=run.endpoint,
        launch_env=run.launch_env,
    )


def not_here(shard_id: str) -> m.ShardStatus:
    """The answer to a Stop for a shard this node does not run: stopped, so the server can let
    it go."""
    return m.ShardStatus(
        shard_id=shard_id, replica_id="", state=S.STOPPED, reason="not running here"
    )


def told_in_register(states: Iterable[tuple[str, ShardState]]) -> list[str]:
    """The shards a Register just told of for the last time (ended): forget them."""
    return [sid for sid, state in states if state in TERMINAL]


def too_many_finished(
    states: Sequence[tuple[str, ShardState]], keep: int = MAX_FINISHED
) -> list[str]:
    """On a long-lived stream, the oldest ended shards beyond the latest `keep` (in report
    order): forget them."""
    finished = [sid for sid, state in states if state in TERMINAL]
    return finished[: max(0, len(finished) - keep)]
