"""What one fleet peer may cost: size caps, the heartbeat bucket, bounded refusal logging. Pure."""

from __future__ import annotations

import logging

import pytest

from llmgw.fleet.limits import Caps, HeartbeatRate, RefusalLog, heartbeat_problem, register_problem
from llmgw.wire import messages as m


def test_register_caps_name_every_number() -> None:
    caps = Caps(gpus=4, ports=2, shards=1)
    ok = m.Register(node_id="n", version="1", inventory=m.Inventory(gpus=[m.Gpu(index=i) for i in range(4)]))
    assert register_problem(ok, caps) is None
    big = m.Register(node_id="n", version="1", inventory=m.Inventory(
        gpus=[m.Gpu(index=i) for i in range(100_000)], ports=[m.Port(device="mlx5_0", port=i) for i in range(3)]))
    assert register_problem(big, caps) == (
        "the Register reports 100,000 GPUs (fleet.max_gpus is 4) and 3 ports (fleet.max_ports is 2); "
        "raise the limit in the server config if this is real")
    links = m.Register(node_id="n", version="1",
                       inventory=m.Inventory(gpus=[m.Gpu(index=0, nvlink={i: 1 for i in range(9)})]))
    assert "a GPU with 9 NVLink peers" in (register_problem(links, caps) or "")
    assert heartbeat_problem(m.Heartbeat(gpus=[m.GpuHealth(index=i) for i in range(5)]), caps)


def test_heartbeats_within_the_rate_pass_and_a_flood_is_called_one() -> None:
    bucket = HeartbeatRate(10, now=0.0)  # bursts of 20, a flood after 40 dropped in a row
    assert all(bucket.offer(0.0).accept for _ in range(20))
    assert not bucket.offer(0.0).accept
    assert bucket.offer(0.1).accept  # one token a tenth of a second
    # A steady agent at the rate never drops one.
    steady = HeartbeatRate(10, now=0.0)
    assert all(steady.offer(t * 0.1).accept for t in range(1000))
    # Twice the rate, sustained: drops, but never a flood (not 40 in a row).
    fast = HeartbeatRate(10, now=0.0)
    verdicts = [fast.offer(t * 0.05) for t in range(2000)]
    assert any(not v.accept for v in verdicts) and not any(v.flood for v in verdicts)
    # 6,000/s: a flood within the first 60 beyond the burst.
    flood = HeartbeatRate(10, now=0.0)
    verdicts = [flood.offer(t / 6000) for t in range(100)]
    assert any(v.flood for v in verdicts[:61])


def test_refusal_lines_are_bounded_per_host_and_in_all(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.refusals")
    refusals = RefusalLog(logger, every=10, budget=3)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        sent = [refusals.warning(0.1 * i, "tls_timeout", "10.0.0.1", "refused %s", i) for i in range(50)]
        assert sent.count(True) == 1
        # Other hosts: the budget of 3 lines per interval holds across hosts.
        others = [refusals.warning(1.0, "tls_timeout", f"10.0.1.{i}", "refused %s", i) for i in range(10)]
        assert others.count(True) == 2
        # After the interval the same host logs again and says what was held back.
        assert refusals.warning(11.0, "tls_timeout", "10.0.0.1", "refused %s", "again")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert lines[-1] == (
        "refused again (49 more like it from 10.0.0.1 held back; 8 other refusal lines held back in the last 10s)")
