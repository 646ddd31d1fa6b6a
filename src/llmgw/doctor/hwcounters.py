"""RDMA hw_counters (/sys/class/infiniband/<dev>/ports/<n>/hw_counters/*) graded as rates between
two readings (issue 39): the counters check's half for RoCE and the QP-level errors.

The names are mlx5's (drivers/infiniband/hw/mlx5/counters.c: the Q counters, their `vport_`
twins aside, and the congestion counters of RoCE) as the kernel's sysfs shows them; what each
means follows NVIDIA's "Understanding mlx5 Linux counters". A total means little (they count
from the driver's load, across every job since); what matters is whether one rises now:
- a QP's retries exceeded: the QP went to the error state and the job on it failed: CRIT;
- loss on what must be a lossless fabric (sequence errors, ACK timeouts, corrupted packets):
  WARN, CRIT from LOSS_CRIT_RATE a second (at 400 Gb/s and 4 KiB a port moves ~12 M packets a
  second; 1,000 lost a second is ~1e-4, where go-back-N retransmission takes most of RC's
  throughput);
- out_of_buffer / RNR NAKs: the receiver had no buffer posted (an engine not keeping up, or too
  few receive WQEs): WARN;
- ECN marks and CNPs are DCQCN doing its job, and the CQE error counters rise on every job's
  teardown (NVIDIA's note on resp_cqe_error): neither is graded.
"""

from __future__ import annotations

import msgspec

from llmgw.verdict import Status
from llmgw.wire import messages as m

HW_CRIT = {
    "req_transport_retries_exceeded": "transport retries exceeded",
    "req_rnr_retries_exceeded": "RNR retries exceeded",
}
HW_LOSS = {
    "packet_seq_err": "sequence-error NAKs received",
    "out_of_sequence": "packets received out of sequence",
    "local_ack_timeout_err": "ACK timeouts",
    "implied_nak_seq_err": "implied NAKs",
    "rx_icrc_encapsulated": "RoCE packets with ICRC errors",
    "duplicate_request": "requests received again",
}
HW_RECEIVER = {
    "out_of_buffer": "drops for want of a receive WQE",
    "rnr_nak_retry_err": "RNR NAKs received",
}
GRADED = (*HW_CRIT, *HW_LOSS, *HW_RECEIVER)
LOSS_CRIT_RATE = 1000.0  # a second


class HwRise(msgspec.Struct, kw_only=True):
    status: Status = Status.OK
    rises: list[str] = []  # "packet_seq_err +120 (12/s)"
    action: str = ""


def _rate(delta: int, window: float) -> str:
    if window <= 0:
        return ""
    per = delta / window
    return f" ({per:.1f}/s)" if per < 10 else f" ({per:,.0f}/s)"


def hw_rises(now: m.PortCounters, then: m.PortCounters | None, window: float, netdev: str = "",
             roce: bool = True) -> HwRise:
    """The graded hw_counters that rose between `then` and `now` (`window` seconds apart); `roce`
    False for an InfiniBand port (credit-based: no PFC to blame)."""
    out = HwRise()
    if then is None or not now.hw_counters:
        return out
    worst = Status.OK
    meanings: list[str] = []
    kinds: set[str] = set()
    for name in GRADED:
        a, b = now.hw_counters.get(name), then.hw_counters.get(name)
        if a is None or b is None or a <= b:
            continue  # not read, or not rising (a counter that went back: the driver reloaded)
        delta = a - b
        out.rises.append(f"{name} +{delta}{_rate(delta, window)}")
        if name in HW_CRIT or (name in HW_LOSS and window > 0 and delta / window >= LOSS_CRIT_RATE):
            worst = Status.CRIT
        elif worst != Status.CRIT:
            worst = Status.WARN
        kinds.add("crit" if name in HW_CRIT else "loss" if name in HW_LOSS else "receiver")
        meanings.append(f"{name}: {HW_CRIT.get(name) or HW_LOSS.get(name) or HW_RECEIVER[name]}")
    out.status = worst
    if not out.rises:
        return out
    dev, watch = now.device, f"`rdma statistic show link {now.device}/{now.port}` to watch it"
    parts = [f"({'; '.join(meanings)})"]
    if "crit" in kinds:
        parts.append(f"queue pairs on {dev} went to error: the jobs on them failed")
    if kinds & {"loss", "crit"} and roce:
        qos = f"mlnx_qos -i {netdev}" if netdev else "mlnx_qos -i <netdev>"
        parts.append(f"packets are lost on a fabric that must be lossless: PFC/ECN on the RoCE priority ({qos}), the "
                     f"switch port's pause and drop counters, then the cable (mlxlink -d {dev} -c); {watch}")
    elif kinds & {"loss", "crit"}:
        parts.append(f"packets are lost on InfiniBand: the cable or a port (mlxlink -d {dev} -c, the symbol errors "
                     f"at both ends), or a switch discarding (ibqueryerrors); {watch}")
    if "receiver" in kinds:
        parts.append(f"the receiver on {dev} had no buffer posted: an engine not keeping up, or too few receive "
                     "WQEs (NCCL_IB_* settings)")
    out.action = parts[0] + " " + "; ".join(parts[1:])
    return out
