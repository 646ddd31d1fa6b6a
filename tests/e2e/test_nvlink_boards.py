"""NVLink as the agent reads it from NVML, end to end: the real agent and `ctl doctor` processes with
a stand-in `pynvml` (tests/e2e/fake_pynvml.py) first on their PYTHONPATH.

An H100 PCIe pair joined by three NVLink bridges has 12 of each GPU's 18 links up and 6 that were
never cabled; NVML reports those 6 inactive like a link that went down. The board reads healthy in
`ctl doctor --local` and through a running agent; a bridge pulled under the agent (links that were
up go inactive) is reported down.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import (
    FAST_AGENT,
    FAST_FLEET,
    Proc,
    Server,
    ctl,
    make_sim_node,
    run_llmgw,
    wait_until,
)

pytestmark = pytest.mark.e2e

BUSES = (0x18, 0x2A)


def bridged(pulled: range = range(0)) -> dict[str, Any]:
    """Each GPU: 12 links to the other (three bridges of 4), 6 uncabled; `pulled` links inactive
    with nothing at the far end (the bridge taken off)."""
    gpus = []
    for index, bus in enumerate(BUSES):
        peer = BUSES[1 - index]
        links = [["none", 0] if link in pulled else ["gpu", peer] for link in range(12)] + [["none", 0]] * 6
        gpus.append({"bus": bus, "links": links})
    return {"gpus": gpus}


def nvml_node(tmp_path: Path, node_id: str, server_url: str = "") -> tuple[Path, dict[str, str]]:
    """A simulated node whose agent reads its GPUs from (the stand-in) NVML; the env that puts it there."""
    fake = tmp_path / "fake-nvml"
    fake.mkdir()
    shutil.copy(Path(__file__).with_name("fake_pynvml.py"), fake / "pynvml.py")
    board = tmp_path / "board.json"
    board.write_text(json.dumps(bridged()))
    # The stand-in NVML's GPUs are bridged pairs: a board without NVSwitches (no NVSwitch PCI
    # devices and no fabric manager in the simulated tree).
    board_args = ("--gpus", "2", "--ib-ports", "0", "--nvlink", "pairs-nv12")
    if server_url:
        config = make_sim_node(tmp_path, node_id, server_url, FAST_AGENT, *board_args)
    else:
        result = run_llmgw("sim", "node", "--dir", str(tmp_path / node_id), "--node-id", node_id, *board_args)
        assert result.returncode == 0, result.stderr
        config = tmp_path / node_id / "agent.yaml"
    text = config.read_text()
    gpus_file = str(tmp_path / node_id / "gpus.json")
    assert gpus_file in text
    config.write_text(text.replace(gpus_file, "nvml"))
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH", "")) if p)
    return config, {"PYTHONPATH": path, "LLMGW_FAKE_NVML_BOARD": str(board)}


def findings(data: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {f["check"] + (":" + f["subject"] if f.get("subject") else ""): (f["status"], f["finding"])
            for f in data["findings"]}


def test_a_pcie_bridge_board_reads_healthy_in_doctor_local(tmp_path: Path) -> None:
    config, env = nvml_node(tmp_path, "h100-pcie")
    got = {}
    for check in ("nvml", "nvlink"):
        result = run_llmgw("ctl", "doctor", "--local", "--config", str(config), "--check", check, "--interval", "0",
                           "-o", "json", env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        got.update(findings(json.loads(result.stdout)))
    assert got == {"nvml": ("ok", "NVML reachable: 2 GPUs, driver 550.54.15"),
                   "nvlink": ("ok", "2 GPUs, all NVLinks up")}


def test_a_bridge_pulled_under_the_agent_is_links_down(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    config, env = nvml_node(tmp_path, "h100-pcie", server.fleet_url)
    procs.append(Proc("agent-h100-pcie", ["agent", "--config", str(config), "--insecure"], tmp_path, env=env))

    def doctor(code: int) -> dict[str, Any] | None:
        result = ctl(server.url, "doctor", "--node", "h100-pcie", "--check", "nvlink", "-o", "json")
        return json.loads(result.stdout) if result.returncode == code else None

    healthy = wait_until(lambda: doctor(0), "the bridged board healthy through the agent", procs=procs, deadline=60)
    assert findings(healthy) == {"nvlink": ("ok", "2 GPUs, all NVLinks up")}
    node = server.get("/api/v1/nodes/h100-pcie")
    assert [g["nvlink"] for g in node["inventory"]["gpus"]] == [{"1": 12}, {"0": 12}]

    (tmp_path / "board.json").write_text(json.dumps(bridged(pulled=range(8, 12))))
    down = wait_until(lambda: doctor(2), "the pulled bridge found", procs=procs, deadline=60)
    assert findings(down) == {"nvlink:GPU 0": ("crit", "GPU 0: 4 NVLink links down"),
                              "nvlink:GPU 1": ("crit", "GPU 1: 4 NVLink links down")}
