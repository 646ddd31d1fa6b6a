"""The agent's reconnect loop (`Agent.run`) under trio's MockClock, with a scripted dialer.

Each dial attempt is timestamped on the virtual clock: the gap after failure n must lie in
the jittered backoff bounds [d/2, d], d = min(cap, initial · 2^n); a stream that registered
and stayed up starts the backoff over; nothing a session raises ends the loop.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import msgspec
import pytest
import trio

from llmgw import __version__
from llmgw.agent.agent import Agent
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig
from llmgw.fleet import ChannelClosed, DialError
from llmgw.wire import messages as m
from tests.unit.fakes import NoHardware

INITIAL = 0.5
CAP = 8.0
HEARTBEAT = 1.0
# The loop resets the backoff after a stream that stayed registered longer than this.
HEALTHY = 4 * HEARTBEAT + CAP


@pytest.fixture(autouse=True)
def readings_in_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake hardware answers at once; run it inline, because a real thread would let the
    autojump clock leap to the next deadline while the thread runs."""

    async def inline(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", inline)


def config(initial: float = INITIAL, cap: float = CAP) -> AgentConfig:
    return parse_config(
        f"server: http://127.0.0.1:1\nnode_id: gpu-01\nheartbeat_interval: {HEARTBEAT}s\n"
        f"backoff:\n  initial: {initial}s\n  max: {cap}s\n",
        AgentConfig,
    )


def ceiling(n: int, initial: float = INITIAL, cap: float = CAP) -> float:
    return min(cap, initial * 2**n)


class FakeConnection:
    """The H2Connection surface the heartbeat task uses; a PING is answered at once."""

    def __init__(self) -> None:
        self.last_received = 0.0
        self.pings = 0

    def ping(self) -> None:
        self.pings += 1
        self.last_received = trio.current_time()


class FakeStream:
    """The server's end of one stream: Welcome, then it ends after `heartbeats` heartbeats
    (or never, with None), or raises `fault` in the agent's receive after the Welcome."""

    def __init__(self, heartbeats: int | None, fault: BaseException | None = None,
                 extra: list[msgspec.Struct] | None = None) -> None:
        self.connection = FakeConnection()
        self.received: list[Any] = []
        self.heartbeats = heartbeats
        self.registered_at: float | None = None
        self.ended_at: float | None = None
        self._send, self._recv = trio.open_memory_channel[Any](math.inf)
        self._send.send_nowait(m.Welcome(server_version=__version__, heartbeat_interval=HEARTBEAT))
        for msg in extra or []:
            self._send.send_nowait(msg)
        if fault is not None:
            self._send.send_nowait(fault)

    async def send(self, payload: bytes) -> None:
        msg = m.decode_agent_message(payload)
        self.received.append(msg)
        if isinstance(msg, m.Register):
            self.registered_at = trio.current_time()
        beats = sum(isinstance(x, m.Heartbeat) for x in self.received)
        if self.heartbeats is not None and beats >= self.heartbeats and self.ended_at is None:
            self.ended_at = trio.current_time()
            self._send.send_nowait(ChannelClosed("peer ended the stream"))

    async def receive(self) -> bytes:
        item = await self._recv.receive()
        if isinstance(item, BaseException):
            raise item
        return m.encode(item)


class ScriptedDialer:
    """Plays one step per dial: "fail" (DialError at once), ("slow-fail", s), a FakeStream,
    an exception to raise, or, when the script runs out, a dial that never returns."""

    def __init__(self, script: list[Any]) -> None:
        self.script = list(script)
        self.attempts: list[float] = []
        self.exhausted = trio.Event()

    def __call__(self) -> Any:
        return self._dial()

    @asynccontextmanager
    async def _dial(self) -> AsyncIterator[Any]:
        self.attempts.append(trio.current_time())
        if not self.script:
            self.exhausted.set()
            await trio.sleep_forever()
        step = self.script.pop(0)
        if step == "fail":
            raise DialError("cannot connect to 127.0.0.1:1: Connection refused")
        if isinstance(step, tuple) and step[0] == "slow-fail":
            await trio.sleep(step[1])
            raise DialError("cannot connect to 127.0.0.1:1: timed out")
        if isinstance(step, BaseException):
            raise step
        # Like the real dial: the stream lives inside a nursery, so what the session raises
        # comes out wrapped in an exception group.
        async with trio.open_nursery():
            yield step


async def run_script(script: list[Any], seed: int = 0, engines: Any = None,
                     cfg: AgentConfig | None = None) -> tuple[Agent, ScriptedDialer]:
    dialer = ScriptedDialer(script)
    agent = Agent(cfg or config(), hardware=NoHardware(), dialer=dialer, engines=engines, rng=random.Random(seed))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent.run)
        await dialer.exhausted.wait()
        nursery.cancel_scope.cancel()
    return agent, dialer


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def assert_in_backoff(gap: float, n: int, what: str) -> None:
    top = ceiling(n)
    assert top / 2 - 1e-9 <= gap <= top + 1e-9, f"{what}: gap {gap:.3f}s outside [{top / 2:g}, {top:g}] for failure {n}"


@pytest.mark.parametrize("seed", range(5))
async def test_failed_dials_back_off_within_the_jitter_bounds_up_to_the_cap(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    failures = 12
    _, dialer = await run_script(["fail"] * failures, seed)
    assert len(dialer.attempts) == failures + 1
    spread = gaps(dialer.attempts)
    for n, gap in enumerate(spread):
        assert_in_backoff(gap, n, f"seed {seed}")
    assert max(spread) <= CAP
    # 0.5 · 2^4 = 8: from the fifth failure on, every delay is drawn from [cap/2, cap].
    assert all(gap >= CAP / 2 for gap in spread[4:])


async def test_delays_are_jittered_not_the_same_for_every_agent(autojump_clock: trio.testing.MockClock) -> None:
    thirds = []
    for seed in range(8):
        _, dialer = await run_script(["fail"] * 3, seed)
        thirds.append(gaps(dialer.attempts)[2])
    assert len({round(g, 6) for g in thirds}) == len(thirds)


async def test_after_a_healthy_stream_the_backoff_starts_over_small(autojump_clock: trio.testing.MockClock) -> None:
    long_stream = FakeStream(heartbeats=int(HEALTHY / HEARTBEAT) + 3)
    agent, dialer = await run_script(["fail"] * 6 + [long_stream, "fail", "fail", "fail"])
    spread = gaps(dialer.attempts)
    for n in range(6):
        assert_in_backoff(spread[n], n, "before the stream")
    assert agent.sessions == 1
    assert long_stream.registered_at is not None and long_stream.ended_at is not None
    assert long_stream.ended_at - long_stream.registered_at > HEALTHY
    heartbeats = [x for x in long_stream.received if isinstance(x, m.Heartbeat)]
    assert [h.seq for h in heartbeats] == list(range(1, len(heartbeats) + 1))
    # The stream ended at once after its last heartbeat: the next dial comes after the
    # first, smallest delay, and the failures after it grow again from there.
    assert_in_backoff(dialer.attempts[7] - long_stream.ended_at, 0, "first retry after the healthy stream")
    for n, gap in enumerate(gaps(dialer.attempts[7:])):
        assert_in_backoff(gap, n + 1, "failures after the healthy stream")


async def test_a_short_stream_does_not_reset_the_backoff(autojump_clock: trio.testing.MockClock) -> None:
    short = FakeStream(heartbeats=2)
    agent, dialer = await run_script(["fail"] * 4 + [short, "fail"])
    assert agent.sessions == 1 and short.ended_at is not None
    assert_in_backoff(dialer.attempts[5] - short.ended_at, 4, "retry after a short stream")
    assert_in_backoff(dialer.attempts[6] - dialer.attempts[5], 5, "the failure after it")


async def test_time_spent_dialing_is_not_a_healthy_stream(autojump_clock: trio.testing.MockClock) -> None:
    """A dial that hangs for minutes and then fails (a blackholed server) never registered:
    the backoff must keep growing instead of starting over."""
    slow = ("slow-fail", 10 * HEALTHY)
    _, dialer = await run_script(["fail"] * 4 + [slow, "fail"])
    assert_in_backoff(dialer.attempts[5] - (dialer.attempts[4] + 10 * HEALTHY), 4, "retry after the slow dial")
    assert_in_backoff(dialer.attempts[6] - dialer.attempts[5], 5, "the failure after it")


class BuggyEngines:
    """A supervisor whose handling of Start has a bug."""

    features: ClassVar[list[str]] = [m.FEATURE_START]

    def __init__(self) -> None:
        self.attached: list[bool] = []

    def reports(self) -> list[m.ShardReport]:
        return []

    def snapshot(self) -> list[m.ShardReport]:
        return []

    async def handle(self, msg: Any, send: Callable[[msgspec.Struct], None]) -> None:
        raise KeyError("bug in the supervisor")

    def attach(self, send: Callable[[msgspec.Struct], None] | None) -> None:
        self.attached.append(send is not None)


async def test_a_bug_inside_a_session_does_not_end_the_loop(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    start = m.Start(spec=m.ShardSpec(shard_id="s.1", replica_id="s", model="x", profile="p", engine="sim", port=20000))
    engines = BuggyEngines()
    script = [
        FakeStream(heartbeats=None, extra=[start]),  # the supervisor raises KeyError
        FakeStream(heartbeats=None, fault=RuntimeError("bug in the link")),  # receive raises
        TypeError("bug in the dialer"),
        FakeStream(heartbeats=None, fault=ChannelClosed("server went away", error=True)),
        "fail",
        "fail",
    ]
    agent, dialer = await run_script(script, engines=engines)
    assert len(dialer.attempts) == 7, "the loop stopped dialing after a bug"
    assert agent.sessions == 3
    bugs = [r for r in caplog.records if r.getMessage() == "link to the server failed"]
    assert len(bugs) == 3 and all(r.levelno == logging.ERROR and r.exc_info for r in bugs)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "stream closed: server went away" in text
    assert "cannot connect to 127.0.0.1:1: Connection refused" in text
    # Every session was detached from the supervisor when it ended (the last False is the
    # cancelled final dial); the loop kept its backoff.
    assert engines.attached == [True, False, True, False, False, True, False, False, False, False]
    for n, gap in enumerate(gaps(dialer.attempts)):
        assert_in_backoff(gap, n, "after bugs")
    assert not agent.connected.is_set()


async def test_a_dial_error_is_logged_once_not_on_every_attempt(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    await run_script(["fail"] * 5)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["cannot connect to 127.0.0.1:1: Connection refused"]
