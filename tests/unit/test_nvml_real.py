"""Discovery, the health readings, the Xid watcher and `ctl doctor --local` against a real NVML
(issue 44). Every test here is marked `gpu`: skipped on a machine without one (tests/conftest.py),
run by tools/device-check.sh on the device machine, where a skip would hide a broken NVML and
LLMGW_GPU_TESTS=require turns it into a failure.

What the fake pynvml assumes (tests/unit/test_discovery.py) is asserted here against the real
thing: results of the same shapes (test_nvml_api's checks, on real values), links past a GPU's
last one raising NVMLError rather than anything else, an empty event set raising NVMLError on a
0 ms wait, str where the fake has str.
"""

from __future__ import annotations

import re

import pytest

from llmgw.agent import discovery
from llmgw.agent.nvml_events import XidWatch
from llmgw.catalog.schema import Discovery
from tests.unit.test_nvml_api import _check_value, code_uses, fake_names

pytestmark = pytest.mark.gpu

PCI_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
CFG = Discovery(gpus="nvml")


@pytest.fixture
def nv(monkeypatch):
    """The real pynvml, initialised by discovery's own session (a fresh one per test)."""
    monkeypatch.setattr(discovery, "_nvml", discovery._Nvml())
    module = discovery._nvml.start(retry=True)
    assert module is not None, f"NVML did not start: {discovery._nvml.reason}"
    return module


def test_discovery_lists_every_gpu_nvml_has(nv):
    inv = discovery.discover(CFG)
    assert inv.gpu_source == "nvml", inv.gpu_note
    assert len(inv.gpus) == int(nv.nvmlDeviceGetCount()) > 0
    assert re.match(r"^\d+\.\d+", inv.gpu_driver), inv.gpu_driver
    indices = [g.index for g in inv.gpus]
    for gpu in inv.gpus:
        assert gpu.health == "ok", gpu
        assert gpu.uuid.startswith("GPU-"), gpu.uuid
        assert gpu.name.startswith("NVIDIA") and not gpu.name.startswith("b'"), gpu.name
        assert gpu.memory_mib > 1024, gpu
        assert PCI_BUS_ID.match(gpu.pci_bus_id), gpu.pci_bus_id
        for peer, links in gpu.nvlink.items():
            assert peer in indices and peer != gpu.index and links > 0, gpu.nvlink
    matrix = {g.index: g.nvlink for g in inv.gpus}
    for a, row in matrix.items():
        for b, links in row.items():
            assert matrix[b].get(a) == links, f"NVLink matrix not symmetric: {matrix}"


def test_health_readings_are_plausible(nv):
    inventory = {g.index: g for g in discovery.discover(CFG).gpus}
    health = discovery.read_gpu_health(CFG)
    assert [h.index for h in health] == sorted(inventory)
    for h in health:
        assert h.health == "ok", h
        assert 0 < h.temperature_c < 120, h
        assert 0 <= h.utilization_pct <= 100, h
        assert 0 <= h.memory_used_mib <= inventory[h.index].memory_mib, h
        assert h.ecc_uncorrected is None or h.ecc_uncorrected >= 0, h
        assert h.nvlink_down is None or 0 <= h.nvlink_down <= int(nv.NVML_NVLINK_MAX_LINKS), h
        assert h.xid is None or h.xid >= 0, h


# What must answer on any NVIDIA GPU; everything else may raise NVMLError (NotSupported), which
# the code catches.
MUST_ANSWER = {"nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
               "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPciInfo", "nvmlSystemGetDriverVersion",
               "nvmlDeviceGetIndex", "nvmlDeviceGetTemperature", "nvmlDeviceGetUtilizationRates"}


def test_real_results_have_the_shapes_the_fake_gives(nv):
    fake = fake_names()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    real_args = {
        "nvmlDeviceGetHandleByIndex": (0,),
        "nvmlDeviceGetTemperature": (handle, nv.NVML_TEMPERATURE_GPU),
        "nvmlDeviceGetTotalEccErrors": (handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
    }
    for name, counts in sorted(code_uses().items()):
        if name not in fake or not callable(fake[name]) or isinstance(fake[name], type) or not counts:
            continue
        if name in ("nvmlInit", "nvmlEventSetWait", "nvmlDeviceRegisterEvents", "nvmlEventSetCreate"):
            continue  # started by the fixture; the event set has its own test
        count = max(counts)
        args = real_args.get(name, (handle, 0)[:count])
        try:
            real = getattr(nv, name)(*args)
        except nv.NVMLError as exc:
            assert name not in MUST_ANSWER, f"{name}: {type(exc).__name__}: {exc}"
            continue
        fake_args = (0, 0, 0)[:count]
        try:
            expected = fake[name](*fake_args)
        except Exception:
            continue  # the fake raises for this argument (no link 0 on GPU 0): nothing to compare
        _check_value(name, expected, real)


def test_links_nvml_cannot_report_raise_nvml_errors(nv):
    """The fake raises NVMLError for links past a GPU's last; the code catches only that."""
    enabled = nv.NVML_FEATURE_ENABLED
    for index in range(int(nv.nvmlDeviceGetCount())):
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
            try:
                state = nv.nvmlDeviceGetNvLinkState(handle, link)
            except nv.NVMLError:
                continue
            assert state in (enabled, getattr(nv, "NVML_FEATURE_DISABLED", 0)), (index, link, state)
            if state != enabled:
                continue
            for call in (nv.nvmlDeviceGetNvLinkRemotePciInfo, nv.nvmlDeviceGetNvLinkRemoteDeviceType):
                try:
                    call(handle, link)
                except nv.NVMLError:
                    pass


def test_xid_watch_starts_or_says_why(nv):
    watch = XidWatch()
    found = watch.poll(nv)
    if found is None:
        assert watch.unavailable, "no Xid events and no reason given"
        return
    assert all(isinstance(xid, int) for xid in found.values())
    with pytest.raises(nv.NVMLError):  # the fake's "nothing waiting": NVMLError_Timeout here
        for _ in range(1000):
            nv.nvmlEventSetWait(watch.event_set, 0)


def test_doctor_local_on_this_machine(nv):
    from llmgw.cli.doctor import _local_report

    data = _local_report(None, None, None, 0.0)
    by_check = {f["check"]: f for f in data["findings"]}
    assert by_check["nvml"]["status"] == "ok", by_check["nvml"]
    assert "NVML reachable" in by_check["nvml"]["finding"]
    for check in ("gpu-health", "nvlink"):
        for f in data["findings"]:
            if f["check"] == check:
                assert "not reachable" not in f["finding"] and "no heartbeat" not in f["finding"], f


def test_versions_doctor_compares_have_nvidia_smis_shapes(nv):
    """Issue 39: the CUDA version as nvidia-smi prints it ("CUDA Version: 13.0") and each GPU's
    VBIOS as `nvidia-smi -q` does ("96.00.A5.00.1A" on the H200 of tests/fixtures/real)."""
    inv = discovery.discover(CFG)
    assert re.fullmatch(r"\d+\.\d", inv.cuda_driver), inv.cuda_driver
    for gpu in inv.gpus:
        assert re.fullmatch(r"[0-9A-Fa-f]{2}(\.[0-9A-Fa-f]{2}){4}", gpu.vbios), gpu.vbios
