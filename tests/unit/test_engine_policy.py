"""The agent's allowlist: which engines, executables and profile environment keys it accepts.
The supervisor applying it to real launches is in tests/e2e/test_supervisor.py, a real agent
refusing a server's Start in tests/e2e/test_agent_allowlist.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from llmgw.agent.engines import LaunchError
from llmgw.agent.engines.policy import (
    check_engine,
    check_env,
    check_executable,
    env_refused,
    executable_allowed,
)
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig, EngineAllow


def test_the_default_runs_the_known_engines_but_not_any_command() -> None:
    allow = EngineAllow()
    for engine in ("vllm", "sglang", "sim"):
        check_engine(engine, allow)
    with pytest.raises(LaunchError, match="engine 'command' is not allowed on this node"):
        check_engine("command", allow)


@pytest.mark.parametrize("key", ["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONSTARTUP",
                                 "PYTHONHOME", "PYTHONINSPECT"])
def test_keys_that_change_what_runs_are_refused_by_default(key: str) -> None:
    assert env_refused(key, EngineAllow())
    with pytest.raises(LaunchError, match=f"profile env sets {key}, which this node refuses"):
        check_env({key: "x", "HF_HOME": "/models"}, EngineAllow())


def test_ordinary_keys_and_explicitly_allowed_ones_pass() -> None:
    check_env({"HF_HOME": "/models", "VLLM_ATTENTION_BACKEND": "FLASHINFER", "NCCL_IB_HCA": "mlx5",
               "PYTHONUNBUFFERED": "0",
               "CUDA_VISIBLE_DEVICES": "0"}, EngineAllow())
    check_env({"LD_LIBRARY_PATH": "/opt/cuda/lib64"}, EngineAllow(env=["LD_LIBRARY_PATH"]))
    assert not env_refused("path", EngineAllow())  # case matters: PATH is PATH


def test_bare_names_match_bare_names_only() -> None:
    assert executable_allowed("vllm", ["vllm", "python3"])
    assert executable_allowed("python3", ["python*"])
    assert not executable_allowed("sh", ["vllm", "python3"])
    assert not executable_allowed("vllm", ["/usr/local/bin/vllm"])  # a name could resolve anywhere: list it as a name


def test_paths_match_by_pattern_or_by_the_file_they_resolve_to(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    engines.mkdir()
    serve = engines / "serve"
    serve.write_text("#!/bin/sh\n")
    serve.chmod(0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "serve").symlink_to(serve)  # another name for an allowed file
    evil = elsewhere / "evil"
    evil.write_text("#!/bin/sh\n")
    (engines / "link").symlink_to(evil)  # a link an admin put in an allowed dir

    assert executable_allowed(str(serve), [str(serve)])
    assert executable_allowed(str(elsewhere / "serve"), [str(serve)])
    assert executable_allowed(str(serve), [f"{engines}/*"])
    assert executable_allowed(str(engines / "link"), [f"{engines}/*"])  # as written: the admin's own dir
    assert not executable_allowed(str(evil), [f"{engines}/*", str(serve)])
    assert not executable_allowed(f"{engines}/../elsewhere/evil", [f"{engines}/*"])  # `..` folded first
    assert not executable_allowed("engines/serve", ["*", f"{engines}/*"])  # relative: resolved in the work dir, never
    python3 = shutil.which("python3")
    assert python3 is not None
    assert executable_allowed(os.path.realpath(python3), ["python3"])  # the file the name is here


def test_the_simulated_engine_needs_no_entry_but_only_as_itself() -> None:
    import sys

    check_executable("sim", sys.executable, EngineAllow(executables=[]))
    with pytest.raises(LaunchError, match=r"command: executable '.*' is not allowed on this node"):
        check_executable("command", sys.executable, EngineAllow(executables=[]))


def test_the_allowlist_is_read_from_the_agent_config_and_checked() -> None:
    cfg = parse_config("allow:\n  engines: [vllm, command]\n  executables: [/opt/engines/*]\n"
                       "  env: [LD_LIBRARY_PATH]\n", AgentConfig)
    assert cfg.allow.engines == ["vllm", "command"] and cfg.allow.executables == ["/opt/engines/*"]
    assert cfg.allow.refuse_env == ["PATH", "LD_*", "PYTHON*"]  # the default stays unless set
    assert parse_config("", AgentConfig).allow == EngineAllow()
    from llmgw.errors import UsageError

    with pytest.raises(UsageError, match="trtllm"):
        parse_config("allow:\n  engines: [trtllm]\n", AgentConfig)
