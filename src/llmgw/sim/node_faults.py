"""What a simulated node reports for doctor's version, hw_counters and fabric-manager checks (issue
39), and the commands that change it under a running agent: `llmgw sim node set-versions`,
`set-counter` and `set-fabric-manager`.

The hw_counters names are those of real mlx5 ports: an InfiniBand ConnectX (prometheus/procfs's
fixture, tests/fixtures/real/sysfs/procfs-fixtures-hfi1-mlx4-mlx5.txt) and, on Ethernet, RoCE's
congestion counters as a ConnectX bond reports them (telegraf's infiniband README,
tests/fixtures/real/sysfs/telegraf-mlx5-bond-roce-hw-counters.txt), plus the two retry counters
Linux 6.11 added (req_transport_retries_exceeded, req_rnr_retries_exceeded).

Versions: the NVIDIA driver and CUDA go in gpus.json (read at each registration: restart the
agent after `set-versions`, as after a real driver upgrade), VBIOS per GPU there too; HCA
firmware in sys/class/infiniband/<dev>/fw_ver and MLNX_OFED's module version in
sys/module/mlx5_core/version, where the agent's discovery reads them.
"""

from __future__ import annotations

import os

import msgspec

from llmgw.agent import hostfacts
from llmgw.agent.discovery import SimGpuFile
from llmgw.errors import UsageError
from llmgw.fsutil import atomic_write

SIM_CUDA_VERSION = "12.4"  # what driver 550.54.15 (SIM_DRIVER_VERSION) supports
SIM_VBIOS = "96.00.A5.00.1A"  # the shape nvidia-smi -q prints (the H200 fixture's VBIOS)

HW_COUNTERS = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer", "out_of_sequence",
    "packet_seq_err", "req_cqe_error", "req_cqe_flush_error", "req_remote_access_errors",
    "req_remote_invalid_request", "req_rnr_retries_exceeded", "req_transport_retries_exceeded", "resp_cqe_error",
    "resp_cqe_flush_error", "resp_local_length_error", "resp_remote_access_errors", "rnr_nak_retry_err",
    "roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart", "roce_slow_restart_cnps",
    "roce_slow_restart_trans", "rx_atomic_requests", "rx_dct_connect", "rx_read_requests", "rx_write_requests",
)
ROCE_HW_COUNTERS = ("np_cnp_sent", "np_ecn_marked_roce_packets", "rp_cnp_handled", "rp_cnp_ignored",
                    "rx_icrc_encapsulated")
COUNTER_DIRS = ("counters", "counters_ext", "hw_counters")


def hw_counter_files(port_dir: str, roce: bool) -> dict[str, str]:
    """A fresh port's hw_counters/ (all zero; `lifespan` is the driver's cache time, 10 ms)."""
    names = sorted((*HW_COUNTERS, *ROCE_HW_COUNTERS) if roce else HW_COUNTERS)
    files = {f"{port_dir}/hw_counters/{name}": "0\n" for name in names}
    files[f"{port_dir}/hw_counters/lifespan"] = "10\n"
    return files


def _root(directory: str) -> str:
    root = os.path.abspath(directory)
    if not os.path.isfile(os.path.join(root, "gpus.json")):
        raise UsageError(f"no simulated node in {directory} (no gpus.json there)")
    return root


def _write(path: str, text: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, text.encode())
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def set_counter(directory: str, device: str, port: int, name: str, value: int) -> str:
    """Set one counter of a simulated port (counters/, counters_ext/ or hw_counters/, wherever the
    port has it); returns the file's path. The agent reads it on its next heartbeat."""
    port_dir = os.path.join(_root(directory), "sys", "class", "infiniband", device, "ports", str(port))
    if not os.path.isdir(port_dir):
        raise UsageError(f"no port {device}/{port} in the simulated node {directory}")
    for sub in COUNTER_DIRS:
        path = os.path.join(port_dir, sub, name)
        if os.path.isfile(path):
            _write(path, f"{value}\n")
            return path
    raise UsageError(f"{device}/{port} has no counter {name!r} in {', '.join(COUNTER_DIRS)}")


def set_versions(directory: str, *, driver: str | None = None, cuda: str | None = None, vbios: str | None = None,
                 hca_fw: str | None = None, ofed: str | None = None) -> dict[str, str]:
    """Change what the simulated node reports as its versions; returns what it reports now."""
    root = _root(directory)
    path = os.path.join(root, "gpus.json")
    try:
        with open(path, "rb") as fh:
            data = msgspec.json.decode(fh.read(), type=SimGpuFile)
    except (OSError, msgspec.DecodeError) as exc:
        raise UsageError(f"{path} is not a simulated GPU inventory ({exc})") from None
    if driver is not None:
        data.driver_version = driver
    if cuda is not None:
        data.cuda_version = cuda
    if vbios is not None:
        data.gpus = [msgspec.structs.replace(g, vbios=vbios) for g in data.gpus]
    _write(path, (msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n").decode())
    ib = os.path.join(root, "sys", "class", "infiniband")
    devices = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
    if hca_fw is not None:
        if not devices:
            raise UsageError(f"--hca-fw: the simulated node in {directory} has no HCA")
        for device in devices:
            _write(os.path.join(ib, device, "fw_ver"), hca_fw + "\n")
    module = os.path.join(root, "sys", "module", "mlx5_core", "version")
    if ofed is not None:
        if ofed:
            _write(module, ofed + "\n")
        elif os.path.exists(module):
            os.unlink(module)  # "": back to the in-box driver
    fw = sorted({_read(os.path.join(ib, d, "fw_ver")) for d in devices})
    return {"driver": data.driver_version, "cuda": data.cuda_version,
            "vbios": ", ".join(sorted({g.vbios for g in data.gpus})), "hca_fw": ", ".join(fw),
            "ofed": _read(module) or "(in-box)"}


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


# ---- NVSwitch boards: the switches on the PCI bus and the fabric manager's process ---------------

# An HGX H100 8-GPU baseboard carries four third-generation NVSwitches (NVIDIA's Fabric Manager
# user guide, "NVSwitch-Based Systems"); `lspci -Dnn` on one lists them as "0000:07:00.0 Bridge
# [0680]: NVIDIA Corporation GH100 [H100 NVSwitch] [10de:22a3]" through 0000:0a:00.0. The sysfs
# files print as the kernel's pci-sysfs.c does: vendor/device "0x%04x", class "0x%06x".
NVSWITCH_BUSES = (0x07, 0x08, 0x09, 0x0A)
NVSWITCH_DEVICE = "0x22a3"
# The process the nvidia-fabricmanager service runs (its unit's ExecStart), as /proc shows it:
# comm cut to 15 characters, cmdline NUL-separated. The pid is the one in a real `systemctl
# status nvidia-fabricmanager` ("Main PID: 2939 (nv-fabricmanager)").
FABRIC_MANAGER_PID = 2939
FABRIC_MANAGER_CMDLINE = "/usr/bin/nv-fabricmanager\0-c\0/usr/share/nvidia/nvswitch/fabricmanager.cfg\0"


def nvswitch_tree() -> tuple[dict[str, str], dict[str, str]]:
    """(files, symlinks) under the node's sys/: the NVSwitch PCI functions, and the fabric
    manager's /proc entry (sys/proc/, where agent/hostfacts.py looks on a simulated node)."""
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    for bus in NVSWITCH_BUSES:
        pci = f"0000:{bus:02x}:00.0"
        base = f"sys/devices/pci0000:00/{pci}"
        files.update({f"{base}/vendor": hostfacts.NVIDIA_VENDOR + "\n", f"{base}/device": NVSWITCH_DEVICE + "\n",
                      f"{base}/class": hostfacts.BRIDGE_OTHER_CLASS + "\n"})
        links[f"sys/bus/pci/devices/{pci}"] = f"../../../devices/pci0000:00/{pci}"
    init = f"sys/{hostfacts.SIM_PROC}/1"  # every /proc has PID 1 (the agent takes its absence for hidepid)
    files[f"{init}/comm"], files[f"{init}/cmdline"] = "systemd\n", "/sbin/init\0"
    proc = f"sys/{hostfacts.SIM_PROC}/{FABRIC_MANAGER_PID}"
    files[f"{proc}/comm"] = hostfacts.FABRIC_MANAGER[:hostfacts.COMM_LEN] + "\n"
    files[f"{proc}/cmdline"] = FABRIC_MANAGER_CMDLINE
    return files, links


def set_fabric_manager(directory: str, running: bool) -> str:
    """Start or stop the simulated node's fabric manager (its /proc entry comes or goes); the
    running agent reports it on its next heartbeat. Returns what the node runs now."""
    root = _root(directory)
    sysfs = os.path.join(root, "sys")
    if not hostfacts.nvswitch_count(sysfs):
        raise UsageError(f"the simulated node in {directory} has no NVSwitches (it was made with --nvlink "
                         "'none' or 'pairs-nv<N>'): there is no fabric manager to start or stop")
    files, _links = nvswitch_tree()
    proc = os.path.join(sysfs, hostfacts.SIM_PROC, str(FABRIC_MANAGER_PID))
    if running:
        for rel, text in files.items():
            if rel.startswith(f"sys/{hostfacts.SIM_PROC}/{FABRIC_MANAGER_PID}/"):
                _write(os.path.join(root, rel), text)
        return "nv-fabricmanager running"
    for name in ("comm", "cmdline"):
        try:
            os.unlink(os.path.join(proc, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(proc)
    except OSError:
        pass
    return "nv-fabricmanager stopped"
