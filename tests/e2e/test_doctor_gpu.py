"""Issue 39's GPU board checks end to end: a real server, a real agent on a simulated node, faults
injected at runtime with `llmgw sim node set-gpu`, `set-fabric-manager`, `set-pcie` (read at
registration: the agent restarts) and nvidia_peermem unloaded from the fake sysfs (what the agent then reads through
its real NVML-stand-in and sysfs path), and the real `ctl doctor -o json` naming each one with the
exit code cron and Nagios read: warnings alone exit 1, a critical one 2, all well again 0.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    make_sim_node,
    run_llmgw,
    start_agent,
    wait_until,
)
from tests.e2e.test_doctor import doctor, problems
from tests.e2e.test_nvlink_boards import nvml_node

pytestmark = pytest.mark.e2e

BOARD_CHECKS = {"row-remap", "clocks", "temperature", "pcie", "gpu-modes", "fabric-manager", "gpudirect"}


def test_doctor_names_each_injected_gpu_and_hca_fault(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, "", "--gpus", "4", "--ib-ports", "1")
    agent = start_agent(tmp_path, "gpu-01", config)
    procs.append(agent)
    node = str(config.parent)

    def wait_for(code: int, expected: set[tuple[str, str, str, str]], what: str) -> dict:
        def check() -> dict | None:
            rc, data = doctor(server, "--node", "gpu-01")
            return data if rc == code and set(problems(data)) == expected else None

        return wait_until(check, what, procs=procs, deadline=60, interval=0.3)

    healthy = wait_for(0, set(), "the healthy node")
    assert {f["check"] for f in healthy["findings"]} >= BOARD_CHECKS
    pcie_ok = next(f for f in healthy["findings"] if f["check"] == "pcie")
    assert pcie_ok["finding"].startswith("4 GPUs and 1 HCAs at their full PCIe width"), pcie_ok
    fm_ok = next(f for f in healthy["findings"] if f["check"] == "fabric-manager")
    assert fm_ok["finding"] == "4 NVSwitches, nv-fabricmanager running; 4 GPUs: NVSwitch fabric set up", fm_ok

    def restart(old: Proc, change: Callable[[], None]) -> Proc:
        old.stop()
        procs.remove(old)  # stopped on purpose: the harness's liveness watch is for the others
        change()
        new = start_agent(tmp_path, "gpu-01", config)
        procs.append(new)
        return new

    def sim(*args: str) -> None:
        result = run_llmgw("sim", "node", *args)
        assert result.returncode == 0, result.stderr

    # Warnings only: a thermal slowdown, a GPU and an HCA trained at x8, persistence off, a
    # pending ECC change.
    sim("set-gpu", node, "1", "--throttle", "hw_thermal", "--throttle", "hw_slowdown")
    sim("set-gpu", node, "2", "--pcie-width", "8")
    # An HCA's PCIe link is read when the agent registers: retrain it and restart the agent.
    agent = restart(agent, lambda: sim("set-pcie", node, "mlx5_0", "--speed", "16", "--width", "8"))
    sim("set-gpu", node, "0", "--no-persistence", "--ecc-pending", "off")
    peermem = config.parent / "sys" / "module" / "nvidia_peermem"
    shutil.rmtree(peermem)  # `rmmod nvidia_peermem`, as the agent's next heartbeat sees it
    warned = wait_for(1, {("gpu-01", "clocks", "warn", "GPU 1"), ("gpu-01", "pcie", "warn", "GPU 2"),
                          ("gpu-01", "pcie", "warn", "mlx5_0"), ("gpu-01", "gpu-modes", "warn", "GPU 0"),
                          ("gpu-01", "gpudirect", "warn", "")}, "the warnings named")
    modes = [f["finding"] for f in warned["findings"] if f["check"] == "gpu-modes"]
    assert len(modes) == 2 and "persistence mode off" in modes[0] and "ECC mode changes from on to off" in modes[1]
    said = {(f["check"], f.get("subject", "")): f for f in warned["findings"] if f["status"] != "ok"}
    assert said[("clocks", "GPU 1")]["finding"] == "GPU 1: clocks held down: HW thermal slowdown"
    assert "x8 of x16 lanes" in said[("pcie", "GPU 2")]["finding"]
    assert said[("pcie", "mlx5_0")]["finding"].startswith(
        "mlx5_0: PCIe gen4 x8, the card allows gen5 x16; it carries"), said
    assert all(f["action"] for f in said.values())

    # Critical: a pending row remap, a card at its shutdown temperature, an Xid of a current driver
    # (140: unrecovered ECC), an NVSwitch fabric the fabric manager has not set up, and the fabric
    # manager's process gone from the NVSwitch board.
    sim("set-gpu", node, "3", "--remap-pending", "--temperature", "91", "--xid", "140", "--fabric-state", "not_started")
    sim("set-fabric-manager", node, "stopped")
    crit = wait_for(2, set(problems(warned)) | {("gpu-01", "row-remap", "crit", "GPU 3"),
                                                 ("gpu-01", "temperature", "crit", "GPU 3"),
                                                 ("gpu-01", "gpu-health", "crit", "GPU 3"),
                                                 ("gpu-01", "fabric-manager", "crit", ""),
                                                 ("gpu-01", "fabric-manager", "crit", "GPU 3")},
                    "the critical faults named")
    fm = next(f for f in crit["findings"] if f["check"] == "fabric-manager" and not f.get("subject"))
    assert ("4 NVSwitches and no nv-fabricmanager process" in fm["finding"]
            and "nvidia-fabricmanager" in fm["action"]), fm
    xid = next(f for f in crit["findings"] if f["check"] == "gpu-health")
    assert (xid["finding"] == "GPU 3: Xid 140 (unrecovered ECC error, the driver could not offline or "
            "remap the page)"), xid
    remap = next(f for f in crit["findings"] if f["check"] == "row-remap")
    assert "nvidia-smi -r -i 3" in remap["action"], remap

    # All well again: exit 0.
    sim("set-gpu", node, "1", "--throttle", "none")
    sim("set-gpu", node, "2", "--pcie-width", "16")
    sim("set-pcie", node, "mlx5_0", "--speed", "32", "--width", "16")
    sim("set-gpu", node, "0", "--persistence", "--ecc-pending", "on")
    sim("set-gpu", node, "3", "--no-remap-pending", "--temperature", "40", "--xid", "0", "--fabric-state", "completed")
    sim("set-fabric-manager", node, "running")
    peermem.mkdir()
    restart(agent, lambda: None)
    wait_for(0, set(), "the node healthy again")


def test_doctor_local_reads_the_board_from_nvml(tmp_path: Path) -> None:
    """`ctl doctor --local` on a node whose GPUs come from NVML (the stand-in pynvml, answering
    with the real H200's fields): healthy, then one GPU with a pending remap and an x8 link."""
    config, env = nvml_node(tmp_path, "h200")

    def local() -> tuple[int, dict]:
        result = run_llmgw("ctl", "doctor", "--local", "--config", str(config), "--interval", "0", "-o", "json",
                           env=env)
        return result.returncode, json.loads(result.stdout)

    rc, data = local()
    board = {f["check"]: (f["status"], f["finding"]) for f in data["findings"] if f["check"] in BOARD_CHECKS}
    assert rc == 0 and board["row-remap"] == ("ok", "2 GPUs: no pending or failed row remaps"), data
    assert board["pcie"] == ("ok", "2 GPUs at their full PCIe width; idle GPUs may run a lower speed to save power")
    assert board["gpu-modes"][0] == "ok" and board["clocks"][0] == "ok", board
    assert board["gpudirect"] == ("ok", "no GPUDirect RDMA expected (no RDMA adapters)")
    assert board["fabric-manager"][0] == "ok" and "no NVSwitch" in board["fabric-manager"][1], board
    described = json.loads(Path(env["LLMGW_FAKE_NVML_BOARD"]).read_text())
    described["gpus"][1]["board"] = {"remapped": [0, 1, 1, 0], "width": [8, 16], "reasons": 0x8 | 0x80}
    Path(env["LLMGW_FAKE_NVML_BOARD"]).write_text(json.dumps(described))
    rc, data = local()
    assert rc == 2 and sorted(problems(data)) == [("h200", "clocks", "warn", "GPU 1"),
                                                  ("h200", "pcie", "warn", "GPU 1"),
                                                  ("h200", "row-remap", "crit", "GPU 1")], problems(data)
