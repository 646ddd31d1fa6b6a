"""`llmgw ctl fabrics --file` and `llmgw sim fabric` as real subprocesses: every real sample, as a
table and as JSON, never a traceback; bad input is one line and an exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.sim.node import node_guid
from tests.e2e.harness import run_llmgw
from tests.realfixtures import REAL

pytestmark = pytest.mark.e2e

SAMPLES = sorted((REAL / "ibnetdiscover").glob("*.txt")) + sorted((REAL / "ibnetdiscover-ports").glob("*.txt"))
JSON_KEYS = {"switches", "adapters", "links", "rails", "problems"}


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_real_sample_as_table_and_json(path: Path) -> None:
    table = run_llmgw("ctl", "fabrics", "--file", str(path), env={"NO_COLOR": "1"})
    assert table.returncode == 0, table.stderr
    assert "Traceback" not in table.stdout + table.stderr and table.stderr == ""
    assert f"{path}:" in table.stdout and "switches" in table.stdout

    result = run_llmgw("ctl", "fabrics", "--file", str(path), "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc.keys() >= JSON_KEYS
    for switch in doc["switches"]:
        assert {"guid", "description", "tier"} <= switch.keys()
    for adapter in doc["adapters"]:
        assert {"guid", "node"} <= adapter.keys()
    for link in doc["links"]:
        assert {"a", "b", "width", "speed", "degraded"} <= link.keys()
        assert {"guid", "port"} <= link["a"].keys() and {"guid", "port"} <= link["b"].keys()
    for problem in doc["problems"]:
        assert problem["kind"] and problem["message"]


def test_json_counts_on_a_small_sample() -> None:
    result = run_llmgw("ctl", "fabrics", "--file", str(REAL / "ibnetdiscover" / "manpage-voltaire-sdr-1x-degraded.txt"),
                       "-o", "json")
    doc = json.loads(result.stdout)
    assert (len(doc["switches"]), len(doc["adapters"]), len(doc["links"])) == (2, 4, 7)
    assert sum(link["degraded"] for link in doc["links"]) == 2
    assert [p["kind"] for p in doc["problems"]] == ["degraded_link", "degraded_link"]


@pytest.mark.parametrize(("make", "says"), [
    (lambda d: d / "missing.txt", "cannot read --file"),
    (lambda d: d, "is a directory"),
    (lambda d: _write(d / "empty.txt", b""), "no ibnetdiscover topology"),
    (lambda d: _write(d / "binary.bin", b"\x7fELF\0\0\0\x01" * 100), "binary file"),
    (lambda d: _write(d / "latin1.txt", "caf\xe9 ibnetdiscover\n".encode("latin-1")), "no ibnetdiscover topology"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, make, says: str) -> None:
    result = run_llmgw("ctl", "fabrics", "--file", str(make(tmp_path)))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_sim_fabric_feeds_ctl_fabrics(tmp_path: Path) -> None:
    out = tmp_path / "fabric"
    made = run_llmgw("sim", "fabric", "--nodes", "8", "--rails", "4", "--group-size", "4", "--spines", "2",
                     "--degrade", "node-3", "--misrail", "node-6", "--out", str(out), "-o", "json")
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout)
    assert (out / "ibnetdiscover.txt").exists() and (out / "smir.txt").exists()
    assert summary["leaf_of"]["node-6 mlx5_0"] == "leaf-g2-r1"

    result = run_llmgw("ctl", "fabrics", "--file", str(out / "ibnetdiscover.txt"), "--sm", str(out / "smir.txt"),
                       "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert f"0x{node_guid('node-3', 3):016x}" in {a["guid"] for a in doc["adapters"]}
    assert [(v["node"], v["adapter"]) for v in doc["rail_violations"]] == [("node-6", "mlx5_0"), ("node-6", "mlx5_1")]
    assert [f["master"]["guid"] for f in doc["subnet_managers"]] == [summary["master"]]
    kinds = sorted(p["kind"] for p in doc["problems"])
    assert kinds == ["degraded_link", "rail_violation", "rail_violation"]

    table = run_llmgw("ctl", "fabrics", "--file", str(out / "ibnetdiscover.txt"), "--sm", str(out / "smir.txt"),
                      env={"NO_COLOR": "1"})
    for heading in ("subnet managers of fabric", "degraded cables", "rail violations", "node-3 mlx5_3"):
        assert heading in table.stdout


def test_a_host_named_another_way_is_listed_apart_not_as_a_rail_violation(tmp_path: Path) -> None:
    """Issue 38, item 7: `ctl fabrics` says which nodes it did not hold to the rail order."""
    out = tmp_path / "fabric"
    made = run_llmgw("sim", "fabric", "--nodes", "8", "--rails", "2", "--group-size", "4", "--spines", "2",
                     "--misrail", "node-6", "--out", str(out), "-o", "json")
    assert made.returncode == 0, made.stderr
    dump = out / "ibnetdiscover.txt"
    dump.write_text(dump.read_text().replace('"node-6 mlx5_0"', '"node-6 HCA-1"').replace('"node-6 mlx5_1"',
                                                                                          '"node-6 HCA-2"'))
    doc = json.loads(run_llmgw("ctl", "fabrics", "--file", str(dump), "-o", "json").stdout)
    assert doc["rails_apart"] == ["node-6"] and doc["rail_violations"] == []
    table = run_llmgw("ctl", "fabrics", "--file", str(dump), env={"NO_COLOR": "1"}).stdout
    assert "not judged for rails (adapters counted or named unlike most nodes'): node-6" in table, table


def test_sim_fabric_bad_flags(tmp_path: Path) -> None:
    result = run_llmgw("sim", "fabric", "--nodes", "4", "--degrade", "node-99")
    assert result.returncode == 2 and "names no simulated node" in result.stderr and "Traceback" not in result.stderr
    result = run_llmgw("sim", "fabric", "--rate", "4xFAST")
    assert result.returncode == 2 and "4xNDR" in result.stderr
