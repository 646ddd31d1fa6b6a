"""fabric-test's pure core: rail pairing (NCCL's rail to rail), grading against the link rate, the exit code."""

from __future__ import annotations

import pytest

from llmgw.fabric.perftest import parse
from llmgw.fabric.railtest import Rail, client_target, grade, lock_order, overall, pair_rails, phase
from llmgw.verdict import EXIT_CRIT, EXIT_OK, EXIT_UNKNOWN, EXIT_WARN
from llmgw.wire.messages import FabricStatus
from tests.realfixtures import REAL


def fabric(name: str, ports: list[str], kind: str = "infiniband", usable: bool = True) -> FabricStatus:
    return FabricStatus(name=name, kind=kind, usable=usable, ports=ports)


def rates(ports: list[str], gbps: float = 400.0) -> dict[str, float]:
    return {p.replace(":", "/"): gbps for p in ports}


def table(gbps: float):
    text = ("-" * 87 + "\n #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
            f" 65536      5000             {gbps:.2f}            {gbps:.2f}\t\t     0.748336\n" + "-" * 87 + "\n")
    return parse(text)


def test_rails_pair_the_nth_port_of_a_with_the_nth_of_b() -> None:
    a = [fabric("ib", ["mlx5_0:1", "mlx5_1:1"]), fabric("roce", ["mlx5_4:1"], "roce"), fabric("mgmt", [], "ethernet")]
    b = [fabric("roce", ["mlx5_8:1"], "roce"), fabric("ib", ["mlx5_2:1", "mlx5_3:1"])]
    rails, problems = pair_rails(a, b, rates(["mlx5_0:1", "mlx5_1:1"]) | {"mlx5_4/1": 200.0},
                                 rates(["mlx5_2:1", "mlx5_3:1"]) | {"mlx5_8/1": 100.0})
    assert problems == []
    assert [(r.index, r.fabric, r.a, r.b, r.expected_gbps) for r in rails] == [
        (0, "ib", "mlx5_0:1", "mlx5_2:1", 400.0), (1, "ib", "mlx5_1:1", "mlx5_3:1", 400.0),
        (2, "roce", "mlx5_4:1", "mlx5_8:1", 100.0)]


def test_a_port_without_partner_is_a_crit_rail_and_a_fabric_on_one_side_a_problem() -> None:
    rails, problems = pair_rails([fabric("ib", ["mlx5_0:1", "mlx5_1:1"]), fabric("ib2", ["mlx5_5:1"])],
                                 [fabric("ib", ["mlx5_0:1"]), fabric("ib2", ["mlx5_5:1"], usable=False)],
                                 rates(["mlx5_0:1", "mlx5_1:1"]), rates(["mlx5_0:1"]))
    assert [(r.a, r.b) for r in rails] == [("mlx5_0:1", "mlx5_0:1"), ("mlx5_1:1", "")]
    assert problems == ["fabric ib2: usable on A, not on B"]
    result = grade(rails[1], None)
    assert result.status == "crit" and "no partner on B" in result.detail


def test_no_common_fabric_says_so() -> None:
    assert pair_rails([], [], {}, {}) == ([], ["no usable InfiniBand or RoCE fabric on both nodes"])


RAIL = Rail(index=0, fabric="ib", kind="infiniband", a="mlx5_0:1", b="mlx5_0:1", expected_gbps=400.0,
            a_gbps=400.0, b_gbps=400.0)


@pytest.mark.parametrize(("gbps", "status"), [(392.34, "ok"), (360.0, "ok"), (359.99, "warn"), (280.0, "warn"),
                                              (279.99, "crit"), (0.0, "crit")])
def test_grades_follow_the_ratio_to_the_link_rate(gbps: float, status: str) -> None:
    result = grade(RAIL, table(gbps))
    assert (result.status, result.measured_gbps, result.expected_gbps) == (status, gbps, 400.0)
    assert (result.detail == "") is (status == "ok")


def test_the_real_ndr_sample_is_ok_on_a_400g_link_and_mb_units_are_converted() -> None:
    ndr = parse((REAL / "perftest" / "cx7-ndr-b2b-ib_write_bw-client-gbits.txt").read_text())
    assert grade(RAIL, ndr).ratio == pytest.approx(0.9809, abs=1e-4)
    fdr = parse((REAL / "perftest" / "comet-fdr-mlx4-ib_write_bw-client-mb.txt").read_text())
    fdr_rail = Rail(index=0, fabric="ib", kind="infiniband", a="mlx4_0:1", b="mlx4_0:1", expected_gbps=56.0)
    result = grade(fdr_rail, fdr)
    assert result.measured_gbps == pytest.approx(50.6148) and result.status == "ok"  # 90.4 % of FDR's 56


def test_a_failed_run_or_no_row_is_crit_and_an_unknown_rate_is_not_graded() -> None:
    assert grade(RAIL, None, "gpu-02: ib_write_bw exited with status 1").status == "crit"
    empty = grade(RAIL, parse((REAL / "perftest" / "comet-old-perftest-v1-ib_write_bw-server-no-result.txt").read_text()))
    assert empty.status == "crit" and "no result row" in empty.detail
    unknown = grade(Rail(index=0, fabric="ib", kind="infiniband", a="x:1", b="y:1"), table(100.0))
    assert unknown.status == "unknown" and unknown.measured_gbps == 100.0


def test_a_rail_whose_ends_differ_is_a_warning_even_at_full_speed() -> None:
    """A degraded cable (1X: 100 of 400 Gb/s) carries its own rate well; the rail is still not what it should be."""
    rail = Rail(index=3, fabric="ib", kind="infiniband", a="mlx5_3:1", b="mlx5_3:1", expected_gbps=100.0,
                a_gbps=400.0, b_gbps=100.0)
    result = grade(rail, table(96.0))
    assert result.status == "warn" and "runs at 100 Gb/s" in result.detail


def test_the_exit_code_is_the_worst_rails_nagios_code() -> None:
    ok, warn, crit = grade(RAIL, table(390)), grade(RAIL, table(300)), grade(RAIL, table(10))
    unknown = grade(Rail(index=0, fabric="ib", kind="infiniband", a="x:1", b="y:1"), table(1))
    assert overall([ok, ok]) == ("ok", EXIT_OK)
    assert overall([ok, warn]) == ("warn", EXIT_WARN)
    assert overall([warn, crit, ok]) == ("crit", EXIT_CRIT)
    assert overall([ok, unknown]) == ("unknown", EXIT_UNKNOWN)
    assert overall([]) == ("unknown", EXIT_UNKNOWN)


# ---- issue 40, findings 6 and 7: what B may say, how long any wait lasts, the lock order -----------


@pytest.mark.parametrize("port", [0, 22, 53, 1023, 65536, -1, 1 << 40, "18515", 18515.0, True, None])
def test_a_port_b_answers_outside_1024_to_65535_is_refused_in_one_line(port: object) -> None:
    host, tcp_port, why = client_target("gpu-02", "10.0.0.2", port)
    assert (host, tcp_port) == ("", 0)
    assert why.startswith("gpu-02 answered TCP port ") and "outside 1024-65535" in why and "\n" not in why


@pytest.mark.parametrize("port", [1024, 18515, 40000, 65535])
def test_the_client_gets_the_registered_host_and_a_port_in_range(port: int) -> None:
    assert client_target("gpu-02", " 10.0.0.2 ", port) == ("10.0.0.2", port, "")


@pytest.mark.parametrize("host", ["", "  ", "-oProxyCommand=x", "10.0.0.2 evil"])
def test_no_usable_registered_host_is_refused(host: str) -> None:
    _, _, why = client_target("gpu-02", host, 18515)
    assert "no usable address on record for gpu-02" in why


def test_a_phase_deadline_is_fixed_at_its_start_and_progress_moves_it_once_to_the_ceiling() -> None:
    prepare = phase("prepare", 100.0, 0.0, 10.0, install=660.0)
    assert (prepare.deadline, prepare.ceiling, prepare.seconds) == (110.0, 760.0, 10.0)
    for _ in range(1000):  # a node saying "progress" forever
        prepare.progressed()
    assert (prepare.deadline, prepare.seconds) == (760.0, 660.0)
    ready = phase("ready", 5.0, 60.0, 10.0)  # no install: progress changes nothing
    ready.progressed()
    assert (ready.deadline, ready.ceiling) == (75.0, 75.0)
    assert phase("x", 0.0, -5.0, -1.0, install=-3.0).deadline == 0.0  # nothing negative widens or narrows it oddly


def test_locks_are_taken_in_name_order_whichever_side_is_a() -> None:
    assert lock_order("gpu-10", "gpu-02") == lock_order("gpu-02", "gpu-10") == ["gpu-02", "gpu-10"]
    assert lock_order("n1", "n1") == ["n1"]
