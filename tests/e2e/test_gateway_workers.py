"""`gateway.workers: 2`: two real worker processes accept on the server's public port
(SO_REUSEPORT), both serve, and one killed with SIGKILL under load from OpenAI clients is started
again while the other serves on."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import openai

from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    bearer,
    ctl,
    start_sim_engine,
    wait_until,
    writes,
)

WORKERS = """\
gateway:
  workers: 2
"""


def scrape(server: Server) -> dict[str, dict[str, float]]:
    """Per worker: its pid, whether it follows, and the requests it finished (from the one /metrics)."""
    out: dict[str, dict[str, float]] = {}
    text = httpx.get(f"{server.url}/metrics", timeout=5, verify=server.verify, headers=bearer(server.token)).text
    for line in text.splitlines():
        if line.startswith("#") or 'worker="' not in line:
            continue
        name, value = line.rsplit(" ", 1)
        worker = name.split('worker="', 1)[1].split('"', 1)[0]
        row = out.setdefault(worker, {"pid": 0.0, "connected": 0.0, "requests": 0.0})
        if name.startswith("llmgw_gateway_worker_pid{"):
            row["pid"] = float(value)
        elif name.startswith("llmgw_gateway_control_plane_connected{"):
            row["connected"] = float(value)
        elif name.startswith("llmgw_requests_total{") and 'code="200"' in name:
            row["requests"] += float(value)
    return out


def client(server: Server, retries: int, api_key: str = "unused") -> openai.OpenAI:
    # No keep-alive: every request is a new connection, which the kernel gives to either worker.
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30, verify=server.verify)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=retries, http_client=http)


def chat(c: openai.OpenAI, i: int) -> None:
    r = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=2)
    assert r.choices[0].message.content


def two_workers(server: Server, procs: list[Proc]) -> dict[str, dict[str, float]]:
    """Wait for both workers to follow the control plane; their scrape (two distinct pids)."""
    workers = wait_until(lambda: (w := scrape(server)) and len(w) == 2 and all(r["connected"] for r in w.values())
                         and w,
                         "two workers following the control plane", procs=procs)
    assert {int(r["pid"]) for r in workers.values()} - {0} and len({r["pid"] for r in workers.values()}) == 2
    return workers


def both_serve(server: Server, procs: list[Proc], api_key: str = "unused") -> None:
    """New connections spread across the two workers' sockets: both finish requests."""
    c = client(server, retries=0, api_key=api_key)
    for i in range(40):
        chat(c, i)
    wait_until(lambda: all(r["requests"] > 0 for r in scrape(server).values()), "both workers to have served",
               procs=procs)


def kill_one_under_load(server: Server, workers: dict[str, dict[str, float]], procs: list[Proc],
                        api_key: str = "unused") -> dict[str, dict[str, float]]:
    """kill -9 worker-0 under load from OpenAI clients; returns the scrape that saw it back, serving."""
    # Load from OpenAI clients, one worker killed: clients that retry see no failure at all; a
    # client with retries off may see a reset on a connection the dead worker held (counted,
    # reported), nothing else.
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"ok": 0, "reset": 0}
    failures: list[str] = []

    def load(retries: int) -> None:
        c = client(server, retries, api_key)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                chat(c, i)
            except openai.APIConnectionError as exc:
                with lock:
                    if retries:
                        failures.append(f"retrying client: {exc!r}")
                    else:
                        counts["reset"] += 1
                continue
            except Exception as exc:
                with lock:
                    failures.append(f"retries={retries}: {exc!r}")
                continue
            with lock:
                counts["ok"] += 1

    threads = [threading.Thread(target=load, args=(retries,), daemon=True) for retries in (2, 2, 0, 0)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: counts["ok"] >= 20, "load running", procs=procs)
        victim = "worker-0"
        dead_pid = int(workers[victim]["pid"])
        os.kill(dead_pid, signal.SIGKILL)
        ok_at_kill = counts["ok"]
        back = wait_until(lambda: (w := scrape(server)).get(victim, {}).get("connected") and
                          w[victim]["pid"] not in (0, dead_pid) and w[victim]["requests"] > 0 and w,
                          f"{victim} started again and serving", procs=procs)
        wait_until(lambda: counts["ok"] >= ok_at_kill + 20, "load served after the kill", procs=procs)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert failures == [], failures
    print(f"\n{counts['ok']} requests served; {counts['reset']} reset(s) seen by clients with retries off")
    assert "exited with signal 9; starting it again" in server.proc.log() if server.proc else True
    return back


def test_two_workers_serve_one_port_and_a_killed_one_comes_back(tmp_path: Path, procs: list[Proc]) -> None:
    urls = []
    for name in ("engine-a", "engine-b"):
        proc, url = start_sim_engine(tmp_path, name, "--served-model-name", "chat", "--ttft-ms", "1", "--itl-ms", "1")
        procs.append(proc)
        urls.append(url)
    static = "endpoints:\n" + "".join(f"  - model: chat\n    url: {u}\n" for u in urls)
    server = Server(tmp_path, FAST_FLEET + WORKERS + static)
    procs.append(server.start())
    workers = two_workers(server, procs)

    both_serve(server, procs)
    back = kill_one_under_load(server, workers, procs)
    assert back["worker-1"]["pid"] == workers["worker-1"]["pid"]  # the other one was never restarted

    # A reload reaches every worker: with an API key configured, every new connection, whichever
    # worker the kernel hands it to (the restarted one too), wants it.
    key = "sk-workers-reload"
    digest = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    server.config.write_text(FAST_FLEET + WORKERS.rstrip("\n") + f'\n  api_keys: ["{digest}"]\n' + static)
    result = ctl(server.url, "reload")
    assert result.returncode == 0, result.stderr

    def refused_without_key() -> bool:
        return all(httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 401 for _ in range(10))

    # Each worker applies it when its feed delivers it (milliseconds apart): ten in a row.
    wait_until(refused_without_key, "every worker to want the API key", procs=procs)
    keyed = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0,
                          http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30))
    for i in range(20):
        assert httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 401
        chat(keyed, i)

    # SIGTERM: the server lets its workers finish (each drains and exits 0), none is started again.
    assert server.proc is not None
    assert server.proc.stop(timeout=30) == 0
    log = server.proc.log()
    for worker in ("worker-0", "worker-1"):
        assert re.search(rf"gateway {worker} \(pid \d+\) stopped \(exit code 0\)", log), log[-3000:]



def test_through_workers_every_door_holds(tmp_path: Path, procs: list[Proc]) -> None:
    """With workers the API, the admin pages and /metrics are forwarded to the control plane: each
    still stands behind its door, on whichever worker a connection lands (ten new ones each)."""
    from tests.e2e.test_doors import KEY, OPERATOR, VIEWER, digest

    proc, url = start_sim_engine(tmp_path, "engine-a", "--served-model-name", "chat", "--ttft-ms", "1", "--itl-ms", "1")
    procs.append(proc)
    config = (FAST_FLEET + WORKERS + f'  api_keys: ["{digest(KEY)}"]\n'
              f'api:\n  viewer_tokens: ["{digest(VIEWER)}"]\n  operator_tokens: ["{digest(OPERATOR)}"]\n'
              f"endpoints:\n  - model: chat\n    url: {url}\n")
    server = Server(tmp_path, config, token=VIEWER)
    procs.append(server.start())

    def status(method: str, path: str, headers: dict[str, str], cookies: dict[str, str] | None = None) -> set[int]:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=10, cookies=cookies) as http:
            return {http.request(method, f"{server.url}{path}", headers=headers).status_code for _ in range(10)}

    wait_until(lambda: len(scrape_with(server, VIEWER)) == 2, "two workers", procs=procs)
    assert status("GET", "/v1/models", bearer(KEY)) == {200}
    for path in ("/api/v1/nodes", "/api/v1/models", "/admin/", "/metrics"):
        for headers in ({}, bearer(KEY), bearer("not-" + VIEWER)):
            assert status("GET", path, headers) == {401}, (path, headers)
        assert status("GET", path, bearer(VIEWER)) == {200}, path
    for headers in (bearer(VIEWER), bearer(OPERATOR)):
        assert status("GET", "/v1/models", headers) == {401}  # a fleet credential is no API key
    assert status("POST", "/api/v1/reload", bearer(VIEWER)) == {403}
    assert status("POST", "/api/v1/reload", bearer(KEY)) == {401}
    assert status("POST", "/api/v1/reload", {}, cookies={"llmgw_admin": OPERATOR}) == {401}  # the cookie only reads
    assert status("POST", "/api/v1/reload", writes(OPERATOR)) == {200}
    # A worker passes the client's Host on, so a page of this server's own origin is told from another site's.
    own = {**writes(OPERATOR), "origin": server.url}
    assert status("POST", "/api/v1/reload", own) == {200}
    assert status("POST", "/api/v1/reload", {**own, "origin": "http://evil.example"}) == {403}
    assert status("POST", "/api/v1/reload", bearer(OPERATOR)) == {403}  # no JSON, no X-Llmgw-Request


def scrape_with(server: Server, token: str) -> set[str]:
    text = httpx.get(f"{server.url}/metrics", headers=bearer(token), timeout=5).text
    return {line.split('worker="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if line.startswith("llmgw_gateway_control_plane_connected{") and line.endswith(" 1.0")}
