"""`llmgw agent` stopped with SIGTERM: it ends its stream cleanly and leaves its engines serving."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    engines_config,
    make_sim_node,
    pid_alive,
    replicas,
    start_agent,
    wait_until,
)

CATALOG = """\
models:
  - name: small
    profiles:
      - engine: sim
        gpus: 1
"""


def test_sigterm_ends_the_stream_cleanly_and_engines_keep_serving(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG))
    procs.append(server.start())
    agent = start_agent(tmp_path, "gpu-01",
                        make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "1"))
    procs.append(agent)
    ready = wait_until(lambda: next((r for r in replicas(server) if r["state"] == "ready"), None), "the replica ready",
                       procs=procs)
    shard = ready["shards"][0]

    assert agent.stop() == 0
    # The server hears a goodbye (END_STREAM, GOAWAY), not a dropped connection.
    wait_until(lambda: "node gpu-01: ready → unreachable (stream closed: peer ended the stream)" in server.proc.log(),
               "the server to see the stream end cleanly", procs=[server.proc])
    assert "connection closed by peer" not in server.proc.log()
    # Traffic goes gateway → engine directly: the engine outlives its agent and still answers.
    assert pid_alive(shard["pid"])
    assert httpx.get(f"{shard['endpoint']}/health", timeout=5).status_code == 200
