"""`llmgw ctl fabric-test A B` end to end: a real server, two real agents on simulated nodes whose
stand-in ib_write_bw really pair over TCP, the real CLI.

Every rail is reported, the slow one (a `sim node --bandwidth` adapter on B only, so it shows
only when B's server side and A's client side run on the right adapters and meet) is flagged, the
exit code follows the worst rail; an agent without the feature is refused at once; a viewer or an
API key cannot start a test.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import httpx

from tests.e2e.harness import (
    FAST_AGENT,
    FAST_FLEET,
    Proc,
    Server,
    bearer,
    make_sim_node,
    run_llmgw,
    start_agent,
    wait_until,
    writes,
)

NO_INSTALL = FAST_AGENT + "fabric_test:\n  install: false\n"


def ready(server: Server, *node_ids: str) -> bool:
    nodes = server.nodes()
    return all(n in nodes and nodes[n]["state"] == "ready" and nodes[n]["heartbeats"] >= 1 for n in node_ids)


def test_every_rail_is_graded_and_the_slow_one_flagged(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    a = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--ib-ports", "4")
    # B's third adapter moves 150 of its 400 Gb/s (crit), its second 330 (82 %: warn).
    b = make_sim_node(tmp_path, "gpu-02", server.fleet_url, FAST_AGENT, "--ib-ports", "4",
                      "--bandwidth", "mlx5_2=150", "--bandwidth", "mlx5_1=330")
    procs += [start_agent(tmp_path, "gpu-01", a), start_agent(tmp_path, "gpu-02", b)]
    wait_until(lambda: ready(server, "gpu-01", "gpu-02"), "both nodes ready with a heartbeat", procs=procs)

    result = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-01", "gpu-02", "--duration", "1",
                       "-o", "json",
                       timeout=120)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)  # a crit rail: Nagios critical
    report = json.loads(result.stdout)
    assert (report["a"], report["b"], report["status"], report["exit_code"]) == ("gpu-01", "gpu-02", "crit", 2)
    rails = report["rails"]
    assert [(r["a"], r["b"]) for r in rails] == [(f"mlx5_{i}:1", f"mlx5_{i}:1") for i in range(4)]  # rail to rail
    assert [r["status"] for r in rails] == ["ok", "warn", "crit", "ok"]
    assert [r["measured_gbps"] for r in rails] == [384.0, 330.0, 150.0, 384.0]  # 96 % of 400 where healthy
    assert all(r["expected_gbps"] == 400.0 for r in rails)
    assert rails[2]["ratio"] == 0.375 and "check the cable" in rails[2]["detail"]
    # Progress went to stderr as it happened, one line per rail.
    assert result.stderr.count("rail ") >= 8 and "testing 4 rails" in result.stderr, result.stderr

    table = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-01", "gpu-02", "--duration", "1",
                      env={"COLUMNS": "250"}, timeout=120)
    assert table.returncode == 2, table.stderr
    lines = [line for line in table.stdout.splitlines() if line.startswith("ib#")]
    assert len(lines) == 4, table.stdout
    assert "150 Gb/s" in lines[2] and "crit" in lines[2] and "38%" in lines[2]
    assert "warn" in lines[1] and "ok" in lines[0]
    # A Nagios plugin's first line (issue 46, item 4): verdict, rails by grade, each rail's Gb/s as perfdata.
    first = table.stdout.splitlines()[0]
    assert first.startswith("LLMGW FABRIC-TEST CRITICAL - gpu-01 → gpu-02: 4 rails: 1 crit, 1 warn, 0 unknown, 2 ok | "
                            "crit=1 warn=1 unknown=0 ok=2 ib_0_gbps="), first
    assert "ib_2_gbps=150 " in first + " ", first
    # The pair's last result on /metrics: its Nagios code and each rail's Gb/s (issue 46, item 8).
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'llmgw_fabric_test_status{a="gpu-01",b="gpu-02"} 2.0' in metrics, metrics[-3000:]
    assert re.search(r'llmgw_fabric_test_rail_gbps\{a="gpu-01",b="gpu-02",fabric="ib",rail="2"\} 150(\.0)?\n', metrics)
    quiet = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-01", "gpu-02", "--duration", "1", "--quiet",
                      timeout=120)
    status, *bad = quiet.stdout.splitlines()
    assert quiet.returncode == 2 and status.split(" | ")[0] == first.split(" | ")[0] and quiet.stderr == "", quiet
    assert [line.split()[:3] for line in bad] == [["WARN", "rail", "ib#1"], ["CRIT", "rail", "ib#2"]], bad

    # The same pair the other way round: the slow adapter is now on the client side, and still found.
    reverse = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-02", "gpu-01", "--duration", "0",
                        "-o", "json",
                        timeout=120)
    assert [r["status"] for r in json.loads(reverse.stdout)["rails"]] == ["ok", "warn", "crit", "ok"]


def test_all_ok_exits_0_and_roce_picks_its_gid_index(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    args = ("--ib-ports", "0", "--roce-ports", "2")
    procs += [start_agent(tmp_path, n, make_sim_node(tmp_path, n, server.fleet_url, FAST_AGENT, *args))
              for n in ("gpu-01", "gpu-02")]
    wait_until(lambda: ready(server, "gpu-01", "gpu-02"), "both nodes ready", procs=procs)
    result = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-01", "gpu-02", "--duration", "1",
                       "-o", "json",
                       timeout=120)
    assert result.returncode == 0, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert [(r["fabric"], r["status"], r["measured_gbps"]) for r in report["rails"]] == [("roce", "ok", 192.0)] * 2
    # Each agent chose the RoCE v2 GID with the IPv4 address (index 3 in the simulated table) and said so.
    assert "mlx5_0/1: RoCE v2 GID index 3" in report["rails"][0]["notes"]
    assert "RoCE v2 GID index 3" in result.stderr


def test_refused_at_once_without_the_feature_and_behind_the_operator_door(tmp_path: Path, procs: list[Proc]) -> None:
    viewer, operator, key = "viewer-8d1f", "operator-77ac", "sk-client-19e0"
    digest = lambda s: "sha256:" + hashlib.sha256(s.encode()).hexdigest()  # noqa: E731
    credentials = (f'gateway:\n  api_keys: ["{digest(key)}"]\napi:\n  viewer_tokens: ["{digest(viewer)}"]\n'
                   f'  operator_tokens: ["{digest(operator)}"]\n')
    server = Server(tmp_path, FAST_FLEET + credentials, token=viewer)
    procs.append(server.start())
    good = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--ib-ports", "2")
    old = make_sim_node(tmp_path, "gpu-02", server.fleet_url, NO_INSTALL, "--ib-ports", "2")
    (tmp_path / "gpu-02" / "bin" / "ib_write_bw").unlink()  # no perftest, and not allowed to install it
    procs += [start_agent(tmp_path, "gpu-01", good), start_agent(tmp_path, "gpu-02", old)]
    wait_until(lambda: ready(server, "gpu-01", "gpu-02"), "both nodes ready", procs=procs)
    assert "fabric-test" in server.get("/api/v1/nodes/gpu-01")["features"]
    assert "fabric-test" not in server.get("/api/v1/nodes/gpu-02")["features"]

    started = time.monotonic()
    result = run_llmgw("ctl", "--server", server.url, "--token", operator, "fabric-test", "gpu-01", "gpu-02")
    took = time.monotonic() - started
    assert result.returncode == 3, (result.stdout, result.stderr)  # could not run: Nagios unknown
    [line] = result.stderr.strip().splitlines()
    assert "the agent on gpu-02" in line and "does not run fabric tests" in line, line
    [status] = result.stdout.splitlines()
    assert status.startswith("LLMGW FABRIC-TEST UNKNOWN - fabric test gpu-01 → gpu-02 could not run:"), status
    assert took < 20, took  # refused, not timed out (the rail timeout is 60 s)
    assert "ib_write_bw" not in procs[1].log()  # gpu-01 was never asked to start anything

    # An unknown node, and one that is not connected: refused, with the reason.
    missing = run_llmgw("ctl", "--server", server.url, "--token", operator, "fabric-test", "gpu-01", "gpu-09")
    assert missing.returncode == 3 and "no node 'gpu-09'" in missing.stderr
    same = run_llmgw("ctl", "--server", server.url, "--token", operator, "fabric-test", "gpu-01", "gpu-01")
    assert same.returncode == 3 and "two different nodes" in same.stderr, (same.returncode, same.stderr)
    procs[2].stop()
    wait_until(lambda: server.nodes()["gpu-02"]["state"] != "ready", "gpu-02 to go", procs=procs[:2])
    gone = run_llmgw("ctl", "--server", server.url, "--token", operator, "fabric-test", "gpu-01", "gpu-02")
    assert gone.returncode == 3 and "node gpu-02 is not connected" in gone.stderr, gone.stderr

    # Only an operator starts a test: a viewer reads, an API key reaches /v1 only.
    body = {"a": "gpu-01", "b": "gpu-02"}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        r = http.post("/api/v1/fabric-tests", json=body, headers=bearer(viewer))
        assert r.status_code == 403 and "may read the fleet but not change it" in r.json()["error"]["message"]
        for headers in (bearer(key), {}):
            assert http.post("/api/v1/fabric-tests", json=body, headers=headers).status_code == 401
        bad = http.post("/api/v1/fabric-tests", content=b"[1]", headers=writes(operator))
        assert bad.status_code == 400 and "fabric test request" in bad.json()["error"]["message"]
        for field, value in (("timeout", -1), ("timeout", 1e9), ("size", 0), ("size", -5), ("iterations", 0)):
            wild = http.post("/api/v1/fabric-tests", json={**body, field: value}, headers=writes(operator))
            assert wild.status_code == 400 and field in wild.json()["error"]["message"], (field, value, wild.text)
    viewer_ctl = run_llmgw("ctl", "--server", server.url, "--token", viewer, "fabric-test", "gpu-01", "gpu-02")
    # Refused is "could not run" (3), never a warning (1) to a Nagios check.
    assert viewer_ctl.returncode == 3 and "HTTP 403" in viewer_ctl.stderr


def test_a_hung_client_is_killed_at_the_rail_timeout_and_the_server_side_with_it(tmp_path: Path,
                                                                                 procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    a = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--ib-ports", "2")
    b = make_sim_node(tmp_path, "gpu-02", server.fleet_url, FAST_AGENT, "--ib-ports", "2")
    hung = tmp_path / "gpu-01" / "bin" / "ib_write_bw"
    marker = f"fabtest-hung-{tmp_path.name}"
    hung.write_text("#!/bin/sh\n# a perftest client that never finishes (a peer that never answers)\nsh -c 'sleep "
                    f"300' {marker} &\nwait\n")
    procs += [start_agent(tmp_path, "gpu-01", a), start_agent(tmp_path, "gpu-02", b)]
    wait_until(lambda: ready(server, "gpu-01", "gpu-02"), "both nodes ready", procs=procs)
    result = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-01", "gpu-02", "--rail-timeout", "2",
                       "-o", "json",
                       timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    rails = json.loads(result.stdout)["rails"]
    assert [r["status"] for r in rails] == ["crit", "crit"]
    assert all(r["detail"] == "gpu-01: ib_write_bw did not finish within 2s; killed" for r in rails), rails
    # Nothing is left running on either node: the client's group was killed, and B's server cancelled
    # (on its own it would run out its 2 + 10 s).
    def leftovers() -> list[str]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline or f"llmgw.sim.perftest {tmp_path}" in cmdline:
                found.append(cmdline)
        return found

    wait_until(lambda: not leftovers(), "no ib_write_bw left running", deadline=8, procs=procs)

    # Ctrl-C on the operator's terminal ends the test at once: the runs it started on both nodes too
    # (the rail timeout here is 60 s).
    import signal
    import subprocess
    import sys

    from tests.e2e.harness import llmgw_env

    with subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "--server", server.url, "fabric-test", "gpu-01",
                           "gpu-02"],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=llmgw_env()) as ctl:
        assert ctl.stderr is not None
        seen = ""
        while "rail 0 (ib)" not in seen:
            seen += ctl.stderr.readline() or "(eof)"
            assert "(eof)" not in seen, seen
        wait_until(lambda: len(leftovers()) >= 2, "both sides of rail 0 running", procs=procs)
        ctl.send_signal(signal.SIGINT)
        ctl.wait(timeout=30)
    wait_until(lambda: not leftovers(), "no ib_write_bw left after Ctrl-C", deadline=8, procs=procs)
    assert "Traceback" not in procs[0].log(), procs[0].log()[-3000:]


def test_an_agent_without_perftest_installs_it_the_first_time_and_says_so(tmp_path: Path, procs: list[Proc]) -> None:
    """The real agent, its PATH holding a stand-in apt-get (nothing is really installed): the stand-in
    ib_write_bw is the "package" it puts in place."""
    import os

    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    a = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--ib-ports", "1")
    os_release = tmp_path / "os-release"
    os_release.write_text('PRETTY_NAME="Ubuntu 22.04.4 LTS"\nID=ubuntu\nID_LIKE=debian\n')
    b = make_sim_node(tmp_path, "gpu-02", server.fleet_url, FAST_AGENT + f"fabric_test:\n  os_release: {os_release}\n",
                      "--ib-ports", "1")
    tool = tmp_path / "gpu-02" / "bin" / "ib_write_bw"
    package = tmp_path / "perftest.deb-contents"
    tool.rename(package)
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    apt = fake_bin / "apt-get"
    apt.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "apt-get.args"}\ncp -p {package} {tool}\n')
    apt.chmod(0o755)
    procs += [start_agent(tmp_path, "gpu-01", a),
              Proc("agent-gpu-02", ["agent", "--config", str(b), "--insecure"], tmp_path,
                   env={"PATH": f"{fake_bin}:{os.environ['PATH']}"})]
    wait_until(lambda: ready(server, "gpu-01", "gpu-02"), "both nodes ready", procs=procs)
    assert "fabric-test" in server.get("/api/v1/nodes/gpu-02")["features"]  # it can run one: it can install perftest

    # gpu-02 is the client side: its install happens before B's server starts (prepare), not while it waits.
    first = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-02", "gpu-01", "-o", "json", timeout=120)
    assert first.returncode == 0, (first.stdout, first.stderr)
    assert "gpu-02: ib_write_bw missing: installing perftest with apt-get" in first.stderr, first.stderr
    assert "gpu-02: installed perftest with apt-get (" in first.stderr
    assert (tmp_path / "apt-get.args").read_text().split() == ["install", "-y", "--no-install-recommends", "perftest"]
    report = json.loads(first.stdout)
    assert [r["status"] for r in report["rails"]] == ["ok"]
    # Not told how long: perftest's own 5 s (-D), so the row counts iterations and measures no peak.
    assert report["duration"] == 5 and report["rails"][0]["peak_gbps"] is None
    assert report["rails"][0]["duration"] >= 5
    assert report["notes"][0] == "gpu-02: ib_write_bw missing: installing perftest with apt-get"
    assert report["notes"][1].startswith("gpu-02: installed perftest with apt-get (")
    (tmp_path / "apt-get.args").unlink()
    again = run_llmgw("ctl", "--server", server.url, "fabric-test", "gpu-02", "gpu-01", timeout=120)
    assert again.returncode == 0 and "installing" not in again.stderr and not (tmp_path / "apt-get.args").exists()


def test_qdr_is_graded_after_8b10b_a_narrow_slot_is_the_reason_and_gpudirect_needs_gpus(
        tmp_path: Path, procs: list[Proc]) -> None:
    """Issue 39: what the link can carry. QDR nodes (sysfs "40 Gb/sec (4X QDR)", 32 of data after
    8b/10b) measure ~31 Gb/s and are ok, not warn; an EDR HCA trained at x8 gen3 (`sim node set-pcie`,
    read by the agent from sysfs device/current_link_*) is graded against the 57.6 Gb/s its slot
    moves, with that reason; --gpudirect runs --use_cuda where both nodes have GPUs and is refused
    at once where one has none."""
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    qdr = ("--ib-ports", "1", "--ib-rate", "40 Gb/sec (4X QDR)")
    edr = ("--ib-ports", "2", "--ib-rate", "100 Gb/sec (4X EDR)")
    configs = {"qdr-01": make_sim_node(tmp_path, "qdr-01", server.fleet_url, FAST_AGENT, *qdr),
               "qdr-02": make_sim_node(tmp_path, "qdr-02", server.fleet_url, FAST_AGENT, *qdr, "--gpus", "0"),
               "edr-01": make_sim_node(tmp_path, "edr-01", server.fleet_url, FAST_AGENT, *edr),
               "edr-02": make_sim_node(tmp_path, "edr-02", server.fleet_url, FAST_AGENT, *edr)}
    narrowed = run_llmgw("sim", "node", "set-pcie", str(tmp_path / "edr-02"), "mlx5_1", "--speed", "8", "--width", "8")
    assert narrowed.returncode == 0 and "PCIe gen3 x8 (max gen3 x16)" in narrowed.stdout, narrowed
    procs += [start_agent(tmp_path, n, c) for n, c in configs.items()]
    wait_until(lambda: ready(server, *configs), "four nodes ready", procs=procs)
    port = server.get("/api/v1/nodes/edr-02")["inventory"]["ports"][1]
    assert (port["pcie_speed_gts"], port["pcie_width"], port["pcie_max_width"]) == (8.0, 8, 16), port

    result = run_llmgw("ctl", "--server", server.url, "fabric-test", "qdr-01", "qdr-02", "--duration", "1",
                       "-o", "json",
                       timeout=120)
    assert result.returncode == 0, (result.stdout, result.stderr)
    [rail] = json.loads(result.stdout)["rails"]
    assert (rail["status"], rail["expected_gbps"], rail["measured_gbps"]) == ("ok", 32.0, 30.72), rail
    assert rail["peak_gbps"] is None  # a -D run measures no peak

    result = run_llmgw("ctl", "--server", server.url, "fabric-test", "edr-01", "edr-02", "--duration", "1",
                       "--gpudirect", "-o", "json", timeout=120)
    assert result.returncode == 0, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert report["gpudirect"] is True and report["duration"] == 1
    healthy, narrow = report["rails"]
    assert (healthy["expected_gbps"], healthy["measured_gbps"], healthy["detail"]) == (100.0, 96.0, "")
    assert (narrow["status"], narrow["expected_gbps"], narrow["measured_gbps"]) == ("ok", 57.6, 55.3), narrow
    assert narrow["limited_by"].startswith("PCIe gen3 x8 on B") and healthy["limited_by"] == ""
    assert narrow["detail"].startswith("limited by PCIe gen3 x8 on B (57.6 Gb/s of payload; the card "
                                       "can do gen3 x16"), narrow
    # mlx5_1 sits on the switch of GPU 4 (sim/pcitree.py: two adapters, one by each socket's first GPU)
    assert "GPUDirect: buffers in GPU 4 of edr-01 and GPU 4 of edr-02 (--use_cuda)" in narrow["notes"], narrow
    assert "GPUDirect: buffers in GPU 0 of edr-01 and GPU 0 of edr-02 (--use_cuda)" in healthy["notes"], healthy
    assert "buffers in GPU memory (GPUDirect RDMA)" in result.stderr
    table = run_llmgw("ctl", "--server", server.url, "fabric-test", "edr-01", "edr-02", "--duration", "1",
                      env={"COLUMNS": "300"}, timeout=120)
    assert table.returncode == 0 and "limited by PCIe gen3 x8 on B" in table.stdout, table.stdout

    refused = run_llmgw("ctl", "--server", server.url, "fabric-test", "qdr-01", "qdr-02", "--gpudirect")
    assert refused.returncode == 3, (refused.stdout, refused.stderr)
    assert ("--gpudirect: qdr-02 has no GPU" in refused.stderr
            and "run without --gpudirect" in refused.stderr), refused.stderr
    too_long = run_llmgw("ctl", "--server", server.url, "fabric-test", "qdr-01", "qdr-02", "--duration", "10",
                         "--rail-timeout", "12")
    assert too_long.returncode == 3 and "does not fit in the 12 s rail timeout" in too_long.stderr, too_long.stderr
