"""Router-only use: `llmgw server` with static `endpoints:` only (no profiles, no agents) in
front of engines it does not run; here, simulated engines this test starts itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    ctl,
    get_json,
    pid_alive,
    start_sim_engine,
    wait_until,
)

# Scrapes far apart: the first one (at start) shows both engines up, and after the kill it is
# the requests themselves that find the dead engine (retried elsewhere, breaker opened), not a
# scrape that happens to come first and takes it out of rotation (which would make the test a race).
GATEWAY = """\
gateway:
  breaker_failures: 2
  breaker_cooldown: 60s
  scrape_interval: 60s
"""


def endpoints(server: Server) -> dict[str, dict[str, Any]]:
    result = ctl(server.url, "endpoints", "-o", "json")
    assert result.returncode == 0, result.stderr
    return {e["endpoint"]: e for e in json.loads(result.stdout)}


def test_static_endpoints_behind_the_gateway(tmp_path: Path, procs: list[Proc]) -> None:
    urls = []
    engines = []
    for name in ("engine-a", "engine-b"):
        proc, url = start_sim_engine(tmp_path, name, "--served-model-name", "chat", "--ttft-ms", "1", "--itl-ms", "1")
        procs.append(proc)
        engines.append(proc)
        urls.append(url)
    static = "endpoints:\n" + "".join(f"  - model: chat\n    url: {u}\n" for u in urls)
    server = Server(tmp_path, FAST_FLEET + GATEWAY + static)
    procs.append(server.start())
    assert get_json(f"{server.url}/api/v1/replicas") == []  # nothing is run, only routed

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["chat"]
    wait_until(lambda: all(e["engine_up"] for e in endpoints(server).values()) and len(endpoints(server)) == 2,
               "both engines scraped up", procs=procs)

    def chat(i: int) -> str:
        r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": f"hello {i}"}],
                                           max_tokens=4)
        assert r.model == "chat" and r.choices[0].message.content
        return r.choices[0].message.content

    for i in range(10):
        chat(i)

    def served(url: str) -> float:
        lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total{"))

    assert all(served(u) > 0 for u in urls)  # the balancer used both

    # One engine dies: every request still succeeds (retried on the other), and the operator
    # sees why in `ctl endpoints`.
    dead, alive = urls
    engines[0].kill9()
    assert not pid_alive(engines[0].pid)
    before = served(alive)
    for i in range(40):
        chat(100 + i)
    assert served(alive) >= before + 40
    view = wait_until(lambda: (eps := endpoints(server))[dead]["breaker"] == "open" and eps,
                      "the dead engine's breaker open", procs=[server.proc, engines[1]])
    assert "connect" in view[dead]["breaker_reason"], view[dead]
    assert view[alive]["breaker"] == "closed" and view[alive]["engine_up"]
    table = ctl(server.url, "endpoints")
    assert table.returncode == 0 and "open" in table.stdout, table.stdout  # only the dead one is open
    retried = [line for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines()
               if line.startswith("llmgw_upstream_retries_total{") and 'model="chat"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in retried) >= 2

    # The last engine gone too: a clear 503 in OpenAI's error shape, not a hang.
    engines[1].kill9()
    try:
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}])
    except openai.APIStatusError as exc:
        assert exc.status_code in (502, 503) and "chat" in exc.message
    else:
        raise AssertionError("a request with every engine dead succeeded")

