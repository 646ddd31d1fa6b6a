"""Gateway workers on day 2, through real servers, workers, agents and engines on loopback: a
worker's 503 logs the control plane's reason, `gateway.workers` changed by a reload, and
`ctl gateways` (what the control plane knows of its followers)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx

# harness.Load (steady openai clients, new connections or keep-alive) is `Clients` here, beside the
# fault suite's Load, which records each outcome for its report.
from tests.e2e.harness import (
    FAST_AGENT,
    FAST_FLEET,
    Proc,
    Server,
    bearer,
    ctl,
    engines_config,
    make_sim_node,
    start_agent,
    start_sim_engine,
    token_digest,
    wait_until,
)
from tests.e2e.harness import Load as Clients
from tests.e2e.test_gateway_remote import start_gateway
from tests.e2e.test_gateway_workers import WORKERS, scrape, scrape_with
from tests.faults.fleet import Load

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
        logged = wait_until(lambda rid=rid: {m.group(1): m.group(2)
                                             for m in LOGGED_503.finditer(server_proc.log())}.get(rid),
                            f"the log line of {rid}", procs=procs)
        assert rid_free.sub("big-ID", logged) == want
    assert "as the control plane last said" not in server_proc.log()
    # A gateway on another machine follows the same feed: the same answer, the same reason logged.
    gw_proc, gw_url, gw_metrics = start_gateway(tmp_path / "two", "gateway", server.fleet_url, "--insecure")
    procs.append(gw_proc)
    updates = re.compile(r"^llmgw_gateway_control_plane_updates_total (\S+)", re.M)
    wait_until(lambda: (m := updates.search(httpx.get(f"{gw_metrics}/metrics", timeout=5).text))
               and float(m.group(1)) >= 2,
               "the remote gateway to have its config and endpoints", procs=procs)
    r = httpx.post(f"{gw_url}/v1/chat/completions", timeout=5,
                   json={"model": "big", "messages": [{"role": "user", "content": "hi"}]})
    rid = r.headers["x-request-id"]
    assert r.status_code == 503 and r.json()["error"]["message"].replace(rid, "RID") == one["body"]
    logged = wait_until(lambda: {m.group(1): m.group(2) for m in LOGGED_503.finditer(gw_proc.log())}.get(rid),
                        "the remote gateway's 503 logged", procs=procs)
    assert rid_free.sub("big-ID", logged) == want


def test_ctl_gateways_lists_the_workers_and_a_remote_gateway(tmp_path: Path, procs: list[Proc]) -> None:
    """Two workers and one gateway on another "machine" follow a real server: `ctl gateways` (JSON
    and the table) names each with its kind, peer, pid, version, since when, its last report, the
    requests it served and whether it runs the config published now (after a reload too);
    GET /api/v1/gateways stands behind the viewer door (an API key is refused, on whichever
    worker the connection lands)."""
    key, viewer = "sk-gw-ops", "viewer-gw-ops"
    proc, url = start_sim_engine(tmp_path, "engine-a", "--served-model-name", "chat", "--ttft-ms", "1", "--itl-ms", "1")
    procs.append(proc)
    config = (FAST_FLEET + WORKERS + f'  api_keys: ["{token_digest(key)}"]\n'
              f'api:\n  viewer_tokens: ["{token_digest(viewer)}"]\n'
              f"endpoints:\n  - model: chat\n    url: {url}\n")
    server = Server(tmp_path, config, token=viewer)
    server_proc = server.start()
    procs.append(server_proc)
    gw_proc, gw_url, _ = start_gateway(tmp_path, "gateway", server.fleet_url, "--insecure", "--name", "edge-1")
    procs.append(gw_proc)
    wait_until(lambda: len(scrape_with(server, viewer)) == 3, "two workers and a remote gateway", procs=procs)
    wait_until(lambda: httpx.get(f"{gw_url}/v1/models", headers=bearer(key), timeout=5).status_code == 200,
               "the remote gateway to serve", procs=procs)
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=10) as http:
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(6):  # new connections, served by both workers in turn
            assert http.post(f"{server.url}/v1/chat/completions", headers=bearer(key), json=chat).status_code == 200
        assert http.post(f"{gw_url}/v1/chat/completions", headers=bearer(key), json=chat).status_code == 200
        refused = {http.get(f"{server.url}/api/v1/gateways", headers=h).status_code for h in ({}, bearer(key))
                   for _ in range(5)}
        assert refused == {401}

    def listed() -> list[dict] | None:
        result = ctl(server.url, "gateways", "-o", "json", env={"LLMGW_TOKEN": viewer})
        assert result.returncode == 0, result.stderr
        rows = json.loads(result.stdout)
        return rows if len(rows) == 3 and all(r["last_report"] and r["config"] == "current" for r in rows) \
            and sum(r["requests"] for r in rows) >= 7 else None

    rows = wait_until(listed, "three gateways that have reported their requests", procs=procs)
    by_name = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == ["worker-0", "worker-1", "edge-1"]  # the server's own first
    assert {by_name[n]["kind"]
            for n in ("worker-0", "worker-1")} == {"worker"} and by_name["edge-1"]["kind"] == "remote"
    assert by_name["edge-1"]["pid"] == gw_proc.pid and by_name["edge-1"]["peer"].startswith("127.0.0.1:")
    assert {by_name[n]["peer"] for n in ("worker-0", "worker-1")} == {"local (gateway.sock)"}
    assert by_name["edge-1"]["requests"] >= 1
    worker_pids = {int(w["pid"]) for w in scrape_pids(server, viewer).values()}
    assert {by_name[n]["pid"] for n in ("worker-0", "worker-1")} == worker_pids
    assert all(r["version"] and r["since"] <= r["last_report"] for r in rows)

    table = ctl(server.url, "gateways", env={"LLMGW_TOKEN": viewer})
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "PEER", "PID", "VERSION", "CONNECTED", "LAST", "REPORT", "REQUESTS",
                                "CONFIG"]
    assert [line.split()[:2] + line.split()[-1:] for line in lines[1:]] == [
        ["worker-0", "worker", "current"], ["worker-1", "worker", "current"], ["edge-1", "remote", "current"]]
    # A reload changes the catalog (a second model): every follower takes it and says so.
    server.config.write_text(config + f"  - model: chat-2\n    url: {url}\n")
    server_proc.signal(signal.SIGHUP)
    wait_until(lambda: "chat-2" in httpx.get(f"{gw_url}/v1/models", headers=bearer(key), timeout=5).text,
               "the remote gateway to serve the reloaded catalog", procs=procs)
    wait_until(lambda: (rows := listed()) and [r["config"] for r in rows] == ["current"] * 3,
               "every follower on the reloaded config", procs=procs)
    assert "\x1b" not in table.stdout  # no colour on a pipe
    # The remote gateway stops: it leaves the list.
    gw_proc.stop()
    wait_until(lambda: [r["name"] for r in json.loads(ctl(server.url, "gateways", "-o", "json",
                                                          env={"LLMGW_TOKEN": viewer}).stdout)]
               == ["worker-0", "worker-1"],
               "the stopped gateway to leave the list", procs=procs[:2])


def scrape_pids(server: Server, token: str) -> dict[str, dict[str, float]]:
    text = httpx.get(f"{server.url}/metrics", headers=bearer(token), timeout=5).text
    return {line.split('worker="', 1)[1].split('"', 1)[0]: {"pid": float(line.rsplit(" ", 1)[1])}
            for line in text.splitlines() if line.startswith("llmgw_gateway_worker_pid{") and 'worker="worker-' in line}


def resized_config(n: int, urls: list[str]) -> str:
    return (FAST_FLEET + f"gateway:\n  workers: {n}\n  shutdown_grace: 20s\n"
            + "endpoints:\n" + "".join(f"  - model: chat\n    url: {u}\n" for u in urls))


def test_a_reload_resizes_the_workers_under_load_with_no_failed_request(tmp_path: Path, procs: list[Proc]) -> None:
    """`gateway.workers` 2 → 3 by `ctl reload`, then 3 → 2 by SIGHUP, while openai clients send one
    request after another (new connections with retries off; keep-alive ones, half of them
    streaming): the third worker starts and serves, then drains and exits 0 (retired, not started
    again); the first two are never restarted, and no request fails, not even on a keep-alive
    connection of a client without retries (the retiring worker lets each idle connection bring
    one more request, answered with `connection: close`, instead of closing it under a request
    being sent: HTTP/1.1's keep-alive race)."""
    urls = []
    for name in ("engine-a", "engine-b"):
        proc, url = start_sim_engine(tmp_path, name, "--served-model-name", "chat", "--ttft-ms", "5", "--itl-ms", "5")
        procs.append(proc)
        urls.append(url)
    server = Server(tmp_path, resized_config(2, urls))
    server_proc = server.start()
    procs.append(server_proc)
    before = wait_until(lambda: (w := scrape(server)) and len(w) == 2 and all(r["connected"] for r in w.values()) and w,
                        "two workers following", procs=procs)
    with Load(server.url, workers=3) as load, \
            Clients(server.url, "chat", threads=3, stream=False, fresh=True) as fresh, \
            Clients(server.url, "chat", threads=2, stream=False, retries=2) as kept:
        load.wait_successes(30, "load running")
        server.config.write_text(resized_config(3, urls))
        result = ctl(server.url, "reload")
        assert result.returncode == 0 and "restart" not in result.stdout + result.stderr, result
        # The new worker serves connections the kernel hands it (the load's new ones, and ours).
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30) as http:
            def third_serves() -> dict[str, dict[str, float]] | None:
                http.get(f"{server.url}/v1/models")
                w = scrape(server)
                return w if len(w) == 3 and w.get("worker-2", {}).get("requests", 0) > 0 else None
            grown = wait_until(third_serves, "worker-2 started and serving", procs=procs)
        load.wait_successes(30, "load served by three workers")
        fresh.wait(30, "new connections served by three workers")
        server.config.write_text(resized_config(2, urls))
        server_proc.signal(signal.SIGHUP)
        wait_until(lambda: re.search(r"gateway worker-2 \(pid \d+\) retired \(exit code 0\)", server_proc.log()),
                   "worker-2 drained and retired", procs=procs)
        wait_until(lambda: set(scrape(server)) == {"worker-0", "worker-1"}, "worker-2 gone from /metrics", procs=procs)
        load.wait_successes(30, "load served by two workers again")
        fresh.wait(30, "new connections served by two workers again")
    # Not one request failed on a new connection (retries off: what the kernel had queued on the
    # retiring worker's socket was served, not reset), on a keep-alive one with the openai
    # client's retries, or on a keep-alive one without (the load's).
    assert fresh.failures == [] and kept.failures == [], (fresh.failures, kept.failures)
    assert load.failures(avoidable_only=False) == [], load.report("resize", "")
    after = scrape(server)
    for name in ("worker-0", "worker-1"):  # never restarted
        assert after[name]["pid"] == before[name]["pid"] == grown[name]["pid"]
    log = server_proc.log()
    assert "gateway: 2 → 3 worker(s)" in log and "gateway: 3 → 2 worker(s)" in log
    assert "starting it again" not in log
    # 2 → 1 is no live change: one clear line says a restart is needed, and two workers serve on.
    server.config.write_text(resized_config(1, urls))
    result = ctl(server.url, "reload")
    assert result.returncode == 0, result.stderr
    assert ("gateway.workers 2 → 1 needs a restart of the server" in result.stdout
            and "2 kept" in result.stdout), result.stdout
    assert re.search(r"WARNING llmgw.server: reload: gateway.workers 2 → 1 needs a restart", server_proc.log())
    assert set(scrape(server)) == {"worker-0", "worker-1"} and "gateway: 2 → 1" not in server_proc.log()
    print(f"\n{fresh.ok} new-connection and {kept.ok} keep-alive (retrying) requests, none failed; {load.successes()} "
          f"keep-alive with retries off, none failed; worker-2 served "
          f"{grown['worker-2']['requests']:.0f} by the time it was seen serving")


def test_one_process_to_workers_by_reload_is_refused_with_one_line(tmp_path: Path, procs: list[Proc]) -> None:
    """workers: 1 → 2 cannot be done live (the one process accepts on the public port itself):
    the reload says so in one line, applies the rest of the config, and the one process serves on."""
    proc, url = start_sim_engine(tmp_path, "engine-a", "--served-model-name", "chat", "--ttft-ms", "1", "--itl-ms", "1")
    procs.append(proc)
    server = Server(tmp_path, resized_config(1, [url]))
    server_proc = server.start()
    procs.append(server_proc)
    key = "sk-one-process"
    viewer = "viewer-one-process"
    server.config.write_text(resized_config(2, [url]).replace("  shutdown_grace",
                                                              f'  api_keys: ["{token_digest(key)}"]\n  shutdown_grace')
                             + f'api:\n  viewer_tokens: ["{token_digest(viewer)}"]\n')
    result = ctl(server.url, "reload")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "gateway.workers" in line]
    assert len(lines) == 1 and "gateway.workers 1 → 2 needs a restart of the server" in lines[0], result.stdout
    # The rest applied (the API key is wanted now), still by the one process: no worker follows.
    assert httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=bearer(key), timeout=5).status_code == 200
    listed = ctl(server.url, "gateways", "-o", "json", env={"LLMGW_TOKEN": viewer})
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed
    assert "gateway: 1 → 2" not in server_proc.log()
