"""`nvidia-smi topo -m` → the GPU-to-GPU link matrix. Pure: text in, values out.

The agent reads NVLink from NVML; this parser reads what operators paste and what the real
samples in tests/fixtures/real/nvidia-smi-topo hold, so the simulated boxes (sim/profiles.py)
are checked against real ones. Rows start with `GPU<n>`; the GPU columns come first in every
row, in order, so a row's first N cells after its name are its links to GPU0..GPU(N-1)
whatever the header looks like (terminal copies turn tabs into spaces; some headers are
mangled). Cells: ` X ` (itself), `NV<n>`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`.
"""

from __future__ import annotations

import re

_ROW = re.compile(r"^GPU(\d+)\s")


def parse_topo(text: str) -> dict[int, dict[int, str]]:
    """GPU index → {other GPU index → link token} (the diagonal left out)."""
    rows: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if match:
            rows[int(match[1])] = line.split()[1:]
    count = len(rows)
    return {
        gpu: {other: cells[other] for other in range(min(count, len(cells))) if other != gpu}
        for gpu, cells in rows.items()
    }


def nvlink_matrix(text: str) -> dict[int, dict[int, int]]:
    """GPU index → {peer → NVLink count} for the `NV<n>` cells only (what NVML would report)."""
    out: dict[int, dict[int, int]] = {}
    for gpu, links in parse_topo(text).items():
        out[gpu] = {peer: int(token[2:]) for peer, token in links.items() if re.fullmatch(r"NV\d+", token)}
    return out
