"""The operator's actions through `llmgw ctl` against a real fleet: reload, restart, forget.

A restart brings the successor up first (issue 46): a one-replica model under load loses no
request, and where there is no room for both it stops nothing unless told to with --force.

A real server, two agents running simulated engines, and `llmgw ctl` processes carrying the
operator token in LLMGW_TOKEN, as a script or a cron job would.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tests.e2e.harness import (
    FAST_AGENT,
    Load,
    Proc,
    Server,
    ctl,
    engines_config,
    make_sim_node,
    one_error_line,
    pid_alive,
    replicas,
    start_agent,
    wait_until,
)

TOKEN = "ops-9b1c0f3d"
AS_OPERATOR = {"LLMGW_TOKEN": TOKEN}
CATALOG = """\
models:
  - name: chat
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
"""


def ready(server: Server) -> list[dict[str, Any]]:
    return [r for r in replicas(server) if r["state"] == "ready"]


def ready_count(server: Server, n: int) -> list[dict[str, Any]] | None:
    rs = replicas(server)
    return rs if len(rs) == n and all(r["state"] == "ready" for r in rs) else None


def ctl_ok(server: Server, *args: str) -> str:
    result = ctl(server.url, *args, env=AS_OPERATOR)
    assert result.returncode == 0, result.stderr
    return result.stdout


def fleet(tmp_path: Path, procs: list[Proc]) -> tuple[Server, dict[str, Proc]]:
    api = f'api:\n  operator_tokens: ["sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
    server = Server(tmp_path, engines_config(CATALOG, api), token=TOKEN)
    procs.append(server.start())
    agents = {}
    for node in ("gpu-01", "gpu-02"):
        cfg = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "2")
        agents[node] = start_agent(tmp_path, node, cfg, "--stop-engines-on-exit")
        procs.append(agents[node])
    wait_until(lambda: ready_count(server, 1), "one replica ready", procs=procs)
    return server, agents


def test_reload_applies_the_catalog_and_refuses_a_broken_config(tmp_path: Path, procs: list[Proc]) -> None:
    server, _ = fleet(tmp_path, procs)
    good = server.config.read_text().replace("replicas: 1", "replicas: 3")
    server.config.write_text(good)
    assert "reloaded" in ctl_ok(server, "reload")
    assert json.loads(ctl_ok(server, "reload", "-o", "json"))["ok"] is True  # every command with -o has json (issue 46)
    running = wait_until(lambda: ready_count(server, 3), "three replicas after `ctl reload`", procs=procs)
    assert json.loads(ctl_ok(server, "models", "-o", "json"))[0]["replicas"] == 3

    # A value out of range: refused with file:line; nothing changes.
    lines = good.splitlines()
    bad_line = next(i for i, line in enumerate(lines, 1) if "replicas: 3" in line)
    server.config.write_text(good.replace("replicas: 3", "replicas: -1"))
    result = ctl(server.url, "reload", env=AS_OPERATOR)
    assert result.returncode == 1
    line = one_error_line(result)
    assert f"{server.config.name}:{bad_line}" in line and "replicas" in line and "running config stays" in line, line
    # Broken YAML: the same.
    server.config.write_text(good + "  - name: [unclosed\n")
    result = ctl(server.url, "reload", env=AS_OPERATOR)
    assert result.returncode == 1
    line = one_error_line(result)
    assert f"{server.config.name}:" in line and "invalid YAML" in line and "running config stays" in line, line
    # The running config stayed: still three replicas of chat, the same engines.
    assert json.loads(ctl_ok(server, "models", "-o", "json"))[0]["replicas"] == 3
    assert {r["id"]: r["shards"][0]["pid"] for r in ready_count(server, 3) or []} == \
        {r["id"]: r["shards"][0]["pid"] for r in running}
    assert "reload failed, keeping the running config" in server.proc.log()

    # Back to one replica: the reload takes it down again (the surplus is stopped).
    server.config.write_text(good.replace("replicas: 3", "replicas: 1"))
    ctl_ok(server, "reload")
    survivor = wait_until(lambda: ready_count(server, 1), "one replica after reloading replicas: 1", procs=procs)
    gone = [r["shards"][0]["pid"] for r in running if r["id"] != survivor[0]["id"]]
    wait_until(lambda: not any(pid_alive(p) for p in gone), "the surplus engines to exit", procs=procs)


def test_restart_of_a_one_replica_model_under_load_fails_no_request(tmp_path: Path, procs: list[Proc]) -> None:
    """It stopped first: a 1-replica model answered 503 for the 3–4 s its engine took to start."""
    server, _ = fleet(tmp_path, procs)
    old = ready(server)[0]
    with Load(server.url, "chat", threads=3) as load:
        result = ctl(server.url, "restart", old["id"], env=AS_OPERATOR)
        ok_during = load.ok
    assert result.returncode == 0, result.stdout + result.stderr
    assert load.failures == [], load.failures[:5]
    assert ok_during > 10, ok_during  # traffic flowed throughout
    [new] = ready_count(server, 1) or [None]
    assert new is not None and new["id"] != old["id"], replicas(server)
    out = result.stdout
    assert "a successor is placed first" in out and f"restarted {old['id']}: {new['id']} serves instead" in out, out
    kinds = [e["message"] for e in json.loads(ctl_ok(server, "events", "--model", "chat", "-o", "json"))
             if e["kind"] == "restart"]
    assert any(f"move of {old['id']} done" in m for m in kinds), kinds


def test_restart_without_room_stops_nothing_unless_forced(tmp_path: Path, procs: list[Proc]) -> None:
    api = f'api:\n  operator_tokens: ["sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
    server = Server(tmp_path, engines_config(CATALOG, api), token=TOKEN)
    procs.append(server.start())
    cfg = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "1")
    procs.append(start_agent(tmp_path, "gpu-01", cfg, "--stop-engines-on-exit"))
    [old] = wait_until(lambda: ready_count(server, 1), "one replica ready", procs=procs)
    result = ctl(server.url, "restart", old["id"], env=AS_OPERATOR)
    assert result.returncode == 1, result.stdout + result.stderr
    line = one_error_line(result)
    assert "no room for a successor" in line and "--force stops it first" in line, line
    assert [(r["id"], r["state"]) for r in replicas(server)] == [(old["id"], "ready")]  # it serves on

    forced = ctl(server.url, "restart", "--force", old["id"], "-o", "json", env=AS_OPERATOR)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert json.loads(forced.stdout)["state"] == "done"
    new = wait_until(lambda: next((r for r in ready(server) if r["id"] != old["id"]), None), "the new replica ready",
                     procs=procs)
    assert [r["id"] for r in replicas(server)] == [new["id"]]


def test_restart_replaces_a_replica_and_forget_needs_a_lost_node(tmp_path: Path, procs: list[Proc]) -> None:
    server, agents = fleet(tmp_path, procs)
    old = ready(server)[0]
    old_pid = old["shards"][0]["pid"]
    out = ctl_ok(server, "restart", old["id"])
    assert old["id"] in out
    new = wait_until(lambda: next((r for r in ready(server) if r["id"] != old["id"]), None), "a new replica ready",
                     procs=procs)
    wait_until(lambda: not pid_alive(old_pid), "the restarted replica's engine to exit", procs=procs)
    wait_until(lambda: [r["id"] for r in replicas(server)] == [new["id"]], "the old replica gone", procs=procs)
    assert ("restart requested by operator token "
            f"sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()[:8]}" in server.proc.log())

    # A connected node cannot be forgotten: 409, one line, exit 1.
    result = ctl(server.url, "forget", "gpu-02", env=AS_OPERATOR)
    assert result.returncode == 1
    line = one_error_line(result)
    assert "HTTP 409" in line and "gpu-02" in line and "stop its agent first" in line, line
    assert server.nodes()["gpu-02"]["state"] == "ready"

    # Once its agent is gone and the node is lost, it can.
    agents["gpu-02"].stop()
    wait_until(lambda: server.nodes()["gpu-02"]["state"] == "lost", "gpu-02 lost", procs=[server.proc])
    assert json.loads(ctl_ok(server, "forget", "gpu-02", "-o", "json")) == {"forgotten": "gpu-02"}
    assert set(server.nodes()) == {"gpu-01"}
    known = json.loads((server.state_dir / "known-nodes.json").read_text())
    assert known == ["gpu-01"]  # a restarted server does not wait for it either
    result = ctl(server.url, "forget", "gpu-02", env=AS_OPERATOR)
    assert result.returncode == 1 and "HTTP 404" in one_error_line(result)
    # The replica (wherever it ran) is served on gpu-01 now.
    wait_until(lambda: (rs := ready_count(server, 1)) and rs[0]["shards"][0]["node"] == "gpu-01",
               "the replica on gpu-01", procs=[server.proc, agents["gpu-01"]])


def test_hash_secret_prints_json_too() -> None:
    import hashlib

    from tests.e2e.harness import run_llmgw

    result = run_llmgw("ctl", "hash-secret", "-o", "json", input="sk-abc\n")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"digest": "sha256:" + hashlib.sha256(b"sk-abc").hexdigest()}
