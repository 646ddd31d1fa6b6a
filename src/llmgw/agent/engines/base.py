"""What every engine adapter answers: the argv for a shard, and what it needs to start."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence

from llmgw.agent.engines import multinode
from llmgw.wire.messages import ShardSpec


class LaunchError(Exception):
    """The shard cannot be launched; the message is what the operator sees."""


class Adapter:
    name = ""
    # Flags that set the tensor-parallel size, which must equal the shard's GPU count.
    tp_flags: tuple[str, ...] = ()
    # Where the shard's engine API key goes: an environment variable (kept out of argv, which
    # every local user can read in /proc), or else the engine's --api-key flag.
    key_env = ""
    key_flag = ""

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        raise NotImplementedError

    def executable(self, spec: ShardSpec) -> str:
        return self.argv(spec, "127.0.0.1", spec.port or 1)[0]

    def executables(self, spec: ShardSpec, argv: list[str]) -> list[str]:
        """What the agent's allowlist must allow for this launch (argv[0], or what a wrapper runs)."""
        return [argv[0]]

    def validate(self, spec: ShardSpec) -> None:
        """Raise LaunchError for what would fail minutes later (bad tensor size, missing binary).

        The profile's own mistakes first: a tensor size that contradicts the GPU count is
        wrong on every node, a missing binary only on this one.
        """
        if spec.api_key and self.key_flag and any(
            a == self.key_flag or a.startswith(self.key_flag + "=") for a in spec.args
        ):
            raise LaunchError(
                f"{self.name}: profile args set {self.key_flag}, but the agent gives every engine its own key "
                "(the one the gateway sends); drop the flag"
            )
        if self.tp_flags and spec.gpus and not multinode.has_flag(spec.args, "--pipeline-parallel-size", "-pp"):
            tp = tensor_parallel_arg(spec.args, self.tp_flags)
            want = multinode.tensor_parallel(spec, self.name)
            if tp is not None and tp != want:
                where = f"the replica has {want} GPU(s) on {spec.world} nodes" if want != len(spec.gpus) else \
                    f"the shard has {len(spec.gpus)} GPU(s) {spec.gpus}"
                raise LaunchError(
                    f"{self.name}: profile args set tensor parallel size {tp} but {where}; "
                    f"drop the flag or set gpus: {tp}"
                )
        for exe in self.executables(spec, self.argv(spec, "127.0.0.1", spec.port or 1)):
            if not _runnable(exe):
                raise LaunchError(f"{self.name}: executable {exe!r} not found on PATH ({os.environ.get('PATH', '')})")

    def env(self, spec: ShardSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.env)
        # The GPUs placement gave the shard and no others: an engine given none sees none
        # (not every GPU the agent happens to see), unless its profile says otherwise.
        if spec.gpus or "CUDA_VISIBLE_DEVICES" not in spec.env:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.key_env:
            env.pop(self.key_env, None)  # only the shard's own key, never one the agent or a profile has
            if spec.api_key:
                env[self.key_env] = spec.api_key
        return env


def _runnable(exe: str) -> bool:
    if os.sep in exe:
        return os.path.isfile(exe) and os.access(exe, os.X_OK)
    return shutil.which(exe) is not None


def tensor_parallel_arg(args: Sequence[str], flags: Sequence[str]) -> int | None:
    """The tensor-parallel size set in profile args (`--tp 4`, `--tp=4`), if any."""
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                raise LaunchError(f"profile args: {flag} needs a number, got {value!r}") from None
    return None


class VllmAdapter(Adapter):
    """`vllm serve SOURCE --host H --port P --tensor-parallel-size N --served-model-name M …args`"""

    name = "vllm"
    tp_flags = ("--tensor-parallel-size", "-tp")
    # vLLM reads VLLM_API_KEY as it reads --api-key (`args.api_key or envs.VLLM_API_KEY`) and,
    # from the environment, does not print it among its non-default args at start.
    key_env = "VLLM_API_KEY"
    key_flag = "--api-key"

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        argv = ["vllm", "serve", spec.source or spec.model, "--host", host, "--port", str(port)]
        if tensor_parallel_arg(spec.args, self.tp_flags) is None and len(spec.gpus) > 1:
            argv += ["--tensor-parallel-size", str(len(spec.gpus))]
        if spec.served_name and "--served-model-name" not in spec.args:
            argv += ["--served-model-name", spec.served_name]
        argv += multinode.vllm_flags(spec)
        argv += list(spec.args)
        if spec.world > 1 and spec.engine_mode == multinode.MODE_RAY:
            return multinode.ray_argv(sys.executable, spec, argv)
        return argv

    def executables(self, spec: ShardSpec, argv: list[str]) -> list[str]:
        if spec.world > 1 and spec.engine_mode == multinode.MODE_RAY:
            return ["ray", "vllm"] if spec.rank == 0 else ["ray"]  # what the rayrank wrapper runs
        return [argv[0]]


class SglangAdapter(Adapter):
    """`python -m sglang.launch_server --model-path SOURCE --host H --port P --tp-size N …args`"""

    name = "sglang"
    tp_flags = ("--tp", "--tp-size", "--tensor-parallel-size")
    key_flag = "--api-key"  # SGLang reads it from no environment variable

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        # The interpreter is the agent's choice (its own environment), never the server's.
        python = os.environ.get("LLMGW_SGLANG_PYTHON") or "python3"
        argv = [python, "-m", "sglang.launch_server", "--model-path", spec.source or spec.model,
                "--host", host, "--port", str(port)]
        if spec.api_key:
            argv += ["--api-key", spec.api_key]
        tp = multinode.tensor_parallel(spec, self.name)
        if tensor_parallel_arg(spec.args, self.tp_flags) is None and tp > 1:
            argv += ["--tp-size", str(tp)]  # SGLang's own name; `--tp` is only argparse's abbreviation of it
        if spec.served_name and "--served-model-name" not in spec.args:
            argv += ["--served-model-name", spec.served_name]
        return argv + multinode.sglang_flags(spec) + list(spec.args)


class CommandAdapter(Adapter):
    """Any command: an argv template with {port} {host} {source} {model} {gpus} {tp} {rank} {world}
    {master_addr} {master_port} {api_key}; the key is also in the environment as LLMGW_ENGINE_API_KEY."""

    name = "command"
    key_env = "LLMGW_ENGINE_API_KEY"

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        if not spec.command:
            raise LaunchError("engine 'command' needs a command template in the profile")
        values = {
            "port": str(port),
            "host": host,
            "source": spec.source or spec.model,
            "model": spec.served_name or spec.model,
            "gpus": ",".join(str(g) for g in spec.gpus),
            "tp": str(max(len(spec.gpus), 1)),
            "rank": str(spec.rank),
            "world": str(spec.world),
            "master_addr": spec.master_addr,
            "master_port": str(spec.master_port),
            "api_key": spec.api_key,
        }
        out = []
        for part in list(spec.command) + list(spec.args):
            try:
                out.append(part.format_map(values))
            except (KeyError, IndexError) as exc:
                raise LaunchError(
                    f"command template {part!r}: unknown placeholder {{{exc.args[0]}}}; known: "
                    f"{', '.join('{' + k + '}' for k in values)} (write {{{{ and }}}} for literal braces)"
                ) from None
            except ValueError as exc:
                raise LaunchError(
                    f"command template {part!r}: {exc} (write {{{{ and }}}} for literal braces)"
                ) from None
        return out


class SimAdapter(Adapter):
    """The simulated engine (`llmgw sim engine`), in this agent's own Python."""

    name = "sim"
    key_env = "VLLM_API_KEY"  # as vLLM

    def argv(self, spec: ShardSpec, host: str, port: int) -> list[str]:
        # The multi-node flags as vLLM takes them: the simulated engine's ranks join like vLLM's,
        # in Ray mode through the same rayrank wrapper, with `llmgw sim node`'s stand-in `ray`.
        argv = [sys.executable, "-m", "llmgw", "sim", "engine", "--host", host, "--port", str(port),
                "--model", spec.served_name or spec.model, *multinode.vllm_flags(spec), *spec.args]
        if spec.world > 1 and spec.engine_mode == multinode.MODE_RAY:
            return multinode.ray_argv(sys.executable, spec, argv)
        return argv

    def executables(self, spec: ShardSpec, argv: list[str]) -> list[str]:
        if spec.world > 1 and spec.engine_mode == multinode.MODE_RAY:
            return ["ray"]  # what the rayrank wrapper runs besides this agent's own Python
        return [argv[0]]


ADAPTERS: dict[str, Adapter] = {a.name: a for a in (VllmAdapter(), SglangAdapter(), CommandAdapter(), SimAdapter())}


def adapter_for(engine: str) -> Adapter:
    adapter = ADAPTERS.get(engine)
    if adapter is None:
        raise LaunchError(f"unknown engine {engine!r}; this agent knows {', '.join(sorted(ADAPTERS))}")
    return adapter
