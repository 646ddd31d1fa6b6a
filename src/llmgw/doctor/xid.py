"""What each Xid means and what to do about it, for doctor's gpu-health check. Pure data.

Read from NVIDIA's Xid catalog for Ampere and later
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html: mnemonic, description and
"resolution bucket" per Xid), the dynamic page retirement guide
(https://docs.nvidia.com/deploy/dynamic-page-retirement/visibility.html: 48, 63, 64) and NVML's
recovery actions (nvmlDeviceGpuRecoveryAction_t: none, GPU reset, node reboot, drain P2P, drain
and reset), which Xid 154 reports. The grading is the catalog's bucket turned into doctor's:
RESET_GPU and hardware faults are CRIT (move the work off, then reset or service the card);
RESTART_APP / IGNORE ones, which an engine's own bug can raise, are WARN, and so are Blackwell's
NVLink5 errors (144-150), whose grading depends on the error status in the log line: when one
needs a recovery, Xid 154 follows and names it, which is CRIT.
An Xid the table does not know is WARN with a pointer to the catalog.
"""

from __future__ import annotations

from typing import NamedTuple

from llmgw.verdict import Status

CATALOG = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

DRAIN_RESET = "move work off the node, then reset the GPU (nvidia-smi -r -i N) and watch for a repeat"
DRAIN_SERVICE = "move work off the node, then nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT; reset or RMA"
APP = "an engine's own fault is the usual cause: see its log; drain the node if it repeats"
NVLINK5 = ("the line's error status says if it is fatal (the catalog's NVLink5 table); a fatal one is followed "
           "by Xid 154 naming the recovery: watch for it, reset the GPU if it comes")


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
    74: Xid("NVLink error", Status.CRIT,
            "move work off the node; nvidia-smi nvlink -e; reset the GPUs, then the board's service"),
    79: Xid("GPU has fallen off the bus", Status.CRIT,
            "move work off the node and reboot it; a repeat is the GPU, riser or slot: RMA"),
    92: Xid("high single-bit ECC error rate", Status.WARN,
            "watch the ECC counters (nvidia-smi -q -d ECC); plan a reset"),
    94: Xid("contained ECC error", Status.WARN, "the application hit by it was stopped; reset the GPU when it is idle"),
    95: Xid("uncontained ECC error", Status.CRIT, DRAIN_RESET),
    109: Xid("context switch timeout", Status.CRIT, DRAIN_RESET),
    110: Xid("security fault", Status.CRIT, "move work off the node; revert recent hardware changes and cold-reset "
             "it; a repeat is the board: RMA"),
    119: Xid("GSP RPC timeout, the GPU System Processor did not answer", Status.CRIT,
             DRAIN_RESET + "; if it persists, power-cycle the node, then NVIDIA's GPU debug guidelines"),
    120: Xid("GSP error", Status.CRIT, DRAIN_RESET + "; if it persists, power-cycle the node, then NVIDIA's GPU debug "
             "guidelines"),
    136: Xid("NVLink link training failed", Status.CRIT, DRAIN_RESET + "; a repeat is the link's signal integrity"),
    137: Xid("NVLink privilege error, an illegal peer-to-peer access", Status.WARN, APP),
    140: Xid("unrecovered ECC error, the driver could not offline or remap the page", Status.CRIT,
             DRAIN_RESET + "; if it persists, the board: RMA"),
    143: Xid("GPU initialization error", Status.CRIT, DRAIN_RESET + "; if it persists, contact the vendor"),
    # NVLink5 (Blackwell) errors: the catalog's bucket is WORKFLOW_NVLINK5_ERR, its grading the
    # error status the log line carries (many are non-fatal); a fatal one is followed by Xid 154.
    144: Xid("NVLink SAW error", Status.WARN, NVLINK5),
    145: Xid("NVLink RLW error", Status.WARN, NVLINK5),
    146: Xid("NVLink TLW error", Status.WARN, NVLINK5),
    147: Xid("NVLink TREX error", Status.WARN, NVLINK5),
    148: Xid("NVLink NVLPW_CTRL error", Status.WARN, NVLINK5),
    149: Xid("NVLink NETIR error", Status.WARN, NVLINK5),
    150: Xid("NVLink MSE error", Status.WARN, NVLINK5),
    154: Xid("GPU recovery action changed, the kernel log line names it: drain P2P, drain and reset, GPU reset "
             "or node reboot", Status.CRIT,
             "`dmesg | grep 'Xid.*154'` names the action: drain the node, then reset the GPU or reboot the node"),
    155: Xid("NVLink software-defined error, a link taken down on purpose", Status.WARN,
             "check who took the link down (a reset, a sleep transition); reset the GPU if it was not intended"),
    156: Xid("resource retirement event", Status.WARN, "reset the GPU when it is idle to apply the retirement"),
    157: Xid("resource retirement failure, no spare resources left", Status.WARN,
             "the GPU still runs but may fault again: plan its replacement with the vendor"),
    158: Xid("GPU fatal timeout", Status.CRIT, DRAIN_RESET),
}


def explain(xid: int) -> Xid:
    known = XIDS.get(xid)
    if known is not None:
        return known
    return Xid(f"not in llmgw's table: see {CATALOG}", Status.WARN,
               "watch `dmesg | grep Xid`; drain the node if it repeats")
