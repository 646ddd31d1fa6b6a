"""The install itself serves: `llmgw server`, `llmgw agent` and `llmgw gateway`, started from the
console script the install put in its venv's bin/ (what the systemd units in deploy/ start),
answer a chat request end to end.

Issue 36: a regular `pip install .` crashed at every server start while the suite passed on
another build. `make test` runs this file in both venvs it builds: the compiled wheel's (with
the whole suite) and the compiler-less LLMGW_PURE=1 wheel's. Run on the editable .venv
(`make e2e`), it checks that install the same way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import openai

from llmgw import hotpath
from tests.e2e.harness import Proc, Server, engines_config, free_port, make_sim_node, wait_until

CATALOG = """\
models:
  - name: chat
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
        args: ["--ttft-ms", "1", "--itl-ms", "1"]
"""

SCRIPT = Path(sys.prefix) / "bin" / "llmgw"


def expected_build() -> str:
    """What `--version` and the start-up logs must say this install runs."""
    expect = os.environ.get("LLMGW_EXPECT_INSTALLED")
    if expect == "compiled" or (expect is None and hotpath.compiled()):
        return f"hot path compiled ({len(hotpath.COMPILED)} of {len(hotpath.COMPILED)} modules)"
    return "hot path pure Python"


def chat(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True) if chunk.choices)
    whole = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=4).choices[0].message.content
    assert streamed and whole, (streamed, whole)
    return streamed


def test_the_installed_console_script_runs_server_agent_and_gateway(tmp_path: Path, procs: list[Proc]) -> None:
    assert SCRIPT.is_file(), f"the install has no console script at {SCRIPT}"
    command = [str(SCRIPT)]
    version = Proc("version", ["--version"], tmp_path, command=command)
    assert version.popen.wait(timeout=60) == 0, version.log()
    assert expected_build() in version.log(), version.log()

    server = Server(tmp_path, engines_config(CATALOG), command=command)
    procs.append(server.start())
    agent = Proc("agent-node-a", ["agent", "--config", str(make_sim_node(tmp_path, "node-a", server.fleet_url)),
                                  "--insecure"], tmp_path, command=command)
    procs.append(agent)
    wait_until(lambda: any(r["state"] == "ready" for r in server.get("/api/v1/replicas")), "the replica ready",
               procs=procs, deadline=60)
    assert chat(server.url)

    port = free_port()
    gateway = Proc("gateway", ["gateway", "--control-plane", server.fleet_url, "--listen", f"127.0.0.1:{port}",
                               "--insecure"], tmp_path, command=command)
    procs.append(gateway)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/v1/models", timeout=2).json()["data"], "the gateway to know the model",
               procs=procs)
    wait_until(lambda: chat(url), "a chat through the gateway", procs=procs)

    # Each process said which build it runs, and it is this install's.
    for proc in (server.proc, gateway):
        assert proc is not None
        assert expected_build() in proc.log(), proc.log()[-2000:]
