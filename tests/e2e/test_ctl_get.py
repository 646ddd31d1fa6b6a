"""The habits kubectl users bring to `ctl` (issue 46, item 2), against a real server and agent: one
object at a time (`ctl nodes NODE`, `replicas ID`, `models NAME`), `-o yaml`, `-o wide`, `-o name`,
`--watch -o json` a line per change, and a row that stays one line at a terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl,
    engines_config,
    llmgw_env,
    make_sim_node,
    one_error_line,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)

pytestmark = pytest.mark.e2e

CATALOG = """\
models:
  - name: chat
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict]]:
    tmp = tmp_path_factory.mktemp("get")
    server = Server(tmp, engines_config(CATALOG))
    procs: list[Proc] = [server.start()]
    try:
        cfg = make_sim_node(tmp, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "2", "--ib-ports", "2")
        procs.append(start_agent(tmp, "gpu-01", cfg, "--stop-engines-on-exit"))
        ready = wait_until(lambda: [r for r in replicas(server) if r["state"] == "ready"] or None, "the replica ready",
                           procs=procs)
        assert run_llmgw("sim", "node", "set-gpu", str(cfg.parent), "1", "--xid", "79").returncode == 0
        wait_until(lambda: any(h.get("xid") == 79 for h in server.get("/api/v1/nodes/gpu-01").get("gpu_health") or []),
                   "gpu-01's Xid in its heartbeat", procs=procs)
        yield server, ready[0]
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
            p.kill_group()


def ok(server: Server, *args: str) -> str:
    result = ctl(server.url, *args)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


def test_one_node_its_gpus_ports_replicas_and_events(fleet: tuple[Server, dict]) -> None:
    server, replica = fleet
    shown = ok(server, "nodes", "gpu-01")
    for heading in ("GPUs (latest heartbeat)", "Ports", "Fabrics", "Replicas", "Events"):
        assert heading in shown, shown
    gpu_rows = [line.split() for line in shown.splitlines() if line.split()[:1] in (["0"], ["1"])]
    # the Xid of GPU 1, read from its heartbeat
    assert len(gpu_rows) == 2 and "79" in gpu_rows[1] and "°C" in shown, shown
    assert "72 W" in shown and "POWER" in shown, shown  # the board's power draw from the heartbeat
    assert replica["id"] in shown and "mlx5_0/1" in shown
    assert "placement" in shown  # an event of the node's own history
    assert "driver 550.54.15, CUDA 12.4" in shown, shown  # what doctor's driver-versions compares (issue 39)
    doc = yaml.safe_load(ok(server, "nodes", "gpu-01", "-o", "yaml"))
    volatile = {"last_heartbeat_age", "heartbeats", "gpu_health", "port_readings", "port_states", "state_since"}
    as_json = json.loads(ok(server, "nodes", "gpu-01", "-o", "json"))
    assert {k: v for k, v in doc.items() if k not in volatile} == {k: v for k, v in as_json.items()
                                                                   if k not in volatile}
    assert doc["id"] == "gpu-01" and len(doc["gpu_health"]) == 2
    assert ok(server, "nodes", "gpu-01", "-o", "name") == "node/gpu-01\n"
    missing = ctl(server.url, "nodes", "gpu-09")
    assert missing.returncode == 1 and "no node 'gpu-09'" in one_error_line(missing)


def test_one_replica_and_one_model(fleet: tuple[Server, dict]) -> None:
    server, replica = fleet
    shown = ok(server, "replicas", replica["id"])
    assert "Shards" in shown and "gpu-01" in shown and replica["endpoint"] in shown
    assert json.loads(ok(server, "replicas", replica["id"], "-o", "json"))["id"] == replica["id"]
    model = ok(server, "models", "chat")
    assert "1 ready of 1" in model and replica["id"] in model
    assert yaml.safe_load(ok(server, "models", "chat", "-o", "yaml"))["name"] == "chat"
    missing = ctl(server.url, "models", "nope")
    assert missing.returncode == 1 and "no model 'nope'" in one_error_line(missing)


def test_listings_print_yaml_wide_and_names(fleet: tuple[Server, dict]) -> None:
    server, replica = fleet
    assert ok(server, "nodes", "-o", "name") == "node/gpu-01\n"
    assert ok(server, "replicas", "-o", "name") == f"replica/{replica['id']}\n"
    assert ok(server, "models", "-o", "name") == "model/chat\n"
    assert [r["id"] for r in yaml.safe_load(ok(server, "replicas", "-o", "yaml"))] == [replica["id"]]
    wide = ok(server, "nodes", "-o", "wide").splitlines()
    assert wide[0].split()[:2] == ["NODE", "STATE"] and {"ADDRESS", "IDENTITY", "FEATURES"} <= set(wide[0].split())
    assert "RANKS" in ok(server, "replicas", "-o", "wide").splitlines()[0]


def test_watch_json_prints_a_replica_a_line_when_it_changes(fleet: tuple[Server, dict]) -> None:
    server, replica = fleet
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "--server", server.url, "replicas", "--watch",
                             "-o", "json",
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=llmgw_env())
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["id"] == replica["id"] and first["state"] == "ready"
        # Nothing changed: no more lines for a while (an unchanged replica is not printed again).
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        assert not ready, proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")


@pytest.mark.parametrize(("listing", "key", "name"), [("nodes", "id", "gpu-01"), ("models", "name", "chat")])
def test_every_listing_watches_as_json_a_line_per_change(fleet: tuple[Server, dict], listing: str, key: str,
                                                         name: str) -> None:
    """Issue 46: `--watch -o json` on every listing, not only events and replicas; a heartbeat's
    ticking age is not a change."""
    server, _ = fleet
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "--server", server.url, listing, "--watch",
                             "-o", "json",
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=llmgw_env())
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())[key] == name
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        assert not ready, proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    refused = ctl(server.url, listing, "--watch", "-o", "yaml")
    assert refused.returncode == 2 and "--watch prints a table" in refused.stderr


def test_a_listing_row_stays_one_line_at_a_terminal(fleet: tuple[Server, dict], tmp_path: Path) -> None:
    """At an 80-column terminal a long NOTE ends in … instead of wrapping the row; -o wide keeps it whole."""
    server, _ = fleet

    def at_terminal(*args: str) -> list[str]:
        main, child = pty.openpty()
        env = {**llmgw_env(), "COLUMNS": "80", "LINES": "40"}
        proc = subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "--server", server.url, *args], stdin=child,
                                stdout=child, stderr=child, env=env, close_fds=True)
        os.close(child)
        out = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        proc.wait(timeout=10)
        os.close(main)
        return out.decode().replace("\r", "").splitlines()

    # A port left in INIT: gpu-01's NOTE names it, past the 80th column.
    node_dir = server.tmp / "gpu-01"
    assert run_llmgw("sim", "node", "set-port", str(node_dir), "mlx5_1", "1", "init").returncode == 0
    wait_until(lambda: "INIT" in ok(server, "nodes", "-o", "wide"), "the INIT port in gpu-01's note")
    lines = at_terminal("nodes")
    assert lines and lines[0].startswith("NODE"), lines
    assert len(lines) == 2 and all(len(line) <= 80 for line in lines), lines
    # -o wide cuts nothing: the note is there whole, the terminal wrapping the long line.
    wide = "".join(at_terminal("nodes", "-o", "wide"))
    assert "ports not ACTIVE: mlx5_1/1 INIT" in wide and "ADDRESS" in wide, wide
