"""Replicas that cannot run, end to end: a real server, agent and simulated engines on loopback.

What the agent refuses before launching (missing binary, bad tensor size, port in use), an
engine that never becomes healthy, an engine that died while its agent was down, and a state
file nobody can read: each must reach the operator, through `llmgw ctl replicas`, with why.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from llmgw.agent import procs as agent_procs
from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl_json,
    engines_config,
    free_port,
    make_sim_node,
    pid_alive,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)


def one_node(tmp_path: Path, procs: list[Proc], config: str, gpus: int = 4,
             agent_extra: str = "") -> tuple[Server, Proc, Path]:
    server = Server(tmp_path, config)
    procs.append(server.start())
    agent_config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT + agent_extra, "--gpus", str(gpus))
    agent = start_agent(tmp_path, "gpu-01", agent_config, "--stop-engines-on-exit")
    procs.append(agent)
    return server, agent, agent_config


class Seen:
    """Failed replicas seen so far, by model: replicas that fail are retried, so a failed
    state comes and goes; each poll adds what it sees."""

    def __init__(self) -> None:
        self.by_model: dict[str, dict[str, Any]] = {}
        self.table: dict[str, str] = {}

    def from_json(self, server: Server, expected: dict[str, str]) -> bool:
        for r in ctl_json(server.url, "replicas"):
            if r["state"] == "failed" and expected.get(r["model"], "\0") in r["reason"]:
                self.by_model[r["model"]] = r
        return self.by_model.keys() >= expected.keys()

    def from_table(self, server: Server, expected: dict[str, str]) -> bool:
        result = run_llmgw("ctl", "--server", server.url, "replicas")
        assert result.returncode == 0, result.stderr
        for row in table_rows(result.stdout):
            needle = expected.get(row["MODEL"])
            if needle is not None and row["STATE"] == "failed" and needle in row["REASON"]:
                self.table[row["MODEL"]] = row["REASON"]
        return self.table.keys() >= expected.keys()


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the replicas table; a REASON wrapped over several lines is joined again."""
    lines = text.splitlines()
    header = lines[0]
    names = header.split()
    starts = [header.index(name) for name in names]
    rows: list[dict[str, str]] = []
    for line in lines[1:]:
        if not line.strip():
            break  # the table is over (the output tails follow)
        if line[0] != " ":
            cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
            rows.append(dict(zip(names, cells, strict=True)))
        elif rows:
            rows[-1]["REASON"] += " " + line[starts[-1]:].strip()
    return rows


def test_profiles_the_agent_refuses_and_a_start_timeout_are_failed_with_the_reason(tmp_path: Path,
                                                                                   procs: list[Proc]) -> None:
    catalog = """\
models:
  - name: nobin
    profiles:
      - engine: command
        gpus: 1
        command: [llmgw-no-such-engine, --port, "{port}"]
  - name: badtp
    profiles:
      - engine: vllm
        gpus: 2
        args: [--tensor-parallel-size, "4"]
  - name: hangs
    profiles:
      - engine: sim
        gpus: 1
        args: [--hang]
        start_timeout: 2s
        stop_grace: 1s
"""
    # This node allows the command engine and that (missing) program: the refusal is the agent's
    # own check that it exists, not its allowlist (test_agent_allowlist.py has those).
    allow = "allow:\n  engines: [vllm, sglang, sim, command]\n  executables: [vllm, python3, llmgw-no-such-engine]\n"
    server, agent, _ = one_node(tmp_path, procs, engines_config(catalog), agent_extra=allow)
    expected = {
        "nobin": "gpu-01: not started: command: executable 'llmgw-no-such-engine' not found on PATH",
        "badtp": "gpu-01: not started: vllm: profile args set tensor parallel size 4 but the shard has 2 GPU(s)",
        "hangs": "gpu-01: not healthy within 2s (start_timeout); stopped it",
    }
    seen = Seen()
    wait_until(lambda: seen.from_json(server, expected), "all three replicas failed with their reasons (ctl -o json)",
               procs=procs)
    assert seen.by_model["badtp"]["reason"].endswith("drop the flag or set gpus: 4")
    for model in ("nobin", "badtp"):
        assert seen.by_model[model]["tail"] == []  # nothing ran, so there is no output
    hung = seen.by_model["hangs"]
    # Its output tail: it came up but never answered, and the agent stopped it.
    assert hung["tail"][0].startswith("=== llmgw: starting hangs-")
    assert any("Application startup complete." in line for line in hung["tail"]), hung["tail"]
    assert any("Received SIGTERM; shutting down." in line for line in hung["tail"]), hung["tail"]

    # The same reasons in the operator's table, and the hung engine's last output under it.
    wait_until(lambda: seen.from_table(server, expected), "the reasons in the replicas table", procs=procs)
    wait_until(lambda: (r := run_llmgw("ctl", "--server", server.url, "replicas")).returncode == 0
               and any(line.startswith(f"{hung['id']} — last output:") for line in r.stdout.splitlines())
               and "Received SIGTERM; shutting down." in r.stdout,
               "the hung engine's output under the table", procs=procs)
    # Nothing was launched for the refused profiles.
    logs = tmp_path / "gpu-01" / "work" / "logs"
    assert {p.name.split("-")[0] for p in logs.glob("*.log")} == {"hangs"}
    assert "not healthy within 2s (start_timeout); stopped it" in agent.log()


def test_a_port_in_use_is_reported_and_the_replica_starts_once_it_is_free(tmp_path: Path, procs: list[Proc]) -> None:
    catalog = """\
models:
  - name: small
    profiles:
      - engine: sim
        gpus: 1
"""
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    try:
        server, _, _ = one_node(tmp_path, procs, engines_config(catalog, f"  port_range: [{port}, {port}]\n"))
        expected = {"small": f"gpu-01: not started: port {port} on 127.0.0.1 is in use by another process"}
        seen = Seen()
        wait_until(lambda: seen.from_json(server, expected), "the port clash in ctl -o json", procs=procs)
        wait_until(lambda: seen.from_table(server, expected), "the port clash in the table", procs=procs)
    finally:
        squatter.close()
    ready = wait_until(lambda: next((r for r in replicas(server) if r["state"] == "ready"), None),
                       "the replica ready once the port is free", procs=procs)
    assert ready["shards"][0]["port"] == port and ready["id"] == seen.by_model["small"]["id"]
    assert ready["shards"][0]["endpoint"] == f"http://127.0.0.1:{port}"


def test_an_engine_that_exited_while_the_agent_was_down_is_reported_and_replaced(tmp_path: Path,
                                                                                 procs: list[Proc]) -> None:
    catalog = """\
models:
  - name: small
    profiles:
      - engine: sim
        gpus: 1
"""
    # The node must not be declared lost while its agent is down: the agent's own report of
    # the exit is what this test is about.
    config = engines_config(catalog).replace("lost_after: 2s", "lost_after: 60s")
    server, agent, agent_config = one_node(tmp_path, procs, config, gpus=2)
    before = wait_until(lambda: next((r for r in replicas(server) if r["state"] == "ready"), None), "the replica ready",
                        procs=procs)
    pid = before["shards"][0]["pid"]

    agent.kill9()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), "the engine to die", procs=[server.proc])
    assert server.nodes()["gpu-01"]["state"] in ("ready", "unreachable")
    agent = start_agent(tmp_path, "gpu-01", agent_config, "--stop-engines-on-exit")
    procs.append(agent)
    live = [server.proc, agent]

    wait_until(lambda: "the engine exited while the agent was not running" in agent.log(), "the agent to notice",
               procs=live)
    after = wait_until(lambda: next((r for r in replicas(server) if r["id"] == before["id"] and r["state"] == "ready"
                                     and r["shards"][0]["pid"] != pid), None),
                       "the same replica ready again with a new engine", procs=live)
    assert after["attempt"] == before["attempt"] + 1 and not after["adopted"]
    assert pid_alive(after["shards"][0]["pid"])
    log = server.proc.log()
    assert (f"replica {before['id']} failed: gpu-01: the engine exited while the agent "
            "was not running" in log), log[-3000:]


def test_a_state_file_nobody_can_read_naming_a_live_process_stops_it(tmp_path: Path, procs: list[Proc]) -> None:
    # No server needed: the agent deals with its state files before it first dials.
    agent_config = make_sim_node(tmp_path, "gpu-01", f"http://127.0.0.1:{free_port()}", FAST_AGENT, "--gpus", "2")
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],  # ok: a child that just lives
                             start_new_session=True)
    try:
        ticks = agent_procs.start_ticks(stray.pid)
        shards = tmp_path / "gpu-01" / "work" / "shards"
        shards.mkdir(parents=True, exist_ok=True)
        state = shards / "mystery-bcdfg.1.json"
        state.write_text(json.dumps({"format": 99, "pid": stray.pid, "pgid": stray.pid, "start_ticks": ticks,
                                     "spec": {"written_by": "a newer agent"}}))
        agent = start_agent(tmp_path, "gpu-01", agent_config)
        procs.append(agent)
        wait_until(lambda: stray.poll() is not None, "the agent to stop the process", procs=[agent])
        assert stray.returncode == -signal.SIGKILL
        wait_until(lambda: "nobody can describe it" in agent.log(), "the agent to say why", procs=[agent])
        assert f"stopping the engine it names (pid {stray.pid}): nobody can describe it" in agent.log()
        assert str(state) in agent.log() and not state.exists()
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
