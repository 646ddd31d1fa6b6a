"""Engine versions: the oldest release that takes each flag llmgw launches with (pure), and how
the agent reads the version a node has (real processes: a `vllm` script whose interpreter answers
from package metadata, a wrapper that answers `--version`, the simulated engine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from llmgw.agent import engine_version
from llmgw.agent.engines import adapter_for, versions
from llmgw.wire.messages import ShardSpec


def spec(engine: str, rank: int = 0, world: int = 1, mode: str = "") -> ShardSpec:
    return ShardSpec(shard_id=f"big-x.1.{rank}", replica_id="big-x", model="big", profile="p", engine=engine, rank=rank,
                     world=world, gpus=[0, 1], port=20001, master_addr="10.0.0.1", master_port=20002,
                     engine_mode=mode, source="org/big", served_name="big")


def argv(engine: str, **kwargs: object) -> list[str]:
    return adapter_for(engine).argv(spec(engine, **kwargs), "10.0.0.1", 20001)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "parsed"), [
    ("0.11.1", (0, 11, 1)), ("0.5.0.post1", (0, 5, 0)), ("0.11.1rc2.dev3+gabc123", (0, 11, 1)), ("v0.9.0", (0, 9, 0)),
    ("0.10.1.1", (0, 10, 1)), ("dev", None), ("0.0.0.dev0", None), ("", None),
])
def test_a_version_is_its_release_numbers(text, parsed):
    assert versions.parse(text) == parsed


def test_what_each_launch_needs_is_the_newest_of_its_flags():
    assert versions.needs("vllm", argv("vllm")) == ((0, 5, 2), [])  # `vllm serve`
    assert versions.needs("vllm", argv("vllm", world=2, rank=1)) == ((0, 11, 1), ["--nnodes", "--node-rank",
                                                                                "--master-addr", "--master-port"])
    # Ray mode: `vllm serve` is newer
    assert versions.needs("vllm", argv("vllm", world=2, mode="ray")) == ((0, 5, 2), [])
    assert versions.needs("sglang", argv("sglang")) == ((0, 2, 9), ["--served-model-name"])
    assert versions.needs("sglang", argv("sglang", world=2)) == ((0, 3, 3), ["--dist-init-addr"])
    assert versions.needs("sim", argv("sim", world=2)) == ((0, 11, 1), ["--nnodes", "--node-rank", "--master-addr",
                                                                       "--master-port"])


def test_a_launch_an_old_engine_would_fail_is_refused_with_the_version_found():
    multi = argv("vllm", world=2)
    assert versions.refusal("vllm", "0.11.1", "here", multi) == ""
    assert versions.refusal("vllm", "0.10.2", "here", argv("vllm")) == ""  # one node: 0.10.2 takes all of it
    assert versions.refusal("vllm", "0.10.2", "/opt/vllm/bin/python, package metadata", multi) == (
        "vLLM 0.10.2 (/opt/vllm/bin/python, package metadata) is older than 0.11.1, the first release with --nnodes, "
        "--node-rank, --master-addr, --master-port; upgrade vLLM on this node or run the replica on one node")
    assert "older than 0.5.2, the first release with `vllm serve`; upgrade vLLM on this node" in versions.refusal(
        "vllm", "0.4.3", "here", argv("vllm"))
    assert "SGLang 0.3.2 (here) is older than 0.3.3, the first release with --dist-init-addr" in versions.refusal(
        "sglang", "0.3.2", "here", argv("sglang", world=2))
    assert versions.refusal("vllm", "dev", "here", multi) == ""  # a source build that cannot say is launched
    assert versions.refusal("command", "0.0.1", "here", ["anything"]) == ""


# ---- reading it, for real ------------------------------------------------------------------------


def fake_vllm(tmp_path: Path, version: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `vllm` script run by this Python, and package metadata saying `version` on its path."""
    site = tmp_path / "site"
    dist = site / "vllm-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "vllm"
    if not script.exists():
        script.write_text(f"#!{sys.executable}\nraise SystemExit('the version is read without running vllm')\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return dist


async def test_vllms_version_comes_from_its_interpreters_package_metadata(tmp_path, monkeypatch):
    fake_vllm(tmp_path, "0.10.2", monkeypatch)
    reader = engine_version.EngineVersions()
    why = await reader.refusal("vllm", argv("vllm", world=2))
    assert why.startswith(f"vLLM 0.10.2 ({sys.executable}, package metadata) is older than 0.11.1")
    assert await reader.refusal("vllm", argv("vllm")) == ""  # the kept reading, for a one-node launch
    assert len(reader.kept) == 1


async def test_an_engine_upgraded_in_place_is_read_again_before_a_refusal(tmp_path, monkeypatch):
    dist = fake_vllm(tmp_path, "0.10.2", monkeypatch)
    reader = engine_version.EngineVersions()
    assert await reader.refusal("vllm", argv("vllm")) == ""  # 0.10.2 read and kept
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.1\n")  # the script is unchanged
    assert await reader.refusal("vllm", argv("vllm", world=2)) == ""
    assert [r.version for r in reader.kept.values()] == ["0.11.1"]


async def test_a_vllm_wrapper_is_asked_its_version_and_an_unreadable_one_is_launched(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "vllm"
    wrapper.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 0.8.5 && exit 0\nexit 2\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert f"vLLM 0.8.5 ({wrapper} --version) is older than 0.11.1" in await engine_version.EngineVersions().refusal(
        "vllm", argv("vllm", world=2))
    wrapper.write_text("#!/bin/sh\nsleep 5\n")
    slow = engine_version.EngineVersions(deadline=0.5)
    assert await slow.refusal("vllm", argv("vllm", world=2)) == ""
    [reading] = slow.kept.values()
    assert reading.problem == "no answer within 0.5s"


async def test_the_simulated_engine_says_which_vllm_it_stands_for(monkeypatch):
    reader = engine_version.EngineVersions()
    assert await reader.refusal("sim", argv("sim", world=2)) == ""  # 0.11.1: every flag its ranks take
    monkeypatch.setenv("LLMGW_SIM_ENGINE_VERSION", "0.10.2")
    why = await engine_version.EngineVersions().refusal("sim", argv("sim", world=2))
    assert why.startswith("vLLM 0.10.2 (llmgw sim engine --version) is older than 0.11.1")
