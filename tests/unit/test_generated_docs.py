"""completions/ and man/ are generated from the CLI; a changed flag must regenerate them
(`make docs`), and the example configs under deploy/ must stay valid."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from llmgw.catalog import AgentConfig, ServerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def _gendocs():
    spec = importlib.util.spec_from_file_location("gendocs", ROOT / "tools" / "gendocs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_completion_scripts_are_current() -> None:
    for name, text in _gendocs().completion_scripts().items():
        committed = ROOT / "completions" / name
        assert committed.exists(), f"{committed} missing: run `make docs`"
        assert committed.read_text() == text, f"{committed} is stale: run `make docs`"


def test_man_pages_are_current() -> None:
    pages = _gendocs().man_pages()
    committed = {p.name for p in (ROOT / "man").glob("*.1")}
    assert committed == set(pages), f"man/ differs from the CLI's commands: run `make docs` ({committed ^ set(pages)})"
    for name, text in pages.items():
        assert (ROOT / "man" / name).read_text() == text, f"man/{name} is stale: run `make docs`"
    assert "llmgw-ctl-replicas.1" in pages and "--watch" in pages["llmgw-ctl-replicas.1"]
    assert "NODE_ID: the nodes the server knows." in pages["llmgw-ctl-drain.1"]  # dynamic completion (issue 45)
    assert "--shard: the ranks of the replica's shards." in pages["llmgw-ctl-logs.1"]
    assert "MODEL|REPLICA: the models with replicas, each followed by its replicas." in pages["llmgw-ctl-logs.1"]


@pytest.mark.parametrize(("name", "kind"), [("server.yaml", ServerConfig), ("agent.yaml", AgentConfig)])
def test_example_configs_parse(name: str, kind: type) -> None:
    load_config(str(ROOT / "deploy" / "examples" / name), kind)


def test_agent_unit_keeps_engines_and_unlimited_memlock() -> None:
    unit = (ROOT / "deploy" / "systemd" / "llmgw-agent.service").read_text()
    assert "LimitMEMLOCK=infinity" in unit and "KillMode=process" in unit
    # Not root, and no capabilities: memlock is a limit, not CAP_IPC_LOCK (docs/cluster.md, "What the agent needs").
    lines = unit.splitlines()
    assert "User=llmgw-agent" in lines and "CapabilityBoundingSet=" in lines and "NoNewPrivileges=true" in lines


def test_man_pages_say_exit_status_and_environment_and_whole_names() -> None:
    """Issue 46, item 4: EXIT STATUS and ENVIRONMENT on every page; NAME lines not cut mid-phrase."""
    pages = {p.name: p.read_text() for p in (ROOT / "man").glob("*.1")}
    assert pages
    for name, text in pages.items():
        assert ".SH EXIT STATUS" in text and ".SH ENVIRONMENT" in text, name
        line = text.split(".SH NAME\n", 1)[1].split("\n", 1)[0]
        assert line.count("(") == line.count(")"), (name, line)
    assert "As a Nagios plugin: 0 all ok, 1 a warning, 2 a critical finding, 3 could not run" in (
        pages["llmgw-ctl-doctor.1"])
    assert "As a Nagios plugin" in pages["llmgw-ctl-fabric-test.1"]
    drain = pages["llmgw-ctl-drain.1"]
    assert ".B LLMGW_SERVER\nstands in for --server" in drain and "3 the server unreachable" in drain
