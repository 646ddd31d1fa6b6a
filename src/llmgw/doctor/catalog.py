"""What each of doctor's checks reads and what its statuses mean: `ctl doctor --list` (issue 39).

`dcgmi diag` lists its tests and LBNL's NHC its node checks, each with what it looks at, so that
an operator can tell what a red line means before reading code, and pick a run with `--only` /
`--skip`. The listing is built by walking the registries `run` itself walks (NODE_CHECKS, then
CLUSTER_CHECKS), with the words below looked up by id: a check registered without words here is
listed as "(not documented)", which tests/unit/test_doctor_catalog.py refuses, so the list cannot
lose a check that runs, or keep one that no longer does.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from llmgw.doctor.cluster import CLUSTER_CHECKS
from llmgw.doctor.node import NODE_CHECKS, SERVER_ONLY

UNDOCUMENTED = "(not documented)"


class CheckDoc(msgspec.Struct, kw_only=True):
    id: str
    scope: str  # "node": once per node; "cluster": once for the fleet
    reads: str  # where its facts come from on the node (or the server)
    crit: str  # what a CRIT from it means ("" when it never says crit)
    warn: str  # what a WARN from it means ("" when it never warns)
    needs_server: bool = False  # left out by `--local`


# id → (reads, crit, warn). The NHC / DCGM counterpart is named where there is one.
_WORDS: dict[str, tuple[str, str, str]] = {
    "agent": ("the agent's stream and its heartbeats (server side)",
              "the agent is not connected: the node's readings are stale and nothing can start there",
              "heartbeats late by more than two intervals: an overloaded host or a lossy network"),
    "nvml": ("NVML (nvmlInit, nvmlSystemGetDriverVersion) or the simulated inventory; never CRIT or WARN, "
             "UNKNOWN when NVML cannot be reached (the GPU checks then have nothing to read)", "", ""),
    "gpu-health": ("NVML per GPU: health, volatile uncorrected ECC, Xid events, and the kernel log's Xids from "
                   "the hour before the agent started (dcgmi diag -r 1's ECC/Xid part; NVIDIA's Xid catalog)",
                   "a GPU lost or in error, uncorrected ECC errors, or an Xid that takes it out of service (79, 48, "
                   "109, 119/120 GSP, 140, 143, 154 recovery action, ...)",
                   "an Xid that is worth watching (13, 31, 43, 63, 92, 94, Blackwell's NVLink5 144-150)"),
    "nvlink": ("NVML NVLink link states and each GPU's link count to its peers",
               "NVLink links down on a GPU", "a GPU reaching its peers over fewer links than the others"),
    "row-remap": ("NVML nvmlDeviceGetRemappedRows per GPU; retired pages (nvmlDeviceGetRetiredPages) on boards "
                  "before Ampere (nvidia-smi -q -d ROW_REMAPPER,PAGE_RETIREMENT)",
                  "a row remap pending (reset the GPU) or failed (RMA), or 60 or more retired pages",
                  "a page retirement pending (reload the driver)"),
    "clocks": ("NVML clock event reasons per GPU (nvmlDeviceGetCurrentClocksEventReasons; nvidia-smi -q's "
               "\"Clocks Event Reasons\")", "",
               "HW slowdown, HW thermal, HW power brake or SW thermal slowdown holding the clocks down, named"),
    "temperature": ("NVML GPU temperature against the card's own slowdown and shutdown thresholds "
                    "(nvmlDeviceGetTemperatureThreshold)", "within 2 °C of the card's shutdown temperature",
                    "within 5 °C of its slowdown temperature, or over it"),
    "pcie": ("NVML PCIe link generation and width of each GPU against its maximum; each HCA's pci-sysfs "
             "current_link_speed/width against max_link_* (read when the agent registers)", "",
             "a GPU or HCA trained narrower or slower than card and slot allow (a GPU's speed only while busy), "
             "with what an HCA's link carries against its port"),
    "gpu-modes": ("NVML persistence mode and ECC mode, current and pending, per GPU", "",
                  "persistence mode off, ECC off, or an ECC mode change pending for the next reset"),
    "fabric-manager": ("NVSwitches on the PCI bus (/sys/bus/pci/devices: NVIDIA, class 0x068000), the nv-fabricmanager "
                       "process (/proc/*/comm, the nvidia-fabricmanager service) and NVML GPU fabric info per GPU "
                       "(nvmlDeviceGetGpuFabricInfoV, Hopper NVSwitch boards and later)",
                       "NVSwitches and no nv-fabricmanager running, or a GPU's NVSwitch fabric not set up or its setup "
                       "failed: CUDA cannot start on the GPU", "the fabric still being set up"),
    "gpudirect": ("/sys/module/nvidia_peermem (or nv_peer_mem) and /proc/driver/nvidia/version's open-module flavour, "
                  "on nodes with GPUs and RDMA adapters", "",
                  "neither nvidia_peermem loaded nor dma-buf offered: NCCL stages every GPU buffer through "
                  "host memory"),
    "adapters": ("the agent's declared fabrics against /sys/class/infiniband/*",
                 "a declared RDMA adapter missing (dead HCA, driver not loaded)", ""),
    "ports": ("/sys/class/infiniband/<dev>/ports/<n>/state and phys_state (NHC check_hw_ib)",
              "a declared port DOWN, or INIT (no subnet manager) / RoCE without carrier",
              "an undeclared port down, or ARMED (the subnet manager mid-sweep)"),
    "port-rate": ("ports/<n>/rate against the fastest ACTIVE port of the same fabric anywhere",
                  "a port at half its fabric's rate or less (a cable trained at 1x)", "a port below its fabric's rate"),
    "counters": ("two readings of ports/<n>/counters/* and hw_counters/* (perfquery's and mlx5's names), as rates",
                 "link_downed rising, transport or RNR retries exceeded (QPs in error), or packet loss at "
                 "1,000/s or more",
                 "symbol/receive errors rising (a cable going bad); RoCE out_of_buffer, packet_seq_err, "
                 "out_of_sequence, local_ack_timeout_err, rnr_nak_retry_err, ... rising (loss on a lossless fabric)"),
    "memlock": ("the agent's RLIMIT_MEMLOCK, which its engines inherit",
                "memlock limited on a node with RDMA adapters: NCCL's memory registration fails", ""),
    "disk": ("free space on the model cache's file system (NHC check_fs_free)",
             "under 3 % or 2 GiB free", "under 10 % or 10 GiB free"),
    "cert": ("the not-after date of the agent's client certificate", "expired, or under 3 days left",
             "under 14 days left"),
    "clock": ("the agent's wall clock in heartbeats against the server's", "60 s or more apart",
              "2 s or more apart (event times stop lining up)"),
    "nodes": ("the registry: every node's state", "no node ready",
              "some nodes not ready (each one's agent check says why)"),
    "fabrics": ("subnet managers (saquery SMIR / sminfo) and ibnetdiscover maps of each fabric",
                "no subnet manager, or two masters", "no standby SM, a failover, a degraded cable, a rail "
                "violation, a dump that disagrees with a node"),
    "replicas": ("the reconciler: each model's replicas and their states",
                 "a model with replicas wanted and none ready",
                 "a replica failed, not placeable, or stuck starting/stopping"),
    "driver-versions": ("NVML driver and CUDA driver versions, and the RDMA stack (MLNX_OFED's "
                        "/sys/module/mlx5_core/version, else the in-box kernel) across each catalog model's placement "
                        "pool (the ready nodes its profiles fit, by GPU model), else nodes with the same GPU model",
                        "", "a node whose version differs from the rest of its pool's (a collective that works on 7 "
                        "nodes and hangs on the 8th); the model and the versions seen are named"),
    "firmware-versions": ("NVML VBIOS of each GPU model and /sys/class/infiniband/*/fw_ver of each HCA type, across "
                          "each model's placement pool, else ready nodes with the same GPU model", "",
                          "a node whose GPU VBIOS or HCA firmware differs from the others'"),
}


def listing() -> list[CheckDoc]:
    """Every check `run` runs, in the order it runs them, with its words."""
    out = []
    for scope, names in (("node", NODE_CHECKS), ("cluster", CLUSTER_CHECKS)):
        for name in names:
            reads, crit, warn = _WORDS.get(name, (UNDOCUMENTED, "", ""))
            out.append(CheckDoc(id=name, scope=scope, reads=reads, crit=crit, warn=warn,
                                needs_server=name in SERVER_ONLY))
    return out


def ids() -> tuple[str, ...]:
    return (*NODE_CHECKS, *CLUSTER_CHECKS)


class UnknownCheck(ValueError):
    """An id in --only/--skip that no check has, or a choice that leaves none."""


def split_ids(values: Iterable[str]) -> list[str]:
    """`a,b` `c` → [a, b, c] (repeatable options and comma lists alike); blanks dropped."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def select(only: Iterable[str] = (), skip: Iterable[str] = ()) -> frozenset[str] | None:
    """The checks to run: `only`'s (all when empty) less `skip`'s; None for all of them.
    Raises UnknownCheck naming every id that is not a check, and the ones there are."""
    wanted, dropped = split_ids(only), split_ids(skip)
    known = ids()
    unknown = [name for name in (*wanted, *dropped) if name not in known]
    if unknown:
        raise UnknownCheck(f"no check {', '.join(repr(u[:40]) for u in unknown[:4])}: the checks are "
                           f"{', '.join(known)} (`llmgw ctl doctor --list`)")
    if not wanted and not dropped:
        return None
    chosen = frozenset(wanted or known) - frozenset(dropped)
    if not chosen:
        raise UnknownCheck("--only and --skip leave no check to run")
    return chosen
