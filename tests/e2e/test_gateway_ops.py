"""Gateway workers on day 2, through real servers, workers, agents and engines on loopback: a
worker's 503 logs the control plane's reason, `gateway.workers` changed by a reload, and
`ctl gateways` (what the control plane knows of its followers)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    engines_config,
    make_sim_node,
    start_agent,
    wait_until,
)
from tests.e2e.test_gateway_workers import WORKERS, scrape

# A model that cannot be placed: it wants 4 GPUs, the one node has 2.
TOO_BIG = """\
models:
  - name: big
    replicas: 1
    profiles:
      - name: tp4
        engine: sim
        gpus: 4
"""

LOGGED_503 = re.compile(r"request (\S+): 503 for model big: no ready replica of big \((.+)\)$", re.M)


def unplaceable(tmp: Path, procs: list[Proc], extra: str) -> tuple[Server, Proc, dict[str, str]]:
    """A server (with `extra` config) and a 2-GPU node; returns the 503's body and the logged reason."""
    tmp.mkdir()
    server = Server(tmp, engines_config(TOO_BIG, extra))
    server_proc = server.start()
    procs.append(server_proc)
    procs.append(start_agent(tmp, "gpu-01", make_sim_node(tmp, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "2"),
                             "--stop-engines-on-exit"))

    def answered() -> dict[str, str] | None:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                       json={"model": "big", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        rid = r.headers["x-request-id"]
        logged = {m.group(1): m.group(2) for m in LOGGED_503.finditer(server_proc.log())}
        # Past the settle period, with the node registered: the reason is placement's.
        if rid in logged and "gpu-01" in logged[rid] and "places nothing new" not in logged[rid]:
            return {"body": r.json()["error"]["message"].replace(rid, "RID"), "reason": logged[rid]}
        return None

    return server, server_proc, wait_until(answered, "a 503 logged with placement's reason", procs=procs)


def test_a_workers_503_logs_the_reason_the_one_process_server_gives(tmp_path: Path, procs: list[Proc]) -> None:
    """The same catalog and node, once with the one-process gateway and once with two workers:
    each worker's 503 carries the same client body (which names no replica or engine) and its
    log line the same reason (the replica, its state, placement's per-node words)."""
    _, _, one = unplaceable(tmp_path / "one", procs, "")
    server, server_proc, _ = unplaceable(tmp_path / "two", procs, WORKERS)
    wait_until(lambda: len(scrape(server)) == 2, "two workers", procs=procs)
    rid_free = re.compile(r"big-[a-z0-9]+")  # replica ids differ between the two servers
    want = rid_free.sub("big-ID", one["reason"])
    assert "GPU" in want and "pending" in want, want
    assert one["body"] == "no ready replica of big; retry later (request id RID)"
    # New connections land on either worker: each of ten must answer and log as the one process does.
    for _ in range(10):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=5, headers={"connection": "close"},
                       json={"model": "big", "messages": [{"role": "user", "content": "hi"}]})
        rid = r.headers["x-request-id"]
        assert r.status_code == 503 and r.json()["error"]["message"].replace(rid, "RID") == one["body"]
        logged = wait_until(lambda rid=rid: {m.group(1): m.group(2) for m in LOGGED_503.finditer(server_proc.log())}.get(rid),
                            f"the log line of {rid}", procs=procs)
        assert rid_free.sub("big-ID", logged) == want
    assert "as the control plane last said" not in server_proc.log()
