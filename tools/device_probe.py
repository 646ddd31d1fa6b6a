"""The agent's discovery, run once, as JSON: what `llmgw agent` would report of this machine's
GPUs (tools/device-check.sh runs it on the device machine, issue 44).

It calls what the agent calls (`discovery.discover`, `discovery.read_gpu_health`, whose first
call starts the Xid watcher) and adds raw NVML answers the agent does not keep, for comparing the
real thing with the fake pynvml of tests/unit/test_discovery.py: PCIe link generation and width,
ECC mode, and per NVLink link what NVML answered (the state, the far end's type and PCI address,
or the NVMLError it raised). Exit status: 0 when NVML listed GPUs, 1 when it did not (the JSON
says why), 2 when the probe itself broke.

    python tools/device_probe.py            # JSON on stdout
"""

from __future__ import annotations

import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return ""


def _ask(nv: Any, name: str, *args: Any) -> Any:
    """NVML's answer, or {"error": ...} (a missing function, an NVMLError): never raises."""
    fn = getattr(nv, name, None)
    if fn is None:
        return {"error": f"{name} is not in nvidia-ml-py {_version('nvidia-ml-py')}"}
    try:
        value = fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if isinstance(value, bytes):
        return {"bytes": value.decode(errors="replace")}  # the code expects str: a difference worth seeing
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return list(value)
    fields = getattr(value, "_fields_", None)
    if fields:
        return {f[0]: _plain(getattr(value, f[0])) for f in fields}
    if hasattr(value, "__dict__"):  # what the fake returns (tests/unit/test_device_check.py)
        return {k: _plain(v) for k, v in vars(value).items()}
    return repr(value)


def _plain(value: Any) -> Any:
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    if isinstance(value, bytes):
        return {"bytes": value.decode(errors="replace")}
    return repr(value)


def _field(answer: Any, name: str) -> Any:
    """One field of a struct NVML answered, or the answer itself (an error, say)."""
    return answer.get(name, answer) if isinstance(answer, dict) and "error" not in answer else answer


def raw_gpu(nv: Any, index: int) -> dict[str, Any]:
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        return {"index": index, "error": f"{type(exc).__name__}: {exc}"}
    links: dict[str, Any] = {}
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _ask(nv, "nvmlDeviceGetNvLinkState", handle, link)
        entry: dict[str, Any] = {"state": state}
        if state == getattr(nv, "NVML_FEATURE_ENABLED", 1):
            pci = _ask(nv, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            entry["remote_pci"] = _field(pci, "busId")
            entry["remote_type"] = _ask(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        links[str(link)] = entry
    return {
        "index": index,
        "uuid": _ask(nv, "nvmlDeviceGetUUID", handle),
        "name": _ask(nv, "nvmlDeviceGetName", handle),
        "pcie": {
            "bus_id": _field(_ask(nv, "nvmlDeviceGetPciInfo", handle), "busId"),
            "gen": _ask(nv, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
            "gen_max": _ask(nv, "nvmlDeviceGetMaxPcieLinkGeneration", handle),
            "width": _ask(nv, "nvmlDeviceGetCurrPcieLinkWidth", handle),
            "width_max": _ask(nv, "nvmlDeviceGetMaxPcieLinkWidth", handle),
        },
        "ecc": {
            "mode": _ask(nv, "nvmlDeviceGetEccMode", handle),  # [current, pending]; 1 is on
            "uncorrected_volatile": _ask(nv, "nvmlDeviceGetTotalEccErrors", handle,
                                         getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                                         getattr(nv, "NVML_VOLATILE_ECC", 0)),
        },
        # Issue 39's board readings as NVML answers them, raw: driver 580 prints the temperature
        # limits in T.Limit terms (`nvidia-smi -q`), so what the absolute thresholds and the
        # margin answer on a real H200 is worth recording.
        "board": {
            "remapped_rows": _ask(nv, "nvmlDeviceGetRemappedRows", handle),  # (corr, unc, pending, failure)
            "clocks_event_reasons": _ask(nv, "nvmlDeviceGetCurrentClocksEventReasons", handle),
            "temperature": _ask(nv, "nvmlDeviceGetTemperature", handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0)),
            "threshold_slowdown": _ask(nv, "nvmlDeviceGetTemperatureThreshold", handle,
                                       getattr(nv, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)),
            "threshold_shutdown": _ask(nv, "nvmlDeviceGetTemperatureThreshold", handle,
                                       getattr(nv, "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)),
            "threshold_gpu_max": _ask(nv, "nvmlDeviceGetTemperatureThreshold", handle,
                                      getattr(nv, "NVML_TEMPERATURE_THRESHOLD_GPU_MAX", 3)),
            "margin": _ask(nv, "nvmlDeviceGetMarginTemperature", handle),
            "persistence": _ask(nv, "nvmlDeviceGetPersistenceMode", handle),
        },
        "nvlink_links": links,
    }


def probe() -> tuple[dict[str, Any], int]:
    import msgspec

    from llmgw import __version__
    from llmgw.agent import discovery
    from llmgw.catalog.schema import Discovery

    cfg = Discovery(gpus="nvml")
    inventory = discovery.discover(cfg)
    health = discovery.read_gpu_health(cfg)
    nv = discovery._nvml.module
    xids = discovery._xids
    out: dict[str, Any] = {
        "llmgw": __version__,
        "python": platform.python_version(),
        "nvidia_ml_py": _version("nvidia-ml-py"),
        "gpu_source": inventory.gpu_source,
        "gpu_note": inventory.gpu_note,
        "driver": inventory.gpu_driver,
        "nvml_version": _ask(nv, "nvmlSystemGetNVMLVersion") if nv is not None else None,
        "cuda_driver_version": _ask(nv, "nvmlSystemGetCudaDriverVersion") if nv is not None else None,
        "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name, "memory_mib": g.memory_mib,
                  "pci_bus_id": g.pci_bus_id, "health": g.health} for g in inventory.gpus],
        "nvlink_matrix": {str(g.index): {str(p): n for p, n in g.nvlink.items()} for g in inventory.gpus},
        "health": msgspec.to_builtins(health),
        "xid_watch": {
            "started": xids.event_set is not None,
            "unavailable": xids.unavailable,
            "last": {str(i): xid for i, (xid, _) in xids.last.items()},
        },
        "nvml_raw": [raw_gpu(nv, g.index) for g in inventory.gpus] if nv is not None else [],
        "inventory": msgspec.to_builtins(inventory),
    }
    return out, 0 if inventory.gpu_source == "nvml" and inventory.gpus else 1


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {"error": f"{path.name}: {exc}"}


def _gpu_line(d: dict[str, Any]) -> str:
    gpus = d.get("gpus") or []
    if not gpus:
        return f"discovery: no GPUs from NVML ({d.get('gpu_note') or d.get('error') or 'no reason given'})"
    names = sorted({f"{g['name']} ({g['memory_mib']} MiB)" for g in gpus})
    raw = {r.get("index"): r for r in d.get("nvml_raw", [])}
    pcie = []
    for g in gpus:
        link = raw.get(g["index"], {}).get("pcie", {})
        pcie.append(f"{g['pci_bus_id']} gen {link.get('gen')}/{link.get('gen_max')} "
                    f"x{link.get('width')}/{link.get('width_max')}")
    matrix = d.get("nvlink_matrix") or {}
    nvlink = "; ".join(f"{a}->{b}:{n}" for a, row in matrix.items() for b, n in row.items()) or "no NVLink peers"
    ecc = [str(raw.get(g["index"], {}).get("ecc", {}).get("mode")) for g in gpus]
    health = d.get("health") or []
    xid = d.get("xid_watch") or {}
    xid_state = "started" if xid.get("started") else f"not started ({xid.get('unavailable') or 'never polled'})"
    return (f"discovery: {len(gpus)} GPU(s) from NVML: {', '.join(names)}; driver {d.get('driver')}, "
            f"NVML {d.get('nvml_version')}, CUDA {d.get('cuda_driver_version')}, nvidia-ml-py {d.get('nvidia_ml_py')}, "
            f"Python {d.get('python')}\n"
            f"  PCIe: {', '.join(pcie)}\n  NVLink: {nvlink}\n"
            f"  ECC mode [current, pending]: {', '.join(ecc)}; uncorrected (volatile): "
            f"{[h.get('ecc_uncorrected') for h in health]}; NVLink links down: "
            f"{[h.get('nvlink_down') for h in health]}\n"
            f"  Xid watcher: {xid_state}, last Xids {xid.get('last') or {}}")


def _doctor_line(d: dict[str, Any]) -> str:
    if "findings" not in d:
        return f"doctor --local: no report ({d.get('error') or 'no findings'})"
    s = d.get("summary", {})
    bad = [f"{f['check']} {f['status']}: {f['finding']}" for f in d["findings"] if f["status"] != "ok"]
    return (f"doctor --local: {str(d.get('status')).upper()} (exit {d.get('exit_code')}): ok {s.get('ok')}, "
            f"warn {s.get('warn')}, crit {s.get('crit')}, unknown {s.get('unknown')}"
            + "".join(f"\n  {line}" for line in bad))


def summary(directory: Path) -> list[str]:
    """What device-check.sh prints at its end, and what docs/device-check.md records."""
    try:
        lines = (directory / "pytest.txt").read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return [
        _gpu_line(_load(directory / "discovery.json")),
        _doctor_line(_load(directory / "doctor.json")),
        f"pytest: {lines[-1].strip('= ') if lines else 'no output'}",
    ]


def main() -> int:
    if sys.argv[1:2] == ["--summary"]:
        print("\n".join(summary(Path(sys.argv[2]))))
        return 0
    try:
        out, status = probe()
    except Exception as exc:  # what the agent would have survived, and this must report
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 2
    print(json.dumps(out, indent=2, sort_keys=False))
    return status


if __name__ == "__main__":
    sys.exit(main())
