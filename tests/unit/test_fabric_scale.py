"""A real fabric's size (issue 38, item 10): the sweep's time limit and the dump's bytes."""

from __future__ import annotations

import zlib
from pathlib import Path

from llmgw.agent.fabric_tools import DATA_CAP
from llmgw.catalog.schema import FabricSettings
from llmgw.fabric.ibnetdiscover import parse_topology

REAL = Path(__file__).parent.parent / "fixtures" / "real" / "ibnetdiscover"


def test_the_default_tool_timeout_outlasts_a_sweep_with_unresponsive_ports() -> None:
    # libibnetdisc (linux-rdma/rdma-core 691953d8d, libibnetdisc/internal.h): 2 SMPs on the wire,
    # 1000 ms timeout, 3 retries. A probe that gets no answer costs 4 s in one of 2 slots, so each
    # one adds 2 s to the sweep; 100 of them (a few thousand nodes, a few dozen dead or hung
    # ports) is 200 s, beyond the old 60 s default before a single healthy probe is counted.
    smps_on_wire, timeout_s, retries = 2, 1.0, 3
    unresponsive = 100
    assert float(FabricSettings().tool_timeout) >= unresponsive * timeout_s * (retries + 1) / smps_on_wire


def test_a_fleet_sized_dump_compressed_fits_one_message() -> None:
    # LLNL Lassen: 1818 nodes in 884 KB. Fourteen of them (about 25,000 nodes, 12 MB) compressed
    # as the agent does (zlib level 6) stays under DATA_CAP, so the map arrives in one message.
    text = (REAL / "llnl-lassen-cs7500-edr-174sw.txt").read_text()
    assert len(parse_topology(text).nodes) == 1818
    big = (text * 14).encode()
    assert len(big) > 12_000_000
    assert len(zlib.compress(big, 6)) < DATA_CAP
