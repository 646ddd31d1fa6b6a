"""`llmgw sim node` as a real subprocess, then the agent's real discovery on what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.agent import discovery
from llmgw.catalog.load import load_agent_config

pytestmark = pytest.mark.e2e


def llmgw(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("LLMGW_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=60, env=env
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(autouse=True)
def fresh_discovery_state(monkeypatch):
    monkeypatch.setattr(discovery, "_sim_cache", {})
    monkeypatch.setattr(discovery, "_logged", set())


def test_round_trip_ports_and_gpus(tmp_path):
    node_dir = tmp_path / "node-7"
    proc = llmgw(
        "sim", "node", "--dir", str(node_dir),
        "--gpus", "4", "--gpu-name", "NVIDIA A100-SXM4-80GB", "--gpu-memory-mib", "81920",
        "--nvlink", "nv12", "--ib-ports", "2", "--ib-rate", "200 Gb/sec (4X HDR)",
        "--roce-ports", "1", "--degraded", "1", "--server", "https://127.0.0.1:8443", "-o", "json",
    )  # fmt: skip
    written = json.loads(proc.stdout)
    assert written["node_id"] == "node-7"
    assert written["agent_config"] == str(node_dir / "agent.yaml")

    cfg = load_agent_config(str(node_dir / "agent.yaml"))
    assert cfg.node_id == "node-7"
    assert cfg.server == "https://127.0.0.1:8443"
    assert cfg.work_dir == str(node_dir / "work")
    inv = discovery.discover(cfg.discovery, cfg.server)

    assert inv.gpu_source == "sim"
    assert [g.index for g in inv.gpus] == [0, 1, 2, 3]
    for gpu in inv.gpus:
        assert gpu.name == "NVIDIA A100-SXM4-80GB"
        assert gpu.memory_mib == 81920
        assert gpu.nvlink == {p: 12 for p in range(4) if p != gpu.index}
        assert gpu.uuid.startswith("GPU-")
    assert len({g.uuid for g in inv.gpus}) == 4

    got = [
        (p.device, p.port, p.link_layer, p.rate_gbps, p.width, p.speed, p.netdev) for p in inv.ports
    ]
    assert got == [
        ("mlx5_0", 1, "InfiniBand", 200.0, "4X", "HDR", "ib0"),
        ("mlx5_1", 1, "InfiniBand", 50.0, "1X", "HDR", "ib1"),  # the degraded one
        ("mlx5_2", 1, "Ethernet", 200.0, "4X", "HDR", "eth0"),
    ]
    assert all(p.state == "ACTIVE" and p.phys_state == "LinkUp" for p in inv.ports)
    ib0 = inv.ports[0]
    assert ib0.lid == written["ports"][0]["lid"] > 0
    assert ib0.sm_lid == 1
    assert ib0.node_guid == written["ports"][0]["node_guid"]
    assert ib0.gid.startswith("fe80:0000:0000:0000:")
    assert inv.ports[2].lid == 0
    assert inv.mgmt_ip == "127.0.0.1"

    counters = discovery.read_port_counters(cfg.discovery)
    assert [c.symbol_error > 0 for c in counters] == [False, True, False]
    health = discovery.read_gpu_health(cfg.discovery)
    assert [h.index for h in health] == [0, 1, 2, 3]
    assert all(h.health == "ok" and h.temperature_c > 0 for h in health)


def test_refuses_to_overwrite_without_force_and_keeps_work_dir(tmp_path):
    node_dir = tmp_path / "n1"
    llmgw("sim", "node", "--dir", str(node_dir), "--gpus", "8")
    work = node_dir / "work"
    work.mkdir()
    (work / "state").write_text("keep me")
    before = (node_dir / "gpus.json").read_bytes()

    proc = llmgw("sim", "node", "--dir", str(node_dir), "--gpus", "2", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("llmgw: error: ")
    assert "--force" in proc.stderr
    assert (node_dir / "gpus.json").read_bytes() == before

    llmgw("sim", "node", "--dir", str(node_dir), "--gpus", "2", "--ib-ports", "1", "--force")
    cfg = load_agent_config(str(node_dir / "agent.yaml"))
    inv = discovery.discover(cfg.discovery)
    assert len(inv.gpus) == 2
    assert [p.device for p in inv.ports] == ["mlx5_0"]
    assert (work / "state").read_text() == "keep me"
    leftovers = [p.name for p in node_dir.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_same_node_id_same_identities_other_id_other_guids(tmp_path):
    a = json.loads(
        llmgw(
            "sim", "node", "--dir", str(tmp_path / "a"), "--node-id", "gpu-12", "-o", "json"
        ).stdout
    )
    b = json.loads(
        llmgw(
            "sim", "node", "--dir", str(tmp_path / "b"), "--node-id", "gpu-12", "-o", "json"
        ).stdout
    )
    c = json.loads(
        llmgw(
            "sim", "node", "--dir", str(tmp_path / "c"), "--node-id", "gpu-13", "-o", "json"
        ).stdout
    )
    ids = lambda r: [(p["node_guid"], p["lid"]) for p in r["ports"]]  # noqa: E731
    assert ids(a) == ids(b)
    assert not {g for g, _ in ids(a)} & {g for g, _ in ids(c)}
    assert not {lid for _, lid in ids(a)} & {lid for _, lid in ids(c)}
    assert (
        Path(tmp_path / "a" / "gpus.json").read_bytes()
        == Path(tmp_path / "b" / "gpus.json").read_bytes()
    )


def test_table_output_and_bad_flag(tmp_path):
    proc = llmgw("sim", "node", "--dir", str(tmp_path / "node-4"), "--degraded", "2")
    assert "wrote simulated node node-4" in proc.stdout
    assert proc.stdout.count("degraded") == 2
    bad = llmgw("sim", "node", "--dir", str(tmp_path / "x"), "--ib-rate", "fast", check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith("llmgw: error: --ib-rate 'fast'")
    assert not (tmp_path / "x").exists()


def test_nvml_absent_in_a_real_process():
    """discover(gpus="nvml") in a fresh interpreter, as the agent runs it: no GPU → none, no crash."""
    code = (
        "import msgspec\n"
        "from llmgw.agent.discovery import discover, read_gpu_health\n"
        "from llmgw.catalog.schema import Discovery\n"
        "cfg = Discovery(sysfs_root='/nonexistent', gpus='nvml')\n"
        "inv = discover(cfg)\n"
        "print(msgspec.json.encode({'source': inv.gpu_source, 'gpus': len(inv.gpus), 'health': "
        "len(read_gpu_health(cfg))}).decode())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert result == {"source": "none", "gpus": 0, "health": 0}
        assert proc.stderr.count("no GPUs from NVML") == 1
    else:
        assert result["source"] in ("nvml", "none")
