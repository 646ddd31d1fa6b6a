"""How long NCCL's InfiniBand connections outlive a port that stops carrying traffic. Pure.

NCCL's IB transport sets each queue pair's local ACK timeout to NCCL_IB_TIMEOUT and its retry
count to NCCL_IB_RETRY_CNT (nccl src/transport/net_ib: `NCCL_PARAM(IbTimeout, "IB_TIMEOUT", 20)`,
`NCCL_PARAM(IbRetryCnt, "IB_RETRY_CNT", 7)` since 2.21; 18 and 7 in 2.19, 14 and 7 before). An
RC queue pair waits 4.096 µs × 2^timeout for an ACK and retries `retry_cnt` times (IBTA spec,
vol. 1, 9.7.6.1.3) before it moves to the error state and the collective fails. So a port that
goes INIT or DOWN and comes back within that window (a subnet manager failing over, a link
retraining) costs a stall, not the engine; past it, the engine's collectives are dead.

llmgw keeps a multi-node replica serving through a rail that stops being usable for that long
(placement.fabric_grace, by default this window from the profile's own NCCL settings), and only
then fails it and places it again where the fabric is whole.
"""

from __future__ import annotations

from collections.abc import Mapping

ACK_UNIT = 4.096e-6  # seconds: the IBTA local ACK timeout's unit
NCCL_IB_TIMEOUT = 20
NCCL_IB_RETRY_CNT = 7


def _int(env: Mapping[str, str], key: str, default: int, lo: int, hi: int) -> int:
    try:
        value = int(env.get(key, default))
    except ValueError:
        return default
    return min(max(value, lo), hi)


def qp_retry_window(env: Mapping[str, str]) -> float:
    """Seconds an NCCL IB connection survives silence, from the engine's own NCCL_IB_TIMEOUT and
    NCCL_IB_RETRY_CNT (the defaults of current NCCL where unset): 34 s at 20 and 7."""
    timeout = _int(env, "NCCL_IB_TIMEOUT", NCCL_IB_TIMEOUT, 1, 31)
    retries = _int(env, "NCCL_IB_RETRY_CNT", NCCL_IB_RETRY_CNT, 0, 7)
    return ACK_UNIT * 2**timeout * (retries + 1)
