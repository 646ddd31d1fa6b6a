"""Which vLLM or SGLang this node has: read once per engine install, the first time it is launched.

How, per engine (what each runs, with a deadline, in a worker process):
- vLLM: the interpreter on the `vllm` script's `#!` line, asked for the installed package's
  version (`python -c 'import importlib.metadata as m; print(m.version("vllm"))'`: package
  metadata, no import of vllm or torch, a tenth of a second); a `vllm` that is not a Python
  script (a wrapper) is asked `vllm --version` (vllm/entrypoints/cli/main.py), which imports vLLM.
- SGLang: the interpreter the adapter launches it with (LLMGW_SGLANG_PYTHON, else python3),
  asked the same for "sglang".
- The simulated engine: `llmgw sim engine --version`, the vLLM release it stands for.

A reading is kept per (engine, the file that answered, its modification time): a reinstalled
`vllm` script is read again. A launch the kept reading would refuse reads it once more first (the
engine may have been upgraded in place since), and is refused only on that fresh reading. A
version that cannot be read (no answer within the deadline, a build that names no release) does
not stop the launch: it is logged, and the engine's own error is what the operator gets.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence

import msgspec
import trio

from llmgw.agent.engines import versions

log = logging.getLogger("llmgw.agent.supervisor")

DEADLINE = 60.0  # seconds: `vllm --version` imports vLLM (and torch) when the metadata path is not there
METADATA = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"


class Reading(msgspec.Struct):
    version: str  # "" when it could not be read
    where: str  # how it was read, for the operator ("/opt/vllm/bin/python, package metadata")
    problem: str = ""  # why it could not be read


def _shebang_python(script: str) -> str:
    """The interpreter on a script's `#!` line when it is a Python ("" otherwise)."""
    try:
        with open(script, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return ""
    if not first.startswith(b"#!"):
        return ""
    parts = first[2:].decode(errors="replace").split()
    if not parts:
        return ""
    if os.path.basename(parts[0]) == "env" and len(parts) > 1:
        parts = parts[1:]
        found = shutil.which(parts[0])
        parts[0] = found or parts[0]
    return parts[0] if "python" in os.path.basename(parts[0]) else ""


def probe(engine: str, argv: Sequence[str]) -> tuple[list[str], str, str]:
    """(command, the file it depends on, how it reads) for an engine's version; ([], "", "")
    for an engine that has no version to check."""
    if engine == "sim":
        return ([sys.executable, "-m", "llmgw", "sim", "engine", "--version"], sys.executable,
                "llmgw sim engine --version")
    if engine == "vllm":
        exe = shutil.which("vllm") or ""
        if not exe:
            return [], "", ""
        python = _shebang_python(exe)
        if python:
            return [python, "-c", METADATA, "vllm"], exe, f"{python}, package metadata"
        return [exe, "--version"], exe, f"{exe} --version"
    if engine == "sglang":
        interpreter = (shutil.which(argv[0]) if argv else None) or ""
        if not interpreter:
            return [], "", ""
        return [interpreter, "-c", METADATA, "sglang"], interpreter, f"{interpreter}, package metadata"
    return [], "", ""


def _locate(engine: str, argv: list[str]) -> tuple[list[str], tuple[str, str, int], str]:
    """`probe` and the key its reading is kept under (file system reads: in a worker thread)."""
    command, path, where = probe(engine, argv)
    try:
        return command, (engine, os.path.realpath(path), os.stat(path).st_mtime_ns), where
    except OSError:
        return command, (engine, path, 0), where


class EngineVersions:
    def __init__(self, deadline: float = DEADLINE) -> None:
        self.deadline = deadline
        self.kept: dict[tuple[str, str, int], Reading] = {}

    async def _read(self, command: list[str], where: str) -> Reading:
        with trio.move_on_after(self.deadline):
            try:
                done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False,
                                              stdin=b"")
            except OSError as exc:
                return Reading("", where, f"cannot run {command[0]}: {exc.strerror or exc}")
            lines = done.stdout.decode(errors="replace").strip().splitlines()
            if done.returncode != 0 or not lines:
                tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                return Reading("", where, f"exited {done.returncode}: {tail[0][:200]}")
            return Reading(lines[-1].strip()[:64], where)
        return Reading("", where, f"no answer within {self.deadline:g}s")

    async def refusal(self, engine: str, argv: Sequence[str]) -> str:
        """Why this launch is refused for its engine's version ("" when it is not)."""
        if engine not in versions.TABLES:
            return ""
        command, key, where = await trio.to_thread.run_sync(_locate, engine, list(argv))
        if not command:
            return ""  # no such executable: the adapter's own check says so
        reading = self.kept.get(key)
        fresh = reading is None
        if reading is None:
            started = time.monotonic()
            reading = await self._read(command, where)
            log.info("%s version %s (%s, read in %.2fs)%s", engine, reading.version or "unknown", where,
                     time.monotonic() - started, f": {reading.problem}" if reading.problem else "")
            self.kept[key] = reading
        why = versions.refusal(engine, reading.version, reading.where, argv)
        if why and not fresh:
            del self.kept[key]  # upgraded in place since it was read? read it again before refusing
            return await self.refusal(engine, argv)
        return why
