"""Events and engine logs from one terminal (issue 16): `ctl events` over a real server's
durable log, and `ctl logs -f` reading an engine's log on its node over the fleet stream."""

from __future__ import annotations

import hashlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl,
    engines_config,
    llmgw_env,
    make_sim_node,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)

TOKEN = "ops-5d1e7a0c"
AS_OPERATOR = {"LLMGW_TOKEN": TOKEN}
API = f'api:\n  operator_tokens: ["sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
CATALOG = """\
models:
  - name: chat
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
"""


def ready_replica(server: Server) -> dict[str, Any] | None:
    rs = replicas(server)
    return rs[0] if len(rs) == 1 and rs[0]["state"] == "ready" else None


def events(server: Server, *args: str) -> list[dict[str, Any]]:
    result = ctl(server.url, "events", "-o", "json", *args, env=AS_OPERATOR)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def one_node(tmp_path: Path, procs: list[Proc]) -> tuple[Server, Path, dict[str, Any]]:
    server = Server(tmp_path, engines_config(CATALOG, API), token=TOKEN)
    procs.append(server.start())
    cfg = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "2")
    procs.append(start_agent(tmp_path, "gpu-01", cfg))
    replica = wait_until(lambda: ready_replica(server), "the replica ready", procs=procs)
    return server, cfg, replica


def test_events_survive_a_server_restart(tmp_path: Path, procs: list[Proc]) -> None:
    server, _, replica = one_node(tmp_path, procs)
    wait_until(lambda: any(e["kind"] == "replica" and "ready" in e["message"] for e in events(server)),
               "the replica's ready event", procs=procs)
    before = events(server)
    kinds = {e["kind"] for e in before}
    assert {"node", "placement", "replica"} <= kinds, before
    placed = next(e for e in before if e["kind"] == "placement")
    assert placed["node"] == "gpu-01" and placed["model"] == "chat" and replica["id"] in placed["message"]
    assert all(e["node"] == "gpu-01" for e in events(server, "--node", "gpu-01"))
    assert events(server, "--model", "nope") == []
    assert [e["id"] for e in events(server, "--since", "1h")] == [e["id"] for e in before]

    assert server.proc is not None
    server.proc.stop()
    procs.append(server.start())
    after = wait_until(lambda: (got := events(server)) and len(got) > len(before) and got, "events after the restart",
                       procs=procs)
    assert [e["id"] for e in after[: len(before)]] == [e["id"] for e in before]  # the old ones, kept
    assert after[len(before)]["id"] > before[-1]["id"]


def test_a_bad_since_is_bad_usage_before_any_request() -> None:
    """Exit 2 and one line, as for every usage error (it was the server's 400: exit 1)."""
    result = ctl("http://127.0.0.1:9", "events", "--since", "2x", env=AS_OPERATOR)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "--since" in result.stderr and "expected a duration back from now" in result.stderr
    assert "Traceback" not in result.stderr and "connect" not in result.stderr.lower()


def test_a_corrupt_events_database_is_moved_aside(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG, API), token=TOKEN)
    server.state_dir.mkdir(parents=True)
    (server.state_dir / "events.db").write_bytes(b"this is not a database\n" * 500)
    procs.append(server.start())
    assert server.proc is not None
    wait_until(lambda: "moved it aside" in server.proc.log(), "the warning", procs=procs)  # type: ignore[union-attr]
    [aside] = list(server.state_dir.glob("events.db.corrupt-*"))
    assert aside.read_bytes().startswith(b"this is not a database")
    assert ctl(server.url, "reload", env=AS_OPERATOR).returncode == 0
    assert any(e["kind"] == "reload" for e in events(server))


class Lines:
    """A running `ctl logs -f`: its stdout lines as they come, each with when it arrived."""

    def __init__(self, server: Server, *args: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "ctl", "--server", server.url, "logs", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=llmgw_env(AS_OPERATOR))
        self.queue: queue.Queue[tuple[float, str]] = queue.Queue()
        self.errors: queue.Queue[tuple[float, str]] = queue.Queue()  # stderr: llmgw's own notes
        self.seen: list[str] = []
        self.said: list[str] = []
        threading.Thread(target=self._read, args=(self.popen.stdout, self.queue), daemon=True).start()
        threading.Thread(target=self._read, args=(self.popen.stderr, self.errors), daemon=True).start()

    @staticmethod
    def _read(pipe: Any, into: queue.Queue[tuple[float, str]]) -> None:
        assert pipe is not None
        for line in pipe:
            into.put((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, needle: str, deadline: float, *, stderr: bool = False) -> float:
        """When the first line holding `needle` arrived (fails after `deadline` seconds)."""
        source, seen = (self.errors, self.said) if stderr else (self.queue, self.seen)
        end = time.monotonic() + deadline
        while True:
            try:
                at, line = source.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {needle!r} within {deadline}s; got {seen[-10:]}; "
                                     f"alive: {self.popen.poll() is None}") from None
            seen.append(line)
            if needle in line:
                return at

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def log_file(tmp_path: Path, replica: dict[str, Any], node: str = "gpu-01") -> Path:
    [path] = list(tmp_path.glob(f"{node}/**/logs/{replica['shards'][0]['shard_id']}.log"))
    return path


def append(path: Path, line: str) -> float:
    with open(path, "a") as fh:
        fh.write(line + "\n")
    return time.monotonic()


def test_ctl_logs_follows_a_running_engine_and_an_adopted_one(tmp_path: Path, procs: list[Proc]) -> None:
    server, cfg, replica = one_node(tmp_path, procs)
    path = log_file(tmp_path, replica)

    # Without an operator credential: refused, nothing streamed.
    refused = ctl(server.url, "logs", replica["id"])
    assert refused.returncode != 0 and "401" in refused.stderr

    tail = ctl(server.url, "logs", replica["id"], "--tail", "5", env=AS_OPERATOR)
    assert tail.returncode == 0, tail.stderr
    assert 0 < len(tail.stdout.splitlines()) <= 5
    as_json = ctl(server.url, "logs", replica["id"], "--tail", "5", "-o", "json", env=AS_OPERATOR)
    assert as_json.returncode == 0, as_json.stderr
    objects = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert 0 < len(objects) <= 6 and all("line" in o or "note" in o for o in objects), objects

    follow = Lines(server, replica["id"], "-f", "--tail", "1000")
    try:
        follow.wait_for("=== llmgw: starting", 15)  # the tail: the supervisor's first line
        written = append(path, "marker-one: a new engine line")
        shown = follow.wait_for("marker-one", 5)
        assert shown - written < 1.0, f"the new line took {shown - written:.2f}s to show"
    finally:
        follow.stop()

    # The agent dies and a new one adopts the engine: its log is read the same way.
    agent = next(p for p in procs if p.name == "agent-gpu-01")
    agent.kill9()
    live = [p for p in procs if p is not agent]
    live.append(start_agent(tmp_path, "gpu-01", cfg))
    procs.append(live[-1])
    wait_until(lambda: "adopted this engine" in path.read_text(), "the new agent to adopt the engine", procs=live)
    wait_until(lambda: (r := ready_replica(server)) and r["id"] == replica["id"], "the adopted replica ready",
               procs=live)
    adopted = Lines(server, replica["id"], "-f", "--tail", "3")
    try:
        adopted.wait_for("adopted this engine", 15)
        written = append(path, "marker-two: after adoption")
        shown = adopted.wait_for("marker-two", 5)
        assert shown - written < 1.0, f"the new line took {shown - written:.2f}s to show"
    finally:
        adopted.stop()


def test_ctl_logs_model_follows_the_model_across_a_drain(tmp_path: Path, procs: list[Proc]) -> None:
    """Issue 46: `logs MODEL` (replica ids changed on every move, so `logs -f ID` ended with the
    move and the next one answered 404); `-f` follows the successor, as `kubectl logs -f deploy/X`."""
    server = Server(tmp_path, engines_config(CATALOG, API).replace("settle: 0.5s", "settle: 3s"), token=TOKEN)
    procs.append(server.start())
    for node in ("gpu-01", "gpu-02"):
        cfg = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "2")
        procs.append(start_agent(tmp_path, node, cfg, "--stop-engines-on-exit"))
    old = wait_until(lambda: ready_replica(server), "the replica ready", procs=procs)
    assert old["id"].startswith("chat-")
    node = old["shards"][0]["node"]

    bad = ctl(server.url, "logs", "chat", "--replica", "chat-zzzzz", env=AS_OPERATOR)
    assert bad.returncode == 1 and "model chat has no replica 'chat-zzzzz'" in bad.stderr, bad.stderr
    unknown = ctl(server.url, "logs", "nope", env=AS_OPERATOR)
    assert unknown.returncode == 1 and "no model or replica 'nope' (models: chat)" in unknown.stderr, unknown.stderr
    once = ctl(server.url, "logs", "chat", "--tail", "5", env=AS_OPERATOR)
    assert once.returncode == 0 and 0 < len(once.stdout.splitlines()) <= 5, once.stdout + once.stderr
    assert f"chat: first ready replica {old['id']} (ready on {node})" in once.stderr, once.stderr
    assert "-- llmgw" not in once.stdout  # stdout is the engine's lines alone

    follow = Lines(server, "chat", "-f", "--tail", "1000")
    try:
        follow.wait_for(f"first ready replica {old['id']}", 15, stderr=True)
        follow.wait_for("=== llmgw: starting", 15)
        drained = ctl(server.url, "drain", node, "--timeout", "60", env=AS_OPERATOR)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        [new] = [r for r in replicas(server) if r["state"] == "ready"]
        assert new["id"] != old["id"] and new["shards"][0]["node"] != node
        follow.wait_for(f"{old['id']} retired by a drain (drain of {node} requested by operator token", 30, stderr=True)
        assert (f"following its successor {new['id']} (ready on "
                f"{new['shards'][0]['node']})" in follow.said[-1]), follow.said
        written = append(log_file(tmp_path, new, new["shards"][0]["node"]), "marker-three: the successor's line")
        shown = follow.wait_for("marker-three", 10)
        assert shown - written < 1.0, f"the new line took {shown - written:.2f}s to show"
        assert follow.popen.poll() is None  # still following
    finally:
        follow.stop()


def test_a_port_that_changed_while_its_agent_was_away_is_an_event(tmp_path: Path, procs: list[Proc]) -> None:
    """The heartbeat's port readings are compared with the last ones the server held, across a
    reconnect too: a port that went INIT while the agent was down is seen when it registers."""
    server, cfg, _ = one_node(tmp_path, procs)
    agent = next(p for p in procs if p.name == "agent-gpu-01")
    agent.kill9()
    assert run_llmgw("sim", "node", "set-port", str(tmp_path / "gpu-01"), "mlx5_2", "1", "init").returncode == 0
    live = [p for p in procs if p is not agent]
    live.append(start_agent(tmp_path, "gpu-01", cfg))
    procs.append(live[-1])
    got = wait_until(lambda: [e for e in events(server, "--node", "gpu-01") if e["kind"] == "port"], "the port event",
                     procs=live)
    assert [e["message"] for e in got] == ["port mlx5_2/1 on gpu-01: ACTIVE → INIT (LinkUp)"], got
