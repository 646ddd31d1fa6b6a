"""`llmgw demo` as `make demo` runs it: ready banner, the printed curl answers through the
gateway, every replica ready, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.e2e.harness import Load, free_port, llmgw_env, run_llmgw, wait_until


def processes_under(work: Path) -> list[int]:
    """Processes whose command line or working directory is in the demo's directory (the
    server and agents name their configs there; engines run with their cwd there)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if str(work) in cmdline or cwd.startswith(str(work)):
            out.append(int(proc.name))
    return out


def test_demo_ready_banner_curl_and_clean_ctrl_c(tmp_path: Path) -> None:
    port, fleet_port = free_port(), free_port()
    log = tmp_path / "demo.out"
    with open(log, "wb") as out:
        demo = subprocess.Popen([sys.executable, "-m", "llmgw", "demo", "--port", str(port),
                                 "--fleet-port", str(fleet_port)],
                                stdout=out, stderr=subprocess.STDOUT, env=llmgw_env(), start_new_session=True)
    try:
        wait_until(lambda: "Ready." in log.read_text() or demo.poll() is not None, "the ready banner", deadline=120)
        text = log.read_text()
        assert demo.poll() is None, text
        assert "✓ certificates" in text and text.count("✓ node") == 2 and "3 of 3 ready" in text
        # one model spans both nodes
        assert "llama-3.1-70b-instruct on gpu-0" in text and "(2-node replica)" in text, text
        # The printed replicas of every model with several are on different nodes (issue 18: the
        # second agent registered after the settle period and both went to gpu-01).
        printed = next(line for line in text.splitlines() if "✓ replicas:" in line)
        nodes_of: dict[str, list[str]] = {}
        for model, node in re.findall(r"([\w.-]+) on (gpu-\d+) GPUs", printed):
            nodes_of.setdefault(model, []).append(node)
        assert len(nodes_of.get("llama-3.1-8b-instruct", [])) == 2, printed
        for model, nodes in nodes_of.items():
            assert len(set(nodes)) == len(nodes), f"{model}: replicas share a node: {printed}"
        # One model's weights come by URL, slowly enough that the download was seen (issue 12).
        assert "↓ llama-3.1-70b-instruct: fetching its weights by URL" in text, text
        # The printed curl, as printed, goes through the gateway (the public port).
        curl = next(line.strip() for line in text.splitlines() if line.strip().startswith("curl "))
        args = shlex.split(curl)
        assert args[2].startswith(f"http://127.0.0.1:{port}/v1/")
        body = json.loads(args[args.index("-d") + 1])
        answer = httpx.post(args[2], json=body, timeout=30).json()
        assert answer["choices"][0]["message"]["content"]
        # The ctl commands it prints work as printed (path aside).
        ctl = next(line for line in text.splitlines() if "ctl --server" in line and line.rstrip().endswith("nodes"))
        server = re.search(r"--server (\S+)", ctl).group(1)  # type: ignore[union-attr]
        token = re.search(r"export LLMGW_TOKEN=(\S+)", text).group(1)  # type: ignore[union-attr]
        # Followed top to bottom, the token is exported before the first ctl line needs it.
        assert text.index("export LLMGW_TOKEN=") < text.index("ctl --server"), text
        refused = run_llmgw("ctl", "--server", server, "replicas", env={"LLMGW_TOKEN": ""})
        assert refused.returncode != 0  # the demo has credentials: without the token, refused
        as_operator = {"LLMGW_TOKEN": token}
        listed = run_llmgw("ctl", "--server", server, "replicas", "-o", "json", env=as_operator)
        assert {r["state"] for r in json.loads(listed.stdout)} == {"ready"}, listed.stderr
        small_nodes = [r["shards"][0]["node"] for r in json.loads(listed.stdout)
                       if r["model"] == "llama-3.1-8b-instruct"]
        assert sorted(small_nodes) == ["gpu-01", "gpu-02"], small_nodes
        # The demo has a simulated fabric, mapped; the printed fabric page serves it, and its
        # traffic moves (the counters' deltas between two readings: the page's particles).
        fabric_url = re.search(r"the fabric, live: (\S+)", text).group(1)  # type: ignore[union-attr]
        jar = {"llmgw_admin": token}
        assert httpx.get(fabric_url, cookies=jar, timeout=10).status_code == 200
        assert "✓ fabric 0x" in text and "6 switches, 8 adapters" in text, text

        def sent() -> int:
            ports = httpx.get(f"{fabric_url}/ports.json", cookies=jar, timeout=10).json()["ports"]
            return sum(p.get("xmit_bytes") or 0 for p in ports.values())

        first = sent()
        wait_until(lambda: sent() > first, "the simulated traffic to move the counters", deadline=30, interval=0.5)
        # The printed `ctl logs -f` works as printed: the engine's log streams.
        logs_line = next(line.strip() for line in text.splitlines() if " logs -f " in line)
        logs_args = shlex.split(logs_line)
        logs_args = logs_args[logs_args.index("ctl"):]
        with subprocess.Popen([sys.executable, "-m", "llmgw", *logs_args], stdout=subprocess.PIPE, text=True,
                              env=llmgw_env(as_operator)) as follow:
            assert follow.stdout is not None
            first: list[str] = []
            reader = threading.Thread(target=lambda: first.append(follow.stdout.readline()),  # type: ignore[union-attr]
                                      daemon=True)
            reader.start()
            reader.join(timeout=30)
            follow.send_signal(signal.SIGINT)
            assert first and first[0].startswith("=== llmgw: starting"), first  # the supervisor's first line
        # The printed `ctl drain` works as printed: the node ends up running nothing, the small
        # model's replica moved to the other node, the 2-node one said to be down; `uncordon` brings it back.
        drain_line = next(line.strip() for line in text.splitlines() if " drain " in line and "ctl --server" in line)
        drain_args = shlex.split(drain_line, comments=True)
        drained = run_llmgw(*drain_args[drain_args.index("ctl"):], env=as_operator, timeout=150)
        assert drained.returncode == 0, (drained.stdout, drained.stderr)
        assert "DOWN (--force): " in drained.stdout and "llama-3.1-70b-instruct" in drained.stdout, drained.stdout
        after = json.loads(run_llmgw("ctl", "--server", server, "replicas", "-o", "json", env=as_operator).stdout)
        small_nodes = [r["shards"][0]["node"] for r in after if r["model"] == "llama-3.1-8b-instruct"
                       and r["state"] == "ready"]
        assert small_nodes == ["gpu-01", "gpu-01"], after
        uncordon_line = next(line.strip() for line in text.splitlines() if " uncordon " in line)
        uncordon_args = shlex.split(uncordon_line)
        assert run_llmgw(*uncordon_args[uncordon_args.index("ctl"):], env=as_operator).returncode == 0

        def all_ready() -> bool:
            listed = json.loads(run_llmgw("ctl", "--server", server, "replicas", "-o", "json", env=as_operator).stdout)
            return len(listed) == 3 and all(r["state"] == "ready" for r in listed)

        wait_until(all_ready, "all three replicas ready again after uncordon", deadline=120)
        # Node certificates of a year: no "expires in 30 days" beside every node (issue 46, item 10).
        listed_nodes = json.loads(run_llmgw("ctl", "--server", server, "nodes", "-o", "json", env=as_operator).stdout)
        assert listed_nodes and all(n["cert_days_left"] > 300 for n in listed_nodes), listed_nodes
        # The printed `ctl fabric-test` measures every rail between the two nodes and grades it (issue 14).
        test_line = next(line.strip() for line in text.splitlines() if " fabric-test " in line)
        test_args = shlex.split(test_line)
        tested = run_llmgw(*test_args[test_args.index("ctl"):], env={**as_operator, "COLUMNS": "250"}, timeout=120)
        assert tested.returncode == 0, (tested.stdout, tested.stderr)
        rails = [line for line in tested.stdout.splitlines() if line.startswith("ib#")]
        assert len(rails) == 4 and all(" ok " in line for line in rails), tested.stdout
        assert tested.stdout.startswith("LLMGW FABRIC-TEST OK - gpu-01 → gpu-02: 4 rails: 0 crit, 0 warn, "
                                        "0 unknown, 4 ok"), tested.stdout
        work = Path(re.search(r"loopback, in (/\S+)", text).group(1))  # type: ignore[union-attr]
        # server, 2 agents, 4 engines (the 2-node replica: one per node), the file server
        assert len(processes_under(work)) >= 8
        # `ctl doctor` as a Nagios plugin against the demo (issues 14, 46): all ok, exit 0, the status line
        # alone; a port set to INIT makes it exit 2 with one line per problem, the port's among them.
        doctor_args = shlex.split(next(line for line in text.splitlines() if line.rstrip().endswith(" doctor")))
        doctor_args = doctor_args[doctor_args.index("ctl"):]  # as printed (path aside)
        printed = run_llmgw(*doctor_args, env=as_operator)
        assert printed.returncode == 0 and printed.stdout.startswith("LLMGW DOCTOR OK - 2 nodes"), printed.stdout
        quiet = run_llmgw(*doctor_args, "--quiet", env=as_operator)
        assert (quiet.returncode == 0
                and quiet.stdout.startswith("LLMGW DOCTOR OK - 2 nodes")), quiet.stdout + quiet.stderr
        assert len(quiet.stdout.splitlines()) == 1, quiet.stdout  # the status line alone
        node_dir = str(work / "nodes" / "gpu-01")
        assert run_llmgw("sim", "node", "set-port", node_dir, "mlx5_1", "1", "init").returncode == 0

        def doctor_exits_2() -> subprocess.CompletedProcess[str] | None:
            result = run_llmgw(*doctor_args, "--quiet", env=as_operator)
            return result if result.returncode == 2 else None

        status, *lines = wait_until(doctor_exits_2, "doctor to find the INIT port", deadline=60,
                                    interval=0.5).stdout.splitlines()
        assert status.startswith("LLMGW DOCTOR CRITICAL - "), status
        assert any(line.startswith("CRIT gpu-01 ports: mlx5_1/1 INIT") for line in lines), lines
        assert all(line.split()[0] in ("WARN", "CRIT") for line in lines), lines
        assert run_llmgw("sim", "node", "set-port", node_dir, "mlx5_1", "1", "up").returncode == 0
        xid_hint(text, work, server, as_operator)
    finally:
        os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C at the terminal does
        demo.wait(timeout=60)
    text = log.read_text()
    assert "stopped; nothing left running" in text
    assert demo.returncode == 0, text[-2000:]
    wait_until(lambda: not processes_under(work), "no demo process left", deadline=10)
    # A clean stop leaves the logs the banner pointed at, and says where; nothing else (keys, state).
    assert sorted(p.name for p in work.iterdir()) == ["logs"] and (work / "logs" / "server.log").stat().st_size > 0
    assert f"logs kept in {work / 'logs'}" in text
    shutil.rmtree(work)


def xid_hint(text: str, work: Path, server: str, as_operator: dict[str, str]) -> None:
    """The printed `sim node set-gpu … --xid 79` (issue 43): the replica on that GPU moves to a
    healthy one with no failed request, and the events say why. The drain above moved replicas,
    so the hint's command runs on where a small model's replica is now."""
    line = next(line.strip() for line in text.splitlines() if " set-gpu " in line and "--xid 79" in line)
    assert "sim node set-gpu " in line, line
    listed = json.loads(run_llmgw("ctl", "--server", server, "replicas", "-o", "json", env=as_operator).stdout)
    target = next(r for r in listed if r["model"] == "llama-3.1-8b-instruct" and r["state"] == "ready")
    node, gpu = target["shards"][0]["node"], target["shards"][0]["gpus"][0]
    with Load(server, "llama-3.1-8b-instruct", threads=2) as load:
        assert run_llmgw("sim", "node", "set-gpu", str(work / "nodes" / node), str(gpu), "--xid", "79").returncode == 0

        def moved() -> bool:
            now = json.loads(run_llmgw("ctl", "--server", server, "replicas", "-o", "json", env=as_operator).stdout)
            small = [r for r in now if r["model"] == "llama-3.1-8b-instruct"]
            return target["id"] not in {r["id"] for r in small} and len(small) == 2 and all(
                r["state"] == "ready" for r in small)

        wait_until(moved, "the replica on the faulty GPU replaced", deadline=120, interval=0.5)
    assert load.failures == [], load.failures[:5]
    events = run_llmgw("ctl", "--server", server, "events", "-o", "json", env=as_operator).stdout
    assert f"node {node} cordoned automatically: gpu {gpu} Xid 79" in events, events[-3000:]


def test_demo_port_in_use_is_one_clear_line() -> None:
    import socket

    from tests.e2e.harness import run_llmgw

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = run_llmgw("demo", "--port", str(port), "--fleet-port", str(free_port()))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "--port" in lines[0], result.stderr
