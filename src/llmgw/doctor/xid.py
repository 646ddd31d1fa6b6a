"""What each Xid means and what to do about it, for doctor's gpu-health check. Pure data.

Read from NVIDIA's Xid catalog for Ampere and later
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html: mnemonic, description and
"resolution bucket" per Xid), the dynamic page retirement guide
(https://docs.nvidia.com/deploy/dynamic-page-retirement/visibility.html: 48, 63, 64) and NVML's
recovery actions (nvmlDeviceGpuRecoveryAction_t: none, GPU reset, node reboot, drain P2P, drain
and reset), which Xid 154 reports. The grading is the catalog's bucket turned into doctor's:
RESET_GPU / RESTART_BM / RMA-class hardware faults are CRIT (move the work off, then reset or
service the card); RESTART_APP / CHECK_APP faults, which an engine's own bug can raise, are WARN.
An Xid the table does not know is WARN with a pointer to the catalog.
"""

from __future__ import annotations

from typing import NamedTuple

from llmgw.verdict import Status

CATALOG = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

DRAIN_RESET = "move work off the node, then reset the GPU (nvidia-smi -r -i N) and watch for a repeat"
DRAIN_SERVICE = "move work off the node, then nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT; reset or RMA"
APP = "an engine's own fault is the usual cause: see its log; drain the node if it repeats"


class Xid(NamedTuple):
    meaning: str
    status: Status
    action: str


XIDS: dict[int, Xid] = {
    13: Xid("graphics engine exception", Status.WARN, APP),
    31: Xid("GPU memory page fault", Status.WARN, APP),
    43: Xid("GPU stopped processing", Status.WARN, APP),
    45: Xid("preemptive cleanup, a channel torn down after an earlier fault", Status.WARN, APP),
    46: Xid("GPU stopped processing", Status.CRIT, DRAIN_RESET),
    48: Xid("double-bit ECC error", Status.CRIT, DRAIN_SERVICE),
    61: Xid("internal micro-controller breakpoint", Status.CRIT, DRAIN_RESET),
    62: Xid("internal micro-controller halt", Status.CRIT, DRAIN_RESET),
    63: Xid("ECC page retirement or row remapping recorded", Status.WARN,
            "reset the GPU when it is idle to apply the remap (the row-remap check says if one is pending)"),
    64: Xid("ECC page retirement or row remapping failure", Status.CRIT, DRAIN_SERVICE),
    74: Xid("NVLink error", Status.CRIT, "move work off the node; nvidia-smi nvlink -e; reset the GPUs, then the board's service"),
    79: Xid("GPU has fallen off the bus", Status.CRIT, "move work off the node and reboot it; a repeat is the GPU, riser or slot: RMA"),
    92: Xid("high single-bit ECC error rate", Status.WARN, "watch the ECC counters (nvidia-smi -q -d ECC); plan a reset"),
    94: Xid("contained ECC error", Status.WARN, "the application hit by it was stopped; reset the GPU when it is idle"),
    95: Xid("uncontained ECC error", Status.CRIT, DRAIN_RESET),
    109: Xid("context switch timeout", Status.WARN, APP),
    119: Xid("GSP RPC timeout (the GPU System Processor did not answer)", Status.CRIT,
             DRAIN_RESET + "; recurring: update the driver"),
    120: Xid("GSP error", Status.CRIT, DRAIN_RESET + "; recurring: update the driver"),
    140: Xid("unrecovered ECC error", Status.CRIT, DRAIN_RESET),
    143: Xid("GPU initialization failure", Status.CRIT, "reboot the node; a repeat is the board: RMA"),
    144: Xid("NVLink SAW error", Status.CRIT, DRAIN_RESET),
    145: Xid("NVLink RLW error", Status.CRIT, DRAIN_RESET),
    146: Xid("NVLink TLW error", Status.CRIT, DRAIN_RESET),
    147: Xid("NVLink TREX error", Status.CRIT, DRAIN_RESET),
    148: Xid("NVLink NVLPW control error", Status.CRIT, DRAIN_RESET),
    149: Xid("NVLink NETIR error", Status.CRIT, DRAIN_RESET),
    150: Xid("NVLink MSE error", Status.CRIT, DRAIN_RESET),
    154: Xid("GPU recovery action changed (the kernel log line names it: reset, reboot or drain)", Status.CRIT,
             "`dmesg | grep -A1 'Xid.*154'` says which: drain the node, then reset the GPU or reboot the node"),
}


def explain(xid: int) -> Xid:
    known = XIDS.get(xid)
    if known is not None:
        return known
    return Xid(f"not in llmgw's table: see {CATALOG}", Status.WARN,
               "watch `dmesg | grep Xid`; drain the node if it repeats")
