"""perftest's bandwidth tables (`ib_write_bw`, `ib_read_bw`, `ib_send_bw`), read by column heading.

The table is what perftest prints after its settings block (src/perftest_parameters.h, perftest
25.x): a dashed line (87 dashes; perftest 1.x printed 66), the heading

    #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]

and one row per message size (`REPORT_FMT " %-7lu    %-10lu       %-7.2lf            %-7.2lf\t\t     %-7.6lf"`,
or `REPORT_FMT_EXT` with 6 decimals for small values), closed by another dashed line. The
headings differ by version and flag, so columns are found by their heading, never by position:
`MB/sec` before perftest 24.07, `MiB/sec` from it on (commit 1d202bb "Display proper unit":
both are 2^20 bytes, `format_factor = 0x100000`), `Gb/sec` with `--report_gbits` (10^9 bits);
1.x has no MsgRate column, `--sl` runs add `#sl`, dual-port runs per-port columns. Lines that are
not rows (`Conflicting CPU frequency values detected ...`, which perftest writes to stderr and
so lands anywhere in a merged output) are kept as warnings, not rows.

A duration run (`-D SECONDS`, what `ctl fabric-test` runs) prints ` WARNING: BW peak won't be
measured in this run.` before its settings (perftest_parameters.c, force_dependecies:
DURATION sets noPeak, as do more than 20000 iterations), then one row whose #iterations is the
count it managed in that time and whose BW peak is 0.00 (print_report_bw: peak_up is 0 when
noPeak): `peak_measured` is False, and a 0.00 peak is not a measurement. GPUDirect runs
(`--use_cuda=N`) print CUDA's lines (`initializing CUDA`, `Picking device No. 0`, `allocated GPU
buffer address at ...`) around the table; they are outside it and ignored
(tests/fixtures/real/perftest/openshift-a40-roce-gpudirect-D60-*).

Pure: text in, values out; arbitrary text never raises (tests/unit/test_perftest.py).
"""

from __future__ import annotations

import re

import msgspec

# Bits per second in one unit a heading names (perftest: MB and MiB are 2^20 bytes, Gb 10^9 bits).
UNIT_GBPS = {"MB/sec": 1048576 * 8 / 1e9, "MiB/sec": 1048576 * 8 / 1e9, "Gb/sec": 1.0}

_DASHES = re.compile(r"^\s*-{20,}\s*$")
_HEADING = re.compile(r"#\w+|[A-Za-z][\w ]*?\[[^\]]*\]")
_UNIT = re.compile(r"\[([^\]]*)\]")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")
_SETTING = re.compile(r"^\s*([A-Za-z][\w .'*/-]*?)\s*:\s*(\S.*?)\s*$")
_MAX_LINES = 100_000  # a `-a` sweep prints 23 rows; anything near this is not perftest's


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One message size: bandwidth in the table's own unit and in Gb/s."""

    size: int
    iterations: int
    peak: float
    average: float
    msg_rate_mpps: float | None = None
    peak_gbps: float = 0.0
    average_gbps: float = 0.0


class Table(msgspec.Struct, kw_only=True):
    test: str = ""  # "RDMA_Write BW Test"
    device: str = ""
    link_type: str = ""  # "IB" | "Ethernet"
    gid_index: int | None = None
    server: bool = False  # the server side printed it (its "Waiting for client" banner)
    peak_measured: bool = True  # False: perftest said it would not measure the peak (-D, > 20000 iterations)
    cuda: bool = False  # the buffers were in GPU memory (perftest printed its CUDA initialisation)
    unit: str = ""  # the bandwidth unit the heading named
    columns: list[str] = []
    rows: list[Row] = []
    warnings: list[str] = []  # lines inside the table that are not rows

    @property
    def result(self) -> Row | None:
        """The row a link is judged by: the largest message size (a `-a` sweep saturates there)."""
        return max(self.rows, key=lambda r: r.size) if self.rows else None


def _settings(line: str) -> list[tuple[str, str]]:
    """`Dual-port : OFF\t\tDevice : mlx5_0` → both pairs (perftest prints two per line)."""
    out = []
    for part in re.split(r"\t+| {3,}(?=[A-Za-z][\w .'*/-]*:)", line):
        found = _SETTING.match(part)
        if found:
            out.append((found[1].strip().lower(), found[2]))
    return out


def _column(columns: list[str], prefix: str) -> int | None:
    for i, name in enumerate(columns):
        if name.lower().startswith(prefix):
            return i
    return None


def parse(text: str) -> Table:
    """Everything perftest's bandwidth output says about the run; rows empty when none printed."""
    table = Table()
    columns: list[str] | None = None
    for raw in text.splitlines()[:_MAX_LINES]:
        line = raw.rstrip()
        stripped = line.strip()
        if not stripped:
            continue
        if "Waiting for client to connect" in stripped:
            table.server = True
            continue
        if "BW peak won't be measured" in stripped:
            table.peak_measured = False
            continue
        if stripped.startswith(("initializing CUDA", "Picking device No.", "Picking GPU number")):
            table.cuda = True
            continue
        if _DASHES.match(line):
            columns = None  # a dashed line ends a table (and starts the next block)
            continue
        if columns is None:
            if stripped.startswith("#bytes"):
                found = _HEADING.findall(stripped)
                if _column(found, "bw average") is not None:
                    columns = found
                    table.columns = found
                    unit = _UNIT.search(found[_column(found, "bw average") or 0])
                    table.unit = unit[1] if unit else ""
                continue
            if stripped.endswith(" Test") and not table.test and ":" not in stripped:
                table.test = stripped
                continue
            for key, value in _settings(line):
                if key == "device" and not table.device:
                    table.device = value
                elif key == "link type" and not table.link_type:
                    table.link_type = value
                elif key == "gid index" and table.gid_index is None and value.isdigit():
                    table.gid_index = int(value)
            continue
        row = _row(stripped.split(), columns, table.unit)
        if row is None:
            table.warnings.append(stripped[:500])
        else:
            table.rows.append(row)
    return table


def _row(cells: list[str], columns: list[str], unit: str) -> Row | None:
    if len(cells) != len(columns) or not all(_NUMBER.match(c) for c in cells):
        return None
    size_at = _column(columns, "#bytes")
    iters_at = _column(columns, "#iterations")
    peak_at = _column(columns, "bw peak")
    average_at = _column(columns, "bw average")
    rate_at = _column(columns, "msgrate")
    if size_at is None or average_at is None or "." in cells[size_at]:
        return None
    factor = UNIT_GBPS.get(unit, 0.0)
    average = float(cells[average_at])
    peak = float(cells[peak_at]) if peak_at is not None else 0.0
    iterations = cells[iters_at] if iters_at is not None else "0"
    return Row(
        size=int(cells[size_at]),
        iterations=int(float(iterations)),
        peak=peak,
        average=average,
        msg_rate_mpps=float(cells[rate_at]) if rate_at is not None else None,
        peak_gbps=round(peak * factor, 4),
        average_gbps=round(average * factor, 4),
    )
