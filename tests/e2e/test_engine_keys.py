"""Engines take requests only from the gateway: each shard's engine listens on the node's own
address (here loopback, never every interface) and refuses /v1/* without the random key the
server made for that shard, which only the gateway sends and no API output or log shows.
Real server, real agent, real simulated engine process."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl,
    engine_key,
    engines_config,
    get_json,
    make_sim_node,
    replicas,
    start_agent,
    wait_until,
)

CATALOG = """\
models:
  - name: chat
    replicas: 1
    profiles:
      - {name: tp1, engine: sim, gpus: 1}
"""

BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket in LISTEN on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for line in fh:
                fields = line.split()
                addr, hexport = fields[1].rsplit(":", 1)
                if int(hexport, 16) == port and fields[3] == "0A":
                    found.add(addr)
    return found


def test_an_engine_refuses_anyone_but_the_gateway_and_its_key_is_never_shown(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG))
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "2")
    agent = start_agent(tmp_path, "gpu-01", config, "--stop-engines-on-exit")
    procs.append(agent)
    [replica] = wait_until(lambda: (rs := replicas(server)) and rs[0]["state"] == "ready" and rs, "the replica ready",
                           procs=procs)
    shard = replica["shards"][0]
    endpoint = shard["endpoint"]
    key = engine_key(tmp_path, shard["shard_id"])
    assert len(key) >= 40

    # Bound to the node's address (loopback here), not to every interface.
    assert listening_addresses(shard["port"]) == {"0100007F"}, listening_addresses(shard["port"])

    # Through the gateway: served (it sends the key).
    response = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=30)
    assert response.status_code == 200, response.text

    # Straight to the engine: refused without the key, or with another, as vLLM does.
    for headers in ({}, {"authorization": "Bearer not-the-key"}, {"authorization": key}):
        direct = httpx.post(f"{endpoint}/v1/chat/completions", json=BODY, headers=headers, timeout=10)
        assert direct.status_code == 401, (headers, direct.text)
        assert httpx.get(f"{endpoint}/v1/models", headers=headers, timeout=10).status_code == 401
    # Health stays open (the agent's check and vLLM's own /health need no key); the key works.
    assert httpx.get(f"{endpoint}/health", timeout=10).status_code == 200
    ok = httpx.post(f"{endpoint}/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"},
                    timeout=10)
    assert ok.status_code == 200, ok.text

    # The gateway's scrapes use it too and see the engine up.
    wait_until(lambda: all(e["engine_up"] for e in get_json(f"{server.url}/api/v1/endpoints")), "the engine scraped up",
               procs=procs)

    # Nowhere an operator, a viewer or a log reader can see.
    shown = {
        "GET /api/v1/replicas": httpx.get(f"{server.url}/api/v1/replicas", timeout=5).text,
        "GET /api/v1/replicas/ID": httpx.get(f"{server.url}/api/v1/replicas/{replica['id']}", timeout=5).text,
        "GET /api/v1/endpoints": httpx.get(f"{server.url}/api/v1/endpoints", timeout=5).text,
        "GET /api/v1/nodes/gpu-01": httpx.get(f"{server.url}/api/v1/nodes/gpu-01", timeout=5).text,
        "GET /metrics": httpx.get(f"{server.url}/metrics", timeout=5).text,
    }
    for args in (("replicas", "-o", "json"), ("replicas",), ("endpoints", "-o", "json"), ("nodes", "-o", "json")):
        result = ctl(server.url, *args)
        assert result.returncode == 0, result.stderr
        shown[f"ctl {' '.join(args)}"] = result.stdout + result.stderr
    assert json.loads(shown["GET /api/v1/replicas"])[0]["id"] == replica["id"]  # the right thing was read
    shown["server log"] = server.proc.log() if server.proc else ""
    shown["agent log"] = agent.log()
    [engine_log] = list(tmp_path.glob(f"**/logs/{shard['shard_id']}.log"))
    shown["engine log"] = engine_log.read_text()
    assert "=== llmgw: starting" in shown["engine log"]
    for where, text in shown.items():
        assert key not in text, f"the engine key shows in {where}"

    # A restarted server knows no keys until the agent reports its engines (with their specs):
    # the adopted replica serves through the gateway again.
    assert server.proc is not None and server.proc.stop() == 0
    procs.append(server.start())
    wait_until(lambda: (rs := replicas(server)) and rs[0]["state"] == "ready" and rs[0]["adopted"],
               "the replica adopted",
               procs=[server.proc, agent])
    again = wait_until(lambda: (r := httpx.post(f"{server.url}/v1/chat/completions", json=BODY,
                                                timeout=30)).status_code == 200 and r,
                       "the gateway serving the adopted engine", procs=[server.proc, agent])
    assert again.json()["choices"][0]["message"]["content"]
    assert key not in server.proc.log()
