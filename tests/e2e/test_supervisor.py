"""The supervisor in-process, launching real engine processes: the argv and environment the
process really gets (/proc), the checks that refuse a shard before anything is launched, and
adoption from state files. The same paths through a real server and agent are in
test_replica_failures.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from llmgw.agent import procs
from llmgw.agent.supervisor import Supervisor
from llmgw.catalog.schema import EngineAllow, EngineHealth
from llmgw.catalog.units import Duration
from llmgw.wire import messages as m
from tests.e2e.harness import DEFAULT_DEADLINE, free_port, pid_alive

# These tests are about launching, not the allowlist (test_the_agents_allowlist_… is): every
# engine, and any program at an absolute path.
ALLOW_ALL = EngineAllow(engines=["vllm", "sglang", "command", "sim"],
                        executables=["vllm", "python3", "llmgw-no-such-engine", "/*"])

SIM_AS_COMMAND = [sys.executable, "-m", "llmgw", "sim", "engine", "--host", "{host}", "--port", "{port}",
                  "--model", "{model}"]


def spec(shard: str, engine: str = "sim", **kw: Any) -> m.ShardSpec:
    base: dict[str, Any] = {"shard_id": f"{shard}.1", "replica_id": shard, "model": shard, "profile": "p",
                            "engine": engine,
                            "host": "127.0.0.1", "port": free_port(), "gpus": [1], "served_name": shard,
                            "stop_grace": 2.0}
    base.update(kw)
    return m.ShardSpec(**base)


class Node:
    """A supervisor on a 4-GPU node, and every status it sends to the server."""

    def __init__(self, work: Path, health: EngineHealth | None = None, allow: EngineAllow = ALLOW_ALL) -> None:
        self.work = work
        self.supervisor = Supervisor(str(work), gpu_indexes=lambda: {0, 1, 2, 3}, health=health, allow=allow)
        self.sent: list[m.ShardStatus] = []
        self.supervisor.attach(self.sent.append)  # type: ignore[arg-type]

    def status(self, shard_id: str, state: str) -> m.ShardStatus | None:
        return next((s for s in self.sent if s.shard_id == shard_id and s.state == state), None)


@asynccontextmanager
async def node(work: Path, stop_engines: bool = True, health: EngineHealth | None = None,
               allow: EngineAllow = ALLOW_ALL) -> AsyncIterator[Node]:
    """A running supervisor; on the way out it stops its engines, or (stop_engines=False)
    goes away leaving them running, as an agent that is killed does."""
    n = Node(work, health, allow)
    async with trio.open_nursery() as nursery:
        await nursery.start(n.supervisor.run)
        try:
            yield n
        finally:
            if stop_engines:
                with trio.move_on_after(DEFAULT_DEADLINE):
                    await n.supervisor.stop_all("test over")
            nursery.cancel_scope.cancel()


def process_facts(pid: int) -> tuple[list[str], dict[str, str]]:
    """The argv and environment a process really runs with, from /proc."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    env = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return argv, dict(e.split("=", 1) for e in env if "=" in e)


def spawn(code: str, **kw: Any) -> subprocess.Popen[bytes]:
    """A Python process in a session of its own, as engines run."""
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, **kw)


async def until(check: Callable[[], Any], what: str, deadline: float = DEFAULT_DEADLINE) -> Any:
    with trio.move_on_after(deadline):
        while not (value := check()):  # noqa: ASYNC110 - polling process and file state
            await trio.sleep(0.05)  # ok: poll interval of a deadline-bounded wait
        return value
    raise AssertionError(f"timed out after {deadline:g}s waiting for {what}")


async def test_the_engine_process_gets_the_argv_and_gpus_of_its_shard(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the agent sees all four
    s = spec("echo", engine="command", gpus=[1, 3], command=SIM_AS_COMMAND,
             args=["--served-model-name", "{model}-{tp}"],
             env={"LLMGW_TEST_MARK": "profile-env"})
    async with node(tmp_path / "work") as n:
        n.supervisor.start(s)
        ready = await until(lambda: n.status(s.shard_id, "ready"), "the engine to be ready")
        pid = ready.pid
        argv, environ = process_facts(pid)
        assert argv == [
            sys.executable, "-m", "llmgw", "sim", "engine", "--host", "127.0.0.1", "--port", str(s.port),
            "--model", "echo", "--served-model-name", "echo-2"]
        assert environ["CUDA_VISIBLE_DEVICES"] == "1,3" and environ["LLMGW_TEST_MARK"] == "profile-env"
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # its own session: it outlives the agent
        assert ready.endpoint == f"http://127.0.0.1:{s.port}"
        state = json.loads((tmp_path / "work" / "shards" / f"{s.shard_id}.json").read_text())
        assert (state["pid"] == pid and state["start_ticks"] == procs.start_ticks(pid)
                and state["spec"]["gpus"] == [1, 3])
        assert "=== llmgw: starting echo.1" in (tmp_path / "work" / "logs" / f"{s.shard_id}.log").read_text()

        n.supervisor.stop(s.shard_id, 5.0, "test")
        stopped = await until(lambda: n.status(s.shard_id, "stopped"), "the engine to stop")
        assert stopped.reason == "test" and stopped.exit_code is not None
        assert not pid_alive(pid) and not (tmp_path / "work" / "shards" / f"{s.shard_id}.json").exists()


async def test_shards_refused_before_anything_is_launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent-bin")  # no vllm here, as on this test machine
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]  # ok: a child that just lives
    cases = {
        "nobin": (spec("nobin", engine="command", command=["llmgw-no-such-engine", "--port", "{port}"]),
                  "not started: command: executable 'llmgw-no-such-engine' not found on PATH (/nonexistent-bin)"),
        "badtp": (spec("badtp", engine="vllm", gpus=[2, 3], args=["--tensor-parallel-size", "4"]),
                  "not started: vllm: profile args set tensor parallel size 4 but the shard has 2 GPU(s) [2, 3]; "
                  "drop the flag or set gpus: 4"),
        "port": (spec("port", port=busy_port),
                 f"not started: port {busy_port} on 127.0.0.1 is in use by another process"),
        "nogpu": (spec("nogpu", gpus=[3, 9]),
                  "not started: GPU(s) [9] do not exist on this node (it has [0, 1, 2, 3])"),
        "taken": (spec("taken", gpus=[0, 1]), "not started: GPU(s) [0] are in use by another engine on this node"),
        "noport": (spec("noport", port=0), "not started: bad port 0"),
        "engine": (spec("engine", engine="trtllm"),
                   "not started: unknown engine 'trtllm'; this agent knows command, sglang, sim, vllm"),
        "template": (spec("template", engine="command", command=[sys.executable, "--port={prot}"]),
                     "not started: command template '--port={prot}': unknown placeholder {prot}"),
    }
    with busy:
        async with node(tmp_path / "work") as n:
            holder = spec("holder", engine="command", command=sleeper, gpus=[0], start_timeout=600)
            n.supervisor.start(holder)
            await until(lambda: n.status(holder.shard_id, "starting"), "the GPU 0 holder to start")
            for name, (s, reason) in cases.items():
                n.supervisor.start(s)
                failed = n.status(s.shard_id, "failed")  # refused synchronously, before any await
                assert failed is not None, name
                assert failed.reason.startswith(reason), (name, failed.reason)
                assert failed.pid == 0 and failed.replica_id == s.replica_id
                assert not (tmp_path / "work" / "logs" / f"{s.shard_id}.log").exists(), (f"{name}: "
                                                                                         "something was launched")
                assert not (tmp_path / "work" / "shards" / f"{s.shard_id}.json").exists()
                # Told at once, and kept (finished) for the next Register, which repeats it once.
                assert n.supervisor.runs[s.shard_id].state == "failed"
                [again] = [r for r in n.supervisor.reports() if r.spec.shard_id == s.shard_id]
                assert again.state == "failed" and again.reason.startswith(reason)
                assert s.shard_id not in n.supervisor.runs
            assert [x.state for x in n.sent if x.shard_id == holder.shard_id] == ["starting"]


async def test_the_agents_allowlist_refuses_before_anything_is_launched(tmp_path: Path) -> None:
    """The agent's own config decides what runs, whatever the server sends (default allowlist:
    vllm, sglang, sim; argv[0] vllm or python3; no PATH, LD_*, PYTHON* from a profile)."""
    marker = tmp_path / "ran"
    touch = ["/bin/sh", "-c", f"touch {marker}"]
    with_command = EngineAllow(engines=["vllm", "sglang", "sim", "command"])
    cases = {
        "cmd": (EngineAllow(), spec("cmd", engine="command", command=touch),
                "not started: engine 'command' is not allowed on this node (its agent config's allow.engines: vllm, "
                "sglang, sim)"),
        "preload": (EngineAllow(), spec("preload", env={"LD_PRELOAD": str(tmp_path / "evil.so"), "HF_HOME": "/models"}),
                    "not started: profile env sets LD_PRELOAD, which this node refuses (allow.refuse_env: "
                    "PATH, LD_*, PYTHON*"),
        "path": (EngineAllow(),
                 spec("path", env={"PATH": str(tmp_path), "PYTHONPATH": str(tmp_path), "PYTHONUNBUFFERED": "1"}),
                 "not started: profile env sets PATH, PYTHONPATH, which this node refuses"),
        "exe": (with_command, spec("exe", engine="command", command=touch),
                "not started: command: executable '/bin/sh' is not allowed on this node (its agent config's "
                "allow.executables: vllm, python3)"),
        "dotdot": (EngineAllow(engines=["command"], executables=["/usr/bin/*"]),
                   spec("dotdot", engine="command", command=[f"/usr/bin/../..{tmp_path}/sh", "-c", f"touch {marker}"]),
                   f"not started: command: executable '/usr/bin/../..{tmp_path}/sh' is not allowed"),
        "relative": (EngineAllow(engines=["command"], executables=["*"]),
                     spec("relative", engine="command", command=["./sh"]),
                     "not started: command: executable './sh' is not allowed"),
    }
    for name, (allow, s, reason) in cases.items():
        async with node(tmp_path / name, allow=allow) as n:
            n.supervisor.start(s)
            failed = n.status(s.shard_id, "failed")  # refused synchronously, before any await
            assert failed is not None, name
            assert failed.reason.startswith(reason), (name, failed.reason)
            assert failed.pid == 0
            assert not (tmp_path / name / "logs" / f"{s.shard_id}.log").exists(), f"{name}: something was launched"
            assert not (tmp_path / name / "shards" / f"{s.shard_id}.json").exists()
    assert not marker.exists()

    # What the allowlist lets through runs: a key allowed by name, an executable by path.
    allow = EngineAllow(engines=["command", "sim"], executables=[sys.executable],
                        env=["PYTHONUNBUFFERED", "LD_BIND_NOW"])
    async with node(tmp_path / "allowed", allow=allow) as n:
        ok = spec("allowed", env={"LD_BIND_NOW": "1", "PYTHONUNBUFFERED": "1"})
        n.supervisor.start(ok)
        ready = await until(lambda: n.status(ok.shard_id, "ready"), "the allowed sim engine to be ready")
        assert process_facts(ready.pid)[1]["LD_BIND_NOW"] == "1"
        cmd = spec("allowedcmd", engine="command", command=SIM_AS_COMMAND, gpus=[2])
        n.supervisor.start(cmd)
        await until(lambda: n.status(cmd.shard_id, "ready"), "the allowed command engine to be ready")


async def test_the_engine_key_reaches_the_engine_but_not_the_tail_or_the_start_line(tmp_path: Path) -> None:
    """An engine that prints its key (SGLang prints its server args) and fails: the tail the
    server gets, and the agent's own line in the log, show a placeholder instead."""
    key = "k-0123456789abcdefghijklmnopqrstuvwxyzABCDEF"
    blurt = [sys.executable, "-c", "import os, sys; print('env', os.environ['LLMGW_ENGINE_API_KEY']); "
             "print('argv', sys.argv[1]); sys.exit(3)", "--key={api_key}"]
    async with node(tmp_path / "work") as n:
        s = spec("blurt", engine="command", command=blurt, api_key=key)
        n.supervisor.start(s)
        failed = await until(lambda: n.status(s.shard_id, "failed"), "the engine to fail")
    assert failed.tail[0].startswith("=== llmgw: starting blurt.1")
    assert "env <engine api key>" in failed.tail and "argv --key=<engine api key>" in failed.tail, failed.tail
    assert not any(key in line for line in failed.tail)
    start_line = (tmp_path / "work" / "logs" / f"{s.shard_id}.log").read_text().splitlines()[0]
    assert key not in start_line and "--key=<engine api key>" in start_line


async def test_a_program_that_cannot_be_executed_is_failed(tmp_path: Path) -> None:
    script = tmp_path / "engine.sh"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    async with node(tmp_path / "work") as n:
        s = spec("noexec", engine="command", command=[str(script), "{port}"])
        n.supervisor.start(s)
        failed = await until(lambda: n.status(s.shard_id, "failed"), "the launch to fail")
        assert failed.reason.startswith(f"not started: cannot execute {script}:"), failed.reason


def write_state(work: Path, name: str, content: bytes) -> Path:
    path = work / "shards" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


async def test_adoption_from_state_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    work = tmp_path / "work"
    # A process no state file can describe: a valid JSON naming it, in a format this agent cannot read.
    stray = spawn("import time; time.sleep(120)")  # ok: a child that just lives
    # A process that exited while the agent was away, with its output in the log.
    gone = spawn("print('loading weights'); print('CUDA error: out of memory')", stdout=subprocess.PIPE)
    out, _ = gone.communicate(timeout=DEFAULT_DEADLINE)
    try:
        ticks = procs.start_ticks(stray.pid)
        assert ticks is not None
        unreadable = write_state(work, "stray.1", json.dumps({"pid": stray.pid, "pgid": stray.pid, "start_ticks": ticks,
                                                              "spec": "written by a newer agent"}).encode())
        truncated = write_state(work, "cut.1", b'{"spec": {"shard_id": "cut.1", "rep')
        log_path = work / "logs" / "gone.1.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_bytes(out)
        gone_spec = spec("gone")
        exited = write_state(work, "gone.1", msgspec.json.encode({
            "spec": gone_spec, "pid": gone.pid, "pgid": gone.pid, "start_ticks": 12345, "started_at": 1.0,
            "log_path": str(log_path), "endpoint": "http://127.0.0.1:1"}))
        async with node(work) as n:
            await until(lambda: stray.poll() is not None, "the undescribable engine to be stopped")
            assert stray.returncode == -signal.SIGKILL
            assert not unreadable.exists() and not truncated.exists() and not exited.exists()
            reports = n.supervisor.reports()
            assert [(r.spec.shard_id, r.state) for r in reports] == [("gone.1", "exited")]
            assert reports[0].reason == "the engine exited while the agent was not running"
            assert reports[0].tail == ["loading weights", "CUDA error: out of memory"]
            assert n.supervisor.reports() == []  # told once, in the first Register
        text = caplog.text
        assert f"stopping the engine it names (pid {stray.pid}): nobody can describe it" in text
        assert "cut.1.json cannot be read" in text and "removing it" in text
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


@pytest.fixture
def killpg_guard(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """os.killpg with a pgid <= 0 signals the caller's own group (here: pytest): record it
    instead of doing it."""
    bad: list[int] = []
    real = os.killpg

    def guarded(pgid: int, sig: int) -> None:
        if pgid <= 0:
            bad.append(pgid)
            return
        real(pgid, sig)

    monkeypatch.setattr(os, "killpg", guarded)
    return bad


async def test_a_stop_that_arrives_before_the_launch_launches_nothing(tmp_path: Path, killpg_guard: list[int]) -> None:
    async with node(tmp_path / "work") as n:
        s = spec("quick", engine="command", command=SIM_AS_COMMAND)
        n.supervisor.start(s)
        n.supervisor.stop(s.shard_id, 2.0, "surplus")  # before the launcher task ran at all
        stopped = await until(lambda: n.status(s.shard_id, "stopped"), "the shard to be reported stopped")
        assert stopped.pid == 0 and stopped.reason == "surplus"
        assert killpg_guard == [], "signalled process group 0: the agent's own group"
        assert [x.state for x in n.sent if x.shard_id == s.shard_id] == ["stopping", "stopped"]
        assert [r.state for r in n.supervisor.reports() if r.spec.shard_id == s.shard_id] == ["stopped"]
        assert s.shard_id not in n.supervisor.runs
        assert not (tmp_path / "work" / "shards" / f"{s.shard_id}.json").exists()
        assert not (tmp_path / "work" / "logs" / f"{s.shard_id}.log").exists()  # written just before a launch


HEALTH_WHILE_FLAG = """\
import http.server, os, sys, time
port, flag = int(sys.argv[1]), sys.argv[2]
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        while not os.path.exists(flag):  # busy: /health hangs
            time.sleep(0.1)  # ok: the child's own busy loop
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


async def test_an_adopted_engine_that_was_ready_is_ready_at_once_even_if_busy(tmp_path: Path) -> None:
    """An engine that served for hours, busy when the agent restarts (its /health hangs), is
    reported ready in the first Register; it is not stopped for a start timeout that ran out
    long ago, nor shown as starting while a probe waits."""
    work = tmp_path / "work"
    script = tmp_path / "engine.py"
    script.write_text(HEALTH_WHILE_FLAG)
    healthy = tmp_path / "healthy"
    healthy.touch()
    s = spec("busy", engine="command", command=[sys.executable, str(script), "{port}", str(healthy)],
             start_timeout=30.0)
    async with node(work, stop_engines=False) as n:
        n.supervisor.start(s)
        pid = (await until(lambda: n.status(s.shard_id, "ready"), "the engine to be ready")).pid
    # The agent is gone; its engine is not. It gets busy, and it has been up for an hour.
    assert pid_alive(pid)
    healthy.unlink()
    path = work / "shards" / f"{s.shard_id}.json"
    state = json.loads(path.read_text())
    state["started_at"] -= 3600
    path.write_text(json.dumps(state))
    try:
        async with node(work) as n:
            assert [(r.spec.shard_id, r.state, r.pid) for r in n.supervisor.reports()] == [(s.shard_id, "ready", pid)]
            # Still watched: when it does exit, that is reported (with no exit code: not our child).
            os.killpg(pid, signal.SIGKILL)
            exited = await until(lambda: n.status(s.shard_id, "exited"), "the adopted engine's exit to be reported")
            assert exited.exit_code is None and "not this agent's child" in exited.reason
            assert not any(x.state == "failed" for x in n.sent), n.sent
    finally:
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)


async def test_stopping_an_adopted_engine_kills_it_and_frees_its_gpus(tmp_path: Path) -> None:
    """The seed's exact bug (issue 37): an adopted engine reported stopped while nothing was
    killed. The agent restarts and adopts its running engine; a Stop must end the process
    (its pid is gone) before `stopped` is reported, and its GPU takes a new engine."""
    work = tmp_path / "work"
    s = spec("adopted")
    async with node(work, stop_engines=False) as n:
        n.supervisor.start(s)
        pid = (await until(lambda: n.status(s.shard_id, "ready"), "the engine to be ready")).pid
    assert pid_alive(pid)  # the agent is gone; its engine serves on
    try:
        async with node(work) as n:
            assert [(r.spec.shard_id, r.state, r.pid) for r in n.supervisor.reports()] == [(s.shard_id, "ready", pid)]
            n.supervisor.stop(s.shard_id, 2.0, "surplus")
            # The grace is 2 s: well within 15 s, or nothing was signalled (the seed's bug).
            await until(lambda: n.status(s.shard_id, "stopped"), "the adopted engine reported stopped", deadline=15.0)
            assert not pid_alive(pid), "reported stopped, but the adopted engine still runs"
            again = spec("successor", gpus=list(s.gpus))  # the same GPU
            n.supervisor.start(again)
            await until(lambda: n.status(again.shard_id, "ready") or n.status(again.shard_id, "failed"),
                        "the successor on the freed GPU to start or fail")
            assert n.status(again.shard_id, "failed") is None, n.status(again.shard_id, "failed")
    finally:
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)


async def test_a_ready_engine_that_hangs_is_reported_unhealthy_then_ready_again(tmp_path: Path) -> None:
    """Issue 9: a SIGSTOPped engine stayed `ready`. The supervisor keeps health-checking ready
    engines: failures in a row report it `unhealthy` with since when, a pass reports it ready."""
    s = spec("hung")
    fast = EngineHealth(interval=Duration(0.2), timeout=Duration(0.3), failures=2)
    async with node(tmp_path / "work", health=fast) as n:
        n.supervisor.start(s)
        ready = await until(lambda: n.status(s.shard_id, "ready"), "the engine to be ready")
        os.kill(ready.pid, signal.SIGSTOP)
        try:
            sick = await until(lambda: n.status(s.shard_id, "unhealthy"), "the hung engine reported unhealthy")
            assert sick.reason.startswith("unhealthy since ") and "2 health checks" in sick.reason, sick.reason
            assert n.supervisor.runs[s.shard_id].state == "unhealthy"
            state = json.loads((tmp_path / "work" / "shards" / f"{s.shard_id}.json").read_text())
            assert state["ready"] is True  # an agent restarted now adopts it as having been ready
        finally:
            os.kill(ready.pid, signal.SIGCONT)
        await until(lambda: [x.state for x in n.sent if x.shard_id == s.shard_id][-1] == "ready", "ready again")
        assert n.supervisor.runs[s.shard_id].reason == ""


async def test_no_engine_starts_once_the_agent_is_stopping_its_engines(tmp_path: Path) -> None:
    """While an agent stops its engines on exit it is still connected, and the server replaces
    the stopped ones, possibly on this very node: such a start must be refused, or the engine
    outlives the agent (found by the fault suite's leftover check)."""
    first, late = spec("first"), spec("late", gpus=[2])
    async with node(tmp_path / "work") as n:
        n.supervisor.start(first)
        await until(lambda: n.status(first.shard_id, "ready"), "the engine to be ready")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(n.supervisor.stop_all, "agent stopping")
            await until(lambda: n.status(first.shard_id, "stopping"), "stopping")
            n.supervisor.start(late)
        refused = n.status(late.shard_id, "failed")
        assert refused is not None and refused.reason == "not started: the agent is stopping its engines"
        assert n.status(first.shard_id, "stopped") is not None
