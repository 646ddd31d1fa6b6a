"""The agent supervisor's decisions (agent/decide.py), table by table: no processes, no files, no clock.

The supervisor's e2e tests (tests/e2e/test_supervisor.py, the adoption tests) drive the same
decisions through real engines; these name every case, including those a real process makes
hard to reach (a pid alive with a bad spec, a file that decodes only as far as its pid).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from llmgw.agent import decide
from llmgw.agent.decide import Found, PidOnly, ReadyChecks, StateFile
from llmgw.wire import messages as m
from llmgw.wire.shardstate import ShardState as S


def spec(**kw: object) -> m.ShardSpec:
    base: dict[str, object] = dict(shard_id="r.1", replica_id="r", model="x", profile="p", engine="sim", gpus=[0],
                                   port=20001, start_timeout=60.0)
    base.update(kw)
    return m.ShardSpec(**base)  # type: ignore[arg-type]


def state_file(ready: bool = False, **kw: object) -> bytes:
    return msgspec.json.encode(StateFile(spec=spec(**kw), pid=4242, pgid=4242, start_ticks=99, started_at=1000.0,
                                         log_path="/w/logs/r.1.log", endpoint="http://old:1", ready=ready))


def test_the_wire_values_are_the_strings_sent_before() -> None:
    assert [s.value for s in S] == ["starting", "ready", "unhealthy", "stopping", "stopped", "failed", "exited", "lost"]
    assert msgspec.json.encode(m.ShardStatus(shard_id="a.1", replica_id="a", state=S.READY)) == msgspec.json.encode(
        m.ShardStatus(shard_id="a.1", replica_id="a", state="ready"))
    from llmgw.server.states import ShardState as ServerShardState
    assert ServerShardState is S  # one enum, not two that happen to agree


# -- adoption -------------------------------------------------------------------------------------

BAD_ID = state_file(shard_id="../x")
UNDECODABLE_WITH_PID = b'{"pid": 4242, "pgid": 4000, "start_ticks": 99, "spec": 7}'

ADOPTION = [
    # (case, raw, unreadable, log path problem, alive, found, state, reason)
    ("ready and alive: adopted ready", state_file(ready=True), "", "", True, Found.ADOPT, S.READY, ""),
    ("starting and alive: adopted, probed", state_file(), "", "", True, Found.ADOPT, S.STARTING, ""),
    ("ready but dead: gone", state_file(ready=True), "", "", False, Found.GONE, S.EXITED, decide.GONE_REASON),
    ("starting but dead: gone", state_file(), "", "", False, Found.GONE, S.EXITED, decide.GONE_REASON),
    ("a bad shard id, alive: stopped", BAD_ID, "", "", True, Found.STOP, S.STARTING, ""),
    ("a bad shard id, dead: removed", BAD_ID, "", "", False, Found.REMOVE, S.STARTING, ""),
    ("someone else's log path, alive: stopped", state_file(), "", "log path is not the shard's own", True,
     Found.STOP, S.STARTING, ""),
    ("undecodable but names a live pid: stopped", UNDECODABLE_WITH_PID, "", "", True, Found.STOP, S.STARTING, ""),
    ("undecodable, dead: removed", UNDECODABLE_WITH_PID, "", "", False, Found.REMOVE, S.STARTING, ""),
    ("not even JSON: removed", b"{", "", "", False, Found.REMOVE, S.STARTING, ""),
    ("unreadable: kept, whatever runs", None, "Permission denied", "", True, Found.KEEP, S.STARTING, ""),
]


@pytest.mark.parametrize(("raw", "unreadable", "log_problem", "alive", "found", "state", "reason"),
                         [c[1:] for c in ADOPTION], ids=[c[0] for c in ADOPTION])
def test_what_is_done_with_an_engine_found_at_start(raw: bytes | None, unreadable: str, log_problem: str, alive: bool,
                                                     found: Found, state: S, reason: str) -> None:
    read = decide.read_state(raw, unreadable)
    if log_problem:  # the edge's own check (it resolves paths), added as supervisor._adopt does
        read = msgspec.structs.replace(read, problems=(log_problem,))
    verdict = decide.adoption(read, alive=alive, advertise_host="10.0.0.5")
    assert (verdict.found, verdict.state, verdict.reason) == (found, state, reason)
    if found in (Found.ADOPT, Found.GONE):
        assert verdict.endpoint == "http://10.0.0.5:20001"  # derived now, not the file's "http://old:1"
    else:
        assert verdict.why  # a person reads why the file was not adopted


def test_a_file_that_decodes_only_as_far_as_its_pid_still_names_its_group() -> None:
    read = decide.read_state(UNDECODABLE_WITH_PID)
    assert read.state is None and read.ids == PidOnly(pid=4242, pgid=4000, start_ticks=99)
    assert decide.read_state(b"[]").ids == PidOnly()  # nothing at all: pid 0, which is never signalled


def test_a_pid_of_zero_is_never_stopped_even_if_alive_says_so() -> None:
    read = decide.read_state(b'{"spec": 7}')
    assert decide.adoption(read, alive=True, advertise_host="h").found == Found.REMOVE


@pytest.mark.parametrize(("host", "endpoint"), [("10.0.0.5", "http://10.0.0.5:20001"), ("fd00::5", "http://[fd00::5]:20001")])
def test_the_endpoint_is_the_servers_derivation(host: str, endpoint: str) -> None:
    assert decide.endpoint(host, 20001) == endpoint


@pytest.mark.parametrize(("state", "probe"), [(S.STARTING, True), (S.READY, False), (S.UNHEALTHY, False)])
def test_an_adopted_engine_is_probed_only_while_starting(state: S, probe: bool) -> None:
    assert decide.adopted_needs_probe(state) is probe


# -- state changes --------------------------------------------------------------------------------


@dataclass
class Run:
    spec: m.ShardSpec = field(default_factory=spec)
    state: S = S.STARTING
    pid: int = 0
    started_at: float = 0.0
    endpoint: str = "http://h:20001"
    exit_code: int | None = None
    reason: str = ""
    tail: list[str] = field(default_factory=list)
    launch_env: list[m.EnvSetting] = field(default_factory=list)


@pytest.mark.parametrize(("existing", "repeat"),
                         [(None, False), *[(s, s not in decide.TERMINAL) for s in S if s != S.LOST]])
def test_a_start_for_a_running_shard_is_answered_with_its_state(existing: S | None, repeat: bool) -> None:
    assert decide.repeat_start(existing) is repeat


LAUNCH = [
    # (case, gpus, port, known, busy, problem)
    ("fits", [0, 1], 20001, {0, 1, 2}, set(), ""),
    ("discovery unknown: any GPU", [7], 20001, None, set(), ""),
    ("a GPU the node lacks", [0, 5], 20001, {0, 1}, set(), "GPU(s) [5] do not exist on this node (it has [0, 1])"),
    ("a GPU another engine holds", [0, 1], 20001, {0, 1}, {1}, "GPU(s) [1] are in use by another engine on this node"),
    ("port 0", [0], 0, {0}, set(), "bad port 0"),
    ("port 65536", [0], 65536, {0}, set(), "bad port 65536"),
    ("missing GPUs are told before a clash", [3], 0, {0}, {3}, "GPU(s) [3] do not exist on this node (it has [0])"),
]


@pytest.mark.parametrize(("gpus", "port", "known", "busy", "problem"), [c[1:] for c in LAUNCH],
                         ids=[c[0] for c in LAUNCH])
def test_what_stops_a_start_before_anything_runs(gpus: list[int], port: int, known: set[int] | None, busy: set[int],
                                                 problem: str) -> None:
    assert decide.launch_problem(spec(gpus=gpus, port=port), known, busy) == problem


def test_only_shards_that_have_not_ended_hold_gpus() -> None:
    runs = [Run(spec=spec(gpus=[g]), state=s) for g, s in enumerate(S) if s != S.LOST]
    assert decide.busy_gpus(runs) == {0, 1, 2, 3}  # starting, ready, unhealthy, stopping


EXITS = [
    # (case, was, stop_requested, failed_reason, state, reason, tail)
    ("asked to stop", S.STOPPING, True, "", S.STOPPED, "stopped by the server", False),
    ("asked to stop while starting", S.STARTING, True, "", S.STOPPED, "stopped by the server", False),
    ("killed for its start timeout", S.STARTING, False, "not healthy within 1m", S.FAILED, "not healthy within 1m",
     True),
    ("died while starting", S.STARTING, False, "", S.FAILED, "exited with code 1 during startup", True),
    ("died while ready", S.READY, False, "", S.EXITED, "exited with code 1", True),
    ("died while unhealthy", S.UNHEALTHY, False, "", S.EXITED, "exited with code 1", True),
]


@pytest.mark.parametrize(("was", "stop_requested", "failed_reason", "state", "reason", "tail"), [c[1:] for c in EXITS],
                         ids=[c[0] for c in EXITS])
def test_what_an_exit_leaves_a_shard_in(was: S, stop_requested: bool, failed_reason: str, state: S, reason: str,
                                        tail: bool) -> None:
    outcome = decide.exit_outcome(was, stop_requested=stop_requested, stop_reason="stopped by the server",
                                  failed_reason=failed_reason, exit_text="exited with code 1")
    assert (outcome.state, outcome.reason, outcome.tail) == (state, reason, tail)


@pytest.mark.parametrize(("state", "requested", "acts"), [
    (S.STARTING, False, True), (S.READY, False, True), (S.UNHEALTHY, False, True),
    (S.READY, True, False), (S.STOPPED, False, False), (S.FAILED, False, False), (S.EXITED, False, False),
])
def test_a_stop_acts_once_on_a_shard_that_has_not_ended(state: S, requested: bool, acts: bool) -> None:
    assert decide.should_stop(state, requested) is acts


@pytest.mark.parametrize(("started_at", "now", "left"),
                         [(100.0, 100.0, 60.0), (100.0, 130.0, 30.0), (100.0, 200.0, 0.0)])
def test_the_start_timeout_counts_from_the_start(started_at: float, now: float, left: float) -> None:
    assert decide.time_left(spec(), started_at, now) == left


@pytest.mark.parametrize(("mode", "rank", "runs"), [("", 0, True), ("", 1, True), ("ray", 0, True), ("ray", 1, False)])
def test_a_ray_worker_rank_runs_no_engine(mode: str, rank: int, runs: bool) -> None:
    assert decide.runs_engine(spec(engine_mode=mode, rank=rank, world=2)) is runs


HEALTH = [
    # (case, [(ok, state at the check, now)], [changes], first failure)
    ("passing checks change nothing", [(True, S.READY, 1.0), (True, S.READY, 2.0)], [None, None], 0.0),
    ("three failures in a row: unhealthy since the first",
     [(False, S.READY, 1.0), (False, S.READY, 2.0), (False, S.READY, 3.0)], [None, None, S.UNHEALTHY], 1.0),
    ("a pass between failures starts the count again",
     [(False, S.READY, 1.0), (False, S.READY, 2.0), (True, S.READY, 3.0), (False, S.READY, 4.0), (False, S.READY, 5.0)],
     [None, None, None, None, None], 4.0),
    ("unhealthy, then a pass: ready again", [(False, S.UNHEALTHY, 9.0), (True, S.UNHEALTHY, 10.0)], [None, S.READY],
     9.0),
    ("more failures while unhealthy: told once", [(False, S.UNHEALTHY, 1.0)] * 4, [None] * 4, 1.0),
]


@pytest.mark.parametrize(("checks", "changes", "first"), [c[1:] for c in HEALTH], ids=[c[0] for c in HEALTH])
def test_health_checks_of_a_ready_engine(checks: list[tuple[bool, S, float]], changes: list[S | None],
                                         first: float) -> None:
    watch = ReadyChecks(failures=3)
    assert [watch.observe(ok, state, now) for ok, state, now in checks] == changes
    assert watch.first_failure == first


def test_the_unhealthy_reason_names_the_url_and_the_timeout() -> None:
    assert decide.unhealthy_reason("2026-01-01T00:00:00+0000", 3, "http://127.0.0.1:1/health", 2.0) == (
        "unhealthy since 2026-01-01T00:00:00+0000: 3 health checks of http://127.0.0.1:1/health in a row failed "
        "or got no answer within 2s")


# -- reports --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "tail_sent"), [(s, s in (S.FAILED, S.EXITED)) for s in S if s != S.LOST])
def test_a_status_carries_the_tail_only_when_it_failed_or_exited(state: S, tail_sent: bool) -> None:
    run = Run(state=state, tail=["boom"], reason="why")
    status = decide.status(run)
    assert status.tail == (["boom"] if tail_sent else []) and status.state == state and status.reason == "why"
    assert decide.report(run).tail == ["boom"]  # a Register tells everything


def test_a_stop_for_a_shard_not_here_says_stopped() -> None:
    assert decide.not_here("z.1") == m.ShardStatus(shard_id="z.1", replica_id="", state="stopped",
                                                   reason="not running here")


def test_a_register_forgets_what_it_told_of_for_the_last_time() -> None:
    states = [("a", S.READY), ("b", S.FAILED), ("c", S.STOPPING), ("d", S.STOPPED), ("e", S.EXITED)]
    assert decide.told_in_register(states) == ["b", "d", "e"]


@pytest.mark.parametrize(("finished", "keep", "forgotten"), [(3, 5, 0), (5, 5, 0), (7, 5, 2), (70, 64, 6)])
def test_a_long_lived_stream_keeps_the_latest_finished(finished: int, keep: int, forgotten: int) -> None:
    states = [("live", S.READY)] + [(f"f{i}", S.EXITED) for i in range(finished)]
    assert decide.too_many_finished(states, keep) == [f"f{i}" for i in range(forgotten)]  # the oldest first


# -- what the agent decides, the server accepts ---------------------------------------------------


def test_every_change_the_agent_decides_is_legal_in_the_servers_table() -> None:
    """The agent's changes against server/states.py's table: one the server refuses would be a
    warning on every report, and a shard whose state the server never takes."""
    from llmgw.server.states import shard_may

    changes: set[tuple[S, S]] = set()
    for was in (S.STARTING, S.READY, S.UNHEALTHY, S.STOPPING):
        for requested in (False, True):
            for failed in ("", "start timeout"):
                if was == S.STOPPING and not requested:
                    continue  # stopping is set only by a Stop
                out = decide.exit_outcome(was, stop_requested=requested, stop_reason="r",
                                          failed_reason=failed, exit_text="exited")
                changes.add((was, out.state))
        if decide.should_stop(was, False):
            changes.add((was, S.STOPPING))
        for ok in (False, True):
            watch = ReadyChecks(failures=1)
            new = watch.observe(ok, was, 1.0)
            if new is not None:
                changes.add((was, new))
    changes.add((S.STARTING, decide.refused("x")[0]))
    changes.add((S.STARTING, S.READY))  # the first health check that passes
    illegal = sorted((a.value, b.value) for a, b in changes if not shard_may(a, b))
    assert illegal == []
