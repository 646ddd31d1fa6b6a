"""A real agent with its default allowlist refuses what a server (compromised, or just wrong)
asks it to run: a profile env that sets LD_PRELOAD or PATH, a `command` engine. Each is a failed
replica whose reason says why, and nothing is launched; an ordinary profile still runs."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl_json,
    engines_config,
    make_sim_node,
    start_agent,
    wait_until,
)


def test_a_start_outside_the_agents_allowlist_is_a_failed_replica_and_nothing_runs(tmp_path: Path,
                                                                                   procs: list[Proc]) -> None:
    marker = tmp_path / "the-server-ran-this"
    evil = tmp_path / "evil.so"
    catalog = f"""\
models:
  - name: preload
    profiles:
      - {{engine: sim, gpus: 1, env: {{LD_PRELOAD: "{evil}"}}}}
  - name: path
    profiles:
      - {{engine: sim, gpus: 1, env: {{PATH: "{tmp_path}", HF_HOME: /models}}}}
  - name: shell
    profiles:
      - engine: command
        gpus: 1
        command: [/bin/sh, -c, "touch {marker}; exec sleep 60"]
  - name: fine
    profiles:
      - {{engine: sim, gpus: 1}}
"""
    server = Server(tmp_path, engines_config(catalog))
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "4")
    assert "allow" not in config.read_text()  # the agent's defaults
    agent = start_agent(tmp_path, "gpu-01", config, "--stop-engines-on-exit")
    procs.append(agent)
    expected = {
        "preload": "gpu-01: not started: profile env sets LD_PRELOAD, which this node refuses",
        "path": "gpu-01: not started: profile env sets PATH, which this node refuses",
        "shell": "gpu-01: not started: engine 'command' is not allowed on this node",
    }
    seen: dict[str, str] = {}

    def check() -> bool:
        for r in ctl_json(server.url, "replicas"):
            if (r["model"] in expected and r["state"] in ("failed", "pending")
                    and r["reason"].startswith(expected[r["model"]])):
                seen[r["model"]] = r["reason"]
            if r["model"] == "fine" and r["state"] == "ready":
                seen["fine"] = "ready"
        return len(seen) == 4

    wait_until(check, "three replicas refused with their reasons and the ordinary one ready", procs=procs)
    assert "allow.engines: vllm, sglang, sim" in seen["shell"]
    # Nothing of the refused ones ran: no process, no engine log, no state file, no marker.
    work = tmp_path / "gpu-01" / "work"
    launched = {p.name.split("-")[0] for p in (work / "logs").glob("*.log")}
    assert launched == {"fine"}, launched
    assert {p.name.split("-")[0] for p in (work / "shards").glob("*.json")} == {"fine"}
    assert not marker.exists()
    log = agent.log()
    assert "not started: engine 'command' is not allowed" in log and "LD_PRELOAD" in log
