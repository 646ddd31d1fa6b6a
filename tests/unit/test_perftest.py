"""The perftest table parser on every real sample (tests/fixtures/real/perftest, SOURCES.md), with
the exact figures each one prints, plus the headings perftest's source defines that no sample shows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fabric.perftest import parse
from tests.realfixtures import REAL

SAMPLES = REAL / "perftest"

# file → (test, device, link type, GID index, server side, unit, rows, largest size, peak, average,
#         MsgRate, average in Gb/s, warnings)
EXPECTED = {
    "comet-fdr-mlx4-ib_write_bw-client-mb.txt":
        ("RDMA_Write BW Test", "mlx4_0", "IB", None, False, "MB/sec", 1, 65536, 6034.72, 6033.76, 0.096540, 50.6148, 0),
    "comet-fdr-mlx4-ib_write_bw-server-mb.txt":
        ("RDMA_Write BW Test", "mlx4_0", "IB", None, True, "MB/sec", 1, 65536, 6034.72, 6033.76, 0.096540, 50.6148, 0),
    "comet-old-perftest-v1-ib_write_bw-client.txt":
        ("RDMA_Write BW Test", "", "", None, False, "MB/sec", 1, 65536, 6021.90, 6020.33, None, 50.5022, 0),
    "cx7-ndr-b2b-ib_read_bw-client-gbits.txt":
        ("RDMA_Read BW Test", "mlx5_0", "IB", None, False, "Gb/sec", 1, 65536, 328.64, 328.61, 0.626777, 328.61, 1),
    "cx7-ndr-b2b-ib_send_bw-client-mib.txt":
        ("Send BW Test", "mlx5_0", "IB", None, False, "MiB/sec", 1, 65536, 46567.34, 46557.03, 0.744912, 390.5487, 1),
    "cx7-ndr-b2b-ib_write_bw-client-gbits.txt":
        ("RDMA_Write BW Test", "mlx5_0", "IB", None, False, "Gb/sec", 1, 65536, 392.38, 392.34, 0.748336, 392.34, 1),
    "deepops-roce-cx5-client-gbits-cpufreq-warning.txt":
        ("", "", "Ethernet", 3, False, "Gb/sec", 1, 65536, 92.42, 92.40, 0.176230, 92.40, 1),
    "gpu-operator-roce-gpudirect-ib_write_bw-a-gbits-client.txt":
        ("RDMA_Write BW Test", "mlx5_0", "Ethernet", 5, False, "Gb/sec", 23, 8388608, 92.39, 92.39, 0.001377, 92.39, 0),
    "openshift-a40-roce-gpudirect-D60-ib_write_bw-client-gbits.txt":
        ("RDMA_Write BW Test", "mlx5_1", "Ethernet", 3, False, "Gb/sec", 1, 65536, 0.0, 181.46, 0.346100, 181.46, 0),
    "openshift-a40-roce-gpudirect-D60-ib_write_bw-server-gbits.txt":
        ("RDMA_Write BW Test", "mlx5_1", "Ethernet", 3, True, "Gb/sec", 1, 65536, 0.0, 181.46, 0.346100, 181.46, 0),
    "ndr200-ib_send_bw-a-gbits-client.txt":
        ("Send BW Test", "mlx5_2", "IB", None, False, "Gb/sec", 23, 8388608, 196.69, 196.69, 0.002931, 196.69, 0),
}


def test_every_real_sample_is_covered() -> None:
    names = {p.name for p in SAMPLES.glob("*.txt")}
    assert names == set(EXPECTED) | {"comet-old-perftest-v1-ib_write_bw-server-no-result.txt"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_sample(name: str) -> None:
    (test, device, link, gid, server, unit, rows, size, peak, average, rate, gbps, warnings) = EXPECTED[name]
    table = parse((SAMPLES / name).read_text())
    assert (table.test, table.device, table.link_type, table.gid_index, table.server) == (test, device, link, gid,
                                                                                          server)
    assert table.unit == unit
    assert len(table.rows) == rows
    best = table.result
    assert best is not None
    assert (best.size, best.peak, best.average, best.msg_rate_mpps) == (size, peak, average, rate)
    assert best.average_gbps == pytest.approx(gbps, abs=1e-4)
    assert len(table.warnings) == warnings
    if warnings:
        assert table.warnings[0].startswith("Conflicting CPU frequency values detected")


@pytest.mark.parametrize("side", ["client", "server"])
def test_a_duration_run_counts_its_iterations_and_measures_no_peak(side: str) -> None:
    """`-D 60 --use_cuda=0` (the real OpenShift A40 sample): the warning before the settings, CUDA's
    lines around them, one row with the iterations done in 60 s and BW peak 0.00, not a measurement."""
    table = parse((SAMPLES / f"openshift-a40-roce-gpudirect-D60-ib_write_bw-{side}-gbits.txt").read_text())
    assert (table.peak_measured, table.cuda, table.warnings) == (False, True, [])
    assert table.result is not None and table.result.iterations == 10384867 and table.result.peak_gbps == 0.0
    iterations = parse((SAMPLES / "cx7-ndr-b2b-ib_write_bw-client-gbits.txt").read_text())
    assert (iterations.peak_measured, iterations.cuda) == (True, False)


def test_the_server_side_with_no_result_row_has_none() -> None:
    table = parse((SAMPLES / "comet-old-perftest-v1-ib_write_bw-server-no-result.txt").read_text())
    assert table.unit == "MB/sec" and table.columns[:2] == ["#bytes", "#iterations"]
    assert table.rows == [] and table.result is None


def test_mb_and_mib_are_both_two_to_the_twentieth_bytes() -> None:
    """perftest commit 1d202bb renamed MB/sec to MiB/sec; format_factor stayed 0x100000."""
    mb = parse((SAMPLES / "comet-fdr-mlx4-ib_write_bw-client-mb.txt").read_text()).result
    assert mb is not None and mb.average_gbps == pytest.approx(6033.76 * 1048576 * 8 / 1e9, abs=1e-4)


def test_the_small_sizes_use_six_decimals_and_the_sweep_keeps_every_row() -> None:
    table = parse((SAMPLES / "ndr200-ib_send_bw-a-gbits-client.txt").read_text())
    assert [r.size for r in table.rows] == [2 << i for i in range(23)]
    assert (table.rows[0].peak, table.rows[0].average) == (0.052812, 0.050794)
    assert (table.rows[14].peak, table.rows[14].average) == (172.67, 96.54)  # peak and average differ mid-sweep


def test_columns_are_found_by_heading_not_position() -> None:
    """RESULT_FMT_QOS (perftest_parameters.h) puts `#sl` second: the average is the fifth cell."""
    text = ("-" * 87 + "\n #bytes    #sl      #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
            " 65536      3           5000           97.10            96.80                  "
            "0.184631\n" + "-" * 87 + "\n")
    best = parse(text).result
    assert best is not None and (best.size, best.iterations, best.peak, best.average) == (65536, 5000, 97.10, 96.80)


def test_a_latency_table_is_not_read_as_bandwidth() -> None:
    text = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]\n"
            " 2       1000          1.01           3.57         1.04     	       1.06\n")
    assert parse(text).rows == []


@settings(max_examples=300)
@given(st.text())
def test_arbitrary_text_never_raises(text: str) -> None:
    parse(text)


@settings(max_examples=300)
@given(st.lists(st.sampled_from([
    " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]",
    " #bytes #iterations    BW peak[MB/sec]    BW average[MB/sec]  ", " 65536      5000   1.5   1.4   0.1",
    " 65536 5000 x 1", "-" * 87, "-" * 66, " 1.5 2 3 4 5", " Device : mlx5_0", " GID index : x",
    "* Waiting for client to connect... *", "Conflicting CPU frequency values detected", " 9" * 5]), max_size=12))
def test_table_shaped_text_never_raises(lines: list[str]) -> None:
    table = parse("\n".join(lines))
    assert all(r.average >= 0 for r in table.rows)
