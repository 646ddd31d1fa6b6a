"""tools/device-check.sh and tools/device_probe.py (issue 44) where there is no GPU: the script
says so in one line and exits 0, and the probe reports what discovery found, faked or absent."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from llmgw.agent import discovery
from llmgw.agent.nvml_events import XidWatch
from tests.unit.test_discovery import doctor_nvml

ROOT = Path(__file__).resolve().parents[2]


def _has_gpu() -> bool:
    """What the script looks at (its has_gpu)."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return any(line.startswith("GPU ") for line in listed.stdout.splitlines())


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the script would run the whole check")
def test_without_a_gpu_the_script_says_so_in_one_line_and_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_DEVICE_CHECK_REHEARSE"}
    env["OUT"] = str(tmp_path)
    done = subprocess.run(["bash", str(ROOT / "tools" / "device-check.sh")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done
    assert done.stderr == ""
    [line] = done.stdout.splitlines()
    assert line.startswith("device-check: no NVIDIA GPU on this machine") and "docs/device-check.md" in line
    assert list(tmp_path.iterdir()) == []  # nothing installed, nothing written


def test_the_scripts_parse():
    for name in ("device-check.sh", "device-carry.sh"):
        path = ROOT / "tools" / name
        assert os.access(path, os.X_OK), f"{name} is not executable"
        subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)


# ---- the probe ------------------------------------------------------------------------------------


def _probe_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_probe", ROOT / "tools" / "device_probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(discovery, "_nvml", discovery._Nvml())
    monkeypatch.setattr(discovery, "_xids", XidWatch())
    monkeypatch.setattr(discovery, "_logged", set())


def test_probe_reports_the_fakes_gpus_links_and_xids(fresh, monkeypatch, tmp_path):
    nv = doctor_nvml([SimpleNamespace(device=1, eventData=79)])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    probe = _probe_module()
    out, status = probe.probe()
    assert status == 0
    assert out["gpu_source"] == "nvml" and out["driver"] == "550.54.15"
    assert [g["pci_bus_id"] for g in out["gpus"]] == ["00000000:18:00.0", "00000000:2A:00.0"]
    assert out["nvlink_matrix"] == {"0": {"1": 2}, "1": {"0": 1}}  # GPU 1's link 1 is down
    assert out["xid_watch"] == {"started": True, "unavailable": "", "last": {"1": 79}}
    assert [(h["ecc_uncorrected"], h["nvlink_down"]) for h in out["health"]] == [(3, 0), (0, 1)]
    links = out["nvml_raw"][0]["nvlink_links"]
    assert links["0"] == {"state": 1, "remote_pci": "00000000:2A:00.0", "remote_type": 0}
    assert links["2"]["state"] == {"error": "_FakeNvmlError: invalid argument"}
    assert out["nvml_raw"][0]["pcie"]["gen"] == 5  # the fake answers as the H200 of the nvidia-smi -q fixture
    assert out["nvml_raw"][0]["ecc"]["uncorrected_volatile"] == 3

    (tmp_path / "discovery.json").write_text(json.dumps(out))
    (tmp_path / "doctor.json").write_text(json.dumps({
        "status": "warn", "exit_code": 1, "summary": {"ok": 9, "warn": 1, "crit": 0, "unknown": 0},
        "findings": [{"check": "memlock", "status": "warn", "finding": "memlock 64 KiB"}]}))
    (tmp_path / "pytest.txt").write_text("...\n===== 60 passed in 3.2s =====\n")
    gpus, doctor, tests = probe.summary(tmp_path)
    assert gpus.startswith("discovery: 2 GPU(s) from NVML: NVIDIA H100 80GB HBM3 (81559 MiB); driver 550.54.15")
    assert "NVLink: 0->1:2; 1->0:1" in gpus and "Xid watcher: started, last Xids {'1': 79}" in gpus
    assert doctor == "doctor --local: WARN (exit 1): ok 9, warn 1, crit 0, unknown 0\n  memlock warn: memlock 64 KiB"
    assert tests == "pytest: 60 passed in 3.2s"


def test_probe_without_nvml_says_why(fresh, monkeypatch, tmp_path):
    def missing():
        raise nv.NVMLError_LibraryNotFound()

    nv = doctor_nvml([])
    nv.nvmlInit = missing
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    probe = _probe_module()
    out, status = probe.probe()
    assert status == 1
    assert (out["gpu_source"], out["gpus"], out["nvml_raw"]) == ("none", [], [])
    assert "libnvidia-ml.so.1 not found" in out["gpu_note"]
    (tmp_path / "discovery.json").write_text(json.dumps(out))
    gpus, doctor, tests = probe.summary(tmp_path)
    assert gpus.startswith("discovery: no GPUs from NVML (libnvidia-ml.so.1 not found")
    assert doctor.startswith("doctor --local: no report (doctor.json:") and tests == "pytest: no output"


def test_every_nvml_call_of_the_probe_is_in_the_real_module():
    """The probe asks NVML for more than the agent keeps (PCIe, ECC mode, versions): a name
    nvidia-ml-py lacks would only show on the device, as an error in the JSON."""
    import ast
    import inspect

    pynvml = pytest.importorskip("pynvml")
    tree = ast.parse((ROOT / "tools" / "device_probe.py").read_text(encoding="utf-8"))
    calls = [(node.args[1].value, len(node.args) - 2) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_ask"
             and isinstance(node.args[1], ast.Constant)]
    names = {name for name, _ in calls}
    assert {"nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetEccMode", "nvmlSystemGetNVMLVersion",
            "nvmlDeviceGetTotalEccErrors"} <= names
    for name, count in calls:
        fn = getattr(pynvml, name, None)
        assert fn is not None, f"{name} is not in nvidia-ml-py"
        inspect.signature(fn).bind(*range(count))
