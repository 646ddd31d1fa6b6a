"""Engine adapters: the argv and environment each builds for a shard, and what each refuses.

The process these become is checked end to end in tests/e2e/test_supervisor.py (its
/proc/<pid>/cmdline and environ); here, every flag and placeholder one by one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmgw.agent.engines import LaunchError, adapter_for, tensor_parallel_arg
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import ServerConfig
from llmgw.server.reconcile import shard_spec
from llmgw.wire.messages import ShardSpec


def spec(engine: str, **kw: Any) -> ShardSpec:
    base: dict[str, Any] = {"shard_id": "llama-bcdfg.1", "replica_id": "llama-bcdfg", "model": "llama", "profile": "p",
                            "engine": engine, "source": "meta-llama/Llama-3.1-8B-Instruct", "port": 20001,
                            "served_name": "llama", "gpus": [0]}
    base.update(kw)
    return ShardSpec(**base)


# -- vllm --------------------------------------------------------------------------------------


def test_vllm_argv_one_gpu() -> None:
    argv = adapter_for("vllm").argv(spec("vllm", args=["--max-model-len", "8192"]), "10.0.0.5", 20001)
    assert argv == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "10.0.0.5", "--port", "20001",
                    "--served-model-name", "llama", "--max-model-len", "8192"]


def test_vllm_argv_sets_tensor_parallel_from_the_gpu_count() -> None:
    argv = adapter_for("vllm").argv(spec("vllm", gpus=[4, 5, 6, 7]), "127.0.0.1", 20001)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"


@pytest.mark.parametrize("args", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["-tp", "2"]])
def test_vllm_argv_keeps_a_tensor_size_the_profile_sets(args: list[str]) -> None:
    argv = adapter_for("vllm").argv(spec("vllm", gpus=[0, 1], args=args), "127.0.0.1", 20001)
    assert argv[-len(args):] == args
    assert sum(a.startswith("--tensor-parallel-size") or a == "-tp" for a in argv) == 1


def test_vllm_argv_keeps_a_served_name_the_profile_sets_and_defaults_the_source() -> None:
    argv = adapter_for("vllm").argv(spec("vllm", source="", args=["--served-model-name", "alias"]), "h", 1)
    assert argv[2] == "llama" and argv.count("--served-model-name") == 1 and argv[-1] == "alias"


@pytest.mark.parametrize("args", [["--tensor-parallel-size", "4"], ["--tensor-parallel-size=4"], ["-tp", "4"]])
def test_vllm_refuses_a_tensor_size_that_is_not_the_gpu_count(args: list[str]) -> None:
    with pytest.raises(LaunchError,
                       match=r"vllm: profile args set tensor parallel size 4 but the shard has 2 GPU\(s\) \[0, 1\]; "
                                          r"drop the flag or set gpus: 4"):
        adapter_for("vllm").validate(spec("vllm", gpus=[0, 1], args=args))


def test_the_tensor_size_is_reported_even_where_the_binary_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile's mistake is wrong on every node; the binary only on this one: name the first."""
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LaunchError, match="tensor parallel size 4"):
        adapter_for("vllm").validate(spec("vllm", gpus=[0, 1], args=["--tensor-parallel-size", "4"]))
    with pytest.raises(LaunchError, match=r"vllm: executable 'vllm' not found on PATH \(/nonexistent\)"):
        adapter_for("vllm").validate(spec("vllm", gpus=[0, 1], args=["--tensor-parallel-size", "2"]))


def test_vllm_validates_when_the_binary_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "vllm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    adapter_for("vllm").validate(spec("vllm", gpus=[0, 1], args=["-tp", "2"]))
    fake.chmod(0o644)  # there, but not executable
    with pytest.raises(LaunchError, match="not found on PATH"):
        adapter_for("vllm").validate(spec("vllm"))


def test_a_tensor_size_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(LaunchError, match="--tensor-parallel-size needs a number, got 'four'"):
        adapter_for("vllm").validate(spec("vllm", gpus=[0, 1], args=["--tensor-parallel-size", "four"]))


def test_tensor_parallel_arg_forms() -> None:
    flags = ("--tp", "--tp-size")
    assert tensor_parallel_arg(["--tp", "8"], flags) == 8
    assert tensor_parallel_arg(["--tp-size=2"], flags) == 2
    assert tensor_parallel_arg(["--tpx", "2", "--tp"], flags) is None  # a flag with no value is not a size
    assert tensor_parallel_arg([], flags) is None


# -- sglang ------------------------------------------------------------------------------------


def test_sglang_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_SGLANG_PYTHON", raising=False)
    argv = adapter_for("sglang").argv(spec("sglang", gpus=[2, 3], args=["--mem-fraction-static", "0.8"]), "0.0.0.0",
                                      30000)
    assert argv == ["python3", "-m", "sglang.launch_server", "--model-path", "meta-llama/Llama-3.1-8B-Instruct",
                    "--host", "0.0.0.0", "--port", "30000", "--tp-size", "2", "--served-model-name", "llama",
                    "--mem-fraction-static", "0.8"]


def test_sglang_python_comes_from_the_agent_env_never_from_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_SGLANG_PYTHON", "/opt/sglang/bin/python")
    assert adapter_for("sglang").argv(spec("sglang"), "h", 1)[0] == "/opt/sglang/bin/python"
    # A profile (the server) cannot pick the executable: LLMGW_PYTHON is just a variable now.
    assert adapter_for("sglang").argv(spec("sglang", env={"LLMGW_PYTHON": "/tmp/evil"}), "h",
                                      1)[0] == "/opt/sglang/bin/python"
    monkeypatch.delenv("LLMGW_SGLANG_PYTHON")
    assert adapter_for("sglang").argv(spec("sglang", env={"LLMGW_PYTHON": "/tmp/evil"}), "h", 1)[0] == "python3"


@pytest.mark.parametrize("args", [["--tp", "4"], ["--tp-size", "4"], ["--tensor-parallel-size=4"]])
def test_sglang_refuses_a_tensor_size_that_is_not_the_gpu_count(args: list[str]) -> None:
    with pytest.raises(LaunchError, match=r"sglang: profile args set tensor parallel size 4 but the shard has 2 GPU"):
        adapter_for("sglang").validate(spec("sglang", gpus=[0, 1], args=args))


def test_sglang_keeps_the_profiles_tp() -> None:
    argv = adapter_for("sglang").argv(spec("sglang", gpus=[0, 1], args=["--tp-size", "2"]), "h", 1)
    assert "--tp" not in argv and argv[-2:] == ["--tp-size", "2"]


# -- command -----------------------------------------------------------------------------------


def test_command_fills_every_placeholder() -> None:
    s = spec("command", gpus=[4, 6], rank=1, world=2,
             command=["/opt/engine/serve", "--listen={host}:{port}", "--weights", "{source}", "--name", "{model}"],
             args=["--gpus", "{gpus}", "--tp", "{tp}", "--rank", "{rank}/{world}", "--json", '{{"a": 1}}'])
    assert adapter_for("command").argv(s, "10.1.2.3", 24000) == [
        "/opt/engine/serve", "--listen=10.1.2.3:24000", "--weights", "meta-llama/Llama-3.1-8B-Instruct", "--name",
        "llama",
        "--gpus", "4,6", "--tp", "2", "--rank", "1/2", "--json", '{"a": 1}',
    ]


def test_command_with_no_gpus_has_tp_one() -> None:
    s = spec("command", gpus=[], command=["serve", "{tp}", "[{gpus}]"])
    assert adapter_for("command").argv(s, "h", 1) == ["serve", "1", "[]"]


@pytest.mark.parametrize(("part", "message"), [
    ("--port={prot}", r"unknown placeholder \{prot\}; known: \{port\}, \{host\}"),
    ('{"temperature": 0}', r"unknown placeholder \{\"temperature\"\}.*write \{\{ and \}\} for literal braces"),
    ("oops}", r"Single '\}' encountered.*literal braces"),
])
def test_command_template_mistakes_are_named(part: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        adapter_for("command").argv(spec("command", command=["serve", part]), "h", 1)


def test_command_needs_a_template_and_a_program_that_exists(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="engine 'command' needs a command template"):
        adapter_for("command").argv(spec("command", command=[]), "h", 1)
    with pytest.raises(LaunchError, match=r"command: executable '/nonexistent/engine' not found"):
        adapter_for("command").validate(spec("command", command=["/nonexistent/engine", "--port", "{port}"]))
    with pytest.raises(LaunchError, match=r"command: executable 'llmgw-no-such-engine' not found on PATH"):
        adapter_for("command").validate(spec("command", command=["llmgw-no-such-engine"]))
    adapter_for("command").validate(spec("command", command=[sys.executable, "-c", "pass"]))
    # No tensor-size rule for an arbitrary command: it may spell it any way.
    adapter_for("command").validate(spec("command", gpus=[0, 1], command=[sys.executable], args=["--tp", "4"]))


# -- sim ---------------------------------------------------------------------------------------


def test_sim_argv_runs_the_simulated_engine_in_this_python() -> None:
    argv = adapter_for("sim").argv(spec("sim", args=["--startup-delay", "0.3"]), "127.0.0.1", 20001)
    assert argv == [sys.executable, "-m", "llmgw", "sim", "engine", "--host", "127.0.0.1", "--port", "20001",
                    "--model", "llama", "--startup-delay", "0.3"]
    adapter_for("sim").validate(spec("sim", gpus=[0, 1], args=["--tensor-parallel-size", "4"]))  # the sim takes any


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(LaunchError, match="unknown engine 'trtllm'; this agent knows command, sglang, sim, vllm"):
        adapter_for("trtllm")


# -- environment ---------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang", "command", "sim"])
def test_cuda_visible_devices_is_exactly_the_shards_gpus(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # what the agent itself sees
    env = adapter_for(engine).env(spec(engine, gpus=[5, 2], command=["x"],
                                       env={"CUDA_VISIBLE_DEVICES": "0", "HF_HOME": "/models"}))
    assert env["CUDA_VISIBLE_DEVICES"] == "5,2"  # placement's choice wins over the profile's
    assert env["HF_HOME"] == "/models" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"] == os.environ["PATH"]


def test_a_shard_with_no_gpus_sees_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert adapter_for("command").env(spec("command", gpus=[], command=["x"]))["CUDA_VISIBLE_DEVICES"] == ""
    # Unless the profile says which it may use.
    env = adapter_for("command").env(spec("command", gpus=[], command=["x"], env={"CUDA_VISIBLE_DEVICES": "3"}))
    assert env["CUDA_VISIBLE_DEVICES"] == "3"


def test_profile_env_can_override_pythonunbuffered() -> None:  # (the agent's allowlist permits it by default)
    assert adapter_for("sim").env(spec("sim", env={"PYTHONUNBUFFERED": "0"}))["PYTHONUNBUFFERED"] == "0"


def test_the_spec_the_server_builds_from_a_catalog_gives_the_expected_argv() -> None:
    """From YAML to argv, through the reconciler's shard_spec: what the agent will run."""
    cfg = parse_config(
        "models:\n"
        "  - name: llama\n"
        "    source: /models/llama-70b\n"
        "    profiles:\n"
        "      - name: tp4\n"
        "        engine: vllm\n"
        "        gpus: 4\n"
        "        args: [--max-model-len, '8192']\n"
        "        env: {VLLM_ATTENTION_BACKEND: FLASHINFER}\n",
        ServerConfig,
    )
    model = cfg.models[0]
    s = shard_spec(model, model.profiles[0], "llama-x", "llama-x.1", [4, 5, 6, 7], 20007)
    s = msgspec.json.decode(msgspec.json.encode(s), type=ShardSpec)  # as it crosses the wire
    adapter = adapter_for(s.engine)
    assert adapter.argv(s, "10.0.0.9", s.port) == [
        "vllm", "serve", "/models/llama-70b", "--host", "10.0.0.9", "--port", "20007",
        "--tensor-parallel-size", "4", "--served-model-name", "llama", "--max-model-len", "8192"]
    env = adapter.env(s)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and env["VLLM_ATTENTION_BACKEND"] == "FLASHINFER"


# -- engine API keys ---------------------------------------------------------------------------

KEY = "k3y-0123456789abcdef"


def test_vllm_and_sim_get_the_key_in_their_environment_not_their_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM reads VLLM_API_KEY as it reads --api-key; argv is readable by every local user."""
    monkeypatch.setenv("VLLM_API_KEY", "the-agents-own")
    for engine in ("vllm", "sim"):
        s = spec(engine, api_key=KEY)
        assert not any(KEY in a for a in adapter_for(engine).argv(s, "127.0.0.1", 20001))
        assert adapter_for(engine).env(s)["VLLM_API_KEY"] == KEY
        # No key for the shard: none at all, not one the agent or a profile happens to have.
        assert "VLLM_API_KEY" not in adapter_for(engine).env(spec(engine, env={"VLLM_API_KEY": "from-profile"}))
        assert adapter_for(engine).env(spec(engine, api_key=KEY,
                                            env={"VLLM_API_KEY": "from-profile"}))["VLLM_API_KEY"] == KEY


def test_sglang_gets_the_key_as_its_api_key_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_SGLANG_PYTHON", raising=False)
    argv = adapter_for("sglang").argv(spec("sglang", api_key=KEY), "127.0.0.1", 30000)
    assert argv[argv.index("--api-key") + 1] == KEY and argv.count("--api-key") == 1
    assert "--api-key" not in adapter_for("sglang").argv(spec("sglang"), "127.0.0.1", 30000)


def test_command_gets_the_key_as_a_placeholder_and_in_its_environment() -> None:
    s = spec("command", api_key=KEY, command=["/opt/serve", "--key={api_key}", "--port", "{port}"])
    assert adapter_for("command").argv(s, "h", 1) == ["/opt/serve", f"--key={KEY}", "--port", "1"]
    assert adapter_for("command").env(s)["LLMGW_ENGINE_API_KEY"] == KEY


@pytest.mark.parametrize(("engine", "args"), [("vllm", ["--api-key", "mine"]), ("sglang", ["--api-key=mine"])])
def test_a_profile_cannot_set_its_own_engine_key(engine: str, args: list[str]) -> None:
    with pytest.raises(LaunchError,
                       match=f"{engine}: profile args set --api-key, but the agent gives every engine its own key"):
        adapter_for(engine).validate(spec(engine, api_key=KEY, args=args))


def test_the_server_gives_every_shard_its_own_key() -> None:
    from llmgw.server.reconcile import new_engine_key

    keys = {new_engine_key() for _ in range(100)}
    assert len(keys) == 100 and all(len(k) >= 43 for k in keys)
