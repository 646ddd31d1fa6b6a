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
    empty = grade(RAIL,
                  parse((REAL / "perftest" / "comet-old-perftest-v1-ib_write_bw-server-no-result.txt").read_text()))
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


# ---- issue 39: graded against what the link carries (encoding, the HCA's PCIe link) ---------------

from llmgw.fabric import sysfs  # noqa: E402
from llmgw.fabric.linkrate import capacity, data_gbps, parse_pcie_speed, parse_pcie_width, pcie_gbps  # noqa: E402


@pytest.mark.parametrize(("rate", "speed", "layer", "data"), [
    (40.0, "QDR", "InfiniBand", 32.0),  # 8b/10b: sysfs prints the signalling rate
    (20.0, "DDR", "InfiniBand", 16.0), (10.0, "SDR", "InfiniBand", 8.0),
    (40.0, "FDR10", "InfiniBand", 40.0),  # 64b/66b at 10.3125 Gb/s a lane: 10 is the data rate
    (56.0, "FDR", "InfiniBand", 54.55),  # 14.0625 × 64/66 = 13.64 a lane
    (100.0, "EDR", "InfiniBand", 100.0), (200.0, "HDR", "InfiniBand", 200.0), (400.0, "NDR", "InfiniBand", 400.0),
    (10.0, "QDR", "Ethernet", 10.0),  # mlx4's 10GbE reads "10 Gb/sec (1X QDR)": Ethernet's data rate, no 8b/10b
    (40.0, "FDR10", "Ethernet", 40.0),
])
def test_the_data_rate_follows_the_encoding_of_the_speed(rate: float, speed: str, layer: str, data: float) -> None:
    assert data_gbps(rate, speed, layer) == data


def test_pcie_files_read_as_the_kernel_prints_them() -> None:
    assert [parse_pcie_speed(t) for t in ("8.0 GT/s PCIe\n", "8 GT/s", "16.0 GT/s PCIe", "Unknown", "", None)] == \
        [8.0, 8.0, 16.0, 0.0, 0.0, 0.0]
    assert [parse_pcie_width(t) for t in ("8\n", "x16", "0", "", "wide")] == [8, 16, 0, 0, 0]
    assert pcie_gbps(8.0, 8) == 57.6  # 63.0 after 128b/130b, less TLP headers at 256-byte payloads
    assert (pcie_gbps(16.0, 16), pcie_gbps(32.0, 16), pcie_gbps(5.0, 8), pcie_gbps(3.0, 8)) == (230.5, 460.9, 29.3, 0.0)


def test_a_healthy_qdr_link_is_ok_not_warn() -> None:
    """4X QDR prints 40 Gb/s and carries 32; a ConnectX-2 in its x8 gen2 slot measures ~27 (3250 MB/s)."""
    qdr = capacity(40.0, "QDR", pcie_speed=5.0, pcie_width=8, pcie_max_speed=5.0, pcie_max_width=8)
    a = [fabric("ib", ["mlx4_0:1"])]
    [rail], _ = pair_rails(a, a, {"mlx4_0/1": qdr}, {"mlx4_0/1": qdr})
    result = grade(rail, table(27.26))
    assert result.status == "ok" and result.ratio is not None and result.ratio > 0.9, result
    assert rail.link_gbps == 32.0 and rail.expected_gbps == 29.3 and "PCIe gen2 x8" in result.detail
    # Without the PCIe link (an older agent) it is still graded against 32, not 40: a fast QDR card is ok.
    [bare], _ = pair_rails(a, a, {"mlx4_0/1": capacity(40.0, "QDR")}, {"mlx4_0/1": capacity(40.0, "QDR")})
    assert bare.expected_gbps == 32.0 and grade(bare, table(30.5)).status == "ok"
    slow = grade(bare, table(24.0))
    assert slow.status == "warn" and "40 Gb/s signalling, 8b/10b carries 32" in slow.detail


def test_an_x8_limited_hca_is_graded_against_pcie_with_that_reason() -> None:
    """An EDR card trained at x8 gen3 (it can do x16 gen3): 57.6 Gb/s is all it can move, and that is the
    reason given, not a crit on the cable; below it, the grade is against PCIe's figure."""
    narrow = capacity(100.0, "EDR", pcie_speed=8.0, pcie_width=8, pcie_max_speed=8.0, pcie_max_width=16)
    full = capacity(100.0, "EDR", pcie_speed=8.0, pcie_width=16, pcie_max_speed=8.0, pcie_max_width=16)
    a, b = [fabric("ib", ["mlx5_0:1"])], [fabric("ib", ["mlx5_3:1"])]
    [rail], _ = pair_rails(a, b, {"mlx5_0/1": full}, {"mlx5_3/1": narrow})
    assert (rail.expected_gbps, rail.link_gbps, rail.a_gbps, rail.b_gbps) == (57.6, 100.0, 100.0, 100.0)
    ok = grade(rail, table(55.1))
    assert ok.status == "ok" and ok.expected_gbps == 57.6
    assert ok.detail.startswith("limited by PCIe gen3 x8 on B (57.6 Gb/s of payload; the card can do gen3 x16")
    bad = grade(rail, table(45.0))
    assert bad.status == "warn" and "limited by PCIe gen3 x8 on B" in bad.detail and "check the cable" not in bad.detail
    # The same card in a full slot: the link limits, nothing to say.
    [healthy], _ = pair_rails(a, b, {"mlx5_0/1": full}, {"mlx5_3/1": full})
    assert healthy.expected_gbps == 100.0 and grade(healthy, table(96.0)).detail == ""


@pytest.mark.parametrize(("fixture", "lane", "speed", "encoding"), [
    ("qdr-is5030-10-hosts-down-polling.txt", "10.0", "QDR", 8 / 10),
    ("edr-sb7700-xcat-2nodes-author-truncated.txt", "25.78125", "EDR", 64 / 66),
    # HDR: PAM4 with RS(544,514) FEC and 256b/257b transcoding
    ("hdr-quantum-20-nodes-sharp-an-full.txt", "53.125", "HDR", 514 / 544 * 256 / 257),
])
def test_iblinkinfos_signalling_rates_give_the_data_rates_we_grade_against(
        fixture: str, lane: str, speed: str, encoding: float) -> None:
    """iblinkinfo (infiniband-diags) prints the per-lane signalling rate; less its encoding it is the
    data rate linkrate assigns to the figure sysfs prints for that speed (4X: 4 lanes)."""
    text = (REAL / "iblinkinfo" / fixture).read_text()
    assert f"4X {lane} Gbps" in " ".join(text.split()), fixture
    printed = sysfs.parse_rate(sysfs.format_rate(4, speed)).gbps
    assert data_gbps(printed, speed) == pytest.approx(4 * float(lane) * encoding, abs=0.05)
