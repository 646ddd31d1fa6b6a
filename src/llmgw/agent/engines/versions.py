"""The oldest engine release that takes each flag llmgw launches it with. Pure.

A launch with a flag its engine does not know fails minutes later (after the weights are
downloaded, or in rank 1 of 4 while the others wait), with argparse's one-line complaint buried
in the engine's log. The agent reads the engine's version once (agent/engine_version.py) and
refuses such a launch at once, with the version it found and the flag that needs a newer one.

Each minimum was read in the released sources (the sdists on PyPI, the first release that has the
flag; the release before it does not):

vLLM (`vllm serve`):
- `vllm serve` itself: 0.5.2 (vllm/scripts.py, the `vllm` console script; 0.5.1 has neither).
  `--host --port --tensor-parallel-size --pipeline-parallel-size --served-model-name` and the
  VLLM_API_KEY variable are older (0.4.2 has them all).
- `--distributed-executor-backend` (Ray mode): 0.4.3 (vllm/engine/arg_utils.py; 0.4.2 has only
  `--worker-use-ray`).
- `--headless`: 0.9.0 (vllm/entrypoints/cli/serve.py).
- `--nnodes --node-rank --master-addr --master-port` (multi-node without Ray): 0.11.1
  (vllm/engine/arg_utils.py, ParallelConfig; 0.11.0 has none of them).

SGLang (`python -m sglang.launch_server`):
- `--model-path --host --port --tp-size --api-key`: 0.1.13 or older (the oldest sdist read).
  llmgw passes `--tp-size`, SGLang's own name; `--tp` only ever worked as argparse's
  abbreviation of it.
- `--nnodes --node-rank`: 0.1.18 (sglang/srt/server_args.py).
- `--served-model-name`: 0.2.9.
- `--dist-init-addr`: 0.3.3 (before it, `--nccl-init-addr`, still an alias).

The simulated engine takes vLLM's flags and says which vLLM it stands for (`llmgw sim engine
--version`), so it is held to vLLM's table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

Version = tuple[int, ...]

VLLM_SERVE: Version = (0, 5, 2)
VLLM_FLAGS: dict[str, Version] = {
    "--distributed-executor-backend": (0, 4, 3),
    "--headless": (0, 9, 0),
    "--nnodes": (0, 11, 1),
    "--node-rank": (0, 11, 1),
    "--master-addr": (0, 11, 1),
    "--master-port": (0, 11, 1),
}
SGLANG_BASE: Version = (0, 1, 13)
SGLANG_FLAGS: dict[str, Version] = {
    "--nnodes": (0, 1, 18),
    "--node-rank": (0, 1, 18),
    "--served-model-name": (0, 2, 9),
    "--dist-init-addr": (0, 3, 3),
}
# The engines whose version is checked, and whose table they are held to.
TABLES: dict[str, tuple[str, Version, dict[str, Version]]] = {
    "vllm": ("vLLM", VLLM_SERVE, VLLM_FLAGS),
    "sim": ("vLLM", VLLM_SERVE, VLLM_FLAGS),
    "sglang": ("SGLang", SGLANG_BASE, SGLANG_FLAGS),
}

_LEADING = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def parse(text: str) -> Version | None:
    """The release numbers of a version string ("0.11.1", "0.5.0.post1", "0.11.1rc2.dev3+gabc",
    "v0.9.0"); None when it names no release ("dev", a source tree without its version file)."""
    match = _LEADING.match(text)
    if match is None:
        return None
    numbers = tuple(int(part) for part in match.group(1).split("."))
    if not any(numbers):
        return None  # 0.0.0.dev0 and the like: a build that cannot say
    return numbers[:3]


def show(version: Version) -> str:
    return ".".join(str(n) for n in version)


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def needs(engine: str, argv: Sequence[str]) -> tuple[Version, list[str]]:
    """The oldest release that takes every flag of `argv` the table knows, and the flags that
    set it (empty when the base command sets it)."""
    _, base, flags = TABLES[engine]
    want, why = base, []
    for arg in dict.fromkeys(_flag(a) for a in argv):
        need = flags.get(arg)
        if need is None:
            continue
        if need > want:
            want, why = need, [arg]
        elif need == want and need > base:
            why.append(arg)
    return want, why


def refusal(engine: str, found: str, where: str, argv: Sequence[str]) -> str:
    """Why this launch would fail with the engine version `found` ("" when it would not, or
    when the version cannot be told: a build that names no release is launched)."""
    if engine not in TABLES:
        return ""
    version = parse(found)
    if version is None:
        return ""
    name, _, _ = TABLES[engine]
    want, flags = needs(engine, argv)
    if version >= want:
        return ""
    if flags:
        what = f"the first release with {', '.join(flags)}"
    else:
        what = "the first release with `vllm serve`" if name == "vLLM" else "the oldest release llmgw launches"
    multinode = {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--dist-init-addr", "--headless"}
    alternative = " or run the replica on one node" if multinode & set(flags) else ""
    return f"{name} {found} ({where}) is older than {show(want)}, {what}; upgrade {name} on this node{alternative}"
